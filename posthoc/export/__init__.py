"""Exporting a fitted predictive as a plain ``nn.Module``: ``um.to_module()`` and ``calibrator.to_module()``.

Each method exports itself (``Method.to_module(export)``, next to its mathematics, built from the functions of its
predictive); this package holds only what they share: :mod:`posthoc.export.modules` (the network run once, stacking,
mixtures, the top modules) and :mod:`posthoc.export.build` (the walk over a chain, the refusals). It imports only
``core``, so the engine's ``UncertainModel`` and the methods build on it.

Example:
    >>> import posthoc, torch
    >>> from torch import nn
    >>> um = posthoc.wrap(nn.Sequential(nn.Linear(4, 3)), method="none")
    >>> program = torch.export.export(um.to_module(), (torch.randn(2, 4),))
    >>> program.module()(torch.randn(2, 4)).shape
    torch.Size([2, 3])
"""

from posthoc.export.build import calibrator_module, to_module

__all__ = ["calibrator_module", "to_module"]
