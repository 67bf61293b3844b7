"""``"matrix"``: matrix scaling with off-diagonal and intercept regularisation (ODIR; Kull et al., 2019).

``softmax(W z + b)``, fitted by ``mean NLL + off_diagonal * mean_{i != j} W_ij^2 + intercept * mean_j b_j^2``: the
diagonal is free, the off-diagonal terms and the intercepts are shrunk to 0, which keeps the ``C^2 + C`` parameters
from overfitting a small held-out set (both penalties at 0: plain matrix scaling; docs/methods/calibrators.md).

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import logits, labels
    >>> posthoc.calibrate(logits, labels, method="matrix", off_diagonal=1e-2).weight.shape
    torch.Size([3, 3])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posthoc.core.checks import non_negative
from posthoc.methods.calibration.affine import AffineCalibrator


class MatrixScaling(AffineCalibrator):
    """``softmax(W z + b)`` with ODIR (module docs)."""

    name = "matrix"
    extends = "temperature"
    min_per_class = 10

    @dataclass(frozen=True, kw_only=True)
    class Options(AffineCalibrator.Options):
        off_diagonal: float = 10.0
        intercept: float = 10.0

    def __init__(self, *, max_iter: int = 100, off_diagonal: float = 10.0, intercept: float = 10.0) -> None:
        super().__init__(max_iter=max_iter)
        self.off_diagonal = non_negative(off_diagonal, "off_diagonal")
        self.intercept = non_negative(intercept, "intercept")

    def initial(self, num_classes: int, like: Tensor) -> tuple[Tensor, Tensor]:
        options = {"dtype": like.dtype, "device": like.device}
        return torch.eye(num_classes, **options), torch.zeros(num_classes, **options)

    @staticmethod
    def apply(features: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        return features @ weight.T + bias

    def penalty(self, weight: Tensor, bias: Tensor) -> Tensor:
        classes = weight.shape[0]
        off = (weight - torch.diag(torch.diagonal(weight))).square().sum() / (classes * (classes - 1))
        return self.off_diagonal * off + self.intercept * bias.square().mean()
