"""Every calibrator as a stacked method: fitted on ``val_loader`` on top of the inner method's predictive.

``posthoc.wrap(model, method=["laplace", "vector"])`` runs the inner predictive once over the
validation loader, caches its log-probabilities (or its per-sample log-probabilities), and fits the
calibrator on the cache; the inner log-probabilities play the role of logits. A calibrator that
acts per sample (temperature, vector, matrix, Dirichlet, ETS, Platt) maps each posterior sample and
the samples are averaged; histogram binning and isotonic regression map the predictive, and the
calibrated prediction then has no samples.

Example:
    >>> um = posthoc.wrap(model, method=["mc-dropout", "temperature"]).fit(train_loader, val_loader)
    >>> float(um.method.temperature) > 0
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from posthoc.core import distributed
from posthoc.core.inputs import Inputs, check_labels, iterate
from posthoc.core.logits import log_mean_exp
from posthoc.core.method import LogPredictive, Method
from posthoc.core.modules import eval_mode
from posthoc.core.registry import register
from posthoc.methods.calibration.auto import AutoCalibration
from posthoc.methods.calibration.base import Calibrator
from posthoc.methods.calibration.dirichlet import DirichletCalibration
from posthoc.methods.calibration.ets import EnsembleTemperatureScaling
from posthoc.methods.calibration.histogram import HistogramBinning
from posthoc.methods.calibration.isotonic import IsotonicCalibration
from posthoc.methods.calibration.matrix import MatrixScaling
from posthoc.methods.calibration.platt import PlattScaling
from posthoc.methods.calibration.temperature import TemperatureCalibrator
from posthoc.methods.calibration.vector import VectorScaling

#: at most this many bytes of cached per-sample log-probabilities; beyond it, examples are subsampled
CACHE_BYTES = 1 << 30

#: log-probabilities below this are clamped before a calibrator sees them (an exact 0 probability is -inf)
LOG_PROB_FLOOR = -1e4


class CalibrationMethod(Method):
    """Base of the stacked calibrators: ``calibrator_class`` fitted on the inner predictive."""

    needs_val = True
    stacks = True
    calibrator_class: ClassVar[type[Calibrator]]

    def __init__(self, inner: Method, **options: Any) -> None:
        super().__init__(inner.base_model)
        self.inner = inner
        self.calibrator = self.calibrator_class(**options)

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        return cls.calibrator_class.option_defaults()

    @property
    def base_model(self) -> torch.nn.Module:
        return self.inner.base_model

    def follow_model_device(self) -> None:
        super().follow_model_device()
        self.calibrator.to(self.device)

    def fit(self, train_loader: Iterable | None, val_loader: Iterable | None = None, *, progress: bool = True) -> None:
        cached, labels = [], []
        generator = torch.Generator(device=self.device).manual_seed(0)
        with torch.no_grad(), eval_mode(self.inner):
            for x, y in iterate(val_loader, device=self.device, progress=progress, desc=self.name):
                log_probs, samples = self.inner.log_predictive(x, generator=generator)
                cached.append((log_probs if samples is None else samples).float())
                labels.append(check_labels(y, log_probs.shape[-1]))
        dim = 0 if cached[0].dim() == 2 else 1
        cache = distributed.gather_cat(torch.cat(cached, dim), dim)
        targets = distributed.gather_cat(torch.cat(labels))
        if cache.element_size() * cache.numel() > CACHE_BYTES:
            keep = torch.randperm(targets.numel(), generator=torch.Generator().manual_seed(0))
            keep = keep[: max(1, targets.numel() * CACHE_BYTES // (cache.element_size() * cache.numel()))]
            cache, targets = cache.index_select(dim, keep.to(cache.device)), targets[keep.to(targets.device)]
        self.calibrator.fit(cache.clamp_min(LOG_PROB_FLOOR), targets)

    def log_predictive(self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None) -> LogPredictive:
        log_probs, samples = self.inner.log_predictive(x, num_samples=num_samples, generator=generator)
        if samples is not None and self.calibrator.per_sample:
            calibrated = self.calibrator.transform(samples.clamp_min(LOG_PROB_FLOOR))
            return log_mean_exp(calibrated), calibrated
        return self.calibrator.transform(log_probs.clamp_min(LOG_PROB_FLOOR)), None

    def summary(self) -> dict[str, Any]:
        """``random_variables``: the calibrator's parameters (1 for a temperature); the calibrator chosen."""
        return {"random_variables": self.calibrator.num_parameters(), "layers": [], "calibrator": self.calibrator.method}

    def extra_repr(self) -> str:
        return self.calibrator.extra_repr()


@register
class TemperatureScaling(CalibrationMethod):
    """Divide the (inner) log-probabilities by a temperature fitted on held-out data by NLL."""

    name = "temperature"
    calibrator_class = TemperatureCalibrator
    demo_configs = (("temperature", {}),)

    @property
    def temperature(self) -> Tensor:
        """The fitted temperature (a 0-d tensor; 1 before fitting or when the held-out data cannot determine it)."""
        return self.calibrator.temperature

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "temperature": float(self.temperature)}

    def load_posterior_state(self, state: dict[str, Tensor]) -> None:
        # files written before the calibrators moved to methods/calibration/ keep T at the top level
        super().load_posterior_state({("calibrator.temperature" if key == "temperature" else key): value
                                      for key, value in state.items()})


@register
class VectorScalingMethod(CalibrationMethod):
    """Vector scaling of the (inner) log-probabilities: a weight and a bias per class."""

    name = "vector"
    calibrator_class = VectorScaling


@register
class MatrixScalingMethod(CalibrationMethod):
    """Matrix scaling with ODIR of the (inner) log-probabilities (equal to Dirichlet calibration here)."""

    name = "matrix"
    calibrator_class = MatrixScaling


@register
class DirichletCalibrationMethod(CalibrationMethod):
    """Dirichlet calibration (ODIR) of the inner predictive."""

    name = "dirichlet"
    calibrator_class = DirichletCalibration


@register
class EnsembleTemperatureMethod(CalibrationMethod):
    """Ensemble temperature scaling: a mixture of tempered, original and uniform inner predictions."""

    name = "ets"
    calibrator_class = EnsembleTemperatureScaling


@register
class HistogramBinningMethod(CalibrationMethod):
    """Histogram binning of the inner predictive (per class or top label)."""

    name = "histogram"
    calibrator_class = HistogramBinning


@register
class IsotonicCalibrationMethod(CalibrationMethod):
    """One-vs-rest isotonic regression of the inner predictive, renormalised."""

    name = "isotonic"
    calibrator_class = IsotonicCalibration


@register
class PlattScalingMethod(CalibrationMethod):
    """Platt scaling of a binary classifier's (inner) prediction."""

    name = "platt"
    calibrator_class = PlattScaling


@register
class AutoCalibrationMethod(CalibrationMethod):
    """The calibrator with the best cross-validated NLL on val_loader (never worse than none)."""

    name = "auto-calibration"
    calibrator_class = AutoCalibration

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "scores": self.calibrator.scores}
