"""``"temperature"``: one temperature ``T`` for all logits, ``softmax(z / T)``, fitted by NLL (Guo et al., 2017).

Example:
    >>> from posthoc.methods.calibration.temperature import TemperatureCalibrator
    >>> from posthoc_apps.demo.examples import logits, labels
    >>> calibrator = TemperatureCalibrator().fit(logits, labels)
    >>> float(calibrator.temperature)          # the model is overconfident
    2.01
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posthoc.core.checks import positive_int
from posthoc.core.logits import LOG_PROB_FLOOR, log_mean_exp
from posthoc.export.modules import cast
from posthoc.methods.calibration.base import Calibrator
from posthoc.methods.calibration.optimise import minimise

MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-2, 1e2


def tempered_log_probs(log_probs: Tensor, temperature: Tensor | float) -> Tensor:
    """Apply ``T`` to log-probabilities ``(N, C)`` or samples ``(S, N, C)`` (then averaged); returns ``(N, C)``.

    Example:
        >>> import torch
        >>> from posthoc.methods.calibration.temperature import tempered_log_probs
        >>> tempered_log_probs(torch.log(torch.tensor([[0.8, 0.2]])), 2.0).exp()
        tensor([[0.6667, 0.3333]])
    """
    tempered = torch.log_softmax(log_probs / temperature, dim=-1)
    return log_mean_exp(tempered) if log_probs.dim() == 3 else tempered


def temperature_log_probs(logits: Tensor, temperature: Tensor) -> Tensor:
    """``log_softmax(z / T)`` for class logits ``(..., C)`` (samples stay apart): the fitted map."""
    return torch.log_softmax(logits / cast(temperature, logits.dtype), -1)


def fit_temperature(log_probs: Tensor, labels: Tensor, *, max_iter: int = 100) -> float:
    """The temperature minimising the NLL of ``labels`` under the tempered predictive (bounded to [1e-2, 1e2])."""
    log_probs = log_probs.detach().double().clamp_min(LOG_PROB_FLOOR)
    labels = labels.to(log_probs.device)
    log_t = torch.zeros((), dtype=torch.float64, device=log_probs.device, requires_grad=True)
    bound = math.log(MAX_TEMPERATURE)
    minimise(
        lambda: torch.nn.functional.nll_loss(tempered_log_probs(log_probs, log_t.clamp(-bound, bound).exp()), labels),
        [log_t],
        max_iter=max_iter,
        tolerance=1e-10,
    )
    value = float(log_t.detach().clamp(-bound, bound).exp())
    if not math.isfinite(value):
        value = 1.0
    if value <= MIN_TEMPERATURE * 1.01 or value >= MAX_TEMPERATURE * 0.99:
        warnings.warn(
            f"the fitted temperature hit its bound ({value:.3g}): on this held-out set the model is "
            + ("no better than chance (or the labels are mislabelled)" if value > 1 else "almost never wrong")
            + "; check the labels, or collect more held-out data",
            RuntimeWarning,
            stacklevel=2,
        )
    return value


class TemperatureCalibrator(Calibrator):
    """``softmax(z / T)`` with one temperature."""

    name = "temperature"

    @dataclass(frozen=True, kw_only=True)
    class Options(Calibrator.Options):
        max_iter: int = 100

    def __init__(self, *, max_iter: int = 100) -> None:
        super().__init__()
        self.max_iter = positive_int(max_iter, "max_iter")
        self.register_buffer("temperature", torch.ones(()))

    def _reset(self) -> None:
        self.temperature.fill_(1.0)

    def _fit(self, inputs: Tensor, labels: Tensor) -> None:
        self.temperature.fill_(fit_temperature(inputs, labels, max_iter=self.max_iter))

    def map_parts(self) -> tuple[Callable[..., Tensor], dict[str, Tensor], dict[str, Any]]:
        return temperature_log_probs, {"temperature": self.temperature.float()}, {}

    def num_parameters(self) -> int:
        return 1

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, temperature={float(self.temperature):.4f}"
