"""OOD score histograms: in-distribution against OOD values of each score, one panel per score.

Example:
    >>> from posthoc_apps.report.ood_plots import ood_histograms
    >>> from posthoc_apps.demo.examples import report
    >>> fig = ood_histograms({"entropy": report.ood_values["entropy"]}, "ood_scores.png")
    >>> len([ax for ax in fig.axes if ax.get_visible()])
    1
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch
from matplotlib.figure import Figure
from torch import Tensor

from posthoc.evaluation import metrics
from posthoc_apps.report.plots import InlineFigure, save_figure

#: panels per row; more scores wrap onto further rows
MAX_COLUMNS = 4
BINS = 40


def ood_histograms(
    values: Mapping[str, tuple[Tensor, Tensor]], path: str | os.PathLike | None = None, title: str | None = None
) -> Figure:
    """Per score ``name -> (in-distribution values, OOD values)``, the two densities over shared bins, one panel
    each with the score's AUROC in its title; written to a PNG at ``path`` if given; returns the figure."""
    columns = min(MAX_COLUMNS, len(values))
    rows = math.ceil(len(values) / columns)
    fig = InlineFigure(figsize=(3.4 * columns, 2.8 * rows))
    axes = fig.subplots(rows, columns, squeeze=False)
    for ax in axes.flat[len(values) :]:
        ax.set_visible(False)
    for ax, (name, (inside, outside)) in zip(axes.flat, values.items()):
        inside, outside = inside.double().cpu(), outside.double().cpu()
        both = torch.cat([inside, outside])
        low, high = float(both.min()), float(both.max())
        edges = torch.linspace(low, high if high > low else low + 1, BINS + 1).tolist()
        ax.hist(inside.tolist(), bins=edges, density=True, alpha=0.55, color="#4c72b0", label="in-distribution")
        ax.hist(outside.tolist(), bins=edges, density=True, alpha=0.55, color="#dd8452", label="OOD")
        ax.set(title=f"{name}\nAUROC {metrics.ood_auroc(inside, outside):.3f}", xlabel="score (higher = more OOD)")
        ax.set_yticks([])
    axes[0][0].legend(loc="upper right", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)
