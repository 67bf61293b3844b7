"""Metrics of a real-valued (Gaussian-mixture) predictive, as values and as bootstrap statistics: its own module
because they integrate a mixture over real targets, where :mod:`~posthoc.evaluation.metrics` sums a categorical.

The predictive is an equal-weight mixture of Gaussians per output (:class:`~posthoc.core.mixture.GaussianMixture`),
given as ``means`` and ``stds`` of shape ``(K, N, D)`` (:func:`components`); the targets ``y`` are ``(N,)`` or
``(N, D)``. Every metric is exact for such a predictive, in float64, averaged over examples and outputs (:func:`nll` is
joint over an example's outputs). CRPS is in closed form (Grimit et al. 2006); MACE and RMSCE are uncertainty-toolbox's,
read from the probability integral transform ``F(y)``; ENCE is Levi et al. (2019)'s. :func:`statistics` gives each as a
function of an index matrix of resampled examples (an example is resampled with all its outputs).

Example:
    >>> import torch
    >>> from posthoc.evaluation.gaussian_metrics import interval_coverage
    >>> means, stds = torch.zeros(1, 4, 1), torch.ones(1, 4, 1)
    >>> y = torch.tensor([[0.0], [1.0], [-1.0], [3.0]])
    >>> interval_coverage(means, stds, y, 0.9)[0]
    0.75
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posthoc.core.checks import integer_at_least, one_of, probability
from posthoc.core.mixture import GaussianMixture
from posthoc.core.prediction import RegressionPrediction
from posthoc.errors import InputError
from posthoc.evaluation.bootstrap import Statistic, mean_of

#: the interval levels the reports show
LEVELS = (0.5, 0.9, 0.95)
#: expected proportions of :func:`calibration_curve`: 100 levels from 0 to 1, as uncertainty-toolbox
CURVE_LEVELS = 100


def mixture(means: Tensor, stds: Tensor) -> GaussianMixture:
    """The predictive as a float64 :class:`GaussianMixture`, refusing shapes that differ or stds <= 0."""
    if means.shape != stds.shape or means.dim() != 3:
        raise InputError(
            f"a regression predictive is (K, N, D) means and stds of one shape; got {tuple(means.shape)} "
            f"and {tuple(stds.shape)}"
        )
    if not bool((stds > 0).all()):
        raise InputError("every component's std must be > 0; a regression predictive needs a fitted observation noise")
    return GaussianMixture(means.double(), stds.double().square())


def components(prediction: RegressionPrediction) -> tuple[Tensor, Tensor]:
    """``(means, stds)`` ``(K, N, D)`` of a :class:`RegressionPrediction`'s mixture, for the metrics here; a
    recalibrated (isotonic) prediction is refused: its mixture is not the predictive it answers for."""
    if prediction.recalibrated:
        raise InputError(
            "this prediction is recalibrated (isotonic): its Gaussian components are not its predictive, "
            "so the metrics here would score the uncalibrated one; read its .cdf(y), .quantile(q) and "
            ".interval(level), or use 'variance-scaling', whose prediction these metrics score exactly"
        )
    return prediction.distribution.means, prediction.distribution.variances.sqrt()


def as_targets(means: Tensor, y: Tensor) -> Tensor:
    """``y`` as float64 ``(N, D)`` (a ``(N,)`` vector is one output), refusing a shape unlike the predictions'."""
    if y.dim() == 1:
        y = y[:, None]
    if y.shape != means.shape[1:]:
        raise InputError(
            f"targets of shape {tuple(y.shape)} do not match predictions of {tuple(means.shape[1:])} "
            "(examples, outputs)"
        )
    return y.double()


def predictive_mean(means: Tensor) -> Tensor:
    """The mixture's mean ``(N, D)``."""
    return means.double().mean(0)


def predictive_std(means: Tensor, stds: Tensor) -> Tensor:
    """The mixture's std ``(N, D)``: mean component variance plus the variance of the component means."""
    return mixture(means, stds).variance().sqrt()


def rmse(means: Tensor, y: Tensor) -> float:
    """Root mean squared error of the predictive mean."""
    return float(((predictive_mean(means) - as_targets(means, y)) ** 2).mean().sqrt())


def mae(means: Tensor, y: Tensor) -> float:
    """Mean absolute error of the predictive mean."""
    return float((predictive_mean(means) - as_targets(means, y)).abs().mean())


def nll(means: Tensor, stds: Tensor, y: Tensor) -> float:
    """Mean over examples of ``-log p(y)``, joint over an example's outputs."""
    return float(-mixture(means, stds).log_prob(as_targets(means, y)).mean())


def example_nll(means: Tensor, stds: Tensor, y: Tensor) -> Tensor:
    """``-log p(y)`` per example ``(N,)``, joint over its outputs, float64 on the CPU (:func:`nll` is its mean)."""
    y = as_targets(means, y.detach().cpu())
    return -mixture(means.detach().cpu(), stds.detach().cpu()).log_prob(y).double()


def crps(means: Tensor, stds: Tensor, y: Tensor) -> float:
    """Mean continuous ranked probability score (closed form; in the targets' units, lower is better)."""
    return float(mixture(means, stds).crps(as_targets(means, y)).mean())


def interval_coverage(means: Tensor, stds: Tensor, y: Tensor, level: float) -> tuple[float, float]:
    """``(coverage, mean width)`` of the central intervals holding ``level`` of the predictive mass."""
    probability(level, "level")
    lower, upper = mixture(means, stds).interval(level)
    y = as_targets(means, y)
    return float(((lower <= y) & (y <= upper)).double().mean()), float((upper - lower).mean())


def calibration_curve(
    means: Tensor, stds: Tensor, y: Tensor, *, kind: str = "interval", levels: int = CURVE_LEVELS
) -> tuple[Tensor, Tensor]:
    """``(expected, observed)`` proportions at ``levels`` evenly spaced levels from 0 to 1.

    ``kind="interval"``: the fraction of targets inside the central interval of each level (``|2 F(y) - 1| <= p``);
    ``"quantile"``: the fraction at or below the ``p``-quantile (``F(y) <= p``).
    """
    one_of(kind, "kind", ("interval", "quantile"))
    integer_at_least(levels, "levels", 2)
    pit = mixture(means, stds).cdf(as_targets(means, y)).flatten()
    expected = torch.linspace(0.0, 1.0, levels, dtype=torch.float64)
    position = (2.0 * pit - 1.0).abs() if kind == "interval" else pit
    observed = (position[:, None] <= expected[None, :]).double().mean(0)
    return expected, observed


def calibration_error(
    means: Tensor, stds: Tensor, y: Tensor, *, kind: str = "interval", squared: bool = False
) -> float:
    """Mean absolute (or, ``squared=True``, root mean squared) gap of :func:`calibration_curve` from the diagonal."""
    expected, observed = calibration_curve(means, stds, y, kind=kind)
    gap = observed - expected
    return float(gap.pow(2).mean().sqrt()) if squared else float(gap.abs().mean())


def binned_rmv_rmse(means: Tensor, stds: Tensor, y: Tensor, *, bins: int = 10) -> tuple[list[float], list[float]]:
    """Per bin of (nearly) equal count sorted by the predicted std, ``RMV_b`` (root mean predicted variance) and
    ``RMSE_b`` (of the predictive mean): the two sides of :func:`ence`.

    Example:
        >>> from posthoc.evaluation.gaussian_metrics import binned_rmv_rmse, components
        >>> from posthoc_apps.demo.examples import regression_um, reg_x, reg_y
        >>> means, stds = components(regression_um.predict(reg_x))
        >>> rmv, rmse = binned_rmv_rmse(means, stds, reg_y, bins=4)     # 8 points: 4 bins of 2
        >>> [round(v, 3) for v in rmv], [round(v, 3) for v in rmse]
        ([0.146, 0.146, 0.147, 0.15], [0.189, 0.153, 0.067, 0.13])
    """
    integer_at_least(bins, "bins", 1)
    std = predictive_std(means, stds).flatten()
    error = (predictive_mean(means) - as_targets(means, y)).flatten()
    if std.numel() < bins:
        raise InputError(f"ENCE with {bins} bins needs at least {bins} predictions, got {std.numel()}")
    order = std.argsort(stable=True)  # ties (a homoscedastic predictive) keep the examples' order
    groups = order.tensor_split(bins)
    return (
        [float(std[members].pow(2).mean().sqrt()) for members in groups],
        [float(error[members].pow(2).mean().sqrt()) for members in groups],
    )


def ence(means: Tensor, stds: Tensor, y: Tensor, *, bins: int = 10) -> float:
    """Expected normalised calibration error: ``mean_b |RMV_b - RMSE_b| / RMV_b`` over :func:`binned_rmv_rmse`."""
    rmv, rmse = binned_rmv_rmse(means, stds, y, bins=bins)
    return math.fsum(abs(v - e) / v for v, e in zip(rmv, rmse)) / bins


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
    """ENCE of points ``(N * D,)`` with predicted ``std`` and ``error`` of the mean, as :func:`ence`."""

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


def statistics(means: Tensor, stds: Tensor, y: Tensor, *, bins: int = 10) -> dict[str, Statistic]:
    """RMSE, MAE, NLL, CRPS, coverage and width at each of :data:`LEVELS`, MACE and ENCE as bootstrap statistics.

    Example:
        >>> import torch
        >>> from posthoc.evaluation.gaussian_metrics import components, statistics
        >>> from posthoc_apps.demo.examples import regression_um, reg_x, reg_y
        >>> means, stds = components(regression_um.predict(reg_x))
        >>> statistics(means, stds, reg_y)["rmse"](torch.arange(len(reg_y))[None])   # the identity index
        tensor([0.1419], dtype=torch.float64)
    """
    means, stds = means.detach().cpu(), stds.detach().cpu()
    predictive = mixture(means, stds)
    y = as_targets(means, y.detach().cpu())
    outputs = y.shape[1]
    error = predictive_mean(means) - y
    stats = {
        "rmse": _rmse_of(error.square().mean(-1)),
        "mae": mean_of(error.abs().mean(-1)),
        "nll": mean_of(-predictive.log_prob(y)),
        "crps": mean_of(predictive.crps(y).mean(-1)),
    }
    for level in LEVELS:
        lower, upper = predictive.interval(level)
        stats |= interval_statistics(lower, upper, y, suffix=f"_{level_name(level)}")
    stats["mace"] = _mace_of((2.0 * predictive.cdf(y) - 1.0).abs().flatten(), outputs)
    if error.numel() >= bins:  # fewer points than bins: ENCE is unavailable (the report's None)
        stats["ence"] = _ence_of(predictive.variance().sqrt().flatten(), error.flatten(), outputs, bins)
    return stats


def interval_statistics(lower: Tensor, upper: Tensor, y: Tensor, *, suffix: str = "") -> dict[str, Statistic]:
    """``coverage{suffix}`` (fraction of targets inside) and ``width{suffix}`` (mean width) of intervals
    ``(N, D)``; each example counts its outputs' mean."""
    lower, upper, y = lower.detach().cpu().double(), upper.detach().cpu().double(), y.detach().cpu().double()
    inside = ((lower <= y) & (y <= upper)).double().mean(-1)
    return {f"coverage{suffix}": mean_of(inside), f"width{suffix}": mean_of((upper - lower).mean(-1))}
