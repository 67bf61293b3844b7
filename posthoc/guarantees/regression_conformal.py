"""``posthoc.conformal`` for a regressor: split conformal intervals around its predictive.

Calibration reads a wrapped regression model over a labelled loader (or takes a
:class:`~posthoc.RegressionPrediction` and its targets) and hands the predictive's mean and std to
:func:`~posthoc.guarantees.intervals.conformal_intervals`. Each output's interval then holds its target
with probability at least ``1 - alpha`` (marginally, for exchangeable calibration and test examples).
The scores:

- ``"normalized"`` (default): ``|y - mean| / std`` with the predictive std, so the intervals are
  ``mean -+ t * std``: wider where the method is less certain;
- ``"absolute"``: ``|y - mean|``, one width ``mean -+ t`` everywhere (the std is not used);
- ``"cqr"``: the predictive's own central ``1 - alpha`` interval, widened (or narrowed) by ``t``
  (conformalised quantile regression on the predictive's quantiles).

Apart from :mod:`~posthoc.guarantees.conformal` because a regressor's conformal set is an interval from
nonconformity scores of real residuals, a classifier's a set of labels; the intervals themselves are
:mod:`~posthoc.guarantees.intervals`'.

Example:
    >>> cp = posthoc.conformal(regression_um, reg_val_loader, alpha=0.1)
    >>> x_test, y_test = reg_test_loader.dataset.tensors
    >>> lower, upper = cp.intervals(x_test)            # or cp.intervals(regression_um.predict(x_test))
    >>> ((lower <= y_test) & (y_test <= upper)).float().mean()   # about 0.9
    tensor(0.9...)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from posthoc.core.checks import known_name, probability
from posthoc.core.inputs import looks_like_loader
from posthoc.core.likelihood import real_targets
from posthoc.core.prediction import Prediction, RegressionPrediction
from posthoc.engine.predictions import predict_regression_loader
from posthoc.engine.uncertain_model import UncertainModel
from posthoc.errors import ConfigError, InputError
from posthoc.guarantees.intervals import ConformalIntervals, conformal_intervals

#: the scores of a regression conformal predictor, the default first
REGRESSION_SCORES = ("normalized", "absolute", "cqr")


def is_regression(source: Any) -> bool:
    """Whether ``source`` is a :class:`RegressionPrediction` or a model wrapped with a regression likelihood.

    Example:
        >>> is_regression(posthoc.wrap(regressor, method="none", likelihood="regression"))
        True
    """
    if isinstance(source, RegressionPrediction):
        return True
    return isinstance(source, UncertainModel) and source.likelihood.prediction_type is RegressionPrediction


def _bounds(pred: RegressionPrediction, score: str, alpha: float) -> dict[str, Tensor]:
    """What :func:`conformal_intervals` reads from a predictive under ``score``."""
    if score == "cqr":
        lower, upper = pred.interval(1 - alpha)
        return {"lower": lower, "upper": upper}
    return {"mean": pred.mean, "std": pred.std}


class ConformalRegressor:
    """Fitted conformal intervals around a regression predictive; build with :func:`posthoc.conformal`.

    Attributes:
        calibrated: the :class:`~posthoc.guarantees.intervals.ConformalIntervals` it widens predictions by; its
            ``alpha``, ``score``, ``threshold`` ``(D,)`` and ``num_calibration`` are read here too.
        model: the wrapped model calibrated on, or ``None`` when calibrated on a RegressionPrediction.
    """

    def __init__(
        self, calibrated: ConformalIntervals, model: UncertainModel | None, generator: torch.Generator | None
    ) -> None:
        self.calibrated, self.model, self.generator = calibrated, model, generator
        self.alpha, self.score = calibrated.alpha, calibrated.score
        self.threshold, self.num_calibration = calibrated.threshold, calibrated.num_calibration

    def prediction(self, data: Any) -> RegressionPrediction:
        """``data`` as a :class:`RegressionPrediction`: itself, or the wrapped model's predictive of inputs ``data``."""
        if isinstance(data, RegressionPrediction):
            return data
        if isinstance(data, Prediction):
            raise InputError(
                "these conformal intervals were calibrated on a regressor; got a classifier's "
                "posthoc.Prediction. Pass the regressor's um.predict(x) or its inputs x"
            )
        if self.model is None:
            raise InputError(
                f"calibrated on a RegressionPrediction, so intervals() takes one too (um.predict(x)), "
                f"not {type(data).__name__}; calibrate on the model, posthoc.conformal(um, "
                "calibration_loader), to pass inputs"
            )
        return self.model.predict(data, generator=self.generator)

    def intervals(self, data: Any) -> tuple[Tensor, Tensor]:
        """``(lower, upper)``, each float64 ``(N, D)``, for a :class:`RegressionPrediction` or (when calibrated
        on a wrapped model) its inputs ``x``.

        Example:
            >>> cp = posthoc.conformal(regression_um, reg_val_loader, alpha=0.1)
            >>> lower, upper = cp.intervals(regression_um.predict(reg_x))
            >>> lower.shape
            torch.Size([8, 1])
        """
        return self.calibrated.intervals(**_bounds(self.prediction(data), self.score, self.alpha))

    def sets(self, data: Any) -> Tensor:
        """Refused: a regressor has no classes to put in sets; :meth:`intervals` is its conformal output."""
        raise ConfigError(
            "conformal prediction sets are for classifiers; this conformal predictor was calibrated on a "
            "regressor: use cp.intervals(x) or cp.intervals(um.predict(x)) -> (lower, upper)"
        )

    def __repr__(self) -> str:
        return (
            f"ConformalRegressor(score={self.score}, alpha={self.alpha:g}, "
            f"threshold={[round(t, 4) for t in self.threshold.tolist()]}, n={self.num_calibration})"
        )


def _refuse_classification_options(options: dict[str, Any]) -> None:
    given = [name for name, value in options.items() if value not in (None, False, "auto")]
    if given:
        raise ConfigError(
            f"the options {', '.join(given)} configure conformal sets for classifiers; a regressor's conformal "
            f"intervals take alpha= and score= ({', '.join(map(repr, REGRESSION_SCORES))}) only"
        )


def conformal_regression(
    source: RegressionPrediction | UncertainModel,
    targets: Any,
    *,
    alpha: float = 0.1,
    score: str | None = None,
    seed: int = 0,
    progress: bool = True,
    **classification_options: Any,
) -> ConformalRegressor:
    """Calibrate conformal intervals with miscoverage ``alpha`` (called by :func:`posthoc.conformal` for a regressor).

    Args:
        source: a model wrapped with ``likelihood="regression"`` (then ``targets`` is a labelled loader of
            ``(x, y)``), or a :class:`RegressionPrediction` (then ``targets`` is ``(N,)`` or ``(N, D)``).
        score: ``"normalized"`` (default), ``"absolute"`` or ``"cqr"``.
        seed: seeds a sampling model's draws, at calibration and at test time.
        classification_options: the set options of :func:`posthoc.conformal` (``randomized``, ``mondrian``, ...):
            refused when set.

    Example:
        >>> x_cal, y_cal = reg_val_loader.dataset.tensors
        >>> cp = conformal_regression(regression_um.predict(x_cal), y_cal, alpha=0.1, score="absolute")
        >>> lower, upper = cp.intervals(regression_um.predict(reg_x))
        >>> bool(((upper - lower) - (upper - lower)[0]).abs().max() < 1e-6)        # one width everywhere
        True
    """
    _refuse_classification_options(classification_options)
    alpha = probability(alpha, "alpha")
    score = known_name(
        REGRESSION_SCORES[0] if score is None else score, "regression conformal score", REGRESSION_SCORES
    )
    model, generator = None, None
    if isinstance(source, UncertainModel):
        if not looks_like_loader(targets):
            raise InputError(
                f"with a wrapped model, calibration takes a loader of (x, y) batches, not "
                f"{type(targets).__name__}, e.g. posthoc.conformal(um, calibration_loader)"
            )
        model, generator = source, torch.Generator(device=source.device).manual_seed(seed)
        pred, y = predict_regression_loader(
            source, targets, progress=progress, generator=generator, desc="conformal calibration"
        )
    else:
        if looks_like_loader(targets):
            raise InputError(
                "calibrated on a RegressionPrediction, conformal takes its targets (N,) or (N, D), not a "
                "loader; to calibrate on a loader of (x, y) batches pass the wrapped model: "
                "posthoc.conformal(um, calibration_loader)"
            )
        pred, y = source, real_targets(targets, source.mean)
    calibrated = conformal_intervals(y, alpha=alpha, score=score, **_bounds(pred, score, alpha))
    return ConformalRegressor(calibrated, model, generator)
