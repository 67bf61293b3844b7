"""Calibrators that are an affine map of the logits followed by a softmax: ``softmax(W x + b)``.

``x`` is the logits (vector and matrix scaling, Platt) or the log-probabilities (Dirichlet calibration). Parameters
start at the identity map and are fitted by the held-out NLL plus the subclass's penalty, with L-BFGS in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posthoc.core.checks import positive_int
from posthoc.export.modules import cast
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

    @staticmethod
    def features(logits: Tensor) -> Tensor:
        """What the affine map acts on: the logits (Dirichlet calibration: log-probabilities)."""
        return logits

    def initial(self, num_classes: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """The identity map's ``(weight, bias)`` for ``num_classes`` classes, like ``like``."""
        raise NotImplementedError

    @staticmethod
    def apply(features: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
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

    def map_parts(self) -> tuple[Callable[..., Tensor], dict[str, Tensor], dict[str, Any]]:
        tensors = {"weight": self.weight.float(), "bias": self.bias.float()}
        return affine_log_probs, tensors, {"features": type(self).features, "apply": type(self).apply}


def affine_log_probs(
    logits: Tensor,
    weight: Tensor,
    bias: Tensor,
    features: Callable[[Tensor], Tensor],
    apply: Callable[[Tensor, Tensor, Tensor], Tensor],
) -> Tensor:
    """``log_softmax(apply(features(z), W, b))`` for class logits ``(..., C)``: an affine calibrator's map.

    Example:
        >>> import torch
        >>> from posthoc.methods.calibration.affine import affine_log_probs
        >>> keep = lambda z: z
        >>> scale = lambda z, w, b: z * w + b
        >>> affine_log_probs(torch.zeros(1, 2), torch.ones(2), torch.tensor([0.0, 1.0]), keep, scale).exp()
        tensor([[0.2689, 0.7311]])
    """
    weight, bias = cast(weight, logits.dtype), cast(bias, logits.dtype)
    return torch.log_softmax(apply(features(logits), weight, bias), -1)
