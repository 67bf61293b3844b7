"""Calibrators that are an affine map of the logits followed by a softmax: ``softmax(W x + b)``.

``x`` is the logits (vector and matrix scaling, Platt) or the log-probabilities (Dirichlet
calibration). Parameters start at the identity map and are fitted by the NLL of the held-out
labels plus the subclass's penalty, with L-BFGS in float64; on posterior samples each sample is
mapped and the samples averaged.

Example:
    >>> from posthoc_apps.demo.examples import logits, labels
    >>> from posthoc.methods.calibration.vector import VectorScaling
    >>> calibrator = VectorScaling().fit(logits, labels)
    >>> calibrator.weight.shape, calibrator.bias.shape
    (torch.Size([3]), torch.Size([3]))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posthoc.core.checks import positive_int
from posthoc.methods.calibration.base import Calibrator
from posthoc.methods.calibration.optimise import minimise, mixture_nll


class AffineCalibrator(Calibrator):
    """Base of the affine calibrators: subclasses define :meth:`initial` and :meth:`apply`."""

    @dataclass(frozen=True, kw_only=True)
    class Options(Calibrator.Options):
        max_iter: int = 100

    def __init__(self, *, max_iter: int = 100) -> None:
        super().__init__()
        self.max_iter = positive_int(max_iter, "max_iter")
        self.register_buffer("weight", torch.empty(0))
        self.register_buffer("bias", torch.empty(0))

    def features(self, logits: Tensor) -> Tensor:
        """What the affine map acts on: the logits themselves (Dirichlet calibration: log-probabilities)."""
        return logits

    def initial(self, num_classes: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """The identity map's ``(weight, bias)`` for ``num_classes`` classes, dtype/device of ``like``."""
        raise NotImplementedError

    def apply(self, features: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        """The calibrated logits for ``features`` ``(..., C)``."""
        raise NotImplementedError

    def penalty(self, weight: Tensor, bias: Tensor) -> Tensor | float:
        """Added to the mean NLL while fitting (0: plain maximum likelihood)."""
        return 0.0

    def _reset(self) -> None:
        weight, bias = self.initial(int(self.num_classes), torch.empty(0, device=self.num_classes.device))
        self.weight, self.bias = weight, bias

    def _fit(self, inputs: Tensor, labels: Tensor) -> None:
        features = self.features(inputs)
        weight, bias = (value.requires_grad_() for value in self.initial(inputs.shape[-1], inputs))
        minimise(
            lambda: (
                mixture_nll(torch.log_softmax(self.apply(features, weight, bias), -1), labels)
                + self.penalty(weight, bias)
            ),
            [weight, bias],
            max_iter=self.max_iter,
        )
        self.weight, self.bias = weight.detach().float(), bias.detach().float()

    def _transform(self, logits: Tensor) -> Tensor:
        weight, bias = self.weight.to(logits.dtype), self.bias.to(logits.dtype)
        return torch.log_softmax(self.apply(self.features(logits), weight, bias), -1)
