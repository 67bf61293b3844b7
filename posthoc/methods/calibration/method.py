"""Every calibrator as a registered method, stacked on another method's predictive and fitted on ``val_loader``.

``posthoc.wrap(model, method=["laplace", "vector"])`` caches the inner predictive's log-probabilities (or per-sample
ones) over the validation loader and its perturbed copies, and fits the calibrator on them as it would on logits. The
fit is a held-out choice of the selection step (:mod:`posthoc.engine.selection`) among :func:`configurations`, each
scored out of fold, so that a calibrator which overfits a small validation set is not used
(docs/methods/calibrators.md). :func:`calibrators` finds every calibrator by the name ``posthoc.calibrate`` takes.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, train_loader, val_loader
    >>> um = posthoc.wrap(model, method=["mc-dropout", "temperature"]).fit(train_loader, val_loader)
    >>> float(um.method.temperature) > 0
    True
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from posthoc.core.checks import unit_interval
from posthoc.core.inputs import Inputs, check_finite_result, check_labels
from posthoc.core.logits import LOG_PROB_FLOOR, log_mean_exp
from posthoc.core.method import LogPredictive, Method, predictive_of
from posthoc.core.modules import eval_mode
from posthoc.core.options import option
from posthoc.core.registry import REGISTRY, register
from posthoc.engine.fitted_stage import FittedOnHeldOut
from posthoc.engine.held_out import HeldOut
from posthoc.engine.selection import Layout, Rows, Scores, Tolerance, cross_fitted, fold_count, select, warn_kept_plain
from posthoc.errors import InputError
from posthoc.methods.calibration.base import Calibrator, predictive
from posthoc.methods.calibration.dirichlet import DirichletCalibration
from posthoc.methods.calibration.ets import EnsembleTemperatureScaling
from posthoc.methods.calibration.histogram import HistogramBinning
from posthoc.methods.calibration.identity import Identity
from posthoc.methods.calibration.isotonic import IsotonicCalibration
from posthoc.methods.calibration.matrix import MatrixScaling
from posthoc.methods.calibration.options import PLAIN
from posthoc.methods.calibration.platt import PlattScaling
from posthoc.methods.calibration.temperature import TemperatureCalibrator
from posthoc.methods.calibration.vector import VectorScaling

#: how far the candidates move the parameters from the clean fit towards the fit on clean and perturbed examples
SHIFT_WEIGHTS = (0.25, 0.5, 0.75, 1.0)
#: how far the partial candidates move the parameters from the identity towards the clean fit
PARTIAL_FITS = (0.5, 0.75)


def _interpolable(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    """Whether two fitted states have the same floating-point parameters (so one can move towards the other)."""
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and (a[k].is_floating_point() or torch.equal(a[k], b[k])) for k in a
    )


def _between(a: dict[str, Tensor], b: dict[str, Tensor], weight: float) -> dict[str, Tensor]:
    return {k: a[k] + weight * (b[k] - a[k]) if a[k].is_floating_point() else a[k] for k in a}


def stacked_log_predictive(
    transform: Callable[[Tensor], Tensor], log_probs: Tensor, samples: Tensor | None, per_sample: bool
) -> LogPredictive:
    """A calibration map stacked on a predictive ``(log_probs, samples)``: applied to each sample (then averaged)
    where ``per_sample`` and there are samples, else to the (floored) log-probabilities.

    Example:
        >>> import torch
        >>> from posthoc.methods.calibration.method import stacked_log_predictive
        >>> halve = lambda z: torch.log_softmax(z / 2, -1)
        >>> stacked_log_predictive(halve, torch.log(torch.tensor([[0.8, 0.2]])), None, True)[0].exp()
        tensor([[0.6667, 0.3333]])
    """
    if samples is not None and per_sample:
        calibrated = transform(samples.clamp_min(LOG_PROB_FLOOR))
        return log_mean_exp(calibrated), calibrated
    return transform(log_probs.clamp_min(LOG_PROB_FLOOR)), None


class Calibrated(nn.Module):
    """The exported form of a stacked calibration: :func:`stacked_log_predictive` of the map module ``calibration``
    on the ``inner`` predictive module."""

    def __init__(self, inner: nn.Module, calibration: nn.Module, per_sample: bool) -> None:
        super().__init__()
        self.inner, self.calibration, self.per_sample = inner, calibration, per_sample

    def forward(self, x: Any) -> LogPredictive:
        return stacked_log_predictive(self.calibration, *self.inner(x), self.per_sample)


@dataclass
class _Cache:
    """The inner predictive's held-out log-probabilities ``(N, C)`` (or ``(S, N, C)``), clean and perturbed; labels."""

    clean: Tensor
    labels: Tensor
    shifted: Tensor | None
    shifted_labels: Tensor | None

    @property
    def dim(self) -> int:
        """The examples' dimension (1 for samples ``(S, N, C)``)."""
        return 1 if self.clean.dim() == 3 else 0

    def take(self, rows: Rows, *, shifted: bool) -> tuple[Tensor, Tensor]:
        """The log-probabilities and labels of the clean ``rows``, with their perturbed copies when ``shifted``."""
        clean = self.clean.index_select(self.dim, rows.clean.to(self.clean.device))
        labels = self.labels[rows.clean.to(self.labels.device)]
        if not shifted or self.shifted is None or rows.shifted is None:
            return clean, labels
        copies, copy_labels = self.copies(rows)
        return torch.cat([clean, copies], self.dim), torch.cat([labels, copy_labels])

    def copies(self, rows: Rows) -> tuple[Tensor, Tensor]:
        """The perturbed copies of ``rows`` and their labels."""
        return (
            self.shifted.index_select(self.dim, rows.shifted.to(self.shifted.device)),
            self.shifted_labels[rows.shifted.to(self.shifted_labels.device)],
        )

    def scores(self, calibrator: Calibrator | None, rows: Rows) -> Scores:
        """The scores of the calibrated (``None``: the uncalibrated) predictive on ``rows``."""

        def log_probs(values: Tensor) -> Tensor:
            if calibrator is None:  # log-probabilities stay as they are; a deployed model's raw logits are normalised
                return torch.log_softmax(predictive(values), -1)
            return calibrator.calibrated_predictive(values)

        clean, labels = self.take(rows, shifted=False)
        if self.shifted is None or rows.shifted is None:
            return Scores.of_log_probs(log_probs(clean), labels)
        copies, copy_labels = self.copies(rows)
        return Scores.of_log_probs(log_probs(clean), labels, log_probs(copies), copy_labels)


def calibrator_options(cls: type[CalibrationMethod]) -> type[Method.Options]:
    """The ``Options`` dataclass of a stacked calibrator: its calibrator's ``Options`` and ``shift_weight``.

    Example:
        >>> from posthoc.methods.calibration.method import TemperatureScaling
        >>> TemperatureScaling.Options()
        TemperatureScaling.Options(max_iter=100, shift_weight='auto')
    """
    what = "'auto': chosen on held-out data; a number in [0, 1]: how far to move towards the fit with perturbed copies"
    shift_weight = [("shift_weight", Any, option("auto", what))]
    options = dataclasses.make_dataclass(
        "Options", shift_weight, bases=(cls.calibrator_class.Options,), frozen=True, kw_only=True
    )
    options.__module__, options.__qualname__ = cls.__module__, f"{cls.__qualname__}.Options"
    return options


class CalibrationMethod(FittedOnHeldOut, Method):
    """Base of the stacked calibrators: ``calibrator_class`` fitted on the inner predictive; its ``Options`` are
    made by :func:`calibrator_options`."""

    needs_val = True
    stacks = True
    knob_name = "calibration"
    exports = ("classification",)
    calibrator_class: ClassVar[type[Calibrator]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "calibrator_class" in cls.__dict__:
            cls.Options = calibrator_options(cls)

    def __init__(self, inner: Method, options: Method.Options) -> None:
        shift_weight = options.shift_weight
        super().__init__(inner.base_model)
        self.inner = inner
        self.calibrator = self.calibrator_class(**{k: v for k, v in options.as_dict().items() if k != "shift_weight"})
        if shift_weight != "auto":
            shift_weight = unit_interval(shift_weight, "shift_weight")
        self.shift_weight_option = shift_weight
        #: how far the parameters moved from the clean fit towards the fit with perturbed copies (NaN: clean only;
        #: below 0: the clean fit taken ``1 + shift_weight`` of the way from the identity map)
        self.register_buffer("shift_weight", torch.tensor(math.nan))

    @property
    def base_model(self) -> torch.nn.Module:
        return self.inner.base_model

    def follow_model_device(self) -> torch.device:
        followed = self.__dict__.get("_followed")
        device = super().follow_model_device()
        if followed != device:  # the calibrator (not a method) moves with the model too, once per move
            self.calibrator.to(device)
        return device

    def fit(self, train_loader: Iterable | None, val_loader: Iterable | None = None, *, progress: bool = True) -> None:
        """Nothing on the training data: the calibrator is fitted on held-out data by :meth:`choose`."""

    def held_out_cache(self, held_out: HeldOut) -> _Cache:
        """The inner (floored) log-probabilities over the held-out batches, gathered over ranks, checked."""

        def inner(x: Inputs, generator: torch.Generator) -> Tensor:
            log_probs, samples = self.inner.log_predictive(x, generator=generator)
            check_finite_result(
                log_probs if samples is None else samples,
                f"the log-probabilities of {predictive_of(self.inner)} that '{self.name}' is fitted on",
                log_probs=True,
            )
            return (log_probs if samples is None else samples).float()

        if self.inner.name == "none" and held_out.plain_outputs is not None:  # the plain model's, read once already
            clean, labels, shifted, shifted_labels = held_out.plain_outputs
        else:
            with torch.no_grad(), eval_mode(self.inner):
                clean, labels, shifted, shifted_labels = held_out.outputs(inner)
        classes = clean.shape[-1]
        cache = _Cache(
            clean.clamp_min(LOG_PROB_FLOOR),
            check_labels(labels, classes),
            None if shifted is None else shifted.clamp_min(LOG_PROB_FLOOR),
            None if shifted_labels is None else check_labels(shifted_labels, classes),
        )
        self.calibrator.check(cache.labels, classes)
        return cache

    def configurations(self, cache: _Cache) -> list[tuple[str, float | None]]:
        return configurations(self.calibrator, shifted=cache.shifted is not None, shift_weight=self.shift_weight_option)

    def fit_and_score(
        self, cache: _Cache, configurations: list[tuple[str, float | None]], fitting: Rows, scored: Rows
    ) -> list[Scores | None]:
        return fit_and_score(self.calibrator, cache, configurations, fitting, scored)

    def apply(self, cache: _Cache, value: float | None, held_out: HeldOut) -> None:
        """Fit the calibrator at configuration ``value`` on every held-out row (``None``: keep the inner predictive)."""
        self.shift_weight.fill_(math.nan if value is None or (value == 0 and cache.shifted is None) else value)
        self.calibrator = configured(self.calibrator, value, cache, held_out.layout.everything())

    def to_module(self, export: Any) -> nn.Module:
        """The fitted map (:meth:`Calibrator.log_prob_map`) stacked on the inner method's exported predictive."""
        inner = export.predictive(self.inner)
        return Calibrated(inner, self.calibrator.log_prob_map(), bool(self.calibrator.per_sample))

    def log_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> LogPredictive:
        log_probs, samples = self.inner.log_predictive(x, num_samples=num_samples, generator=generator)
        return stacked_log_predictive(self.calibrator.transform, log_probs, samples, self.calibrator.per_sample)

    def summary(self) -> dict[str, Any]:
        """``random_variables``: the calibrator's parameters; the calibrator chosen."""
        card = {
            "random_variables": self.calibrator.num_parameters(),
            "layers": [],
            "calibrator": self.calibrator.chosen_name,
        }
        weight = float(self.shift_weight)
        if weight < 0:
            card["share_of_clean_fit"] = round(1 + weight, 4)
        elif not math.isnan(weight):
            card["shift_weight"] = round(weight, 4)
        return card

    def extra_repr(self) -> str:
        return self.calibrator.extra_repr()


def configurations(
    calibrator: Calibrator, *, shifted: bool, shift_weight: float | str = "auto"
) -> list[tuple[str, float | None]]:
    """``(label, value)`` of the configurations a held-out fit tries, the most conservative first: the plain
    (``None``), the clean fit taken :data:`PARTIAL_FITS` of the way from the identity (``share - 1``, below 0), the
    clean fit (0), then, with perturbed copies, moved towards the fit on clean and perturbed examples (in (0, 1]).

    Example:
        >>> from posthoc.methods.calibration.method import configurations
        >>> from posthoc.methods.calibration.temperature import TemperatureCalibrator
        >>> [label for label, _ in configurations(TemperatureCalibrator(), shifted=False)]
        ['none', 'clean fit at 0.5', 'clean fit at 0.75', 'clean fit']
    """
    if shift_weight != "auto":
        weight = float(shift_weight) if shifted else 0.0
        return [(PLAIN, None), (f"shift weight {weight:g}" if weight else "clean fit", weight)]
    interpolable = type(calibrator).interpolable
    partial = [(f"clean fit at {share:g}", share - 1.0) for share in PARTIAL_FITS] if interpolable else []
    found: list[tuple[str, float | None]] = [(PLAIN, None), *partial, ("clean fit", 0.0)]
    if shifted:
        weights = SHIFT_WEIGHTS if interpolable else (1.0,)
        found += [(f"shift weight {weight:g}", weight) for weight in weights]
    return found


def fit_and_score(
    calibrator: Calibrator, cache: _Cache, configurations: list[tuple[str, float | None]], fitting: Rows, scored: Rows
) -> list[Scores | None]:
    """Every configuration of ``calibrator`` fitted on ``fitting`` and scored on ``scored`` (the clean and combined
    fits made once)."""
    try:
        clean = copy.deepcopy(calibrator).fit(*cache.take(fitting, shifted=False))
        combined = (
            copy.deepcopy(calibrator).fit(*cache.take(fitting, shifted=True))
            if cache.shifted is not None and any(w is not None and w > 0 for _, w in configurations)
            else None
        )
    except InputError:  # too few examples of a class in this fold: only the uncalibrated predictive is scored
        return [cache.scores(None, scored) if weight is None else None for _, weight in configurations]
    return [
        cache.scores(
            None if weight is None else fitted_at(calibrator, weight, cache, fitting, clean=clean, combined=combined),
            scored,
        )
        for _, weight in configurations
    ]


def configured(calibrator: Calibrator, value: float | None, cache: _Cache, rows: Rows) -> Calibrator:
    """``calibrator`` at configuration ``value`` fitted on ``rows`` (``None``: the identity), its warnings shown."""
    if value is None:
        identity = copy.deepcopy(calibrator)
        identity._reset()
        identity.num_classes.fill_(cache.clean.shape[-1])
        identity.passthrough.fill_(True)
        return identity
    return fitted_at(calibrator, value, cache, rows, warn=True)


def fitted_at(
    calibrator: Calibrator,
    weight: float,
    cache: _Cache,
    rows: Rows,
    *,
    warn: bool = False,
    clean: Calibrator | None = None,
    combined: Calibrator | None = None,
) -> Calibrator:
    """``calibrator`` at configuration ``weight`` fitted on ``rows`` (:func:`configurations`); a map that cannot be
    interpolated takes the combined fit whole."""
    with warnings.catch_warnings():
        if not warn:
            warnings.simplefilter("ignore", RuntimeWarning)
        clean = clean if clean is not None else copy.deepcopy(calibrator).fit(*cache.take(rows, shifted=False))
    if weight == 0:
        return clean
    if weight < 0:
        return partial_fit(clean, 1.0 + weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the clean fit's warnings stand
        combined = combined if combined is not None else copy.deepcopy(calibrator).fit(*cache.take(rows, shifted=True))
    if weight == 1 or not _interpolable(dict(clean.named_buffers()), dict(combined.named_buffers())):
        return combined
    return _moved(clean, combined, weight)


def partial_fit(clean: Calibrator, share: float) -> Calibrator:
    """A copy of the fitted ``clean`` calibrator with its parameters taken ``share`` of the way from the identity map.

    Example:
        >>> import torch
        >>> from posthoc.methods.calibration.method import partial_fit
        >>> from posthoc.methods.calibration.temperature import TemperatureCalibrator
        >>> clean = TemperatureCalibrator()
        >>> clean.temperature.fill_(3.0)
        tensor(3.)
        >>> float(partial_fit(clean, 0.75).temperature)
        2.5
    """
    identity = copy.deepcopy(clean)
    identity._reset()
    return _moved(identity, clean, share)


def _moved(start: Calibrator, end: Calibrator, weight: float) -> Calibrator:
    """A copy of ``start`` with its floating-point parameters moved ``weight`` of the way to ``end``'s."""
    moved = copy.deepcopy(start)
    moved.load_buffers(_between(dict(start.named_buffers()), dict(end.named_buffers()), weight))
    return moved


def fit_on_logits(calibrator: Calibrator, logits: Tensor, labels: Tensor, *, tolerance: Tolerance) -> Calibrator:
    """``calibrator`` fitted on held-out ``logits`` ``(N, C)`` by the selection step, as a stacked calibrator is fitted
    with ``shift=None``; the record is kept as ``.selection``. A tolerance of ``math.inf`` takes the clean fit.

    Example:
        >>> from posthoc.engine.selection import Tolerance
        >>> from posthoc.methods.calibration.method import fit_on_logits
        >>> from posthoc_apps.demo.examples import logits, labels
        >>> from posthoc.methods.calibration.temperature import TemperatureCalibrator
        >>> fitted = fit_on_logits(TemperatureCalibrator(), logits, labels, tolerance=Tolerance())
        >>> fitted.selection["chosen"], round(float(fitted.temperature), 2)
        ('clean fit at 0.75', 1.76)
    """
    if tolerance.nats(0.0) == math.inf:
        fitted = calibrator.fit(logits, labels)
        fitted.selection = None
        return fitted
    calibrator.check(labels, logits.shape[-1])  # too few examples, one class: refused by name, before any fold
    cache = _Cache(logits, labels, None, None)
    plain = cache.scores(None, Layout(len(labels)).everything())
    layout = Layout(len(labels), key=plain.clean)  # the folds follow the examples, not their order
    found = configurations(calibrator, shifted=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        scores = cross_fitted(lambda fitting, scored: fit_and_score(calibrator, cache, found, fitting, scored), layout)
    folds = fold_count(layout)
    selection = select(
        found,
        scores,
        plain=plain,
        tolerance=tolerance.nats(plain.nll),
        knob="calibration",
        folds=folds if folds > 1 else None,
    )
    fitted = configured(calibrator, selection.value, cache, layout.everything())
    fitted.selection = selection.to_dict()
    warn_kept_plain(selection, method=calibrator.name, retry="posthoc.calibrate", stacklevel=4)
    return fitted


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
        super().load_posterior_state(
            {("calibrator.temperature" if key == "temperature" else key): value for key, value in state.items()}
        )


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
    """Every calibrator by the name ``posthoc.calibrate(method=...)`` takes: the identity and the calibrator of every
    registered :class:`CalibrationMethod`.

    Example:
        >>> from posthoc.methods.calibration.method import calibrators
        >>> sorted(calibrators())[:3]
        ['auto', 'dirichlet', 'ets']
    """
    found: dict[str, type[Calibrator]] = {Identity.name: Identity}
    for cls in REGISTRY.values():
        if issubclass(cls, CalibrationMethod):
            found[cls.calibrator_class.name] = cls.calibrator_class
    return found
