"""Exporting a fitted predictive as a plain ``nn.Module``: ``um.to_module()`` and ``calibrator.to_module()``.

:mod:`posthoc.export.modules` holds the module classes (plain torch, copyable on their own);
:mod:`posthoc.export.build` converts each method's fitted state into them.

Example:
    >>> import torch
    >>> from torch import nn
    >>> import posthoc
    >>> um = posthoc.wrap(nn.Sequential(nn.Linear(4, 3)), method="none")
    >>> program = torch.export.export(um.to_module(), (torch.randn(2, 4),))
    >>> program.module()(torch.randn(2, 4)).shape
    torch.Size([2, 3])
"""

from posthoc.core.exporters import register_exporter
from posthoc.export.build import calibrator_module, to_module

register_exporter("model", to_module)
register_exporter("calibrator", calibrator_module)

__all__ = ["calibrator_module", "to_module"]
