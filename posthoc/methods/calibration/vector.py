"""``"vector"``: vector scaling, ``softmax(w * z + b)`` with a weight and a bias per class (Guo et al., 2017).

Fitted by ``mean NLL + spread * mean_c (w_c - mean(w))^2 + intercept * mean_c b_c^2``: the weights are shrunk towards
their mean and the intercepts towards 0, as plain maximum likelihood (``spread=0, intercept=0``) overfits
near-separable held-out sets (docs/methods/calibrators.md).

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import logits, labels
    >>> posthoc.calibrate(logits, labels, method="vector").weight.shape        # one scale per class
    torch.Size([3])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posthoc.core.checks import non_negative
from posthoc.methods.calibration.affine import AffineCalibrator


class VectorScaling(AffineCalibrator):
    """``softmax(w * z + b)``, one weight and bias per class."""

    name = "vector"
    extends = "temperature"
    min_per_class = 5

    @dataclass(frozen=True, kw_only=True)
    class Options(AffineCalibrator.Options):
        spread: float = 1.0
        intercept: float = 1.0

    def __init__(self, *, max_iter: int = 100, spread: float = 1.0, intercept: float = 1.0) -> None:
        super().__init__(max_iter=max_iter)
        self.spread = non_negative(spread, "spread")
        self.intercept = non_negative(intercept, "intercept")

    def initial(self, num_classes: int, like: Tensor) -> tuple[Tensor, Tensor]:
        options = {"dtype": like.dtype, "device": like.device}
        return torch.ones(num_classes, **options), torch.zeros(num_classes, **options)

    @staticmethod
    def apply(features: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        return features * weight + bias

    def penalty(self, weight: Tensor, bias: Tensor) -> Tensor:
        return self.spread * (weight - weight.mean()).square().mean() + self.intercept * bias.square().mean()
