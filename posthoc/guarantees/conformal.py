"""``posthoc.conformal``: split conformal prediction sets on any predictive.

Calibration computes the conformity score of the true class for ``n`` held-out examples and keeps
the ``ceil((n + 1)(1 - alpha))``-th smallest as the threshold; a test example's set holds every class
whose score is at most the threshold. If calibration and test examples are exchangeable, the set
holds the true class with probability at least ``1 - alpha`` (marginally, over both draws); with
``mondrian=True`` there is one threshold per class and the guarantee holds for each class.

Example:
    >>> import torch
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import val_probs, val_labels, test_probs, test_labels, um
    >>> from posthoc_apps.demo.examples import calibration_loader, x
    >>> cp = posthoc.conformal(val_probs, val_labels, alpha=0.1, score="aps", seed=0)
    >>> sets = cp.sets(test_probs)                  # bool (N, C)
    >>> (sets[torch.arange(len(test_labels)), test_labels]).float().mean()   # about 0.9
    tensor(0.8906)
    >>> cp = posthoc.conformal(um, calibration_loader, alpha=0.1)
    >>> cp.predict(x).sets.shape
    torch.Size([8, 3])

A regressor (a model wrapped with ``likelihood="regression"``, or its ``RegressionPrediction``) gets conformal
intervals instead, a :class:`ConformalRegressor` (:mod:`~posthoc.guarantees.intervals`): each output's interval holds
its target with probability at least ``1 - alpha``. The scores:

- ``"normalized"`` (default): ``|y - mean| / std`` with the predictive std, so the intervals are
  ``mean -+ t * std``: wider where the method is less certain;
- ``"absolute"``: ``|y - mean|``, one width ``mean -+ t`` everywhere (the std is not used);
- ``"cqr"``: the predictive's own central ``1 - alpha`` interval, widened (or narrowed) by ``t``
  (conformalised quantile regression on the predictive's quantiles).

Example:
    >>> from posthoc_apps.demo.examples import regression_um, reg_val_loader, reg_test_loader
    >>> cp = posthoc.conformal(regression_um, reg_val_loader, alpha=0.1)
    >>> x_test, y_test = reg_test_loader.dataset.tensors
    >>> lower, upper = cp.intervals(x_test)            # or cp.intervals(regression_um.predict(x_test))
    >>> ((lower <= y_test) & (y_test <= upper)).float().mean()   # about 0.9
    tensor(0.9...)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from posthoc.core.checks import integer, known_name, probability
from posthoc.core.inputs import looks_like_loader
from posthoc.core.likelihood import real_targets
from posthoc.core.prediction import Prediction, RegressionPrediction
from posthoc.engine.predictions import predict_regression_loader
from posthoc.engine.uncertain_model import UncertainModel
from posthoc.errors import ConfigError, InputError
from posthoc.guarantees.bounds import conformal_threshold
from posthoc.guarantees.class_conditional import clustered_thresholds, per_class_thresholds
from posthoc.guarantees.covariate_shift import MAX_WEIGHT, weighted_conformal
from posthoc.guarantees.dense_conformal import DenseConformalPredictor, conformal_dense
from posthoc.guarantees.intervals import ConformalIntervals, conformal_intervals
from posthoc.guarantees.scores import ConformityScore
from posthoc.guarantees.set_predictor import ConformalPredictor
from posthoc.guarantees.sources import calibration_predictions, prediction_type

#: the scores of a regression conformal predictor, the default first
REGRESSION_SCORES = ("normalized", "absolute", "cqr")


def _bounds(pred: RegressionPrediction, score: str, alpha: float) -> dict[str, Tensor]:
    """What :func:`conformal_intervals` reads from a predictive under ``score``."""
    if score == "cqr":
        lower, upper = pred.interval(1 - alpha)
        return {"lower": lower, "upper": upper}
    return {"mean": pred.mean, "std": pred.std}


class ConformalRegressor:
    """Fitted conformal intervals around a regression predictive; build with :func:`posthoc.conformal`.
    ``model`` is ``None`` when calibrated on a RegressionPrediction."""

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
        on a wrapped model) its inputs ``x``."""
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

    ``source``: a model wrapped with ``likelihood="regression"`` (then ``targets`` is a labelled loader), or a
    :class:`RegressionPrediction`; ``classification_options`` (those of sets) are refused when set.

    Example:
        >>> from posthoc.guarantees.conformal import conformal_regression
        >>> from posthoc_apps.demo.examples import reg_val_loader, regression_um, reg_x
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


#: the conditions of a classifier's sets: one threshold, one per class, one per cluster of classes
CONDITIONS = ("marginal", "class", "cluster")


def conformal(
    source: Any,
    labels: Any,
    *,
    alpha: float = 0.1,
    score: str | None = None,
    randomized: bool | None = None,
    k_reg: int | None = None,
    lam: float | None = None,
    mondrian: bool = False,
    condition: str | None = None,
    non_empty: bool = False,
    shift_loader: Iterable | None = None,
    features: Any = None,
    shift_features: Any = None,
    max_weight: float | None = MAX_WEIGHT,
    seed: int = 0,
    inputs: str = "auto",
    progress: bool = True,
) -> ConformalPredictor | ConformalRegressor | DenseConformalPredictor:
    """Calibrate conformal prediction sets (intervals, for a regressor) with miscoverage ``alpha``.

    Args:
        source: calibration probabilities or logits ``(N, C)`` (tensor or numpy), a :class:`~posthoc.Prediction`, or a
            fitted :class:`~posthoc.UncertainModel`; a regressor gives a :class:`ConformalRegressor`, a dense model
            (``posthoc.wrap(model, dense=True)``) a :class:`~posthoc.guarantees.dense_conformal.DenseConformalPredictor`
            of sets per position, whose guarantee is on the mean over a new image's positions (see that module).
        labels: the calibration labels ``(N,)``; for a wrapped model, a labelled loader of ``(x, y)`` (labels per
            position for a dense model, the ignore index left out);
            for a RegressionPrediction, its targets ``(N,)`` or ``(N, D)``.
        alpha: miscoverage in ``(0, 1)``; needs at least ``ceil(1/alpha - 1)`` calibration examples.
        score: ``"lac"`` (default; smallest sets on average, but a set may be empty), ``"aps"`` (adaptive), ``"raps"``
            (regularised adaptive) or ``"saps"`` (sorted adaptive: the top probability and the rank);
            for a regressor, see the module docs.
        randomized: randomise APS/RAPS/SAPS (default ``True``: exact coverage; a set may be empty);
            ``False`` gives deterministic, conservative sets (coverage above ``1 - alpha``).
        k_reg, lam: RAPS regularisation (defaults 1 and 0.01); ``lam`` is also SAPS's weight of a rank (default 0.2).
        mondrian: the same as ``condition="class"``.
        condition: ``"marginal"`` (default: one threshold), ``"class"`` (one per class: coverage for each class;
            needs ``ceil(1/alpha - 1)`` examples of each) or ``"cluster"`` (one per cluster of classes that score
            alike, Ding et al. 2023: for many classes with few examples each;
            :mod:`~posthoc.guarantees.class_conditional`).
        non_empty: add the most probable class to a set that would be empty (LAC and randomised sets can be empty).
        shift_loader: for a wrapped model, an unlabelled loader of deployment inputs: the calibration scores are
            weighted by the likelihood ratio of deployment to calibration inputs, estimated on the model's features
            (covariate shift, Tibshirani et al. 2019; :mod:`~posthoc.guarantees.covariate_shift`).
        features, shift_features: the same with arrays: the calibration points' and the deployment points' features.
        max_weight: the cap of an estimated likelihood ratio (``None``: no cap).
        seed: seeds the APS/RAPS/SAPS randomisation, a sampling model's draws and the clustering.
        inputs: ``"auto"`` (rows in [0, 1] summing to 1 are probabilities, anything else logits),
            ``"probs"`` or ``"logits"``; test-time arrays must be of the same kind.

    Example:
        >>> import posthoc
        >>> from posthoc_apps.demo.examples import val_logits, val_labels, test_logits
        >>> cp = posthoc.conformal(val_logits, val_labels, alpha=0.05, score="raps", k_reg=2, lam=0.1)
        >>> cp.threshold, cp.sets(test_logits).shape
        (tensor(0.9948, dtype=torch.float64), torch.Size([128, 3]))
    """
    integer(seed, "seed")
    shift = shift_loader is not None or shift_features is not None or features is not None
    dense = getattr(source, "dense_outputs", False)  # per-position sets (posthoc.guarantees.dense_conformal)
    calibration = conformal_dense if dense else CALIBRATIONS.get(prediction_type(source), conformal_sets)
    options = {
        "alpha": alpha,
        "score": score,
        "randomized": randomized,
        "k_reg": k_reg,
        "lam": lam,
        "mondrian": mondrian,
        "seed": seed,
        "inputs": inputs,
        "progress": progress,
    }
    if calibration is not conformal_sets:
        given = [name for name, on in (("condition", condition), ("non_empty", non_empty), ("shift", shift)) if on]
        if given:
            raise ConfigError(
                f"the options {', '.join(given)} configure conformal sets of a classifier with one label per input; "
                f"they are not supported for {'a dense model' if dense else 'a regressor'}"
            )
        return calibration(source, labels, **options)
    if options.pop("mondrian"):
        if condition not in (None, "class"):
            raise ConfigError(f"mondrian=True is condition='class'; it contradicts condition={condition!r}")
        condition = "class"
    return conformal_sets(
        source,
        labels,
        **options,
        condition=known_name("marginal" if condition is None else condition, "condition", CONDITIONS),
        non_empty=bool(non_empty),
        shift={"shift_loader": shift_loader, "features": features, "shift_features": shift_features} if shift else None,
        max_weight=max_weight,
    )


def conformal_sets(
    source: Any,
    labels: Any,
    *,
    alpha: float,
    score: str | None,
    randomized: bool | None,
    k_reg: int | None,
    lam: float | None,
    condition: str = "marginal",
    non_empty: bool = False,
    shift: dict[str, Any] | None = None,
    max_weight: float | None = MAX_WEIGHT,
    seed: int,
    inputs: str,
    progress: bool,
) -> ConformalPredictor:
    """Calibrate conformal prediction sets of classes (called by :func:`conformal` for a classifier; its arguments;
    ``shift`` holds ``shift_loader``, ``features`` and ``shift_features`` when weighted for a covariate shift)."""
    alpha = probability(alpha, "alpha")
    generator = torch.Generator().manual_seed(seed)
    conformity = ConformityScore(
        "lac" if score is None else score, randomized=randomized, k_reg=k_reg, lam=lam, generator=generator
    )
    if shift is not None and condition != "marginal":
        raise ConfigError(
            f"condition={condition!r} and a covariate shift cannot be combined yet: weighted conformal sets are "
            "marginal over the deployment law"
        )
    predictive, pred, targets = calibration_predictions(
        source, labels, inputs=inputs, progress=progress, seed=seed, desc="conformal calibration"
    )
    true_scores = conformity(pred.probs.cpu()).gather(1, targets[:, None]).squeeze(1)
    clusters = None
    if condition == "class":
        threshold = per_class_thresholds(true_scores, targets, pred.num_classes, alpha)
    elif condition == "cluster":
        threshold, clusters = clustered_thresholds(true_scores, targets, pred.num_classes, alpha, generator)
    else:
        threshold = conformal_threshold(true_scores, alpha)
    cp = ConformalPredictor(
        predictive, conformity, alpha, threshold, condition, len(targets), non_empty=non_empty, clusters=clusters
    )
    if shift is None:
        return cp
    return weighted_conformal(
        cp,
        true_scores,
        source=source,
        calibration=labels,
        labels=targets,
        max_weight=max_weight,
        seed=seed,
        progress=progress,
        **shift,
    )


#: the conformal calibration of each kind of prediction, by the type its likelihood predicts
#: (``Likelihood.prediction_type``): sets of classes, or intervals of real targets
CALIBRATIONS = {Prediction: conformal_sets, RegressionPrediction: conformal_regression}
