"""``"auto"``: choose the calibrator by k-fold cross-validated NLL through the selection step.

Every candidate is fitted on all stratified folds but one and predicts the one left out; the selection step
(:mod:`posthoc.engine.selection`) keeps the simplest admissible candidate near the best gain, or the identity (the
model's own probabilities), which is then refitted on all held-out examples. A candidate with too few examples per
class in the training folds is skipped with a warning.

A regressor's ``"auto"`` (:class:`AutoRecalibration`) chooses among none, variance scaling and isotonic recalibration
by cross-validated CRPS instead (an isotonic map is flat in places, where its NLL is infinite): the simplest of the
candidates :func:`confidently_better` than the identity, within noise of the best (:func:`simplest_within_noise`).

Example:
    >>> import posthoc, torch
    >>> from posthoc_apps.demo.examples import logits, labels
    >>> calibrator = posthoc.calibrate(logits, labels, method="auto")
    >>> calibrator.chosen_name, calibrator.selection["candidates"][1]["reason"]
    ('none', 'in-distribution NLL excess -0.0620 nats, 90% bound +0.0278 > tolerance 0.0111')
    >>> posthoc.calibrate(logits, labels, method="auto", tolerance=0.02).chosen_name
    'ets'
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

from posthoc.core.checks import integer_at_least, positive_int
from posthoc.core.prediction import RegressionPrediction
from posthoc.core.registry import register
from posthoc.engine.selection import Scores, Tolerance, select, warn_kept_plain
from posthoc.errors import ConfigError, InputError
from posthoc.export.modules import LogSoftmax
from posthoc.methods.calibration.base import Calibrator, RegressionCalibrator, RegressionIdentity
from posthoc.methods.calibration.method import CalibrationMethod, calibrators
from posthoc.methods.calibration.options import plain_named
from posthoc.methods.calibration.quantile_recalibration import IsotonicRecalibration
from posthoc.methods.calibration.variance_scaling import VarianceScaling

#: the calibrators "auto" compares by default ("identity" is always scored as the reference)
DEFAULT_CANDIDATES = ("temperature", "vector", "matrix", "dirichlet", "ets", "histogram", "isotonic", "platt")


def top_label_ece(probs: Tensor, labels: Tensor, bins: int = 15) -> float:
    """Top-label ECE with ``bins`` equal-width bins ``(lo, hi]``, as :func:`posthoc.evaluation.metrics.ece`."""
    confidence, predicted = probs.double().max(-1)
    index = (torch.ceil(confidence * bins).long() - 1).clamp(0, bins - 1)
    correct = (predicted == labels).double()
    gap = torch.bincount(index, weights=confidence - correct, minlength=bins)
    return float(gap.abs().sum() / labels.numel())


def stratified_folds(labels: Tensor, folds: int, seed: int) -> Tensor:
    """A fold number in ``[0, folds)`` per example, each class spread evenly over the folds (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(labels.numel(), generator=generator)
    order = order[torch.sort(labels.cpu()[order], stable=True).indices]
    fold = torch.empty(labels.numel(), dtype=torch.long)
    fold[order] = torch.arange(labels.numel()) % folds
    return fold.to(labels.device)


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

    def _usable(self, labels: Tensor, fold: Tensor, num_classes: int) -> list[str]:
        usable = []
        for name, candidate in self.choices.items():
            if candidate.binary_only and num_classes != 2:
                continue
            problem = next(
                (
                    p
                    for k in range(self.folds)
                    if (p := candidate.requirement(labels[fold != k], num_classes)) is not None
                ),
                None,
            )
            if problem is None:
                usable.append(name)
            else:
                warnings.warn(
                    f"auto calibration skips '{name}': {problem} (in each of the {self.folds} "
                    f"cross-validation training folds)",
                    RuntimeWarning,
                    stacklevel=4,
                )
        return usable

    def _fit(self, inputs: Tensor, labels: Tensor) -> None:
        num_classes = inputs.shape[-1]
        fold = stratified_folds(labels, self.folds, self.seed)
        usable = self._usable(labels, fold, num_classes)
        sizes = {}
        out_of_fold = {
            name: torch.empty(labels.numel(), num_classes, dtype=inputs.dtype, device=inputs.device) for name in usable
        }
        for k in range(self.folds):
            train, test = fold != k, fold == k
            for name in usable:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    fitted = self._candidate(name).fit(_rows(inputs, train), labels[train])
                out_of_fold[name][test] = fitted.calibrated_predictive(_rows(inputs, test))
                sizes[name] = 0 if name == "identity" else fitted.num_parameters()
        names = list(self.choices)
        for name, log_probs in out_of_fold.items():
            nll = float(torch.nn.functional.nll_loss(log_probs, labels))
            self.cross_validated[names.index(name)] = torch.tensor([nll, top_label_ece(log_probs.exp(), labels)])
        order = sorted(usable, key=lambda name: (sizes[name], names.index(name)))  # the identity first
        plain = Scores.of_log_probs(out_of_fold["identity"], labels)
        selection = select(
            [(plain_named(name), name) for name in order],
            [Scores.of_log_probs(out_of_fold[name], labels) for name in order],
            plain=plain,
            tolerance=Tolerance.of(self.tolerance).nats(plain.nll),
            knob="calibrator",
            folds=self.folds,
            rank_without_shift="first",
        )
        self.selection = selection.to_dict()
        warn_kept_plain(selection, method="auto calibration", retry="posthoc.calibrate", stacklevel=5)
        self.choice.fill_(names.index(selection.value))
        self.chosen.fit(inputs, labels)

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


#: a candidate must beat the identity's out-of-fold NLL by this many standard errors to be eligible, and the
#: simplest candidate within this many standard errors of the lowest out-of-fold NLL is chosen
STANDARD_ERRORS = 1.0


def confidently_better(losses: dict[str, Tensor], reference: str = "identity") -> set[str]:
    """``reference`` and the candidates whose out-of-fold loss beats it by more than :data:`STANDARD_ERRORS`
    standard errors of the per-example difference (the lowest loss alone often only got lucky on these folds).

    Example:
        >>> import torch
        >>> from posthoc.methods.calibration.auto import confidently_better
        >>> confidently_better({"identity": torch.tensor([0.1, 0.2]), "vector": torch.tensor([0.1, 0.19])})
        {'identity'}
    """
    base = losses[reference]
    eligible = {reference}
    for name, loss in losses.items():
        difference = loss - base
        if float(difference.mean()) + STANDARD_ERRORS * _standard_error(difference) < 0:
            eligible.add(name)
    return eligible


def _standard_error(difference: Tensor) -> float:
    return float(difference.std() / math.sqrt(difference.numel())) if difference.numel() > 1 else 0.0


def simplest_within_noise(losses: dict[str, Tensor], sizes: dict[str, int]) -> str:
    """The candidate with the fewest parameters (``sizes``) whose mean per-example loss exceeds the lowest one's by
    at most :data:`STANDARD_ERRORS` standard errors of their per-example difference (ties in size: the lower loss).

    Example:
        >>> import torch
        >>> from posthoc.methods.calibration.auto import simplest_within_noise
        >>> losses = {"temperature": torch.tensor([0.2, 0.1, 0.3]), "matrix": torch.tensor([0.1, 0.1, 0.35])}
        >>> simplest_within_noise(losses, {"temperature": 1, "matrix": 72})
        'temperature'
    """
    best = min(losses, key=lambda name: float(losses[name].mean()))
    within = [
        name
        for name, loss in losses.items()
        if float((loss - losses[best]).mean()) <= STANDARD_ERRORS * _standard_error(loss - losses[best])
    ]
    return min(within, key=lambda name: (sizes[name], float(losses[name].mean())))


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
    """The simplest of none / variance scaling / isotonic within the noise of the best cross-validated CRPS."""

    name = "auto"

    @dataclass(frozen=True, kw_only=True)
    class Options(RegressionCalibrator.Options):
        candidates: tuple[str, ...] | list[str] = ("variance-scaling", "isotonic")
        folds: int = 5
        seed: int = 0

    def __init__(
        self,
        *,
        candidates: tuple[str, ...] | list[str] = ("variance-scaling", "isotonic"),
        folds: int = 5,
        seed: int = 0,
    ) -> None:
        super().__init__()
        known = [name for name in _regression_candidates() if name != "identity"]
        if not candidates or isinstance(candidates, str) or any(name not in known for name in candidates):
            raise ConfigError(f"auto candidates for regression must be among {known}; got {candidates!r}")
        self.candidates = tuple(candidates)
        self.folds = integer_at_least(folds, "folds", 2, why="cross-validation needs two folds or more")
        self.seed = seed
        names = ["identity", *self.candidates]
        self.choices = nn.ModuleDict({name: _regression_candidates()[name]() for name in names})
        self.register_buffer("choice", torch.zeros((), dtype=torch.long))
        self.register_buffer("cross_validated", torch.full((len(names),), math.nan, dtype=torch.float64))

    @property
    def options(self) -> dict[str, Any]:
        return {"candidates": list(self.candidates), "folds": self.folds, "seed": self.seed}

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
        fold = torch.randperm(count, generator=torch.Generator().manual_seed(self.seed)).to(targets.device) % self.folds
        losses = {name: torch.empty(count, dtype=torch.float64, device=targets.device) for name in self.choices}
        sizes: dict[str, int] = {}
        for k in range(self.folds):
            train, test = fold != k, fold == k
            fit_part, test_part = prediction_rows(prediction, train), prediction_rows(prediction, test)
            for name, cls in ((n, type(c)) for n, c in self.choices.items()):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    fitted = cls().fit(fit_part, targets[train])
                losses[name][test] = quantile_crps(fitted.calibrate(test_part), targets[test])
                sizes[name] = fitted.num_parameters()
        for index, name in enumerate(self.choices):
            self.cross_validated[index] = losses[name].mean()
        chosen = simplest_within_noise({name: losses[name] for name in confidently_better(losses)}, sizes)
        self.choice.fill_(list(self.choices).index(chosen))
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
