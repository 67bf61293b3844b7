"""Bootstrap statistics of a regression report: every metric of :mod:`~posthoc.evaluation.regression_metrics`
as a function of an index matrix of resampled examples.

An example is resampled with all its outputs. Each statistic evaluated on the identity index gives the
report's value; on a ``(B, n)`` index it gives ``B`` values at once in tensor ops, which
:func:`posthoc.evaluation.bootstrap.intervals` turns into intervals. MACE counts, per resample, how many of
its points first fall inside the central interval at each of the curve's levels (one bucketed sum, no
``(B, n, levels)`` tensor); ENCE sorts each resample's points by predicted std and sums per bin of ranks.

Apart from :mod:`~posthoc.evaluation.bootstrap` only in its statistics (those of
:mod:`~posthoc.evaluation.regression_metrics`); the resampling and the intervals are that module's.

Example:
    >>> import torch
    >>> from posthoc.evaluation import regression_metrics
    >>> from posthoc.evaluation.regression_bootstrap import regression_statistics
    >>> from posthoc.demo.examples import regression_um, reg_x, reg_y
    >>> means, stds = regression_metrics.components(regression_um.predict(reg_x))     # (1, 8, 1) each
    >>> stats = regression_statistics(means, stds, reg_y)
    >>> float(stats["crps"](torch.arange(len(reg_y))[None])[0]) == regression_metrics.crps(means, stds, reg_y)
    True
"""

from __future__ import annotations

import torch
from torch import Tensor

from posthoc.evaluation import regression_metrics
from posthoc.evaluation.bootstrap import Statistic, mean_of
from posthoc.evaluation.regression_metrics import CURVE_LEVELS, LEVELS


def level_name(level: float) -> str:
    """``"90"`` for 0.9: the suffix of a level's coverage and width (``coverage_90``, ``width_90``)."""
    return f"{round(level * 100):d}"


def _points(index: Tensor, outputs: int) -> Tensor:
    """The ``(B, n * D)`` point indices (example-major) of resampled examples ``(B, n)``."""
    return (index[..., None] * outputs + torch.arange(outputs)).flatten(-2)


def _rmse_of(squared: Tensor) -> Statistic:
    return lambda index: squared[index].mean(-1).sqrt()


def _mace_of(position: Tensor, outputs: int) -> Statistic:
    """Mean absolute gap of the interval calibration curve; ``position = |2 F(y) - 1|`` per point ``(N * D,)``."""
    expected = torch.linspace(0.0, 1.0, CURVE_LEVELS, dtype=torch.float64)
    first = torch.searchsorted(expected, position)  # the first level whose interval holds the point

    def mace(index: Tensor) -> Tensor:
        points = _points(index, outputs)
        rows = torch.arange(points.shape[0])[:, None] * (CURVE_LEVELS + 1) + first[points]
        counts = torch.zeros(points.shape[0] * (CURVE_LEVELS + 1), dtype=torch.float64)
        counts.index_add_(0, rows.flatten(), torch.ones(rows.numel(), dtype=torch.float64))
        observed = counts.view(-1, CURVE_LEVELS + 1)[:, :CURVE_LEVELS].cumsum(-1) / points.shape[1]
        return (observed - expected).abs().mean(-1)

    return mace


def _ence_of(std: Tensor, error: Tensor, outputs: int, bins: int) -> Statistic:
    """ENCE of points ``(N * D,)`` with predicted ``std`` and ``error`` of the mean, as :func:`regression_metrics.ence`."""

    def ence(index: Tensor) -> Tensor:
        points = _points(index, outputs)
        count = points.shape[1]
        order = std[points].argsort(dim=-1, stable=True)
        ranked = points.gather(-1, order)
        bin_of = torch.cat(
            [torch.full((len(part),), b) for b, part in enumerate(torch.arange(count).tensor_split(bins))]
        )
        rows = (torch.arange(points.shape[0])[:, None] * bins + bin_of).flatten()
        sums = [
            torch.zeros(points.shape[0] * bins, dtype=torch.float64)
            .index_add_(0, rows, values[ranked].flatten())
            .view(-1, bins)
            for values in (std.square(), error.square())
        ]
        sizes = torch.bincount(bin_of, minlength=bins).double()
        rmv, rmse = (sums[0] / sizes).sqrt(), (sums[1] / sizes).sqrt()
        return ((rmv - rmse).abs() / rmv).mean(-1)

    return ence


def regression_statistics(means: Tensor, stds: Tensor, y: Tensor, *, bins: int = 10) -> dict[str, Statistic]:
    """RMSE, MAE, NLL, CRPS, coverage and width at each of :data:`LEVELS`, MACE and ENCE of a predictive
    ``(means, stds)`` ``(K, N, D)`` and targets ``y`` (the definitions of
    :mod:`~posthoc.evaluation.regression_metrics`).

    Example:
        >>> import torch
        >>> from posthoc.evaluation import regression_metrics
        >>> from posthoc.evaluation.regression_bootstrap import regression_statistics
        >>> from posthoc.demo.examples import regression_um, reg_x, reg_y
        >>> means, stds = regression_metrics.components(regression_um.predict(reg_x))
        >>> regression_statistics(means, stds, reg_y)["rmse"](torch.arange(len(reg_y))[None])   # the identity index
        tensor([0.1419], dtype=torch.float64)
    """
    means, stds = means.detach().cpu(), stds.detach().cpu()
    mixture = regression_metrics.mixture(means, stds)
    y = regression_metrics.as_targets(means, y.detach().cpu())
    outputs = y.shape[1]
    error = regression_metrics.predictive_mean(means) - y
    stats = {
        "rmse": _rmse_of(error.square().mean(-1)),
        "mae": mean_of(error.abs().mean(-1)),
        "nll": mean_of(-mixture.log_prob(y)),
        "crps": mean_of(mixture.crps(y).mean(-1)),
    }
    for level in LEVELS:
        lower, upper = mixture.interval(level)
        stats |= interval_statistics(lower, upper, y, suffix=f"_{level_name(level)}")
    stats["mace"] = _mace_of((2.0 * mixture.cdf(y) - 1.0).abs().flatten(), outputs)
    if error.numel() >= bins:  # fewer points than bins: ENCE is unavailable (the report's None)
        stats["ence"] = _ence_of(mixture.variance().sqrt().flatten(), error.flatten(), outputs, bins)
    return stats


def interval_statistics(lower: Tensor, upper: Tensor, y: Tensor, *, suffix: str = "") -> dict[str, Statistic]:
    """``coverage{suffix}`` (fraction of targets inside) and ``width{suffix}`` (mean width) of intervals
    ``(N, D)``; each example counts its outputs' mean."""
    lower, upper, y = lower.detach().cpu().double(), upper.detach().cpu().double(), y.detach().cpu().double()
    inside = ((lower <= y) & (y <= upper)).double().mean(-1)
    return {f"coverage{suffix}": mean_of(inside), f"width{suffix}": mean_of((upper - lower).mean(-1))}
