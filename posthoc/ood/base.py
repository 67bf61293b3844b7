"""The contract every OOD score implements: :class:`Score`, and the batch :class:`Outputs` it reads.

A score maps one batch's outputs to one number per example, **larger = more out-of-distribution**. Scores that need
training statistics accumulate them in :meth:`Score.update` over passes of the training loader and finish each pass in
:meth:`Score.finish` (where sums are reduced over ``torch.distributed`` ranks).

Example:
    >>> from posthoc.ood.base import Score
    >>> class NegativeMaxLogit(Score):
    ...     name, uses = "neg-max-logit", frozenset({"logits"})
    ...     def __call__(self, outputs):
    ...         return -outputs.logits.max(-1).values
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from posthoc.core import distributed
from posthoc.core.options import Options as BaseOptions
from posthoc.core.prediction import Prediction, RegressionPrediction
from posthoc.errors import NotFittedError, NumericalError


@dataclass(frozen=True)
class Outputs:
    """What the model gives for one batch, computed once and read by every score: ``features`` ``(N, D)``, the head's
    input; ``logits`` ``(N, C)``; ``prediction``, the predictive; ``head``, the ``nn.Linear`` whose weights ViM reads."""

    features: Tensor | None = None
    logits: Tensor | None = None
    prediction: Prediction | RegressionPrediction | None = None
    head: nn.Linear | None = None


class Score:
    """Base class of an OOD score; subclasses set the class attributes and implement ``__call__``.

    Class attributes:
        name: the name ``posthoc.detector(..., score=name)`` takes.
        uses: which fields of :class:`Outputs` the score reads (``"features"``, ``"logits"``, ``"prediction"``).
        fit_passes: the most passes over the training loader ``fit`` may need (0: the score needs no fit);
            ``fit`` takes another pass while a score is not ``fitted`` after :meth:`finish`.
        needs_labels: whether ``fit`` reads the class labels.
        tasks: the models the score is for: ``"classification"`` and/or ``"regression"``.

    Options: the fields of a nested ``@dataclass(frozen=True, kw_only=True) class Options(Score.Options)``, which
    ``__init__`` takes as keyword-only arguments with the same defaults; ``posthoc.detector`` routes its options by them.
    """

    name: ClassVar[str] = ""
    uses: ClassVar[frozenset[str]] = frozenset()
    fit_passes: ClassVar[int] = 0
    needs_labels: ClassVar[bool] = False
    tasks: ClassVar[frozenset[str]] = frozenset({"classification"})
    #: the score's options (none by default)
    Options: ClassVar[type[BaseOptions]] = BaseOptions

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget fitted statistics (``fit`` calls it before its first pass)."""
        self.fitted = self.fit_passes == 0

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """The options this score accepts, with their defaults: the fields of :attr:`Options`."""
        return cls.Options.defaults()

    def update(self, outputs: Outputs, labels: Tensor | None, pass_index: int) -> None:
        """Accumulate one training batch's statistics for pass ``pass_index``."""

    def finish(self, pass_index: int) -> None:
        """Reduce the statistics of pass ``pass_index`` over ranks and compute what they give; set ``fitted``
        when done (the same on every rank), else ``fit`` takes another pass."""

    def check_statistics(self) -> None:
        """Refuse training statistics (the score's tensor attributes once a pass is finished) holding NaN or inf."""
        for name, value in vars(self).items():
            if isinstance(value, Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise NumericalError(
                    f"the OOD score '{self.name}' computed non-finite training statistics ({name.strip('_')} holds NaN "
                    "or inf): the model's features overflow on the training data; check its weights and dtype "
                    "(e.g. float16 overflow), or score in float32"
                )

    def check_fitted(self) -> None:
        if not self.fitted:
            raise NotFittedError(
                f"the OOD score '{self.name}' needs statistics of the training data: call "
                "detector.fit(train_loader) before scoring"
            )

    def __call__(self, outputs: Outputs) -> Tensor:
        """The score of each example, ``(N,)``; larger = more out-of-distribution."""
        raise NotImplementedError


def linear_head(head: nn.Linear) -> tuple[Tensor, Tensor]:
    """The weight ``(C, D)`` and bias ``(C,)`` (zeros when it has none) of the head (always an ``nn.Linear``: the
    feature split refuses any other)."""
    weight = head.weight.detach()
    bias = head.bias.detach() if head.bias is not None else weight.new_zeros(weight.shape[0])
    return weight, bias


def energy(logits: Tensor) -> Tensor:
    """The free energy ``-log sum_c exp(logits_c)`` of each row: the score the activation-shaping methods read."""
    return -torch.logsumexp(logits, dim=-1)


def running_sum(sums: dict[str, Tensor], name: str, value: Tensor) -> None:
    """Add ``value`` to ``sums[name]`` (started at the first call)."""
    sums[name] = sums[name] + value if name in sums else value


class FeatureMean(Score):
    """A score that reads ``mean``, the mean of the training features (one pass of float64 running sums)."""

    uses, fit_passes = frozenset({"features", "logits"}), 1

    def reset(self) -> None:
        super().reset()
        self._sums: dict[str, Tensor] = {}

    def update(self, outputs: Outputs, labels: Tensor | None, pass_index: int) -> None:
        features = outputs.features.detach().double()
        running_sum(self._sums, "features", features.sum(0))
        running_sum(self._sums, "count", features.new_tensor(float(features.shape[0])))

    def finish(self, pass_index: int) -> None:
        sums = {name: distributed.all_reduce_sum(value) for name, value in self._sums.items()}
        self.mean = sums["features"] / sums["count"]
        self._sums = {}
        self.fitted = True
