"""Building the exported module of a fitted predictive: each method of the chain exports itself.

:class:`Export` is what a method's ``to_module(export)`` is handed: one :class:`~posthoc.export.modules.Backbone`
per network (so that a method stacked on another reads the same forward pass), the draws' seed and count, and
:meth:`Export.predictive` for the methods it stacks on. A method says what it exports in ``exports`` and why not
otherwise in ``export_refusal`` (:meth:`posthoc.core.method.Method.export_blocker`); every refusal is an
:class:`~posthoc.errors.ExportError` that says what to do instead, raised before anything fitted is read.

Example:
    >>> from posthoc.export.build import to_module
    >>> import posthoc, torch
    >>> from torch import nn
    >>> module = to_module(posthoc.wrap(nn.Sequential(nn.Linear(4, 3)), method="none"))
    >>> module(torch.randn(2, 4)).shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from posthoc.core.likelihood import Categorical
from posthoc.core.method import Method, chain_of
from posthoc.errors import ExportError, NotFittedError
from posthoc.export import modules as plain

#: weight draws of an exported sampling predictive when neither ``num_samples`` nor the method says
DEFAULT_SAMPLES = 100
#: what every refusal suggests
IN_PROCESS = (
    "serve it in process with um.predict (or um(x)) instead, or export a method listed in docs/serving-export.md"
)


class Export:
    """What a method's ``to_module`` builds with: shared backbones, the draws (``num_samples``: ``None`` is each
    method's own), and the inner methods' modules."""

    def __init__(self, num_samples: int | None = None, seed: int = 0, *, regression: bool = False) -> None:
        self.num_samples, self.seed, self.regression = num_samples, seed, regression
        self._backbones: dict[int, plain.Backbone] = {}

    def backbone(self, model: nn.Module) -> plain.Backbone:
        """The exported copy of ``model`` (in eval mode), one per network."""
        if id(model) not in self._backbones:
            self._backbones[id(model)] = plain.Backbone(copy.deepcopy(model).eval().requires_grad_(False))
        return self._backbones[id(model)]

    def generator(self) -> torch.Generator:
        """A fresh generator seeded with :attr:`seed` (every method's draws start from it)."""
        return torch.Generator().manual_seed(self.seed)

    def samples_of(self, method: Method) -> int:
        """How many weight draws ``method`` exports."""
        return int(self.num_samples or getattr(method, "num_samples", None) or DEFAULT_SAMPLES)

    def predictive(self, method: Method) -> nn.Module:
        """The predictive module of ``method`` (and the methods it stacks on)."""
        refuse_unexportable(method, regression=self.regression)
        return method.to_module(self)

    def refusal(self, method: Method, why: str) -> ExportError:
        """The error that refuses ``method`` for ``why``, saying what to do instead."""
        return refusal(method, why, regression=self.regression)


def refusal(method: Method, why: str, *, regression: bool = False) -> ExportError:
    """``um.to_module() cannot export '<name>': <why>; <what to do instead>``."""
    task = " under a regression likelihood" if regression else ""
    return ExportError(f"um.to_module() cannot export '{method.name}'{task}: {why}; {IN_PROCESS}")


def refuse_unexportable(method: Method, *, regression: bool = False) -> None:
    """Refuse, before anything fitted is read, a chain (or ensemble member) with a method that has no exported form.

    Example:
        >>> from posthoc.export.build import refuse_unexportable
        >>> import posthoc
        >>> from torch import nn
        >>> try:
        ...     refuse_unexportable(posthoc.wrap(nn.Sequential(nn.Linear(4, 3)), method="vi", layers="all").method)
        ... except posthoc.ExportError as err:
        ...     print(str(err)[:40])
        um.to_module() cannot export 'vi': its s
    """
    for member in chain_of(method):
        why = member.export_blocker(regression=regression)
        if why is not None:
            raise refusal(member, why, regression=regression)
        for inner in getattr(member, "members", None) or []:
            refuse_unexportable(inner, regression=regression)


def to_module(um: Any, *, num_samples: int | None = None, seed: int = 0) -> nn.Module:
    """The fitted predictive of ``um`` as a self-contained ``nn.Module`` (see ``UncertainModel.to_module``)."""
    regression = not isinstance(um.likelihood, Categorical)
    refuse_unexportable(um.method, regression=regression)
    if um.method.requires_fit and not um.is_fitted:
        raise NotFittedError(
            "um.to_module() exports the fitted predictive: call um.fit(train_loader, val_loader) first"
        )
    um.method.follow_model_device()
    predictive = Export(num_samples, seed, regression=regression).predictive(um.method)
    top = plain.ExportedRegressor(predictive) if regression else plain.ExportedClassifier(predictive)
    return top.to(um.device).eval()  # the draws made on the CPU join the network on its device


def calibrator_module(calibrator: Any) -> nn.Module:
    """A fitted calibrator of ``posthoc.calibrate`` as a module from class logits ``(N, C)`` to probabilities."""
    return plain.ExportedClassifier(plain.LogitsIn(calibrator.log_prob_map())).eval()
