"""``"venn-abers"``: inductive Venn-Abers predictors (Vovk & Petej, 2014; Vovk, Petej & Fedorova, 2015).

A binary problem (a score ``s``, an event) is calibrated twice per test score: the held-out scores and events with the
test example added as an event, and with it added as a non-event, each fitted by isotonic regression. The two fitted
values at the test score, ``p0 <= p1``, are the Venn-Abers interval; the probability is the merged
``p1 / (1 - p0 + p1)``, which minimises the worst log loss over the interval. Both tables depend on the held-out set
alone, so they are computed once per gap between held-out scores and looked up at prediction time (ties follow the
conservative convention: ``p0`` as if the test score were after its equals, ``p1`` before).

Classes are problems of their own as MAPIE's Venn-Abers does:
- ``multiclass="one-vs-rest"`` (the default): "the label is c" against ``p_c``, the merged probabilities
  renormalised; the interval of class ``c`` is its ``(p0, p1)``;
- ``multiclass="pairwise"``: every pair ``(i, j)``, "the label is j" against ``p_j / (p_i + p_j)`` on the examples of
  those two classes, coupled as ``p_c = 1 / (sum_j 1 / p_{c|cj} - (C - 2))`` (MAPIE's ``VennAbersCalibrator`` on a
  prefitted classifier), the coupled intervals from the pairs' bounds.

A binary classifier (one logit, or two classes) is the one problem "the label is 1" in both.

Example:
    >>> import posthoc, torch
    >>> from posthoc_apps.demo.examples import logits, labels, test_logits
    >>> calibrator = posthoc.calibrate(logits, labels, method="venn-abers", tolerance=0.07)
    >>> lower, upper = calibrator.interval(test_logits)
    >>> bool((lower <= upper).all()), calibrator(test_logits).sum(-1)[:2]
    (True, tensor([1., 1.]))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from posthoc.core.checks import one_of
from posthoc.core.inputs import as_tensor, like_given
from posthoc.core.logits import as_class_logits
from posthoc.core.registry import register
from posthoc.export.modules import cast
from posthoc.methods.calibration.base import Calibrator
from posthoc.methods.calibration.histogram import FLOOR
from posthoc.methods.calibration.method import CalibrationMethod

MODES = ("one-vs-rest", "pairwise")


def isotonic_at_insertion(scores: Tensor, events: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The Venn-Abers tables of one binary problem: its distinct sorted ``scores`` ``(K,)`` and, for a test example
    placed after the first ``i`` of them (``i = 0..K``), the isotonic fit at that example when it is added as a
    non-event (``p0[i]``) or an event (``p1[i]``).

    Both come from the max-min formula of isotonic regression, ``max_{a<=i} min_{b>=i} (S_b - S_a + y) /
    (W_b - W_a + 1)`` over the cumulative counts ``W`` and events ``S`` of the sorted groups, found as a bridge
    between two convex hulls (:func:`_max_min`).

    Example:
        >>> import torch
        >>> from posthoc.methods.calibration.venn_abers import isotonic_at_insertion
        >>> points, p0, p1 = isotonic_at_insertion(torch.tensor([0.1, 0.4, 0.8]), torch.tensor([0.0, 1.0, 1.0]))
        >>> p0.tolist(), p1.tolist()
        ([0.0, 0.0, 0.5, 0.6666666666666666], [0.5, 1.0, 1.0, 1.0])
    """
    points, group = torch.unique(scores.double(), sorted=True, return_inverse=True)
    zero = torch.zeros(1, dtype=torch.float64, device=scores.device)
    counts = torch.bincount(group, minlength=points.numel()).double()
    hits = torch.bincount(group, weights=events.double(), minlength=points.numel())
    weight, total = torch.cat([zero, counts.cumsum(0)]), torch.cat([zero, hits.cumsum(0)])
    return points, _max_min(weight, total, 0.0), _max_min(weight, total, 1.0)


def _max_min(weight: Tensor, total: Tensor, event: float) -> Tensor:
    """``max_{a<=i} min_{b>=i} slope(Q_a, P_b)`` for every ``i``: ``P_b = (weight_b, total_b)`` the cumulative sum
    diagram, ``Q_a = P_a - (1, event)``. It is the slope of the lower common tangent (the bridge) of the lower hull of
    ``Q_0..Q_i`` and that of ``P_i..P_K``; both hulls are paths in trees built once by the monotone chain (``left[a]``:
    the hull's vertex before ``Q_a``; ``right[b]``: the one after ``P_b``), and the bridge is found by walking from
    ``(Q_i, P_i)`` along them, each end moved while the next vertex lies under the line."""
    xs, ys = weight.tolist(), total.tolist()
    qx, qy = [x - 1 for x in xs], [y - event for y in ys]
    gaps = len(xs)

    def slope(a: int, b: int) -> float:
        return (ys[b] - qy[a]) / (xs[b] - qx[a])

    left, stack = [-1] * gaps, []
    for a in range(gaps):  # lower hull of Q_0..Q_a, left to right
        while len(stack) > 1 and (qy[stack[-1]] - qy[stack[-2]]) * (qx[a] - qx[stack[-1]]) >= (
            qy[a] - qy[stack[-1]]
        ) * (qx[stack[-1]] - qx[stack[-2]]):
            stack.pop()
        left[a] = stack[-1] if stack else -1
        stack.append(a)
    right, stack = [-1] * gaps, []
    for b in range(gaps - 1, -1, -1):  # lower hull of P_b..P_K, right to left
        while len(stack) > 1 and (ys[stack[-1]] - ys[b]) * (xs[stack[-2]] - xs[stack[-1]]) >= (
            ys[stack[-2]] - ys[stack[-1]]
        ) * (xs[stack[-1]] - xs[b]):
            stack.pop()
        right[b] = stack[-1] if stack else -1
        stack.append(b)
    values = []
    for i in range(gaps):
        a = b = i
        moved = True
        while moved:
            moved = False
            while left[a] >= 0 and slope(left[a], b) >= slope(a, b):
                a, moved = left[a], True
            while right[b] >= 0 and slope(a, right[b]) <= slope(a, b):
                b, moved = right[b], True
        values.append(slope(a, b))
    return torch.tensor(values, dtype=torch.float64, device=weight.device)


def problem_scores(probs: Tensor, mode: str) -> Tensor:
    """The score of each binary problem ``(..., P)`` from class probabilities ``(..., C)``: ``p_1`` for two classes;
    ``p_c`` one-vs-rest; ``p_j / (p_i + p_j)`` for each pair ``i < j`` (pairwise)."""
    classes = probs.shape[-1]
    if classes == 2:
        return probs[..., 1:]
    if mode == "one-vs-rest":
        return probs
    first, second = torch.triu_indices(classes, classes, 1, device=probs.device)
    return probs[..., second] / (probs[..., first] + probs[..., second]).clamp_min(torch.finfo(probs.dtype).tiny)


def venn_abers_bounds(logits: Tensor, points: Tensor, low: Tensor, high: Tensor, mode: str) -> tuple[Tensor, Tensor]:
    """The ``(p0, p1)`` of every binary problem ``(..., P)`` for class logits ``(..., C)``, looked up in the tables
    ``points`` ``(P, L)`` (padded with ``+inf``) and ``low``, ``high`` ``(P, L + 1)``."""
    scores = problem_scores(torch.softmax(cast(logits, torch.float64), -1), mode).unsqueeze(-1)
    points = cast(points, torch.float64)
    after = (scores >= points).sum(-1, keepdim=True)  # searchsorted right, in ops every exporter takes
    before = (scores > points).sum(-1, keepdim=True)  # searchsorted left
    shape = (*scores.shape[:-1], low.shape[-1])
    p0 = torch.gather(cast(low, torch.float64).expand(shape), -1, after).squeeze(-1)
    p1 = torch.gather(cast(high, torch.float64).expand(shape), -1, before).squeeze(-1)
    return p0, p1


def _merged(p0: Tensor, p1: Tensor) -> Tensor:
    return p1 / (1 - p0 + p1)


def _coupled(pair_probs: Tensor, classes: int) -> Tensor:
    """Class probabilities ``(..., C)`` of pairwise probabilities of "the second class" ``(..., P)`` (pairs ``i <
    j``): ``1 / (sum_j 1 / p_{c|cj} - (C - 2))`` (Hastie & Tibshirani's coupling as MAPIE uses it)."""
    first, second = torch.triu_indices(classes, classes, 1, device=pair_probs.device)
    inverse = torch.zeros(*pair_probs.shape[:-1], classes, dtype=pair_probs.dtype, device=pair_probs.device)
    inverse = inverse.index_add(-1, second, 1 / pair_probs).index_add(-1, first, 1 / (1 - pair_probs))
    return 1 / (inverse - (classes - 2))


def venn_abers_probs(
    logits: Tensor, points: Tensor, low: Tensor, high: Tensor, mode: str
) -> tuple[Tensor, Tensor, Tensor]:
    """Venn-Abers probabilities ``(..., C)`` (merged, renormalised) with the per-class interval (lower, upper) of
    class logits ``(..., C)``, in float64.

    Example:
        >>> import torch
        >>> from posthoc.methods.calibration.venn_abers import venn_abers_probs
        >>> tables = torch.tensor([[0.5]]), torch.tensor([[0.0, 0.5]]), torch.tensor([[0.5, 1.0]])
        >>> probs, lower, upper = venn_abers_probs(torch.tensor([[0.0, 2.0]]), *tables, "one-vs-rest")
        >>> probs.tolist(), lower.tolist(), upper.tolist()
        ([[0.3333333333333333, 0.6666666666666666]], [[0.0, 0.5]], [[0.5, 1.0]])
    """
    p0, p1 = venn_abers_bounds(logits, points, low, high, mode)
    classes = logits.shape[-1]
    if classes == 2:
        merged = _merged(p0, p1)
        return torch.cat([1 - merged, merged], -1), torch.cat([1 - p1, p0], -1), torch.cat([1 - p0, p1], -1)
    if mode == "one-vs-rest":
        merged = _merged(p0, p1)
        return merged / merged.sum(-1, keepdim=True), p0, p1
    coupled = _coupled(_merged(p0, p1), classes)
    lower = _coupled(p0.clamp_min(FLOOR), classes).clamp(0, 1)
    upper = torch.nan_to_num(_coupled(p1.clamp_max(1 - FLOOR), classes), nan=1.0).clamp(0, 1)
    return coupled / coupled.sum(-1, keepdim=True), torch.minimum(lower, upper), torch.maximum(lower, upper)


def venn_abers_log_probs(logits: Tensor, points: Tensor, low: Tensor, high: Tensor, mode: str) -> Tensor:
    """The calibrated log-probabilities of class logits ``(..., C)`` (:func:`venn_abers_probs`), in their dtype."""
    probs = venn_abers_probs(logits, points, low, high, mode)[0].clamp_min(FLOOR)
    return cast((probs / probs.sum(-1, keepdim=True)).log(), logits.dtype)


class VennAbersCalibration(Calibrator):
    """Inductive Venn-Abers: two isotonic fits per binary problem, merged; :meth:`interval` gives both."""

    name = "venn-abers"
    extends = "temperature"
    per_sample = False
    interpolable = False

    @dataclass(frozen=True, kw_only=True)
    class Options(Calibrator.Options):
        multiclass: Literal[MODES] = "one-vs-rest"

    def __init__(self, *, multiclass: str = "one-vs-rest") -> None:
        super().__init__()
        self.multiclass = one_of(multiclass, "multiclass", MODES)
        self.register_buffer("points", torch.empty(0))
        self.register_buffer("low", torch.empty(0))
        self.register_buffer("high", torch.empty(0))

    def _fit(self, inputs: Tensor, labels: Tensor) -> None:
        probs = torch.softmax(inputs.double(), -1)
        classes = probs.shape[-1]
        scores = problem_scores(probs, self.multiclass)
        if classes == 2 or self.multiclass == "one-vs-rest":
            first = torch.zeros(scores.shape[-1], dtype=torch.long, device=labels.device)
            second = torch.arange(scores.shape[-1], device=labels.device) + (classes == 2)
            members = [torch.ones_like(labels, dtype=torch.bool)] * scores.shape[-1]
        else:
            first, second = torch.triu_indices(classes, classes, 1, device=labels.device)
            members = [(labels == i) | (labels == j) for i, j in zip(first.tolist(), second.tolist())]
        tables = [isotonic_at_insertion(scores[keep, k], labels[keep] == second[k]) for k, keep in enumerate(members)]
        longest = max(len(points) for points, _, _ in tables)
        self.points = torch.full((len(tables), longest), torch.inf, dtype=torch.float64, device=inputs.device)
        self.low = torch.zeros(len(tables), longest + 1, dtype=torch.float64, device=inputs.device)
        self.high = torch.ones(len(tables), longest + 1, dtype=torch.float64, device=inputs.device)
        for k, (points, p0, p1) in enumerate(tables):
            self.points[k, : len(points)], self.low[k, : len(p0)], self.high[k, : len(p1)] = points, p0, p1

    def map_parts(self) -> tuple[Callable[..., Tensor], dict[str, Tensor], dict[str, Any]]:
        tensors = {"points": self.points, "low": self.low, "high": self.high}
        return venn_abers_log_probs, tensors, {"mode": self.multiclass}

    def num_parameters(self) -> int:
        return int(torch.isfinite(self.points).sum()) * 3

    def interval(self, logits: Any) -> tuple[Any, Any]:
        """The Venn-Abers interval ``(lower, upper)`` of each class's probability ``(N, C)`` (numpy for numpy
        logits); the merged probabilities of ``calibrator(logits)`` are renormalised, so they may sit just outside
        it. A calibrator that kept the model's own probabilities (too few held-out errors) gives them as both ends.

        Example:
            >>> import math, posthoc, torch
            >>> scores = 4 * torch.randn(1000)                      # a binary classifier's logits, twice too sharp
            >>> events = (torch.rand(1000) < torch.sigmoid(scores / 2)).long()
            >>> calibrator = posthoc.calibrate(scores, events, method="venn-abers", tolerance=math.inf)
            >>> lower, upper = calibrator.interval(scores)
            >>> width = (upper - lower)[:, 1]                      # wide where few held-out scores are near
            >>> lower.shape, bool(width.median() < 0.03), bool(width.max() > 0.1)
            (torch.Size([1000, 2]), True, True)
        """
        class_logits = self._log_probs(logits) if bool(self.passthrough) else None
        if class_logits is not None:
            probs = class_logits.exp()
            return like_given(probs, logits), like_given(probs.clone(), logits)
        class_logits = as_class_logits(as_tensor(logits, "logits")).to(self.points.device)
        self.transform(class_logits.float())  # the checks on the number of classes
        _, lower, upper = venn_abers_probs(class_logits, self.points, self.low, self.high, self.multiclass)
        return like_given(lower.float(), logits), like_given(upper.float(), logits)


@register
class VennAbersMethod(CalibrationMethod):
    """Inductive Venn-Abers calibration of the inner predictive (one-vs-rest or pairwise)."""

    name = "venn-abers"
    calibrator_class = VennAbersCalibration
