"""The prior precisions a held-out rule tries: laplace-torch's log grid, and the ladder of the selection step.

:func:`grid_search` is laplace-torch's ``gridsearch`` (``prior_precision="grid"``); :func:`ladder` gives the
candidates of ``"val"`` / ``"auto"``, narrowest posterior first: a decade at a time from ``MAX_PRIOR_PRECISION`` down
to the grid's top, then the grid from ``1e4`` down to ``1e-4``. Not the minimiser: a well-trained classifier's
held-out NLL usually falls all the way to the MAP as ``δ`` grows, a posterior too narrow to change anything under
shift; the widest posterior whose in-distribution cost is bounded widens the shifted predictions.

Example:
    >>> from posthoc.methods.laplace.prior_search import ladder
    >>> candidates = ladder()
    >>> candidates[0], candidates[4], candidates[-1]
    (100000000.0, 10000.0, 0.0001)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from posthoc.errors import NumericalError
from posthoc.methods.laplace.marglik import prior_bounds


def default_grid(num: int = 41, scale: float = 1.0) -> Tensor:
    """Log-spaced prior precisions from 1e-4 to 1e4, divided by ``scale²`` for targets of scale ``scale``."""
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
        >>> import math
        >>> from posthoc.methods.laplace.prior_search import grid_search
        >>> grid_search(lambda delta: (math.log10(delta) - 1) ** 2)
        10.0
    """
    grid = default_grid() if grid is None else grid
    scores = _scores(validation_nll, grid)
    return float(grid[min(range(len(scores)), key=lambda i: (scores[i], i))])


def ladder(grid: Tensor | None = None, *, scale: float = 1.0) -> list[float]:
    """The prior precisions of the held-out rule, narrowest posterior first, for targets of scale ``scale``."""
    grid = default_grid(scale=scale) if grid is None else grid
    top = float(grid[-1])
    decades = []
    value = prior_bounds(scale)[1]
    while value > top * (1 + 1e-9):
        decades.append(value)
        value /= 10
    return [*decades, *(float(delta) for delta in reversed(grid))]
