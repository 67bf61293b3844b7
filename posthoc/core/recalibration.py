"""A monotone map of predictive probabilities per output: the isotonic recalibration of a regression CDF.

Kuleshov et al. (2018) recalibrate a predictive CDF ``F`` by a non-decreasing map ``R`` of ``[0, 1]`` onto itself,
fitted so that the held-out ``R(F(y))`` are uniform; the recalibrated ``q``-quantile is ``F⁻¹(R⁻¹(q))``. ``R`` is
piecewise linear through its knots (as scikit-learn's ``IsotonicRegression.predict``), one map per output;
``R⁻¹`` is the generalised inverse ``inf {u : R(u) >= q}``.

Example:
    >>> import torch
    >>> from posthoc.core.recalibration import MonotoneMap
    >>> knots = torch.tensor([[0.0, 0.5, 1.0]])
    >>> mapping = MonotoneMap(knots, torch.tensor([[0.0, 0.8, 1.0]]))
    >>> mapping(torch.tensor([[0.25]])), mapping.inverse(torch.tensor([0.8]))
    (tensor([[0.4000]]), tensor([0.5000]))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def _segments(knots: Tensor, values: Tensor, right: bool) -> tuple[Tensor, Tensor]:
    """The index ``i`` of the segment ``[knots[i-1], knots[i]]`` holding each value, per output: ``values`` ``(D, n)``."""
    index = torch.searchsorted(knots.contiguous(), values.contiguous(), right=right)
    return (index - 1).clamp(0, knots.shape[1] - 2), index.clamp(1, knots.shape[1] - 1)


def _interpolate(values: Tensor, xs: Tensor, ys: Tensor, right: bool) -> Tensor:
    """The piecewise-linear function through ``(xs, ys)`` ``(D, M)`` at ``values`` ``(D, n)``."""
    low, high = _segments(xs, values, right)
    x0, x1, y0, y1 = xs.gather(1, low), xs.gather(1, high), ys.gather(1, low), ys.gather(1, high)
    weight = ((values - x0) / (x1 - x0)).nan_to_num(0.0, 0.0, 0.0).clamp(0.0, 1.0)
    return y0 + weight * (y1 - y0)


@dataclass(frozen=True)
class MonotoneMap:
    """``D`` non-decreasing piecewise-linear maps of ``[0, 1]`` onto ``[0, 1]``: knot positions ``knots_x`` and values
    ``knots_y``, each ``(D, M)`` non-decreasing from 0 to 1."""

    knots_x: Tensor
    knots_y: Tensor

    def _per_output(self, values: Tensor) -> tuple[Tensor, tuple[int, ...]]:
        values = values.to(self.knots_x.dtype)
        shape = values.shape
        flat = (
            values.reshape(-1, self.knots_x.shape[0]).T
            if values.dim()
            else values.expand(self.knots_x.shape[0])[:, None]
        )
        return flat, shape

    def __call__(self, u: Tensor) -> Tensor:
        """``R(u)`` for probabilities ``u`` ``(..., D)`` (clipped to ``[0, 1]``), same shape."""
        flat, shape = self._per_output(u.clamp(0.0, 1.0))
        return _interpolate(flat, self.knots_x, self.knots_y, right=True).T.reshape(shape)

    def inverse(self, q: Tensor) -> Tensor:
        """``R⁻¹(q)`` for levels ``q`` ``(..., D)`` or ``(D,)``; a scalar level gives ``(1, D)``."""
        if q.dim() == 0:
            q = q.expand(1, self.knots_x.shape[0])
        flat, shape = self._per_output(q.clamp(0.0, 1.0))
        return _interpolate(flat, self.knots_y, self.knots_x, right=False).T.reshape(shape)

    def slope(self, u: Tensor) -> Tensor:
        """``R'(u)`` ``(..., D)``: the density factor of the recalibrated distribution (0 where ``R`` is flat)."""
        flat, shape = self._per_output(u.clamp(0.0, 1.0))
        low, high = _segments(self.knots_x, flat, right=True)
        rise = self.knots_y.gather(1, high) - self.knots_y.gather(1, low)
        run = self.knots_x.gather(1, high) - self.knots_x.gather(1, low)
        return (rise / run).nan_to_num(0.0, 0.0, 0.0).T.reshape(shape)
