"""Choosing a Laplace prior precision on held-out NLL: a log grid, then a 1-d search in ``log δ``.

Both rules score ``δ`` on held-out data with the predictive that will be used (probit, bridge, or
MC with the same random numbers at every ``δ``), over the log grid ``1e-4 .. 1e4`` (41 points,
laplace-torch's search range):

- :func:`grid_search`: the grid point with the lowest mean NLL, what laplace-torch's
  ``optimize_prior_precision(method="gridsearch")`` does (``prior_precision="grid"``);
- :func:`widest_within`: the smallest ``δ`` (the widest posterior) whose *excess* NLL over the
  checkpoint stays under a threshold at every grid point above it: the grid is walked from the
  top (or, when even ``1e4`` is over, a decade at a time above it) by the walk every held-out
  choice shares, and the crossing refined by bisection in ``log δ`` (``prior_precision="val"``/``"auto"``, see
  :mod:`posthoc.methods.laplace.base` for the excess used).

Why not the minimiser: held-out NLL of a well-trained classifier on in-distribution data usually
falls all the way to the MAP as ``δ`` grows (measured on the bundled ``digits_bn_cnn``), so the
minimiser is a posterior too narrow to change anything under shift; the widest posterior whose
in-distribution cost is bounded keeps in-distribution predictions and widens the shifted ones.

Example:
    >>> excess = lambda delta: 1 / (1 + delta)   # NLL over the MAP's, falling to 0
    >>> delta = widest_within(excess, threshold=0.001)   # excess(δ) = 0.001 at δ = 999
    >>> 998 < delta < 1001
    True
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from posthoc.core.errors import NumericalError
from posthoc.engine.held_out import walk_spreads
from posthoc.methods.laplace.marglik import MAX_PRIOR_PRECISION, prior_bounds

#: bisection stops when the bracket is this narrow in ``ln δ`` (0.1% in ``δ``)
LOG_RESOLUTION = 1e-3


def default_grid(num: int = 41, scale: float = 1.0) -> Tensor:
    """Log-spaced prior precisions from 1e-4 to 1e4 in standardised units: divided by ``scale²`` for targets of scale
    ``scale`` (:func:`~posthoc.methods.laplace.marglik.prior_bounds`; 1 for class labels)."""
    return torch.logspace(-4, 4, num, dtype=torch.float64) / scale**2


def _scores(validation_nll: Callable[[float], float], grid: Tensor) -> list[float]:
    scores = [validation_nll(float(delta)) for delta in grid]
    scores = [score if math.isfinite(score) else math.inf for score in scores]
    if all(score == math.inf for score in scores):
        raise NumericalError(
            "the validation NLL is not finite at any prior precision of the grid 1e-4..1e4: the model's "
            "held-out logits are not finite; check the model and data, or pass a fixed prior_precision"
        )
    return scores


def grid_search(validation_nll: Callable[[float], float], grid: Tensor | None = None) -> float:
    """The prior precision in ``grid`` with the lowest ``validation_nll(δ)`` (ties: the smaller δ).

    Example:
        >>> grid_search(lambda delta: (math.log10(delta) - 1) ** 2)
        10.0
    """
    grid = default_grid() if grid is None else grid
    scores = _scores(validation_nll, grid)
    return float(grid[min(range(len(scores)), key=lambda i: (scores[i], i))])


def widest_within(excess: Callable[[float], float], threshold: float, grid: Tensor | None = None, *,
                  scale: float = 1.0) -> float:
    """The smallest ``δ`` with ``excess(δ') <= threshold`` at ``δ`` and every grid point above it (see module docs).

    The walk is :func:`posthoc.engine.held_out.walk_spreads` on the ladder of ``ln δ`` from narrow to
    wide: the decades above the grid (up to ``MAX_PRIOR_PRECISION``), then the grid from its top
    down, starting at the grid's top; the crossing is then refined by bisection in ``ln δ``.

    Args:
        excess: held-out NLL cost of the posterior at a prior precision over the checkpoint's
            (falls to ``0`` as ``δ → ∞``).
        threshold: the cost allowed.
        grid: increasing prior precisions to scan (default :func:`default_grid` at ``scale``).
        scale: the targets' scale (1 for class labels): the top of the search is ``MAX_PRIOR_PRECISION / scale²``.
    """
    grid = default_grid(scale=scale) if grid is None else grid
    logs = grid.log().tolist()
    top = prior_bounds(scale)[1]
    above = _decades_above(logs[-1], top)
    ladder = [*reversed(above), *reversed(logs)]
    within = lambda log_delta: excess(math.exp(log_delta)) <= threshold  # noqa: E731 (NaN counts as over)
    walk = walk_spreads(ladder, within, start=len(above))
    if walk.rejected is None:
        warnings.warn(
            f"the held-out NLL stays within the tolerance down to the grid's lowest prior precision "
            f"{float(grid[0]):g}; pass a fixed prior_precision to go lower",
            RuntimeWarning,
            stacklevel=3,
        )
        return float(grid[0])
    if walk.accepted is None:
        warnings.warn(
            f"every prior precision up to {top:g} costs more held-out NLL over the checkpoint than "
            "the tolerance allows; using that one (the posterior is then nearly the checkpoint). Raise val_tolerance "
            "or pass a fixed prior_precision",
            RuntimeWarning,
            stacklevel=3,
        )
        return top
    return _bisect(excess, threshold, ladder[walk.rejected], ladder[walk.accepted])


def _decades_above(top: float, bound: float = MAX_PRIOR_PRECISION) -> list[float]:
    """``ln δ`` a decade at a time above ``top`` until ``bound`` is reached, narrowest last."""
    decades, low = [], top
    while low < math.log(bound):
        low = low + math.log(10)
        decades.append(low)
    return decades


def _bisect(excess: Callable[[float], float], threshold: float, low: float, high: float) -> float:
    """The crossing of ``threshold`` in ``ln δ`` between ``low`` (over it) and ``high`` (within); returns the side within."""
    while high - low > LOG_RESOLUTION:
        middle = (low + high) / 2
        if excess(math.exp(middle)) <= threshold:
            high = middle
        else:
            low = middle
    return math.exp(high)
