"""``"auto"``: choose the calibrator by k-fold cross-validated NLL through the selection step.

Every candidate is fitted on all folds but one and predicts the one left out (the folds of
:class:`~posthoc.engine.selection.Layout`); the selection step (:mod:`posthoc.engine.selection`) keeps the simplest
admissible candidate near the best gain, or the identity (the model's own probabilities), which is then refitted on
all held-out examples. A candidate that extends a simpler one (``Calibrator.extends``: vector, matrix, Dirichlet, ETS,
histogram, isotonic and Platt extend temperature) is admissible only where its gain over that one is sure, so a few
held-out mistakes never elect a flexible map. A candidate with too few examples per class in the training folds is
skipped with a warning.

A regressor's ``"auto"`` (:class:`AutoRecalibration`) chooses among none, variance scaling and isotonic recalibration
by the same selection step with cross-validated CRPS as the score instead of NLL (an isotonic map is flat in places,
where its NLL is infinite); its tolerance is the default fraction of the plain CRPS (or ``tolerance=`` in the
target's units).

Example:
    >>> import posthoc, torch
    >>> from posthoc_apps.demo.examples import logits, labels
    >>> calibrator = posthoc.calibrate(logits, labels, method="auto")
    >>> calibrator.selection["chosen"], round(float(calibrator.chosen.temperature), 2)
    ('temperature at 0.75', 1.76)
    >>> [record["reason"] for record in calibrator.selection["candidates"] if record["candidate"] == "ets"]
    ["its gain over 'temperature', which it extends, is not sure: NLL excess -0.0008 nats, 95% bound +0.0344 > 0"]
    >>> posthoc.calibrate(logits, labels, method="auto", tolerance=0.02).selection["chosen"]
    'temperature'
    >>> val_mean = torch.randn(500)                                  # a regressor's predictions, whose stds
    >>> val_std, val_y = torch.full((500,), 2.0), val_mean + torch.randn(500)   # are twice too wide
    >>> calibrator = posthoc.calibrate(mean=val_mean, std=val_std, targets=val_y, method="auto")
    >>> calibrator.chosen_name, sorted(calibrator.scores["variance-scaling"])
    ('variance-scaling', ['crps'])
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.calibration_error import top_label_ece
from posthoc.core.checks import integer_at_least, positive_int
from posthoc.core.prediction import RegressionPrediction
from posthoc.core.registry import register
from posthoc.engine.selection import (
    Layout,
    Rows,
    Scores,
    Tolerance,
    class_nll,
    class_scores,
    cross_fitted,
    fold_count,
    select,
    warn_kept_plain,
)
from posthoc.errors import ConfigError, InputError
from posthoc.export.modules import LogSoftmax
from posthoc.methods.calibration.base import Calibrator, RegressionCalibrator, RegressionIdentity
from posthoc.methods.calibration.method import PARTIAL_FITS, CalibrationMethod, calibrators, partial_fit
from posthoc.methods.calibration.options import plain_named
from posthoc.methods.calibration.quantile_recalibration import IsotonicRecalibration
from posthoc.methods.calibration.variance_scaling import VarianceScaling

#: the calibrators "auto" compares by default ("identity" is always scored as the reference)
DEFAULT_CANDIDATES = (
    "temperature",
    "vector",
    "matrix",
    "dirichlet",
    "ets",
    "histogram",
    "isotonic",
    "venn-abers",
    "platt",
)


def _rows(inputs: Tensor, keep: Tensor) -> Tensor:
    return inputs[:, keep] if inputs.dim() == 3 else inputs[keep]


class _Chooser:
    """What an ``"auto"`` says of the calibrator it chose (``choices[choice]``)."""

    choices: nn.ModuleDict
    choice: Tensor

    @property
    def chosen(self) -> Any:
        """The fitted calibrator that was chosen."""
        return list(self.choices.values())[int(self.choice)]

    @property
    def chosen_name(self) -> str:
        return self.chosen.chosen_name

    def num_parameters(self) -> int:
        return self.chosen.num_parameters()


class AutoCalibration(_Chooser, Calibrator):
    """The calibrator the selection step picks by cross-validated NLL (see module docs)."""

    name = "auto"
    interpolable = False  # its choice may differ between two fits

    @dataclass(frozen=True, kw_only=True)
    class Options(Calibrator.Options):
        candidates: tuple[str, ...] | list[str] = DEFAULT_CANDIDATES
        folds: int = 5
        seed: int = 0
        max_iter: int = 100
        tolerance: float | None = None

    def __init__(
        self,
        *,
        candidates: tuple[str, ...] | list[str] = DEFAULT_CANDIDATES,
        folds: int = 5,
        seed: int = 0,
        max_iter: int = 100,
        tolerance: float | None = None,
    ) -> None:
        super().__init__()
        known = [name for name in calibrators() if name != self.name]
        if not candidates or isinstance(candidates, str) or any(name not in known for name in candidates):
            raise ConfigError(f"auto candidates must be calibrator names ({', '.join(known)}); got {candidates!r}")
        self.candidates = tuple(candidates)
        self.folds = integer_at_least(folds, "folds", 2, why="cross-validation needs two folds or more")
        self.seed, self.max_iter = seed, positive_int(max_iter, "max_iter")
        Tolerance.of(tolerance)  # refused here if it is not one
        self.tolerance = tolerance
        #: the record of the last choice (``Selection.to_dict()``; ``None`` before a fit)
        self.selection: dict[str, Any] | None = None
        names = ["identity", *(name for name in self.candidates if name != "identity")]
        self.choices = nn.ModuleDict({name: self._candidate(name) for name in names})
        self.register_buffer("choice", torch.zeros((), dtype=torch.long))
        self.register_buffer("cross_validated", torch.full((len(names), 2), math.nan))

    def _candidate(self, name: str) -> Calibrator:
        cls = calibrators()[name]
        return cls(**{"max_iter": self.max_iter} if "max_iter" in cls.option_defaults() else {})

    @property
    def options(self) -> dict[str, Any]:
        return {
            "candidates": list(self.candidates),
            "folds": self.folds,
            "seed": self.seed,
            "max_iter": self.max_iter,
            "tolerance": self.tolerance,
        }

    @property
    def per_sample(self) -> bool:  # type: ignore[override]
        return self.chosen.per_sample

    @property
    def scores(self) -> dict[str, dict[str, float]]:
        return {
            plain_named(name): {"nll": float(row[0]), "ece": float(row[1])}
            for name, row in zip(self.choices, self.cross_validated.tolist())
            if not math.isnan(row[0])
        }

    def _reset(self) -> None:
        self.choice.fill_(0)
        self.cross_validated.fill_(math.nan)

    def _usable(self, labels: Tensor, folds: list[tuple[Rows, Rows]], num_classes: int) -> list[str]:
        usable = []
        for name, candidate in self.choices.items():
            if candidate.binary_only and num_classes != 2:
                continue
            rows = [fitting.clean.to(labels.device) for fitting, _ in folds]
            problem = next((p for r in rows if (p := candidate.requirement(labels[r], num_classes)) is not None), None)
            if problem is None:
                usable.append(name)
            else:
                warnings.warn(
                    f"auto calibration skips '{name}': {problem} (in each of the {len(folds)} "
                    f"cross-validation training folds)",
                    RuntimeWarning,
                    stacklevel=4,
                )
        return usable

    def _fit(self, inputs: Tensor, labels: Tensor) -> None:
        plain_log_probs = self.choices["identity"].fit(inputs, labels).calibrated_predictive(inputs)
        layout = Layout(labels.numel(), key=class_nll(plain_log_probs, labels))  # folds follow the examples, not order
        folds = layout.folds(self.folds, self.seed)
        usable = self._usable(labels, folds, inputs.shape[-1])
        sizes: dict[str, int] = {}
        candidates = {name: (name, 1.0) for name in usable}  # label: (calibrator, share of its clean fit)
        if "temperature" in usable:  # a partial temperature, as posthoc.calibrate(method="temperature") has
            candidates |= {f"temperature at {share:g}": ("temperature", share) for share in PARTIAL_FITS}
        out_of_fold = {label: torch.full_like(plain_log_probs, math.nan) for label in candidates}

        def fit_and_score(fitting: Rows, scored: Rows) -> list[Scores | None]:
            found: list[Scores | None] = []
            train, test = fitting.clean.to(labels.device), scored.clean.to(labels.device)
            for label, (name, share) in candidates.items():
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", RuntimeWarning)
                        fitted = self._candidate(name).fit(_rows(inputs, train), labels[train])
                except InputError:  # too few examples of a class in this fold
                    found.append(None)
                    continue
                if share < 1:
                    fitted = partial_fit(fitted, share)
                out_of_fold[label][test] = fitted.calibrated_predictive(_rows(inputs, test))
                sizes[label] = 0 if name == "identity" else fitted.num_parameters()
                found.append(Scores.of_log_probs(out_of_fold[label][test], labels[test]))
            return found

        scores = dict(zip(candidates, cross_fitted(fit_and_score, layout, folds=self.folds, seed=self.seed)))
        names = list(self.choices)
        for name in usable:
            _, confidence, correct = class_scores(out_of_fold[name], labels)
            ece = top_label_ece(confidence, correct) if bool(torch.isfinite(confidence).all()) else math.nan
            self.cross_validated[names.index(name)] = torch.tensor([scores[name].nll, ece])
        # the simplest first (the identity), a partial fit just after its clean fit (taken only where that one is not)
        order = sorted(
            candidates,
            key=lambda label: (sizes.get(label, math.inf), names.index(candidates[label][0]), -candidates[label][1]),
        )
        plain = Scores.of_log_probs(out_of_fold["identity"], labels)
        extends = [type(self.choices[candidates[label][0]]).extends for label in order]
        selection = select(
            [(plain_named(label), candidates[label]) for label in order],
            [scores[label] for label in order],
            plain=plain,
            tolerance=Tolerance.of(self.tolerance).nats(plain.nll),
            knob="calibrator",
            folds=len(folds),
            rank_without_shift="first",
            extends=[order.index(parent) if parent in order else None for parent in extends],
        )
        self.selection = selection.to_dict()
        warn_kept_plain(selection, method="auto calibration", retry="posthoc.calibrate", stacklevel=5)
        name, share = selection.value
        self.choice.fill_(names.index(name))
        self.chosen.fit(inputs, labels)
        if share < 1 and not bool(self.chosen.passthrough):
            self.choices[name] = partial_fit(self.chosen, share)

    def _transform(self, logits: Tensor) -> Tensor:
        return self.chosen.transform(logits)

    def log_prob_map(self) -> nn.Module:
        return LogSoftmax() if bool(self.passthrough) else self.chosen.log_prob_map()


@register
class AutoCalibrationMethod(CalibrationMethod):
    """The calibrator with the best cross-validated NLL on val_loader (never worse than none)."""

    name = "auto-calibration"
    calibrator_class = AutoCalibration

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "scores": self.calibrator.scores}


#: the default tolerance of a regressor's ``"auto"``: a share of the plain CRPS alone (CRPS is in the target's units)
CRPS_TOLERANCE = Tolerance(absolute=0.0)
#: midpoint quantile levels of the CRPS estimator
LEVELS = 99


def quantile_crps(prediction: RegressionPrediction, targets: Tensor, levels: int = LEVELS) -> Tensor:
    """``(N,)``: the CRPS summed over outputs, ``2 mean_j pinball_{τ_j}(y, Q(τ_j))`` at ``τ_j = (j - 1/2) / levels``.

    Example:
        >>> import torch
        >>> from posthoc.methods.calibration.auto import quantile_crps
        >>> from posthoc.methods.calibration.base import as_prediction
        >>> quantile_crps(as_prediction(torch.zeros(1)), torch.zeros(1))   # (sqrt 2 - 1) / sqrt pi = 0.2337
        tensor([0.2337], dtype=torch.float64)
    """
    y = prediction.distribution.targets(targets).double()
    total = torch.zeros(y.shape[0], dtype=torch.float64, device=y.device)
    for j in range(levels):
        tau = (j + 0.5) / levels
        error = y - prediction.quantile(tau).double()
        total += torch.maximum(tau * error, (tau - 1) * error).sum(-1)
    return 2.0 * total / levels


def _regression_candidates() -> dict[str, type[RegressionCalibrator]]:
    return {cls.name: cls for cls in (RegressionIdentity, VarianceScaling, IsotonicRecalibration)}


class AutoRecalibration(_Chooser, RegressionCalibrator):
    """None, variance scaling or isotonic recalibration, chosen by the selection step on cross-validated CRPS."""

    name = "auto"

    @dataclass(frozen=True, kw_only=True)
    class Options(RegressionCalibrator.Options):
        candidates: tuple[str, ...] | list[str] = ("variance-scaling", "isotonic")
        folds: int = 5
        seed: int = 0
        tolerance: float | None = None

    def __init__(
        self,
        *,
        candidates: tuple[str, ...] | list[str] = ("variance-scaling", "isotonic"),
        folds: int = 5,
        seed: int = 0,
        tolerance: float | None = None,
    ) -> None:
        super().__init__()
        known = [name for name in _regression_candidates() if name != "identity"]
        if not candidates or isinstance(candidates, str) or any(name not in known for name in candidates):
            raise ConfigError(f"auto candidates for regression must be among {known}; got {candidates!r}")
        self.candidates = tuple(candidates)
        self.folds = integer_at_least(folds, "folds", 2, why="cross-validation needs two folds or more")
        self.seed = seed
        Tolerance.of(tolerance)  # refused here if it is not one
        self.tolerance = tolerance
        #: the record of the last choice (``Selection.to_dict()``, as a classifier's ``"auto"``; ``None`` before a fit)
        self.selection: dict[str, Any] | None = None
        names = ["identity", *self.candidates]
        self.choices = nn.ModuleDict({name: _regression_candidates()[name]() for name in names})
        self.register_buffer("choice", torch.zeros((), dtype=torch.long))
        self.register_buffer("cross_validated", torch.full((len(names),), math.nan, dtype=torch.float64))

    @property
    def options(self) -> dict[str, Any]:
        return {
            "candidates": list(self.candidates),
            "folds": self.folds,
            "seed": self.seed,
            "tolerance": self.tolerance,
        }

    @property
    def scores(self) -> dict[str, dict[str, float]]:
        return {
            plain_named(name): {"crps": float(value)}
            for name, value in zip(self.choices, self.cross_validated.tolist())
        }

    def fit(self, prediction: RegressionPrediction, targets: Any) -> RegressionCalibrator:
        """As :meth:`RegressionCalibrator.fit`, refusing a held-out set whose folds are too small for the candidates."""
        count = len(prediction) if isinstance(prediction, RegressionPrediction) else 0
        wanted = max(cls.min_examples for cls in map(type, self.choices.values()))
        if 0 < count and count - math.ceil(count / self.folds) < wanted:
            enough = next(n for n in range(count, 10 * wanted * self.folds) if n - math.ceil(n / self.folds) >= wanted)
            raise InputError(
                f"'auto' compares the calibrators by {self.folds}-fold cross-validation, fitting each on {self.folds - 1} "
                f"of the folds; {count} held-out examples leave {count - math.ceil(count / self.folds)} for such a fit, "
                f"fewer than the {wanted} a calibrator needs. Pass at least {enough} held-out examples"
                + (f", or more folds (folds={count} fits on {count - 1})" if count - 1 >= wanted else "")
                + (", or choose a calibrator yourself (method='variance-scaling')" if count >= wanted else "")
            )
        return super().fit(prediction, targets)

    def _fit(self, prediction: RegressionPrediction, targets: Tensor) -> None:
        count = targets.shape[0]
        layout = Layout(count)
        sizes: dict[str, int] = {}

        def fit_and_score(fitting: Rows, scored: Rows) -> list[Scores]:
            train, test = fitting.clean.to(targets.device), scored.clean.to(targets.device)
            fit_part, test_part = prediction_rows(prediction, train), prediction_rows(prediction, test)
            found = []
            for name, cls in ((n, type(c)) for n, c in self.choices.items()):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    fitted = cls().fit(fit_part, targets[train])
                found.append(Scores(quantile_crps(fitted.calibrate(test_part), targets[test])))
                sizes[name] = fitted.num_parameters()
            return found

        scores = dict(zip(self.choices, cross_fitted(fit_and_score, layout, folds=self.folds, seed=self.seed)))
        for index, name in enumerate(self.choices):
            self.cross_validated[index] = scores[name].nll
        order = sorted(self.choices, key=lambda name: (sizes[name], list(self.choices).index(name)))
        plain = scores["identity"]
        selection = select(
            [(name, name) for name in order],
            [scores[name] for name in order],
            plain=plain,
            tolerance=(CRPS_TOLERANCE if self.tolerance is None else Tolerance.of(self.tolerance)).nats(plain.nll),
            knob="calibrator",
            folds=fold_count(layout, self.folds),
            rank_without_shift="first",
            score="CRPS",
        )
        self.selection = selection.to_dict()
        self.choice.fill_(list(self.choices).index(selection.value))
        self.chosen.fit(prediction, targets)

    def _calibrate(self, prediction: RegressionPrediction) -> RegressionPrediction:
        return self.chosen.calibrate(prediction)


def prediction_rows(prediction: RegressionPrediction, keep: Tensor) -> RegressionPrediction:
    """The examples ``keep`` (a mask or indices on the prediction's device) of ``prediction``."""
    return RegressionPrediction.from_components(
        prediction.component_means[:, keep], prediction.model_variances[:, keep], prediction.noise[:, keep]
    )


def regression_calibrators() -> dict[str, type[RegressionCalibrator]]:
    """Every regression calibrator by the name ``posthoc.calibrate(mean=..., method=...)`` takes.

    Example:
        >>> from posthoc.methods.calibration.auto import regression_calibrators
        >>> sorted(regression_calibrators())
        ['auto', 'identity', 'isotonic', 'variance-scaling']
    """
    return {**_regression_candidates(), AutoRecalibration.name: AutoRecalibration}
