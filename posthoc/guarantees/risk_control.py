"""``posthoc.risk_control``: a threshold on dense or multi-label scores whose expected false-negative rate is at most ``alpha``.

Conformal risk control (Angelopoulos, Bates, Fisch, Lei & Schuster, "Conformal Risk Control", 2022, Theorem 1):
for a loss ``L_i(lambda)`` that is bounded by ``B`` and does not increase with ``lambda``, on ``n`` exchangeable
calibration examples, the choice

    ``lambda_hat = inf{lambda : n / (n + 1) * R_n(lambda) + B / (n + 1) <= alpha}``,

``R_n`` the mean calibration loss, gives ``E[L_test(lambda_hat)] <= alpha`` for a fresh example (the expectation over
the calibration draw and the test example). With continuous scores it is also tight:
``E[L_test] >= alpha - 2B / (n + 1)`` (Theorem 2).

Here the loss is the false-negative rate, ``B = 1``: the fraction of an example's positives (the positions whose target
is 1) that its mask (the positions of probability at least the threshold ``t = 1 - lambda``) misses, 0 for an example
with no positive. ``t`` is found exactly, not on a grid: the mean loss only changes at the scores of true positives,
so ``t`` is the largest such score whose mask meets the bound.

Example:
    >>> import torch
    >>> import posthoc
    >>> g = torch.Generator().manual_seed(0)
    >>> targets = (torch.rand(500, 6, generator=g) < 0.3).long()       # multi-label: 6 labels per example
    >>> probs = torch.sigmoid(3.0 * (2 * targets - 1) + 2.0 * torch.randn(500, 6, generator=g))
    >>> rc = posthoc.risk_control(probs[:300], targets[:300], alpha=0.1)
    >>> rc
    RiskController(loss='fnr', alpha=0.1, threshold=0.6239, n=300)
    >>> rc.mask(probs[300:]).shape                                     # bool (N, K): the labels predicted
    torch.Size([200, 6])
    >>> float(rc.risk(probs[300:], targets[300:]).mean()) < 0.15        # test FNR, about alpha
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from posthoc.core.checks import integer, known_name, probability
from posthoc.core.inputs import like_given
from posthoc.core.prediction import Prediction
from posthoc.errors import InputError
from posthoc.guarantees.bounds import minimum_calibration_size
from posthoc.guarantees.learn_then_test import MultiRiskController, learn_then_test

#: the losses :func:`risk_control` controls (each bounded by 1 and non-increasing as the mask grows)
LOSSES = ("fnr",)
#: conformal risk control (an expected loss) and Learn then Test (several risks with high probability)
RISK_CONTROL_METHODS = ("crc", "ltt")
#: the label of pixels that carry no target (torchvision's segmentation convention)
IGNORE_INDEX = 255


def as_tensor(values: Any, name: str) -> Tensor:
    """``values`` (a tensor, a numpy array, a nested list, or a :class:`Prediction`'s probabilities) as a tensor."""
    if isinstance(values, Prediction):
        values = values.probs
    if isinstance(values, np.ndarray):
        return torch.from_numpy(values)
    if isinstance(values, Tensor):
        return values
    try:
        return torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError) as error:
        raise InputError(f"{name} must be a tensor or numpy array, got {type(values).__name__}") from error


def _check_probabilities(probs: Tensor) -> Tensor:
    if not probs.is_floating_point():
        raise InputError(f"probs must be floating-point probabilities, got dtype {probs.dtype}")
    if probs.numel() and not (probs.min() >= 0 and probs.max() <= 1):
        raise InputError(
            f"probs must lie in [0, 1] (got values in [{float(probs.min()):.3g}, {float(probs.max()):.3g}]); "
            "pass probabilities, not logits: torch.sigmoid(logits) for multi-label or binary maps, "
            "logits.softmax(1) for a (N, C, H, W) segmentation map"
        )
    return probs


def object_scores(probs: Any, positive: int | str = "foreground", background: int = 0) -> tuple[Tensor, str]:
    """The probability ``(N, ...)`` that each position holds the object, and which layout the input had.

    ``probs`` of the same shape as the targets (multi-label ``(N, K)``, a binary map ``(N, H, W)``) are that probability
    already (layout ``"binary"``); a class map ``(N, C, H, W)`` (softmax over ``C``) gives ``probs[:, positive]`` for a
    class ``positive``, or ``1 - probs[:, background]`` for ``"foreground"`` (layout ``"classes"``).

    Example:
        >>> import torch
        >>> from posthoc.guarantees.risk_control import object_scores
        >>> probs = torch.tensor([[[[0.7]], [[0.2]], [[0.1]]]])    # (1, 3, 1, 1): background 0.7
        >>> object_scores(probs)[0].flatten(), object_scores(probs, positive=2)[0].flatten()
        (tensor([0.3000]), tensor([0.1000]))
    """
    probs = _check_probabilities(as_tensor(probs, "probs"))
    if probs.dim() != 4:
        return probs, "binary"
    if positive == "foreground":
        integer(background, "background")
        if not 0 <= background < probs.shape[1]:
            raise InputError(f"background={background} is not a class of probs with {probs.shape[1]} classes")
        return 1.0 - probs[:, background], "classes"
    integer(positive, "positive")
    if not 0 <= int(positive) < probs.shape[1]:
        raise InputError(
            f"positive={positive} is not a class of probs (N, C, H, W) with C={probs.shape[1]}; pass a class "
            "index in [0, C) or positive='foreground' (every class but background)"
        )
    return probs[:, int(positive)], "classes"


def positives_and_valid(
    targets: Any, scores: Tensor, layout: str, positive: int | str, background: int, ignore_index: int | None
) -> tuple[Tensor, Tensor]:
    """Bool ``(positive, valid)`` of the shape of ``scores``: where the object truly is, and which positions count."""
    targets = as_tensor(targets, "targets")
    if targets.is_floating_point():
        if not torch.equal(targets, targets.round()):
            raise InputError(
                "targets must be whole numbers: 0/1 for multi-label or binary maps, class indices for maps"
            )
        targets = targets.long()
    if targets.shape != scores.shape:
        expected = "(N, H, W) class indices" if layout == "classes" else f"{tuple(scores.shape)} of 0/1"
        raise InputError(
            f"targets of shape {tuple(targets.shape)} do not match probs: expected {expected} (probs "
            f"{'(N, C, H, W)' if layout == 'classes' else tuple(scores.shape)}); pass one target per position, with "
            f"{ignore_index} where there is none"
        )
    valid = torch.ones_like(targets, dtype=torch.bool) if ignore_index is None else targets != ignore_index
    if layout == "classes":
        truth = targets != background if positive == "foreground" else targets == int(positive)
        return truth & valid, valid
    if ((targets != 0) & (targets != 1) & valid).any():
        raise InputError(
            f"targets of multi-label scores or a binary map must be 0 or 1 (or ignore_index={ignore_index}); "
            f"got values {sorted(set(targets[valid].unique().tolist()) - {0, 1})[:5]}. For a class map pass "
            "probs (N, C, H, W) and class indices (N, H, W)"
        )
    return (targets == 1) & valid, valid


def false_negative_rate(mask: Tensor, truth: Tensor) -> Tensor:
    """Per example ``(N,)``: the fraction of its true positions that ``mask`` misses (0 where it has none).

    Example:
        >>> import torch
        >>> from posthoc.guarantees.risk_control import false_negative_rate
        >>> truth = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]]).bool()
        >>> false_negative_rate(torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]]).bool(), truth)
        tensor([0.5000, 0.0000], dtype=torch.float64)
    """
    truth = truth.flatten(1)
    missed = (truth & ~mask.flatten(1)).sum(1).double()
    return missed / truth.sum(1).clamp_min(1).double()


def crc_threshold(scores: Tensor, truth: Tensor, alpha: float) -> tuple[float, float]:
    """The largest threshold ``t`` whose mask ``scores >= t`` has ``n/(n+1) R_n(t) + 1/(n+1) <= alpha``, and ``R_n(t)``.

    ``R_n(t)`` is the total weight ``1 / (n * positives_i)`` of the true positions scored below ``t`` (``t = inf``:
    an empty mask meets the bound).

    Example:
        >>> import torch
        >>> from posthoc.guarantees.risk_control import crc_threshold
        >>> scores = torch.tensor([[0.9, 0.2], [0.8, 0.1], [0.3, 0.6], [0.7, 0.4]] * 5)
        >>> truth = torch.tensor([[1, 0], [1, 0], [0, 1], [1, 0]] * 5).bool()
        >>> crc_threshold(scores, truth, alpha=0.3)          # misses the 0.6 (5 of 20 examples) at t = 0.7
        (0.7..., 0.25)
    """
    n = scores.shape[0]
    scores, truth = scores.flatten(1).double(), truth.flatten(1)
    weights = (1.0 / (n * truth.sum(1).clamp_min(1).double()))[:, None].expand_as(scores)[truth]
    true_scores = scores[truth]
    budget = ((n + 1) * alpha - 1.0) / n  # R_n(t) <= budget  <=>  the bound holds
    total = float(weights.sum())
    if total <= budget + 1e-12:
        return math.inf, total
    order = true_scores.argsort()
    sorted_scores, below = true_scores[order], torch.cat([weights.new_zeros(1), weights[order].cumsum(0)[:-1]])
    # R_n at t = sorted_scores[k] is the weight strictly below it: with ties, the first of each run of equal scores
    first_of_run = torch.searchsorted(sorted_scores, sorted_scores, right=False)
    risk_at = below[first_of_run]
    meets = risk_at <= budget + 1e-12
    k = int(torch.nonzero(meets).max())
    return float(sorted_scores[k]), float(risk_at[k])


class RiskController:
    """A fitted risk-controlling threshold; build with :func:`risk_control`. Positions with probability ``>=
    threshold`` are in the mask (``inf``: an empty mask suffices); ``lam`` is the paper's ``1 - threshold``;
    ``calibration_risk`` is ``R_n`` at ``threshold``."""

    def __init__(
        self,
        *,
        loss: str,
        alpha: float,
        threshold: float,
        calibration_risk: float,
        num_calibration: int,
        positive: int | str,
        background: int,
        ignore_index: int | None,
    ) -> None:
        self.loss, self.alpha, self.threshold = loss, alpha, threshold
        self.lam = 1.0 - threshold
        self.calibration_risk, self.num_calibration = calibration_risk, num_calibration
        self.positive, self.background, self.ignore_index = positive, background, ignore_index

    @property
    def bound(self) -> float:
        """``n/(n+1) R_n + 1/(n+1)``, the quantity held at or below ``alpha``."""
        n = self.num_calibration
        return n / (n + 1) * self.calibration_risk + 1.0 / (n + 1)

    def mask(self, probs: Any) -> Any:
        """The predicted mask: bool of the shape of the targets (``(N, K)``, ``(N, H, W)``); numpy for numpy."""
        scores, _ = object_scores(probs, self.positive, self.background)
        return like_given(scores >= self.threshold, probs)

    def risk(self, probs: Any, targets: Any) -> Tensor:
        """The loss of each example ``(N,)`` under this threshold: the fraction of its positives the mask misses."""
        scores, layout = object_scores(probs, self.positive, self.background)
        truth, _ = positives_and_valid(targets, scores, layout, self.positive, self.background, self.ignore_index)
        return false_negative_rate(scores >= self.threshold, truth)

    def __repr__(self) -> str:
        return (
            f"RiskController(loss={self.loss!r}, alpha={self.alpha:g}, threshold={self.threshold:.4g}, "
            f"n={self.num_calibration})"
        )


def risk_control(
    probs: Any,
    targets: Any,
    alpha: float | Sequence[float] = 0.1,
    *,
    loss: str | Sequence[str] = "fnr",
    method: str = "crc",
    delta: float = 0.1,
    thresholds: Sequence[float] | None = None,
    fwer: str = "bonferroni_holm",
    objective: str | None = None,
    positive: int | str = "foreground",
    background: int = 0,
    ignore_index: int | None = IGNORE_INDEX,
) -> RiskController | MultiRiskController:
    """Calibrate a mask threshold with expected false-negative rate at most ``alpha`` (conformal risk control), or,
    with ``method="ltt"``, one that keeps several risks under their levels with probability ``1 - delta``.

    Args:
        probs: calibration probabilities (tensor, numpy or a :class:`Prediction`): multi-label sigmoid scores
            ``(N, K)``, a binary map ``(N, H, W)`` (any ``(N, ...)`` of the targets' shape), or a segmentation
            map ``(N, C, H, W)`` of class probabilities.
        targets: ``(N, K)`` or ``(N, H, W)`` of 0/1 for the first two; class indices ``(N, H, W)`` for a map.
            Positions equal to ``ignore_index`` count neither as positives nor as misses.
        alpha: the level in ``(0, 1)``; needs ``n >= 1/alpha - 1`` calibration examples. With ``method="ltt"``, one
            level per loss.
        loss: ``"fnr"``; with ``method="ltt"``, one or more of ``"fnr"``, ``"fdr"`` (one minus precision) and
            ``"size"`` (the fraction of positions in the mask) (:mod:`~posthoc.guarantees.learn_then_test`).
        method: ``"crc"`` (conformal risk control: the expected FNR over calibration and test draws is at most
            ``alpha``) or ``"ltt"`` (Learn then Test: with probability ``1 - delta`` over the calibration draw, every
            risk is at most its level).
        delta, thresholds, fwer, objective: Learn then Test's failure probability, grid of thresholds (default 0,
            0.01, ..., 0.99), family-wise error procedure (``"bonferroni_holm"`` or ``"bonferroni"``) and the risk
            whose calibration value the kept threshold minimises among the valid ones (default the first).
        positive: for a map ``(N, C, H, W)``, the object: a class index, or ``"foreground"`` (every class but
            ``background``, scored ``1 - p_background``).
        ignore_index: the target of positions without a label (255 for torchvision maps); ``None`` for none.

    Example:
        >>> import torch
        >>> import posthoc
        >>> g = torch.Generator().manual_seed(0)
        >>> labels = (torch.rand(200, 16, 16, generator=g) < 0.2).long()    # object pixels of 200 images
        >>> labels[:, 0, :] = 255                                           # an unlabelled row
        >>> probs = torch.sigmoid(2.0 * (2 * labels.clamp_max(1) - 1) + torch.randn(200, 16, 16, generator=g))
        >>> rc = posthoc.risk_control(probs, labels, alpha=0.05)
        >>> rc.bound <= 0.05 < rc.lam
        True
    """
    method = known_name(method, "risk-control method", RISK_CONTROL_METHODS)
    if method == "crc":
        loss = known_name(loss, "risk-control loss", LOSSES)
        alpha = probability(alpha, "alpha")
    if ignore_index is not None:
        integer(ignore_index, "ignore_index")
    scores, layout = object_scores(probs, positive, background)
    truth, valid = positives_and_valid(targets, scores, layout, positive, background, ignore_index)
    n = scores.shape[0] if scores.dim() else 0
    if scores.dim() < 2:
        raise InputError(
            f"probs must hold positions per example, (N, K) or (N, H, W) or (N, C, H, W); got shape "
            f"{tuple(scores.shape)}. For one label per example use posthoc.conformal"
        )
    if method == "ltt":
        return learn_then_test(
            scores,
            truth,
            valid,
            loss=loss,
            alpha=alpha,
            delta=delta,
            thresholds=thresholds,
            fwer=fwer,
            objective=objective,
            object_scores=lambda values: object_scores(values, positive, background),
        )
    if n < minimum_calibration_size(alpha):
        raise InputError(
            f"conformal risk control at alpha={alpha:g} needs at least {minimum_calibration_size(alpha)} calibration "
            f"examples (n >= 1/alpha - 1, so that 1/(n+1) <= alpha), got {n}; add calibration examples or raise alpha"
        )
    threshold, risk = crc_threshold(scores, truth, alpha)
    return RiskController(
        loss=loss,
        alpha=alpha,
        threshold=threshold,
        calibration_risk=risk,
        num_calibration=n,
        positive=positive,
        background=background,
        ignore_index=ignore_index,
    )
