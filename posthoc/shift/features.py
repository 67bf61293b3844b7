"""Shift of tabular and 1-D inputs: split rows by one feature into the rows a model may be fitted on and the
shifted rows that test it where the fit data never reached.

:func:`extrapolation_split` holds out the rows *above* a quantile of the feature, :func:`gap_split` a *band in the
middle* of its range. The quantiles are those of ``reference[:, feature]`` (default: ``x`` itself); the quantile ``q``
of ``n`` values is the ``max(1, int(q * n))``-th smallest. Each side's indices run in increasing order of the feature
(shuffle the fit rows before cutting them into training and validation).

Example:
    >>> import torch
    >>> from torch import nn
    >>> import posthoc
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> x = torch.randn(300, 4)
    >>> y = 2 * x[:, 3:] + 0.1 * torch.randn(300, 1)
    >>> fit, shifted = posthoc.shift.extrapolation_split(x, y, feature=3, quantile=0.7)
    >>> len(fit[0]), len(shifted[0])
    (210, 90)
    >>> net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    >>> um = posthoc.wrap(net, method="laplace", likelihood="regression").fit(DataLoader(TensorDataset(*fit), 64))
    >>> table = posthoc.evaluate_shift(um, {"extrapolation": DataLoader(TensorDataset(*shifted), 64)}, progress=False)
    >>> table.methods
    ['laplace']
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posthoc.core.checks import probability
from posthoc.errors import ConfigError, InputError

Rows = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class ShiftSplit:
    """Rows of ``(x, y)`` split by one feature: ``fit`` the rows a model may see, ``shifted`` the held-out rows whose
    feature lies in ``(low, high]``. Unpacks as ``fit, shifted = split``."""

    fit_index: Tensor
    shifted_index: Tensor
    feature: int
    low: float
    high: float
    x: Tensor
    y: Tensor

    @property
    def fit(self) -> Rows:
        """``(x, y)`` of the rows outside the held-out band."""
        return self.x[self.fit_index], self.y[self.fit_index]

    @property
    def shifted(self) -> Rows:
        """``(x, y)`` of the rows inside the held-out band."""
        return self.x[self.shifted_index], self.y[self.shifted_index]

    def __repr__(self) -> str:
        return f"ShiftSplit({self.describe()}: {len(self.fit_index)} fit rows, {len(self.shifted_index)} shifted)"

    def __iter__(self) -> Iterator[Rows]:
        return iter((self.fit, self.shifted))

    def describe(self) -> str:
        """The held-out band in words, e.g. ``"feature 3 above 3425"``."""
        if math.isinf(self.high):
            return f"feature {self.feature} above {self.low:.4g}"
        return f"feature {self.feature} in ({self.low:.4g}, {self.high:.4g}]"


def _features(x: Any, name: str) -> Tensor:
    """``x`` as ``(N, F)``: a ``(N,)`` vector is one feature; anything else is refused."""
    if not isinstance(x, Tensor) or x.dim() not in (1, 2):
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise InputError(
            f"{name} must be a tensor of rows (N, F) or a vector (N,) of one feature, got {shape}; "
            "for images use the corruption kinds (posthoc.shift.corrupt)"
        )
    return x[:, None] if x.dim() == 1 else x


def _column(x: Tensor, feature: Any, name: str) -> Tensor:
    if feature is None:
        if x.shape[1] != 1:
            raise ConfigError(
                f"{name} has {x.shape[1]} features: name the one to split by, feature=0..{x.shape[1] - 1}"
            )
        feature = 0
    if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < x.shape[1]:
        raise ConfigError(f"feature must be a column index from 0 to {x.shape[1] - 1} of {name}, got {feature!r}")
    values = x[:, feature].double()
    if not bool(torch.isfinite(values).all()):
        raise InputError(f"feature {feature} of {name} holds NaN or inf; fill or drop those rows before splitting")
    return values


def _quantile(values: Tensor, q: float) -> float:
    """The ``max(1, int(q * n))``-th smallest of ``values`` (see the module docs)."""
    return float(values.sort().values[max(1, int(q * len(values))) - 1])


def _split(
    x: Any, y: Any, feature: int | None, reference: Any, quantiles: tuple[float, ...]
) -> tuple[Tensor, list[float], int]:
    """``(values, bounds, feature)``: the feature's values in ``x``, the reference's quantiles of it, its column."""
    rows = _features(x, "x")
    if not isinstance(y, Tensor) or y.dim() == 0 or len(y) != len(rows):
        got = f"{len(y)} targets" if isinstance(y, Tensor) and y.dim() else repr(type(y).__name__)
        raise InputError(f"y must be a tensor with one target per row of x ({len(rows)} rows), got {got}")
    values = _column(rows, feature, "x")
    ref = rows if reference is None else _features(reference, "reference")
    if ref.shape[1] != rows.shape[1] or len(ref) == 0:
        raise InputError(f"reference must be rows with the {rows.shape[1]} features of x, got {tuple(ref.shape)}")
    ref_values = _column(ref, feature, "reference")
    return values, [_quantile(ref_values, q) for q in quantiles], 0 if feature is None else feature


def _band_split(x: Tensor, y: Tensor, values: Tensor, feature: int, low: float, high: float, what: str) -> ShiftSplit:
    order = values.argsort()
    held_out = (values[order] > low) & (values[order] <= high)
    split = ShiftSplit(order[~held_out], order[held_out], feature, low, high, x, y)
    for side, index in (("fit", split.fit_index), ("shifted", split.shifted_index)):
        if len(index) == 0:
            raise InputError(
                f"the {what} of feature {feature} leaves no {side} rows ({split.describe()}); "
                "choose other quantiles or another feature"
            )
    return split


def extrapolation_split(
    x: Tensor, y: Tensor, *, feature: int | None = None, quantile: float = 0.7, reference: Tensor | None = None
) -> ShiftSplit:
    """Rows whose ``feature`` lies above the ``quantile`` of ``reference`` (default ``x``) are shifted, the rest fit;
    ``feature`` may be left out for one-feature inputs.

    Example:
        >>> import torch
        >>> from posthoc.shift.features import extrapolation_split
        >>> train_x, test_x = torch.randn(100, 4), torch.randn(50, 4)
        >>> fit, heavy = extrapolation_split(train_x, train_x[:, :1], feature=3, quantile=0.7)   # the top 30 %
        >>> beyond = extrapolation_split(test_x, test_x[:, :1], feature=3, quantile=0.9, reference=train_x).shifted
        >>> len(heavy[0]), bool((beyond[0][:, 3] > train_x[:, 3].quantile(0.85)).all())
        (30, True)
    """
    probability(quantile, "quantile", why="the share of the feature's range the fit rows keep, e.g. 0.7")
    values, (low,), feature = _split(x, y, feature, reference, (quantile,))
    return _band_split(x, y, values, feature, low, math.inf, "extrapolation split")


def gap_split(
    x: Tensor,
    y: Tensor,
    *,
    feature: int | None = None,
    quantiles: tuple[float, float] = (0.4, 0.6),
    reference: Tensor | None = None,
) -> ShiftSplit:
    """Rows whose ``feature`` lies between the ``quantiles=(low, high)`` of ``reference`` (default ``x``) are
    shifted (a gap in the middle of the range), the rows on both sides fit.

    Example:
        >>> import torch
        >>> from posthoc.shift.features import gap_split
        >>> x = torch.arange(10.0)[:, None]
        >>> fit, middle = gap_split(x, x, feature=0, quantiles=(0.4, 0.6))
        >>> middle[0].flatten().tolist()
        [4.0, 5.0]
    """
    if not isinstance(quantiles, (tuple, list)) or len(quantiles) != 2:
        raise ConfigError(
            f"quantiles must be a pair (low, high) of the band to leave out, e.g. (0.4, 0.6), got {quantiles!r}"
        )
    low_q, high_q = (probability(q, "quantiles", why="the band to leave out, e.g. (0.4, 0.6)") for q in quantiles)
    if not low_q < high_q:
        raise ConfigError(f"quantiles must be (low, high) with low < high, got {tuple(quantiles)}")
    values, (low, high), feature = _split(x, y, feature, reference, (low_q, high_q))
    return _band_split(x, y, values, feature, low, high, "gap split")
