"""``"auto"`` for regression: none, variance scaling or isotonic recalibration, by k-fold cross-validated CRPS.

Every candidate is fitted on all folds but one and scores the one left out by the continuous ranked
probability score; the identity (the predictive as it is) is always scored. The rules of the
classification ``"auto"`` (:mod:`posthoc.methods.calibration.auto`) then choose: only candidates
whose out-of-fold CRPS beats the identity's by more than one standard error of the per-example
difference are eligible (so the choice is never worse than none on its folds), and among them the
one with the fewest parameters within one standard error of the lowest wins. CRPS, not NLL: an
isotonic map is flat in places, where its density, and so its NLL, is infinite. All candidates are
scored by the same estimator, ``2 mean_j pinball_{τ_j}(y, Q(τ_j))`` over :data:`LEVELS` midpoint
levels ``τ_j`` (the quantile form of the CRPS), which every recalibrated predictive answers exactly.

Apart from :mod:`~posthoc.methods.calibration.auto` (which chooses by the selection step on NLL) because the score
differs: CRPS by k-fold cross-validation, where an isotonic CDF map has no finite NLL.

Example:
>>> val_mean, test_mean = torch.randn(500), torch.randn(500)     # a regressor's predictions,
    >>> val_std = test_std = torch.full((500,), 2.0)                 # whose stds are twice too wide
    >>> val_y, test_y = val_mean + torch.randn(500), test_mean + torch.randn(500)
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

from posthoc.core.checks import integer_at_least
from posthoc.core.prediction import RegressionPrediction
from posthoc.errors import ConfigError, InputError
from posthoc.methods.calibration.quantile_recalibration import IsotonicRecalibration
from posthoc.methods.calibration.regression_base import RegressionCalibrator
from posthoc.methods.calibration.variance_scaling import VarianceScaling

#: a candidate must beat the identity's out-of-fold NLL by this many standard errors to be eligible, and the
#: simplest candidate within this many standard errors of the lowest out-of-fold NLL is chosen
STANDARD_ERRORS = 1.0


def confidently_better(losses: dict[str, Tensor], reference: str = "identity") -> set[str]:
    """``reference`` and the candidates whose out-of-fold NLL beats it by more than :data:`STANDARD_ERRORS`
    standard errors of the per-example difference: with many candidates and a few hundred examples, the
    lowest cross-validated NLL alone often belongs to one that only got lucky on these folds (a
    histogram chosen on one fold split of the digits CNN cost 1.3x the test NLL of no calibration).

    Example:
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


class RegressionIdentity(RegressionCalibrator):
    """The predictive as it is: the reference of ``"auto"``."""

    name = "identity"

    def _fit(self, prediction: RegressionPrediction, targets: Tensor) -> None:
        pass

    def _calibrate(self, prediction: RegressionPrediction) -> RegressionPrediction:
        return prediction


def quantile_crps(prediction: RegressionPrediction, targets: Tensor, levels: int = LEVELS) -> Tensor:
    """``(N,)``: the CRPS summed over outputs, ``2 mean_j pinball_{τ_j}(y, Q(τ_j))`` at midpoints ``τ_j = (j - 1/2) / levels``.

    Example:
        >>> from posthoc.methods.calibration.regression_base import as_prediction
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


class AutoRecalibration(RegressionCalibrator):
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
    def chosen(self) -> RegressionCalibrator:
        """The fitted calibrator that was chosen."""
        return list(self.choices.values())[int(self.choice)]

    @property
    def chosen_name(self) -> str:
        return list(self.choices)[int(self.choice)]

    @property
    def scores(self) -> dict[str, dict[str, float]]:
        return {name: {"crps": float(value)} for name, value in zip(self.choices, self.cross_validated.tolist())}

    def num_parameters(self) -> int:
        return self.chosen.num_parameters()

    def fit(self, prediction: RegressionPrediction, targets: Any) -> RegressionCalibrator:
        """As :meth:`RegressionCalibrator.fit`, refusing a held-out set whose folds are too small for the candidates,
        saying how many examples (or folds) would do."""
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
            fit_part, test_part = _rows(prediction, train), _rows(prediction, test)
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


def _rows(prediction: RegressionPrediction, keep: Tensor) -> RegressionPrediction:
    return RegressionPrediction.from_components(
        prediction.component_means[:, keep], prediction.model_variances[:, keep], prediction.noise[:, keep]
    )


def regression_calibrators() -> dict[str, type[RegressionCalibrator]]:
    """Every regression calibrator by the name ``posthoc.calibrate(mean=..., method=...)`` takes.

    Example:
        >>> sorted(regression_calibrators())
        ['auto', 'identity', 'isotonic', 'variance-scaling']
    """
    return {**_regression_candidates(), AutoRecalibration.name: AutoRecalibration}
