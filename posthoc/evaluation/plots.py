"""Pictures of calibration: reliability diagrams and risk–coverage curves, written to PNG.

Example:
    >>> reliability_diagram({"MAP": (probs, labels)}, "reliability.png")
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from torch import Tensor  # noqa: E402

from posthoc.evaluation import metrics  # noqa: E402

Curves = Mapping[str, tuple[Tensor, Tensor]]
#: reliability panels per row; more curves wrap onto further rows
MAX_COLUMNS = 5


def reliability_diagram(curves: Curves, path: str | os.PathLike, bins: int = 15) -> None:
    """Accuracy against confidence per bin for each ``name -> (probs, labels)``, one panel each."""
    columns = min(MAX_COLUMNS, len(curves))
    rows = math.ceil(len(curves) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 3.4 * rows), squeeze=False, sharey=True)
    for ax in axes.flat[len(curves):]:
        ax.set_visible(False)
    width = 1.0 / bins
    for ax, (name, (probs, labels)) in zip(axes.flat, curves.items()):
        conf, acc, count = metrics.reliability_bins(probs, labels, bins)
        centers = [(i + 0.5) * width for i in range(bins)]
        filled = count > 0
        ax.bar([c for c, f in zip(centers, filled) if f], acc[filled].tolist(), width=width, edgecolor="black",
               color="#4c72b0", label="accuracy")
        ax.bar([c for c, f in zip(centers, filled) if f], (conf - acc)[filled].tolist(), bottom=acc[filled].tolist(),
               width=width, color="#dd8452", alpha=0.6, edgecolor="#dd8452", label="gap")
        ax.plot([0, 1], [0, 1], "k--", linewidth=1)
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence",
               title=f"{name}\nECE {metrics.ece(probs, labels, bins):.3f}")
    for row in axes:
        row[0].set_ylabel("accuracy")
    axes[0][0].legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def risk_coverage_curve(curves: Curves, path: str | os.PathLike,
                        operating_points: Mapping[str, tuple[float, float]] | None = None,
                        target_risk: float | None = None) -> None:
    """Selective risk against coverage for each ``name -> (probs, labels)``, on one axis.

    ``operating_points`` marks where a selective rule landed on the test set, ``name -> (coverage,
    risk)``; ``target_risk`` draws the risk it was calibrated to stay under.

    Example:
        >>> risk_coverage_curve({"MAP": (probs, labels)}, "rc.png", {"MAP": (0.95, 0.008)}, target_risk=0.02)
    """
    fig, ax = plt.subplots(figsize=(4.6, 3.6))
    for name, (probs, labels) in curves.items():
        confidence, predicted = probs.max(-1)
        coverage, risk = metrics.risk_coverage(confidence, predicted == labels)
        line, = ax.plot(coverage.numpy(), risk.numpy(), label=f"{name} (AURC {float(risk.mean()):.4f})")
        if operating_points and name in operating_points:
            ax.plot(*operating_points[name], "o", color=line.get_color(), markeredgecolor="black")
    if target_risk is not None:
        ax.axhline(target_risk, color="gray", linestyle=":", linewidth=1, label=f"target risk {target_risk:g}")
    ax.set(xlabel="coverage", ylabel="selective risk (error)", xlim=(0, 1), ylim=(0, None))
    if target_risk is not None:
        ax.set_ylim(0, max(ax.get_ylim()[1], 1.2 * target_risk))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
