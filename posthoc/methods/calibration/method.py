"""Every calibrator as a registered method, stacked on another method's predictive and fitted on ``val_loader``.

``posthoc.wrap(model, method=["laplace", "vector"])`` runs the inner predictive once over the
validation loader, caches its log-probabilities (or its per-sample log-probabilities), and fits the
calibrator on the cache; the inner log-probabilities play the role of logits. A calibrator that
acts per sample (temperature, vector, matrix, Dirichlet, ETS, Platt) maps each posterior sample and
the samples are averaged; histogram binning and isotonic regression map the predictive, and the
calibrated prediction then has no samples.

A calibrator is registered once, with its method (:class:`CalibrationMethod` names it as
``calibrator_class``); :func:`calibrators` finds every one by the name ``posthoc.calibrate`` takes.

Example:
    >>> um = posthoc.wrap(model, method=["mc-dropout", "temperature"]).fit(train_loader, val_loader)
    >>> float(um.method.temperature) > 0
    True
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from posthoc.core import distributed
from posthoc.core.inputs import Inputs, check_finite_result, check_labels, iterate, run_model
from posthoc.core.logits import class_log_probs, log_mean_exp
from posthoc.core.method import LogPredictive, Method, predictive_of
from posthoc.core.modules import eval_mode
from posthoc.core.registry import REGISTRY, register
from posthoc.engine.held_out import CLEAN_TOLERANCE, shifted_held_out, widest_accepted
from posthoc.methods.calibration.base import Calibrator, predictive
from posthoc.methods.calibration.dirichlet import DirichletCalibration
from posthoc.methods.calibration.ets import EnsembleTemperatureScaling
from posthoc.methods.calibration.histogram import HistogramBinning
from posthoc.methods.calibration.identity import Identity
from posthoc.methods.calibration.isotonic import IsotonicCalibration
from posthoc.methods.calibration.matrix import MatrixScaling
from posthoc.methods.calibration.platt import PlattScaling
from posthoc.methods.calibration.temperature import TemperatureCalibrator
from posthoc.methods.calibration.vector import VectorScaling

#: at most this many bytes of cached per-sample log-probabilities; beyond it, examples are subsampled
CACHE_BYTES = 1 << 30

def _nll(log_probs: Tensor, targets: Tensor) -> float:
    return float(torch.nn.functional.nll_loss(log_probs.double(), targets))


def _interpolable(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    """Whether two fitted states have the same floating-point parameters (so one can move towards the other)."""
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and (a[k].is_floating_point() or torch.equal(a[k], b[k]))
                                        for k in a)


def _between(a: dict[str, Tensor], b: dict[str, Tensor], weight: float) -> dict[str, Tensor]:
    return {k: a[k] + weight * (b[k] - a[k]) if a[k].is_floating_point() else a[k] for k in a}


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
        #: how far the parameters moved from the clean fit towards the fit with perturbed copies (NaN: clean only)
        self.register_buffer("shift_weight", torch.tensor(math.nan))
        self.shift_description: dict[str, Any] | None = None

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        return cls.calibrator_class.option_defaults()

    @property
    def base_model(self) -> torch.nn.Module:
        return self.inner.base_model

    def follow_model_device(self) -> None:
        super().follow_model_device()
        self.calibrator.to(self.device)

    def fit(self, train_loader: Iterable | None, val_loader: Iterable | None = None, *, progress: bool = True,
            shift: Any = "auto") -> None:
        """Fit the calibrator on the inner predictive over ``val_loader``; with ``shift``, over its perturbed copies too.

        The clean fit is kept unless the fit on clean and perturbed examples together keeps the clean
        NLL within :data:`~posthoc.engine.held_out.CLEAN_TOLERANCE` of the better of the clean fit and
        no calibration; otherwise the parameters move from the clean fit towards the combined one as
        far as that tolerance allows (:func:`~posthoc.engine.held_out.widest_accepted`).
        """
        cache, targets = self._cache(val_loader, progress)
        self.calibrator.fit(cache, targets)
        shifted = shifted_held_out(val_loader, lambda x: class_log_probs(run_model(self.base_model, x)), shift,
                                   device=self.device, model=self.base_model)
        if shifted is None:
            return
        self.shift_description = shifted.description
        shifted_cache, shifted_targets = self._cache(shifted, progress)
        dim = 0 if cache.dim() == 2 else 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a bound or separation warning of the clean fit stands
            combined = copy.deepcopy(self.calibrator).fit(torch.cat([cache, shifted_cache], dim),
                                                           torch.cat([targets, shifted_targets]))
        limit = (1 + CLEAN_TOLERANCE) * min(_nll(predictive(cache), targets),
                                            _nll(self.calibrator.calibrated_predictive(cache), targets))
        clean_state, combined_state = dict(self.calibrator.named_buffers()), dict(combined.named_buffers())
        if _interpolable(clean_state, combined_state):
            clean_state = {k: v.clone() for k, v in clean_state.items()}
            weight = widest_accepted(
                lambda w: self.calibrator.load_buffers(_between(clean_state, combined_state, w)),
                lambda: _nll(self.calibrator.calibrated_predictive(cache), targets) <= limit, interpolable=True)
        else:  # a map of another shape (histogram bins, auto's choice): all or nothing
            weight = float(_nll(combined.calibrated_predictive(cache), targets) <= limit)
            if weight:
                self.calibrator = combined
        self.shift_weight.fill_(weight)

    def _cache(self, loader: Iterable, progress: bool) -> tuple[Tensor, Tensor]:
        """The inner log-probabilities (or per-sample ones) over ``loader`` and its labels, gathered over ranks."""
        cached, labels = [], []
        generator = torch.Generator(device=self.device).manual_seed(0)
        with torch.no_grad(), eval_mode(self.inner):
            for x, y in iterate(loader, device=self.device, progress=progress, desc=self.name):
                log_probs, samples = self.inner.log_predictive(x, generator=generator)
                check_finite_result(log_probs if samples is None else samples,
                                    f"the log-probabilities of {predictive_of(self.inner)} that '{self.name}' is fitted on",
                                    log_probs=True)
                cached.append((log_probs if samples is None else samples).float())
                labels.append(check_labels(y, log_probs.shape[-1]))
        dim = 0 if cached[0].dim() == 2 else 1
        cache = distributed.gather_cat(torch.cat(cached, dim), dim)
        targets = distributed.gather_cat(torch.cat(labels))
        if cache.element_size() * cache.numel() > CACHE_BYTES:
            keep = torch.randperm(targets.numel(), generator=torch.Generator().manual_seed(0))
            keep = keep[: max(1, targets.numel() * CACHE_BYTES // (cache.element_size() * cache.numel()))]
            cache, targets = cache.index_select(dim, keep.to(cache.device)), targets[keep.to(targets.device)]
        return cache.clamp_min(LOG_PROB_FLOOR), targets

    def log_predictive(self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None,
                       max_memory: int | None = None) -> LogPredictive:
        log_probs, samples = self.inner.log_predictive(x, num_samples=num_samples, generator=generator, max_memory=max_memory)
        if samples is not None and self.calibrator.per_sample:
            calibrated = self.calibrator.transform(samples.clamp_min(LOG_PROB_FLOOR))
            return log_mean_exp(calibrated), calibrated
        return self.calibrator.transform(log_probs.clamp_min(LOG_PROB_FLOOR)), None

    def summary(self) -> dict[str, Any]:
        """``random_variables``: the calibrator's parameters (1 for a temperature); the calibrator chosen."""
        card = {"random_variables": self.calibrator.num_parameters(), "layers": [], "calibrator": self.calibrator.chosen_name}
        if not math.isnan(float(self.shift_weight)):
            card["shift_weight"] = round(float(self.shift_weight), 4)
        return card

    def extra_repr(self) -> str:
        return self.calibrator.extra_repr()


@register
class TemperatureScaling(CalibrationMethod):
    """Divide the (inner) log-probabilities by a temperature fitted on held-out data by NLL."""

    name = "temperature"
    calibrator_class = TemperatureCalibrator

    @property
    def temperature(self) -> Tensor:
        """The fitted temperature (a 0-d tensor; 1 before fitting or when the held-out data cannot determine it)."""
        return self.calibrator.temperature

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "temperature": float(self.temperature)}

    def load_posterior_state(self, state: dict[str, Tensor]) -> None:
        # format-1 files keep T at the top level ("temperature"), not under the calibrator
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


def calibrators() -> dict[str, type[Calibrator]]:
    """Every calibrator by the name ``posthoc.calibrate(method=...)`` takes: the identity (the reference, whose
    method is ``"none"``) and the calibrator of every registered :class:`CalibrationMethod`.

    Example:
        >>> sorted(calibrators())[:3]
        ['auto', 'dirichlet', 'ets']
    """
    found: dict[str, type[Calibrator]] = {Identity.name: Identity}
    for cls in REGISTRY.values():
        if issubclass(cls, CalibrationMethod):
            found[cls.calibrator_class.name] = cls.calibrator_class
    return found
