"""``posthoc.calibrate``: calibrating a deployed classifier from its saved logits alone.

Example:
    >>> calibrator = posthoc.calibrate(val_logits, val_labels)
    >>> calibrator.temperature
    1.83
    >>> probs = calibrator(test_logits)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from posthoc.core.checks import positive_int
from posthoc.core.errors import ConfigError, InputError
from posthoc.core.inputs import check_labels
from posthoc.core.logits import check_finite_logits, class_log_probs
from posthoc.core.prediction import Prediction
from posthoc.methods.temperature import fit_temperature, tempered_log_probs

CALIBRATORS = ("temperature",)


def _as_tensor(values: Any, what: str) -> Tensor:
    if isinstance(values, Tensor):
        return values.detach()
    if isinstance(values, np.ndarray) or isinstance(values, (list, tuple)):
        return torch.as_tensor(np.asarray(values))
    raise InputError(f"{what} must be a tensor or a numpy array, got {type(values).__name__}")


@dataclass(frozen=True)
class TemperatureCalibrator:
    """A fitted temperature for logits; call it on logits to get calibrated probabilities."""

    temperature: float

    def log_probs(self, logits: Any) -> Tensor:
        """Calibrated log-probabilities ``(N, C)`` for logits ``(N, C)`` (or ``(N,)`` if binary)."""
        logits = _as_tensor(logits, "logits")
        check_finite_logits(logits)
        return tempered_log_probs(class_log_probs(logits.float()), self.temperature)

    def predict(self, logits: Any) -> Prediction:
        """The calibrated :class:`~posthoc.Prediction` for ``logits``."""
        return Prediction.from_log_probs(self.log_probs(logits))

    def __call__(self, logits: Any) -> Tensor:
        return self.log_probs(logits).exp()


def calibrate(logits: Any, labels: Any, method: str = "temperature", *, max_iter: int = 100) -> TemperatureCalibrator:
    """Fit a calibrator on held-out ``logits`` ``(N, C)`` (or ``(N,)`` for binary) and ``labels`` ``(N,)``.

    Example:
        >>> calibrator = posthoc.calibrate(np.load("val_logits.npy"), np.load("val_labels.npy"))
        >>> calibrator(np.load("test_logits.npy")).sum(-1)   # rows sum to 1
    """
    if method not in CALIBRATORS:
        raise ConfigError(f"unknown calibration method {method!r}; valid: {', '.join(CALIBRATORS)}")
    positive_int(max_iter, "max_iter")
    logits, labels = _as_tensor(logits, "logits"), _as_tensor(labels, "labels")
    if logits.shape[0] != labels.reshape(-1).shape[0]:
        raise InputError(
            f"logits and labels have different lengths ({logits.shape[0]} vs {labels.reshape(-1).shape[0]}); "
            "pass one label per row of logits"
        )
    if logits.shape[0] == 0:
        raise InputError("calibrate got no examples; pass held-out logits and labels")
    check_finite_logits(logits)
    log_probs = class_log_probs(logits.float())
    targets = check_labels(labels, log_probs.shape[-1])
    return TemperatureCalibrator(fit_temperature(log_probs, targets, max_iter=max_iter))
