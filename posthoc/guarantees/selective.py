"""``posthoc.selective``: predict when confident enough, defer otherwise, with a guaranteed risk.

Selection with guaranteed risk (SGR; Geifman & El-Yaniv, "Selective classification for deep neural networks", NeurIPS
2017, Algorithm 1): sort the ``m`` calibration examples by a confidence score ``kappa``; binary-search ``ceil(log2 m)``
thresholds; at each, bound the risk (error rate) of the accepted examples by the binomial tail
(:func:`~posthoc.guarantees.bounds.binomial_upper_bound`) at level ``delta / ceil(log2 m)``. The union bound over the
searched thresholds makes every one of those bounds hold at once with probability at least ``1 - delta``; the threshold
kept is the one accepting the most examples among those whose bound is at most ``target_risk``. So, with probability at
least ``1 - delta`` over the calibration draw, the error rate on accepted future examples (from the same distribution)
is at most ``target_risk``.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import val_probs, val_labels, test_probs
    >>> sel = posthoc.selective(val_probs, val_labels, target_risk=0.2, delta=0.05)
    >>> sel.risk_bound <= 0.2 and 0 < sel.coverage < 1
    True
    >>> keep = sel.accept(test_probs)          # bool (N,): predict these, defer the rest
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posthoc.core.checks import integer, known_name, probability
from posthoc.core.inputs import like_given
from posthoc.core.prediction import Prediction
from posthoc.errors import ConfigError
from posthoc.guarantees.bounds import binomial_upper_bound
from posthoc.guarantees.sources import Predictive, calibration_predictions, is_regression

SELECTION_SCORES = ("confidence", "entropy", "epistemic")


class RiskNotReachableError(ConfigError):
    """No searched threshold bounds the selective risk by the target on this calibration set."""


def selection_score(pred: Prediction, score: str) -> Tensor:
    """The confidence ``kappa`` ``(N,)`` (larger = more confident): top probability, minus the total
    entropy, or minus the epistemic part (mutual information)."""
    if score == "confidence":
        return pred.confidence.double()
    if score == "entropy":
        return -pred.entropy.double()
    return -pred.epistemic.double()


@dataclass(frozen=True)
class Candidate:
    """One searched threshold: accept ``kappa >= threshold``; ``errors`` of ``accepted`` calibration
    examples; ``bound`` on the risk at the search's per-step level."""

    threshold: float
    accepted: int
    errors: int
    bound: float


def search_threshold(kappa: Tensor, correct: Tensor, target_risk: float, delta: float) -> list[Candidate]:
    """The thresholds SGR's binary search visits, each with its accepted count, errors and bound.

    Example:
        >>> from posthoc.guarantees.selective import search_threshold
        >>> from posthoc_apps.demo.examples import val_probs, val_labels
        >>> confidence, predicted = val_probs.max(-1)
        >>> visited = search_threshold(confidence, predicted == val_labels, 0.2, 0.05)
        >>> min(c.bound for c in visited) <= 0.2    # some meet the target
        True
    """
    order = kappa.argsort()
    kappa_sorted = kappa[order].contiguous()
    wrong = (~correct[order]).long()
    errors_from = torch.cat([wrong.flip(0).cumsum(0).flip(0), wrong.new_zeros(1)])  # errors among index >= i
    m = kappa.numel()
    steps = max(1, math.ceil(math.log2(m)))
    low, high = 0, m - 1
    visited = []
    for _ in range(steps):
        middle = math.ceil((low + high) / 2)
        threshold = kappa_sorted[middle]
        first = int(torch.searchsorted(kappa_sorted, threshold))  # ties with the threshold are accepted too
        accepted, errors = m - first, int(errors_from[first])
        candidate = Candidate(float(threshold), accepted, errors, binomial_upper_bound(errors, accepted, delta / steps))
        visited.append(candidate)
        if candidate.bound <= target_risk:
            high = middle
        else:
            low = middle
    return visited


class SelectivePredictor:
    """A fitted deferral rule; build with :func:`selective`. It accepts an example when its score is at least
    ``threshold``; ``coverage`` and ``risk`` are those of the calibration examples, ``risk_bound`` the binomial bound
    at the threshold and ``candidates`` every threshold the search visited."""

    def __init__(
        self,
        predictive: Predictive,
        score: str,
        target_risk: float,
        delta: float,
        chosen: Candidate,
        candidates: list[Candidate],
        num_calibration: int,
    ) -> None:
        self.predictive, self.score, self.target_risk, self.delta = predictive, score, target_risk, delta
        self.threshold, self.risk_bound, self.candidates = chosen.threshold, chosen.bound, candidates
        self.coverage = chosen.accepted / num_calibration
        self.risk = chosen.errors / chosen.accepted
        self.num_calibration = num_calibration

    @property
    def model(self) -> Any:
        """The wrapped model calibrated on, or ``None`` when calibrated on arrays or a Prediction."""
        return self.predictive.model

    def scores(self, data: Any) -> Tensor:
        """The selection score ``(N,)`` of probabilities/logits, a Prediction, or model inputs (numpy for numpy)."""
        return like_given(self._scores(data), data)

    def _scores(self, data: Any) -> Tensor:
        if self.score == "epistemic" and self.predictive.kind != "model" and not isinstance(data, Prediction):
            raise ConfigError(
                "score='epistemic' reads the epistemic part of a Prediction: pass um.predict(x), "
                "not arrays of probabilities"
            )
        return selection_score(self.predictive(data), self.score)

    def accept(self, data: Any) -> Tensor:
        """Boolean ``(N,)``: ``True`` = predict, ``False`` = defer (to a human, a bigger model, ...); numpy for numpy."""
        return like_given(self._scores(data) >= self.threshold, data)

    def __repr__(self) -> str:
        return (
            f"SelectivePredictor(score={self.score}, threshold={self.threshold:.4g}, coverage={self.coverage:.3f}, "
            f"risk_bound={self.risk_bound:.4f} <= target_risk={self.target_risk:g} w.p. >= {1 - self.delta:g})"
        )


def _unreachable(candidates: list[Candidate], m: int, target_risk: float, delta: float, score: str) -> str:
    best = min(candidates, key=lambda c: c.bound)
    steps = len(candidates)
    needed = math.ceil(math.log(delta / steps) / math.log1p(-target_risk))
    return (
        f"no {score} threshold meets target_risk={target_risk:g} with delta={delta:g} on {m} calibration "
        f"examples: the lowest risk bound found is {best.bound:.4f} (accepting {best.accepted}, {best.errors} "
        f"wrong). Even an error-free accepted set needs about {needed} examples for this target. Raise "
        "target_risk or delta, or calibrate on more data"
    )


def selective(
    source: Any,
    labels: Any,
    *,
    target_risk: float = 0.02,
    delta: float = 0.05,
    score: str = "confidence",
    inputs: str = "auto",
    seed: int = 0,
    progress: bool = True,
) -> SelectivePredictor:
    """Fit a deferral threshold whose selective risk is at most ``target_risk`` with probability ``>= 1 - delta``.

    Args:
        source: calibration probabilities or logits ``(N, C)``, a :class:`~posthoc.Prediction`, or a
            fitted :class:`~posthoc.UncertainModel` (then ``labels`` is a labelled loader).
        delta: the allowed probability that the guarantee fails (a bad calibration draw).
        score: ``"confidence"`` (top probability), ``"entropy"`` (low predictive entropy) or
            ``"epistemic"`` (low mutual information; needs a sampling predictive, not arrays).
        inputs: how arrays are read, as in :func:`posthoc.conformal`.

    Raises:
        RiskNotReachableError: (a ConfigError) when no searched threshold meets the target.

    Example:
        >>> import posthoc
        >>> from posthoc_apps.demo.examples import model, train_loader, calibration_loader, x
        >>> sampled = posthoc.wrap(model, method="laplace", link="mc").fit(train_loader)  # sampled: an epistemic part
        >>> sel = posthoc.selective(sampled, calibration_loader, target_risk=0.25, score="epistemic")
        >>> sel.accept(x).shape
        torch.Size([8])
    """
    if is_regression(source):
        raise ConfigError(
            "posthoc.selective is for classifiers for now: its guarantee bounds an error rate (0/1 "
            "losses), which a regressor's squared errors are not. For a regressor, defer the examples "
            "of largest um.predict(x).std, and for a guarantee use posthoc.conformal(um, "
            "calibration_loader).intervals(x)"
        )
    target_risk = probability(target_risk, "target_risk")
    delta = probability(delta, "delta")
    integer(seed, "seed")
    known_name(score, "selection score", SELECTION_SCORES)
    predictive, pred, targets = calibration_predictions(
        source, labels, inputs=inputs, progress=progress, seed=seed, desc="selective calibration"
    )
    if score == "epistemic":
        if predictive.kind in ("probs", "logits") and not isinstance(source, Prediction):
            raise ConfigError(
                "score='epistemic' needs samples from a sampling predictive: pass a wrapped model "
                "(posthoc.selective(um, loader, ...)) or its Prediction, not arrays of probabilities"
            )
        if not bool((pred.epistemic > 0).any()):
            raise ConfigError(
                "score='epistemic': the predictive is deterministic (its epistemic part is 0 for every "
                "calibration example); use a sampling method (laplace, mc-dropout, swag, ...) or "
                "score='confidence'"
            )
    kappa = selection_score(pred, score).cpu()
    correct = pred.label.cpu() == targets
    candidates = search_threshold(kappa, correct, target_risk, delta)
    meeting = [c for c in candidates if c.bound <= target_risk]
    if not meeting:
        raise RiskNotReachableError(_unreachable(candidates, len(targets), target_risk, delta, score))
    chosen = max(meeting, key=lambda c: c.accepted)
    return SelectivePredictor(predictive, score, target_risk, delta, chosen, candidates, len(targets))
