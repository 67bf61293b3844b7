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

A regressor (a model wrapped with ``likelihood="regression"``, or its ``RegressionPrediction``) gets
conformal intervals instead, ``cp.intervals(x) -> (lower, upper)``
(:mod:`posthoc.guarantees.regression_conformal`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from posthoc.core.checks import integer, probability
from posthoc.core.inputs import Inputs, like_given
from posthoc.core.prediction import Prediction
from posthoc.errors import ConfigError, InputError
from posthoc.guarantees.bounds import conformal_threshold, minimum_calibration_size
from posthoc.guarantees.regression_conformal import ConformalRegressor, conformal_regression, is_regression
from posthoc.guarantees.scores import ConformityScore
from posthoc.guarantees.sources import Predictive, calibration_predictions


def mondrian_thresholds(scores: Tensor, labels: Tensor, num_classes: int, alpha: float) -> Tensor:
    """One :func:`conformal_threshold` per class, from the calibration examples of that class ``(C,)``."""
    counts = torch.bincount(labels, minlength=num_classes)
    short = [c for c in range(num_classes) if counts[c] < minimum_calibration_size(alpha)]
    if short:
        listing = ", ".join(f"class {c}: {int(counts[c])}" for c in short[:10]) + (", ..." if len(short) > 10 else "")
        raise InputError(
            f"class-conditional (mondrian) sets at alpha={alpha:g} need at least {minimum_calibration_size(alpha)} "
            f"calibration examples of every class; too few for {listing}. Add calibration data, raise alpha, or "
            "use mondrian=False"
        )
    return torch.stack([conformal_threshold(scores[labels == c], alpha) for c in range(num_classes)])


class ConformalPredictor:
    """Fitted conformal sets; build with :func:`conformal`.

    Attributes:
        alpha: the miscoverage level; sets hold the true class with probability >= ``1 - alpha``.
        score: the :class:`ConformityScore` (``score.name`` is ``"lac"``, ``"aps"`` or ``"raps"``).
        threshold: the calibrated threshold, a 0-dim tensor, or ``(C,)`` per class if ``mondrian``.
        mondrian: whether thresholds are class-conditional.
        num_calibration: how many calibration examples set the threshold.
    """

    def __init__(
        self,
        predictive: Predictive,
        score: ConformityScore,
        alpha: float,
        threshold: Tensor,
        mondrian: bool,
        num_calibration: int,
    ) -> None:
        self.predictive, self.score, self.alpha = predictive, score, alpha
        self.threshold, self.mondrian, self.num_calibration = threshold, mondrian, num_calibration

    @property
    def model(self) -> Any:
        """The wrapped model calibrated on, or ``None`` when calibrated on arrays or a Prediction."""
        return self.predictive.model

    def sets(self, data: Any) -> Tensor:
        """Boolean prediction sets ``(N, C)`` for probabilities/logits (as at calibration), a
        :class:`Prediction`, or model inputs (when calibrated on a wrapped model); a numpy array for a numpy array.

        Example:
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import val_probs, val_labels, test_probs
            >>> cp = posthoc.conformal(val_probs, val_labels, alpha=0.1)
            >>> 1 <= cp.sets(test_probs).sum(-1).float().mean() <= 3     # mean set size
            tensor(True)
        """
        probs = self.predictive(data).probs
        return like_given(self.score(probs) <= self.threshold.to(probs.device), data)

    def predict(self, x: Inputs) -> Prediction:
        """The wrapped model's :class:`Prediction` for inputs ``x``, with ``.sets`` filled.

        Example:
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import um, calibration_loader, x
            >>> pred = posthoc.conformal(um, calibration_loader, alpha=0.1).predict(x)
            >>> pred.sets.sum(-1)         # set sizes
            tensor([1, 1, 1, 1, 1, 1, 1, 1])
        """
        if self.predictive.kind != "model":
            raise ConfigError(
                "predict(x) needs a conformal predictor calibrated on a wrapped model "
                "(posthoc.conformal(um, calibration_loader)); use sets(probs) for arrays"
            )
        pred = self.predictive(x)
        return dataclasses.replace(pred, sets=self.sets(pred))

    def intervals(self, data: Any) -> tuple[Tensor, Tensor]:
        """Refused: a classifier's conformal output is a set of classes, :meth:`sets`; intervals are a regressor's."""
        raise ConfigError(
            "conformal intervals are for regressors; this conformal predictor was calibrated on a "
            "classifier: use cp.sets(...) (or wrap a model that predicts numbers with "
            "posthoc.wrap(..., likelihood='regression') and calibrate on it)"
        )

    def __repr__(self) -> str:
        threshold = f"{float(self.threshold):.4g}" if not self.mondrian else f"per class {self.threshold.tolist()}"
        return (
            f"ConformalPredictor(score={self.score.describe()}, alpha={self.alpha:g}, threshold={threshold}, "
            f"n={self.num_calibration})"
        )


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
    seed: int = 0,
    inputs: str = "auto",
    progress: bool = True,
) -> ConformalPredictor | ConformalRegressor:
    """Calibrate conformal prediction sets (intervals, for a regressor) with miscoverage ``alpha``.

    Args:
        source: calibration probabilities or logits ``(N, C)`` (tensor or numpy), a
            :class:`~posthoc.Prediction`, or a fitted :class:`~posthoc.UncertainModel`. A regressor (a
            model wrapped with ``likelihood="regression"`` or its :class:`~posthoc.RegressionPrediction`)
            gives a :class:`ConformalRegressor`, whose ``intervals(x)`` are ``(lower, upper)``.
        labels: the calibration labels ``(N,)``; for a wrapped model, a labelled loader of ``(x, y)``;
            for a RegressionPrediction, its targets ``(N,)`` or ``(N, D)``.
        alpha: miscoverage in ``(0, 1)``; needs at least ``ceil(1/alpha - 1)`` calibration examples.
        score: ``"lac"`` (default; smallest sets), ``"aps"`` (adaptive) or ``"raps"`` (regularised adaptive);
            for a regressor ``"normalized"`` (default; ``|y - mean| / std``), ``"absolute"`` or ``"cqr"``
            (see :mod:`posthoc.guarantees.regression_conformal`).
        randomized: randomise APS/RAPS (default ``True``: exact coverage; a set may be empty);
            ``False`` gives deterministic, conservative sets (coverage above ``1 - alpha``).
        k_reg, lam: RAPS regularisation (defaults 1 and 0.01).
        mondrian: one threshold per class (class-conditional coverage; needs the minimum per class).
        seed: seeds the APS/RAPS randomisation and a sampling model's draws.
        inputs: ``"auto"`` (rows in [0, 1] summing to 1 are probabilities, anything else logits),
            ``"probs"`` or ``"logits"``; test-time arrays must be of the same kind.
        progress: show a progress bar while a wrapped model predicts the calibration loader.

    Example:
        >>> import posthoc
        >>> from posthoc_apps.demo.examples import val_logits, val_labels, test_logits, regression_um, reg_val_loader
        >>> from posthoc_apps.demo.examples import reg_x
        >>> cp = posthoc.conformal(val_logits, val_labels, alpha=0.05, score="raps", k_reg=2, lam=0.1)
        >>> cp.threshold, cp.sets(test_logits).shape
        (tensor(0.9948, dtype=torch.float64), torch.Size([128, 3]))
        >>> lower, upper = posthoc.conformal(regression_um, reg_val_loader, alpha=0.1).intervals(reg_x)
        >>> bool((lower < upper).all())
        True
    """
    integer(seed, "seed")
    if is_regression(source):
        return conformal_regression(
            source,
            labels,
            alpha=alpha,
            score=score,
            seed=seed,
            progress=progress,
            randomized=randomized,
            k_reg=k_reg,
            lam=lam,
            mondrian=mondrian,
            inputs=inputs,
        )
    alpha = probability(alpha, "alpha")
    generator = torch.Generator().manual_seed(seed)
    conformity = ConformityScore(
        "lac" if score is None else score, randomized=randomized, k_reg=k_reg, lam=lam, generator=generator
    )
    predictive, pred, targets = calibration_predictions(
        source, labels, inputs=inputs, progress=progress, seed=seed, desc="conformal calibration"
    )
    true_scores = conformity(pred.probs.cpu()).gather(1, targets[:, None]).squeeze(1)
    if mondrian:
        threshold = mondrian_thresholds(true_scores, targets, pred.num_classes, alpha)
    else:
        threshold = conformal_threshold(true_scores, alpha)
    return ConformalPredictor(predictive, conformity, alpha, threshold, mondrian, len(targets))
