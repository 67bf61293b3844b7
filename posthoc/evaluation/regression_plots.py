"""Pictures of a regression predictive, as PNG: calibration curves, error against predicted std, the 1-D band.

As :mod:`posthoc.evaluation.plots`, every function draws a matplotlib ``Figure``, writes it to
``path`` (when given) and returns it, closed to pyplot but still readable (``fig.axes[0].get_lines()``).
A predictive is ``(means, stds)`` of shape ``(K, N, D)`` (see :mod:`posthoc.evaluation.regression_metrics`).

Apart from :mod:`~posthoc.evaluation.plots` because the pictures differ: a regressor's calibration is a curve over
interval levels and its uncertainty a band over the inputs, a classifier's a reliability diagram over confidence bins.

Example:
    >>> import torch
    >>> from posthoc.evaluation import regression_metrics
    >>> from posthoc.evaluation.regression_plots import calibration_curves, error_against_std
    >>> from posthoc.evaluation.regression_plots import predictive_band
    >>> from posthoc.demo.examples import regression_um, reg_x, reg_y, reg_train_loader
    >>> means, stds = regression_metrics.components(regression_um.predict(reg_x))
    >>> fig = calibration_curves({"laplace": (means, stds, reg_y)}, "calibration.png")
    >>> fig = error_against_std({"laplace": (means, stds, reg_y)}, "error_std.png", bins=4)
    >>> grid = torch.linspace(-2.5, 2.5, 101)
    >>> band = regression_metrics.components(regression_um.predict(grid[:, None]))
    >>> fig = predictive_band(grid, {"laplace": band}, reg_train_loader.dataset.tensors, "band.png")
    >>> [ax.get_title() for ax in fig.axes]     # one panel per method
    ['laplace']
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from matplotlib.figure import Figure
from torch import Tensor

from posthoc.evaluation import regression_metrics
from posthoc.evaluation.plots import method_styles, plt, save_figure

#: ``method -> (means (K, N, D), stds (K, N, D), targets (N, D) or (N,))``
Predictives = Mapping[str, tuple[Tensor, Tensor, Tensor]]
#: the bands :func:`predictive_band` shades, widest first
BAND_LEVELS = (0.95, 0.5)


def calibration_curves(
    predictives: Predictives, path: str | os.PathLike | None = None, *, kind: str = "interval"
) -> Figure:
    """Observed against expected proportions (:func:`~posthoc.evaluation.regression_metrics.calibration_curve`),
    one line per method, with the diagonal of a calibrated predictive and each method's MACE in the legend."""
    fig, ax = plt.subplots(figsize=(5.2, 4.2))
    ax.plot([0, 1], [0, 1], color="grey", linewidth=1, label="calibrated")
    for style, (name, (means, stds, y)) in zip(method_styles(len(predictives)), predictives.items()):
        expected, observed = regression_metrics.calibration_curve(means, stds, y, kind=kind)
        error = float((observed - expected).abs().mean())
        ax.plot(expected.numpy(), observed.numpy(), label=f"{name} (MACE {error:.3f})", **style)
    what = "inside the central interval" if kind == "interval" else "below the quantile"
    ax.set(xlabel="expected proportion", ylabel=f"observed proportion {what}", xlim=(0, 1), ylim=(0, 1))
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    return save_figure(fig, path)


def error_against_std(predictives: Predictives, path: str | os.PathLike | None = None, *, bins: int = 10) -> Figure:
    """Per bin of predicted std (equal counts), the RMSE of the predictive mean against the bin's root mean
    predicted variance: a calibrated predictive lies on the diagonal (the picture behind ENCE)."""
    fig, ax = plt.subplots(figsize=(5.2, 4.2))
    top = 0.0
    for style, (name, (means, stds, y)) in zip(method_styles(len(predictives)), predictives.items()):
        rmv, rmse = regression_metrics.binned_rmv_rmse(means, stds, y, bins=bins)
        ence = regression_metrics.ence(means, stds, y, bins=bins)
        ax.plot(rmv, rmse, marker="o", label=f"{name} (ENCE {ence:.3f})", **style)
        top = max(top, *rmv, *rmse)
    ax.plot([0, top], [0, top], color="grey", linewidth=1, label="calibrated")
    ax.set(xlabel="predicted std (root mean variance per bin)", ylabel="RMSE per bin")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    return save_figure(fig, path)


def predictive_band(
    x: Tensor,
    predictives: Mapping[str, tuple[Tensor, Tensor]],
    train: tuple[Tensor, Tensor] | None = None,
    path: str | os.PathLike | None = None,
) -> Figure:
    """For a 1-D input grid ``x (N,)``: each method's predictive mean with its 50 % and 95 % central
    intervals shaded, one panel per method, over the training points ``train = (x, y)`` when given."""
    fig, axes = plt.subplots(1, len(predictives), figsize=(4.2 * len(predictives), 3.4), squeeze=False, sharey=True)
    order = x.flatten().argsort()
    grid = x.flatten()[order].numpy()
    for ax, (name, (means, stds)) in zip(axes[0], predictives.items()):
        for level, alpha in zip(BAND_LEVELS, (0.2, 0.35)):
            lower, upper = regression_metrics.mixture(means, stds).interval(level)
            ax.fill_between(
                grid,
                lower[order, 0].numpy(),
                upper[order, 0].numpy(),
                alpha=alpha,
                color="C0",
                linewidth=0,
                label=f"{level:.0%} interval",
            )
        ax.plot(grid, regression_metrics.predictive_mean(means)[order, 0].numpy(), color="C0", label="mean")
        if train is not None:
            ax.scatter(
                train[0].flatten().numpy(),
                train[1].flatten().numpy(),
                s=8,
                color="black",
                zorder=3,
                label="training points",
            )
        ax.set(title=name, xlabel="x")
    axes[0][0].set_ylabel("y")
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    return save_figure(fig, path)
