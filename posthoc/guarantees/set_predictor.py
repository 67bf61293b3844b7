"""The fitted conformal sets of a classifier, :class:`ConformalPredictor` (built by :func:`posthoc.conformal`).

A class is in an example's set when its conformity score is at most the threshold: one threshold (marginal sets),
or one per class (``condition="class"`` or ``"cluster"``, :mod:`~posthoc.guarantees.class_conditional`).
``non_empty=True`` adds the most probable class to a set that would be empty (a superset: coverage can only grow).

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import val_probs, val_labels, test_probs, test_labels
    >>> cp = posthoc.conformal(val_probs, val_labels, alpha=0.1, non_empty=True)
    >>> bool(cp.sets(test_probs).any(-1).all())                       # no empty set
    True
    >>> sorted(cp.coverage(test_probs, test_labels))
    ['class_coverage_gap', 'coverage', 'set_size']
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from posthoc.core.inputs import Inputs, like_given
from posthoc.core.prediction import Prediction
from posthoc.errors import ConfigError
from posthoc.guarantees.measures import class_coverage_gap, coverage, mean_set_size
from posthoc.guarantees.scores import ConformityScore
from posthoc.guarantees.sources import Predictive, as_labels


class ConformalPredictor:
    """Fitted conformal sets; build with :func:`conformal`. ``threshold`` is a 0-dim tensor, or ``(C,)`` per class
    for ``condition="class"`` or ``"cluster"`` (then ``clusters`` ``(C,)`` holds each class's cluster, ``-1`` for the
    null cluster)."""

    def __init__(
        self,
        predictive: Predictive,
        score: ConformityScore,
        alpha: float,
        threshold: Tensor,
        condition: str,
        num_calibration: int,
        *,
        non_empty: bool = False,
        clusters: Tensor | None = None,
    ) -> None:
        self.predictive, self.score, self.alpha = predictive, score, alpha
        self.threshold, self.condition, self.num_calibration = threshold, condition, num_calibration
        self.non_empty, self.clusters = non_empty, clusters

    @property
    def mondrian(self) -> bool:
        """Whether there is one threshold per class (``condition="class"``)."""
        return self.condition == "class"

    @property
    def model(self) -> Any:
        """The wrapped model calibrated on, or ``None`` when calibrated on arrays or a Prediction."""
        return self.predictive.model

    def sets(self, data: Any) -> Tensor:
        """Boolean prediction sets ``(N, C)`` for probabilities/logits (as at calibration), a
        :class:`Prediction`, or model inputs (when calibrated on a wrapped model); a numpy array for a numpy array."""
        probs = self.predictive(data).probs
        return like_given(self._sets(probs, self.threshold.to(probs.device)), data)

    def _sets(self, probs: Tensor, threshold: Tensor) -> Tensor:
        """``{y : score_y <= threshold}``, with the most probable class added to an empty set if ``non_empty``."""
        sets = self.score(probs) <= threshold
        if self.non_empty:
            sets = sets.scatter(1, probs.argmax(-1, keepdim=True), True)
        return sets

    def predict(self, x: Inputs) -> Prediction:
        """The wrapped model's :class:`Prediction` for inputs ``x``, with ``.sets`` filled."""
        if self.predictive.kind != "model":
            raise ConfigError(
                "predict(x) needs a conformal predictor calibrated on a wrapped model "
                "(posthoc.conformal(um, calibration_loader)); use sets(probs) for arrays"
            )
        pred = self.predictive(x)
        return dataclasses.replace(pred, sets=self.sets(pred))

    def coverage(self, data: Any, labels: Any) -> dict[str, float]:
        """On labelled test data: the marginal ``coverage``, the class-conditional coverage gap ``class_coverage_gap``
        (CovGap: the mean over classes of ``|coverage of the class - (1 - alpha)|``) and the mean ``set_size``."""
        return self._coverage(self.sets(data), labels)

    def _coverage(self, sets: Any, labels: Any) -> dict[str, float]:
        sets = torch.as_tensor(sets)
        labels = as_labels(labels, sets.shape[1], sets.shape[0])
        return {
            "coverage": coverage(sets, labels),
            "class_coverage_gap": class_coverage_gap(sets, labels, self.alpha),
            "set_size": mean_set_size(sets),
        }

    def intervals(self, data: Any) -> tuple[Tensor, Tensor]:
        """Refused: a classifier's conformal output is a set of classes, :meth:`sets`; intervals are a regressor's."""
        raise ConfigError(
            "conformal intervals are for regressors; this conformal predictor was calibrated on a "
            "classifier: use cp.sets(...) (or wrap a model that predicts numbers with "
            "posthoc.wrap(..., likelihood='regression') and calibrate on it)"
        )

    def __repr__(self) -> str:
        threshold = (
            f"{float(self.threshold):.4g}" if self.threshold.dim() == 0 else f"per class ({len(self.threshold)})"
        )
        condition = "" if self.condition == "marginal" else f", condition={self.condition!r}"
        return (
            f"ConformalPredictor(score={self.score.describe()}, alpha={self.alpha:g}, threshold={threshold}"
            f"{condition}{', non_empty=True' if self.non_empty else ''}, n={self.num_calibration})"
        )
