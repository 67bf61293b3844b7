"""``"ets"``: ensemble temperature scaling (Zhang, Kailkhura & Han, 2020, "Mix-n-Match").

``p = w_1 softmax(z / T) + w_2 softmax(z) + w_3 / C``: ``T`` is fitted first (as ``"temperature"``), then the weights
by the NLL of the mixture (the paper's NLL variant).

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import logits, labels
    >>> calibrator = posthoc.calibrate(logits, labels, method="ets")
    >>> calibrator.weights.sum()
    tensor(1.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posthoc.core.checks import positive_int
from posthoc.export.modules import cast
from posthoc.methods.calibration.base import Calibrator
from posthoc.methods.calibration.optimise import minimise, mixture_nll
from posthoc.methods.calibration.temperature import fit_temperature


def mixture_log_probs(logits: Tensor, temperature: Tensor, log_weights: Tensor) -> Tensor:
    """``log(w_1 softmax(z / T) + w_2 softmax(z) + w_3 / C)`` for logits ``(..., C)``."""
    uniform = torch.full_like(logits, -math.log(logits.shape[-1]))
    parts = torch.stack([torch.log_softmax(logits / temperature, -1), torch.log_softmax(logits, -1), uniform])
    return torch.logsumexp(parts + log_weights.reshape(3, *([1] * logits.dim())), 0)


def ets_log_probs(logits: Tensor, temperature: Tensor, weights: Tensor) -> Tensor:
    """:func:`mixture_log_probs` with the fitted ``T`` and weights ``(3,)``: the fitted map.

    Example:
        >>> import torch
        >>> from posthoc.methods.calibration.ets import ets_log_probs
        >>> ets_log_probs(torch.zeros(1, 2), torch.tensor(2.0), torch.tensor([0.5, 0.25, 0.25])).exp()
        tensor([[0.5000, 0.5000]])
    """
    return mixture_log_probs(logits, cast(temperature, logits.dtype), cast(weights, logits.dtype).log())


class EnsembleTemperatureScaling(Calibrator):
    """A mixture of the tempered, the original and the uniform prediction (module docs)."""

    name = "ets"
    extends = "temperature"

    @dataclass(frozen=True, kw_only=True)
    class Options(Calibrator.Options):
        max_iter: int = 100

    def __init__(self, *, max_iter: int = 100) -> None:
        super().__init__()
        self.max_iter = positive_int(max_iter, "max_iter")
        self.register_buffer("temperature", torch.ones(()))
        self.register_buffer("weights", torch.tensor([0.0, 1.0, 0.0]))

    def _reset(self) -> None:
        self.temperature.fill_(1.0)
        self.weights.copy_(torch.tensor([0.0, 1.0, 0.0]))

    def _fit(self, inputs: Tensor, labels: Tensor) -> None:
        temperature = torch.tensor(
            fit_temperature(inputs, labels, max_iter=self.max_iter), dtype=inputs.dtype, device=inputs.device
        )
        free = torch.zeros(3, dtype=inputs.dtype, device=inputs.device, requires_grad=True)
        minimise(
            lambda: mixture_nll(mixture_log_probs(inputs, temperature, torch.log_softmax(free, 0)), labels),
            [free],
            max_iter=self.max_iter,
        )
        self.temperature.fill_(float(temperature))
        self.weights.copy_(torch.softmax(free.detach(), 0))

    def map_parts(self) -> tuple[Callable[..., Tensor], dict[str, Tensor], dict[str, Any]]:
        return ets_log_probs, {"temperature": self.temperature.float(), "weights": self.weights.float()}, {}

    def num_parameters(self) -> int:
        return 4
