"""Pictures of calibration and shift: reliability diagrams, risk–coverage curves, shift curves and the frontier
of in-distribution cost against NLL under shift, as PNG; for a real-valued predictive (``means``, ``stds``
``(K, N, D)``, :mod:`~posthoc.evaluation.gaussian_metrics`), its calibration curves over interval levels, its error
against the predicted std and its band over a 1-D input.

Every function draws a matplotlib ``Figure`` of its own (no pyplot state: importing this module leaves the backend
alone), writes it to ``path`` (when given) and returns it: readable (``fig.axes[0].get_lines()``,
``fig.axes[0].get_legend()``), and shown as a PNG where it is a cell's value in a notebook (:class:`InlineFigure`). Up to 20 methods get
distinct colour and line-style pairs (:func:`method_styles`); legends sit under the axes, never wider than them
(long names wrap), and no two texts of a figure overlap (:func:`overlapping_texts` checks it). Reports draw the plain
model, the recommended row and a few best ones; the rest stay in their tables.

Example:
    >>> from posthoc_apps.report.plots import calibration_curves
    >>> from posthoc.evaluation.verdict import FrontierPoint
    >>> from posthoc_apps.report.plots import confidence_plot, frontier, reliability_diagram
    >>> from posthoc_apps.report.plots import risk_coverage_curve
    >>> from posthoc_apps.demo.examples import probs, labels, plain_report, test_labels, report
    >>> fig = reliability_diagram({"MAP": (probs, labels)}, "reliability.png")
    >>> curves = {"MAP": (plain_report.probs, test_labels), "laplace": (report.probs, test_labels)}
    >>> fig = risk_coverage_curve(curves, "rc.png", log_scale=True)
    >>> [line.get_label() for line in fig.axes[0].get_lines()]
    ['MAP (AURC 0.0969)', 'laplace (AURC 0.0987)']
    >>> fig = confidence_plot({"MAP": ([0, 1, 2], [0.99, 0.95, 0.9], [0.98, 0.8, 0.6])}, "confidence.png")
    >>> fig = frontier([FrontierPoint("none", 0.0, (0.0, 0.0), 0.9, (0.85, 0.95), True),
    ...                 FrontierPoint("laplace", 0.002, (0.0, 0.004), 0.7, (0.66, 0.74), True, chosen=True)],
    ...                "frontier.png", tolerance=0.005)
    >>> import torch
    >>> means, stds = torch.zeros(1, 20, 1), torch.ones(1, 20, 1)
    >>> fig = calibration_curves({"N(0, 1)": (means, stds, torch.randn(20))}, "calibration.png")
"""

from __future__ import annotations

import io
import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from matplotlib.transforms import Bbox
from torch import Tensor

from posthoc.core.paths import output_file
from posthoc.evaluation import gaussian_metrics, metrics
from posthoc.evaluation.verdict import FrontierPoint

Curves = Mapping[str, tuple[Tensor, Tensor]]
#: ``method -> (severities, mean confidence, accuracy)``
ConfidenceSeries = Mapping[str, tuple[Sequence[float], Sequence[float], Sequence[float]]]
#: ``method -> metric -> (severities, values, lows or None, highs or None)``
ShiftSeries = Mapping[
    str, Mapping[str, tuple[Sequence[float], Sequence[float], Sequence[float] | None, Sequence[float] | None]]
]
#: reliability panels per row; more curves wrap onto further rows
MAX_COLUMNS = 5
#: 20 distinct colours: tab10, then the light shades of tab20
COLOURS = [*colormaps["tab10"].colors, *colormaps["tab20"].colors[1::2]]
LINE_STYLES = ("-", "--", "-.", ":")
#: marker shapes of the frontier's points, cycling alongside the colours
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")
#: where a point's number may sit, in points from the point, tried in order until it overlaps no text placed yet
NUMBER_OFFSETS = ((5, 4), (5, -10), (-11, 4), (-11, -10), (0, 8), (0, -14), (9, -3), (-15, -3))
#: the frontier's x axis turns symmetric-log when the excesses reach this many tolerances
SYMLOG_SPAN = 30
DPI = 110
#: the recommended point's star: its area (points squared) and about its half width (points)
STAR_SIZE, STAR_RADIUS = 480, 11
#: the font size of legends and of the frontier's numbers (points)
LEGEND_SIZE = 7
#: characters a reliability panel's title holds on one line (a 3-inch panel at 9 points: about 2.1 inches of text)
TITLE_CHARACTERS = 30


def method_styles(count: int) -> list[dict[str, object]]:
    """``count`` line styles (``color``, ``linestyle``): distinct colours for up to 20, line styles cycling
    alongside so that neighbours differ twice over."""
    return [{"color": COLOURS[i % len(COLOURS)], "linestyle": LINE_STYLES[i % len(LINE_STYLES)]} for i in range(count)]


class InlineFigure(Figure):
    """A matplotlib ``Figure`` drawn on its own Agg canvas, outside pyplot's figure manager (so that no backend is
    chosen or switched), that a notebook shows as a PNG when it is a cell's value.

    Example:
        >>> from posthoc_apps.report.plots import InlineFigure
        >>> fig = InlineFigure(figsize=(2, 1))
        >>> _ = fig.subplots().plot([0, 1], [0, 1])
        >>> fig._repr_png_()[:4]
        b'\\x89PNG'
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        FigureCanvasAgg(self)

    def _repr_png_(self) -> bytes:
        return png_bytes(self)


def save_figure(fig: Figure, path: str | os.PathLike | None) -> Figure:
    """Write ``fig`` to ``path`` as PNG (when given; its folder is created, a path that cannot be written is a
    :class:`~posthoc.errors.ConfigError` naming it) and return it."""
    if path is not None:
        with output_file(path, "the plot") as target:
            fig.savefig(target, dpi=DPI, bbox_inches="tight")
    return fig


def png_bytes(fig: Figure) -> bytes:
    """The figure as PNG bytes (for embedding in HTML)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
    return buffer.getvalue()


def _wrapped(text: str, width_points: float, size: float = LEGEND_SIZE) -> str:
    """``text`` wrapped to lines that fit ``width_points`` at font ``size`` (about 0.55 em a character)."""
    return textwrap.fill(text, max(12, int(width_points / (0.55 * size))), break_long_words=False)


def legend_under(ax, *, columns: int = 1) -> None:
    """The legend of ``ax``'s labelled artists under the axes (below the x label), in ``columns`` columns, its long
    labels wrapped so that it is never wider than the axes.

    Example:
        >>> from posthoc_apps.report.plots import InlineFigure, legend_under
        >>> fig = InlineFigure()
        >>> ax = fig.subplots()
        >>> _ = ax.plot([0, 1], [0, 1], label="a method with a rather long name " * 4)
        >>> legend_under(ax)
        >>> fig.canvas.draw()
        >>> bool(ax.get_legend().get_window_extent().width <= ax.get_window_extent().width)
        True
    """
    handles, labels = ax.get_legend_handles_labels()
    width = ax.get_window_extent().width * 72 / ax.figure.dpi / columns - 30  # the handle and the padding
    ax.legend(
        handles,
        [_wrapped(label, width) for label in labels],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        borderaxespad=0,
        fontsize=LEGEND_SIZE,
        frameon=False,
        ncol=columns,
    )


def _drawn_texts(fig: Figure) -> list:
    """The texts ``fig`` draws: titles, axis labels, the tick labels inside each axis' view, legend entries and
    annotations (visible and not empty)."""
    texts = [*fig.texts, *(text for legend in fig.legends for text in legend.get_texts())]
    for ax in fig.axes:
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        if ax.get_legend() is not None:
            texts += ax.get_legend().get_texts()
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            span = 1e-9 * max(1.0, abs(high - low))
            texts += [tick.label1 for tick in axis.get_major_ticks() if low - span <= tick.get_loc() <= high + span]
    return [text for text in texts if text.get_visible() and text.get_text().strip()]


def overlapping_texts(fig: Figure) -> list[tuple[str, str]]:
    """Every pair of texts ``fig`` draws (titles, axis and tick labels, legend entries, annotations) whose boxes
    overlap by more than half a pixel each way: a legible figure has none.

    Example:
        >>> from posthoc_apps.report.plots import InlineFigure, overlapping_texts
        >>> fig = InlineFigure()
        >>> ax = fig.subplots()
        >>> _ = ax.text(0.5, 0.5, "one"), ax.text(0.5, 0.5, "two")
        >>> overlapping_texts(fig)
        [('one', 'two')]
    """
    canvas = fig.canvas if hasattr(fig.canvas, "get_renderer") else FigureCanvasAgg(fig)  # a figure of no backend
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = [(text.get_text(), text.get_window_extent(renderer)) for text in _drawn_texts(fig)]
    found = []
    for i, (first, a) in enumerate(boxes):
        for second, b in boxes[i + 1 :]:
            common = Bbox.intersection(a, b)
            if common is not None and common.width > 0.5 and common.height > 0.5:
                found.append((first, second))
    return found


def reliability_diagram(curves: Curves, path: str | os.PathLike | None = None, bins: int = 15) -> Figure:
    """Accuracy against confidence per bin for each ``name -> (probs, labels)``, one panel each, with the
    number of examples per bin (log scale) under each panel; panels share their axes, long names wrap.

    Example:
        >>> from posthoc_apps.report.plots import reliability_diagram
        >>> from posthoc_apps.demo.examples import probs, labels
        >>> fig = reliability_diagram({"MC dropout (own, rate on val) + temperature": (probs, labels), "MAP": (probs, labels)})
        >>> fig.axes[0].get_title().splitlines()
        ['MC dropout (own, rate on val)', '+ temperature', 'ECE 0.089']
    """
    columns = min(MAX_COLUMNS, len(curves))
    rows = math.ceil(len(curves) / columns)
    fig = InlineFigure(figsize=(3.0 * columns, 4.3 * rows))
    grid = fig.add_gridspec(rows, columns, hspace=0.45, wspace=0.15)
    width = 1.0 / bins
    centers = [(i + 0.5) * width for i in range(bins)]
    first = first_count = None
    for position, (name, (probs, labels)) in enumerate(curves.items()):
        row, column = divmod(position, columns)
        panel = grid[row, column].subgridspec(2, 1, height_ratios=[3, 1], hspace=0.06)
        ax = fig.add_subplot(panel[0], sharex=first, sharey=first)
        counts_ax = fig.add_subplot(panel[1], sharex=ax, sharey=first_count)
        first, first_count = first or ax, first_count or counts_ax
        conf, acc, count = metrics.reliability_bins(probs, labels, bins)
        filled = count > 0
        kept = [c for c, f in zip(centers, filled) if f]
        ax.bar(kept, acc[filled].tolist(), width=width, edgecolor="black", color="#4c72b0", label="accuracy")
        ax.bar(
            kept,
            (conf - acc)[filled].tolist(),
            bottom=acc[filled].tolist(),
            width=width,
            color="#dd8452",
            alpha=0.6,
            edgecolor="#dd8452",
            label="gap",
        )
        ax.plot([0, 1], [0, 1], "k--", linewidth=1)
        ax.set(xlim=(0, 1), ylim=(0, 1))
        title = textwrap.fill(name, TITLE_CHARACTERS, break_long_words=False)
        ax.set_title(f"{title}\nECE {metrics.ece(probs, labels, bins):.3f}", fontsize=9)
        counts_ax.bar(centers, count.tolist(), width=width, color="gray", edgecolor="black", linewidth=0.5)
        counts_ax.set_yscale("log")
        counts_ax.set(xlabel="confidence", xticks=[0, 0.5, 1], xticklabels=["0", "0.5", "1"])
        ax.tick_params(labelbottom=False)
        if column == 0:
            ax.set_ylabel("accuracy")
            counts_ax.set_ylabel("count")
        else:
            ax.tick_params(labelleft=False)
            counts_ax.tick_params(labelleft=False)
    first.legend(loc="upper left", fontsize=7)
    return save_figure(fig, path)


def risk_coverage_curve(
    curves: Curves,
    path: str | os.PathLike | None = None,
    operating_points: Mapping[str, tuple[float, float]] | None = None,
    target_risk: float | None = None,
    *,
    log_scale: bool = False,
) -> Figure:
    """Selective risk against coverage for each ``name -> (probs, labels)``, on one axis, AURC in the legend.

    ``operating_points`` marks where a selective rule landed on the test set, ``name -> (coverage,
    risk)``; ``target_risk`` draws the risk it was calibrated to stay under; ``log_scale`` puts the risk on a
    log axis (zero risks at low coverage are left out), which separates methods whose curves hug 0.

    Example:
        >>> from posthoc_apps.report.plots import risk_coverage_curve
        >>> from posthoc_apps.demo.examples import probs, labels
        >>> fig = risk_coverage_curve({"MAP": (probs, labels)}, "rc.png", {"MAP": (0.95, 0.008)}, target_risk=0.02)
        >>> len(fig.axes)
        1
    """
    fig = InlineFigure(figsize=(5.2, 3.8))
    ax = fig.subplots()
    for (name, (probs, labels)), style in zip(curves.items(), method_styles(len(curves))):
        confidence, predicted = probs.max(-1)
        coverage, risk = metrics.risk_coverage(confidence, predicted == labels)
        ax.plot(coverage.numpy(), risk.numpy(), linewidth=1.3, label=f"{name} (AURC {float(risk.mean()):.4f})", **style)
        if operating_points and name in operating_points:
            ax.plot(*operating_points[name], "o", color=style["color"], markeredgecolor="black")
    if target_risk is not None:
        ax.axhline(target_risk, color="gray", linestyle=":", linewidth=1, label=f"target risk {target_risk:g}")
    ax.set(xlabel="coverage", ylabel="selective risk (error)", xlim=(0, 1))
    if log_scale:
        ax.set_yscale("log", nonpositive="mask")
    else:
        ax.set_ylim(0, max(ax.get_ylim()[1], 1.2 * (target_risk or 0)))
    ax.grid(alpha=0.3)
    legend_under(ax)
    return save_figure(fig, path)


def shift_plot(
    series: ShiftSeries,
    path: str | os.PathLike | None = None,
    metric_names: Sequence[str] = ("nll", "ece"),
    *,
    tick_labels: Sequence[str] | None = None,
    xlabel: str = "severity (0 = clean)",
    ylabels: Mapping[str, str] | None = None,
) -> Figure:
    """Each metric against severity (0 = clean), one panel per metric and one line per method, with the
    interval as a band where given. ``tick_labels`` names the x positions instead (e.g. named test sets at
    0, 1, 2); ``ylabels`` gives a metric's axis label (default: ``"NLL (mean over kinds)"``).

    Example:
        >>> from posthoc_apps.report.plots import shift_plot
        >>> fig = shift_plot({"MAP": {"nll": ([0, 1, 3], [0.08, 0.2, 0.9], None, None)}}, "shift.png", ["nll"])
        >>> len(fig.axes)
        1
    """
    fig = InlineFigure(figsize=(3.8 * len(metric_names), 3.2))
    axes = fig.subplots(1, len(metric_names), squeeze=False)
    for ax, metric in zip(axes[0], metric_names):
        for (name, by_metric), style in zip(series.items(), method_styles(len(series))):
            severities, values, lows, highs = by_metric[metric]
            ax.plot(severities, values, marker="o", markersize=3, linewidth=1.3, label=name, **style)
            if lows is not None and highs is not None:
                ax.fill_between(severities, lows, highs, color=style["color"], alpha=0.12, linewidth=0)
        ax.set(xlabel=xlabel, ylabel=(ylabels or {}).get(metric, f"{metric.upper()} (mean over kinds)"))
        ax.set_xticks(list(next(iter(series.values()))[metric][0]))
        if tick_labels is not None:
            ax.set_xticklabels(tick_labels)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    handles, labels = axes[0][0].get_legend_handles_labels()
    columns = min(len(metric_names), len(labels)) or 1
    width = fig.get_figwidth() * 72 / columns - 30
    fig.legend(
        handles,
        [_wrapped(label, width) for label in labels],
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        fontsize=LEGEND_SIZE,
        frameon=False,
        ncol=columns,
    )
    return save_figure(fig, path)


def confidence_plot(
    series: ConfidenceSeries, path: str | os.PathLike | None = None, *, title: str = "mean over kinds"
) -> Figure:
    """Mean confidence (solid) and accuracy (dashed, same colour) against severity for each method, the gap
    between them shaded: a model that knows when it does not know keeps its confidence close to its accuracy
    as the shift grows, where an overconfident one stays high while accuracy falls.

    Example:
        >>> from posthoc_apps.report.plots import confidence_plot
        >>> fig = confidence_plot({"MAP": ([0, 3, 5], [0.99, 0.93, 0.88], [0.98, 0.70, 0.45]),
        ...                        "laplace": ([0, 3, 5], [0.98, 0.85, 0.72], [0.98, 0.71, 0.46])}, "confidence.png")
        >>> [line.get_label() for line in fig.axes[0].get_lines()][:2]
        ['MAP confidence', 'MAP accuracy']
    """
    fig = InlineFigure(figsize=(5.2, 3.8))
    ax = fig.subplots()
    for (name, (severities, confidence, accuracy)), style in zip(series.items(), method_styles(len(series))):
        colour = style["color"]
        ax.plot(
            severities,
            confidence,
            marker="o",
            markersize=3.5,
            linewidth=1.6,
            color=colour,
            linestyle="-",
            label=f"{name} confidence",
        )
        ax.plot(
            severities,
            accuracy,
            marker="s",
            markersize=3,
            linewidth=1.2,
            color=colour,
            linestyle="--",
            label=f"{name} accuracy",
        )
        ax.fill_between(severities, accuracy, confidence, color=colour, alpha=0.15, linewidth=0)
    ax.set(xlabel="severity (0 = clean)", ylabel="mean confidence / accuracy", ylim=(0, 1.02), title=title)
    ax.set_xticks(list(next(iter(series.values()))[0]))
    ax.grid(alpha=0.3)
    legend_under(ax, columns=2)
    return save_figure(fig, path)


def _bar(value: float, interval: tuple[float, float] | None) -> list[list[float]] | None:
    """An errorbar's ``[[below], [above]]`` lengths of ``interval`` around ``value`` (``None``: no bar)."""
    if interval is None or not all(math.isfinite(v) for v in interval):
        return None
    return [[max(0.0, value - interval[0])], [max(0.0, interval[1] - value)]]


def _place_numbers(ax, points: Sequence[FrontierPoint]) -> None:
    """Write each point's number next to it at the first of :data:`NUMBER_OFFSETS` where it overlaps no number
    placed before and no point's marker; a number that finds no free place is left out (the legend still names the
    point by colour and marker), so that no two texts overlap and no number hides a point."""
    renderer = ax.figure.canvas.get_renderer()
    taken = []
    for point in points:
        x, y = ax.transData.transform((point.x, point.y))
        radius = (STAR_RADIUS if point.chosen else 4) * ax.figure.dpi / 72  # a marker's half width, in pixels
        taken.append(Bbox([[x - radius, y - radius], [x + radius, y + radius]]))
    for number, point in enumerate(points, start=1):
        reach = 1 + STAR_RADIUS / 5 if point.chosen else 1  # a star's number sits beyond the star
        for dx, dy in ((reach * dx, reach * dy) for dx, dy in NUMBER_OFFSETS):
            text = ax.annotate(
                str(number),
                (point.x, point.y),
                xytext=(dx, dy),
                textcoords="offset points",
                fontsize=LEGEND_SIZE,
                zorder=5,
            )
            box = text.get_window_extent(renderer)
            if (
                not any(box.overlaps(other) for other in taken)
                and ax.bbox.contains(box.x0, box.y0)
                and ax.bbox.contains(box.x1, box.y1)
            ):
                taken.append(box)
                break
            text.remove()


def frontier(
    points: Sequence[FrontierPoint],
    path: str | os.PathLike | None = None,
    *,
    tolerance: float,
    title: str | None = None,
    xlabel: str = "in-distribution NLL excess over the plain model (nats)",
    ylabel: str = "NLL under shift",
    chosen_word: str = "recommended",
) -> Figure:
    """The frontier of what a method costs in distribution against what it buys under shift: one point per candidate
    (``x``: its NLL excess over the plain model, ``y``: its NLL under shift) with its intervals as bars, the admissible
    region (excess bound at most ``tolerance``) shaded, refused candidates hollow, the recommended one on a star
    (``chosen_word`` names it in the legend).

    Every point has its own colour and marker and a number next to it (where the number finds room without covering a
    marker or another number); the legend under the axes names them. The recommended point's star is drawn over the
    other points, so that a close neighbour never hides it. Works for a report's rows (test data) and for ``method="auto"``'s selection record
    (held-out data, :func:`posthoc.evaluation.verdict.selection_points`). The x axis turns symmetric-log (linear
    within one tolerance of 0) when the excesses reach :data:`SYMLOG_SPAN` tolerances, so that the admissible region
    stays visible next to a costly candidate.

    Example:
        >>> from posthoc.evaluation.verdict import FrontierPoint
        >>> from posthoc_apps.report.plots import frontier
        >>> fig = frontier([FrontierPoint("none", 0.0, None, 0.9, None, True),
        ...                 FrontierPoint("laplace", 0.002, (0.0, 0.004), 0.7, (0.66, 0.74), True, chosen=True)],
        ...                tolerance=0.005)
        >>> [text.get_text() for text in fig.axes[0].get_legend().get_texts()][-1]
        '2  laplace (recommended)'
    """
    fig = InlineFigure(figsize=(6.0, 4.2))
    ax = fig.subplots()
    shapes = zip(method_styles(len(points)), (MARKERS[i % len(MARKERS)] for i in range(len(points))))
    for number, (point, (style, marker)) in enumerate(zip(points, shapes), start=1):
        colour = style["color"]
        if point.chosen:
            ax.scatter(
                [point.x],
                [point.y],
                marker="*",
                s=STAR_SIZE,
                color="gold",
                edgecolors="black",
                linewidths=0.9,
                zorder=4,
            )
        ax.errorbar(
            [point.x],
            [point.y],
            xerr=_bar(point.x, point.x_interval),
            yerr=_bar(point.y, point.y_interval),
            fmt=marker,
            markersize=6,
            color=colour,
            markerfacecolor=colour if point.admissible else "white",
            markeredgecolor=colour,
            elinewidth=0.9,
            capsize=2,
            zorder=4.5 if point.chosen else 3,
            label=f"{number}  {point.label}" + (f" ({chosen_word})" if point.chosen else ""),
        )
    xs = [v for p in points for v in (p.x, *(p.x_interval or ())) if math.isfinite(v)]
    span = max([abs(v) for v in xs] + [tolerance])
    if tolerance > 0 and span >= SYMLOG_SPAN * tolerance:
        ax.set_xscale("symlog", linthresh=tolerance)
    else:  # few enough ticks that their labels (e.g. -0.0075) never run into each other
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
    left = min(xs + [0.0])
    low = left - 0.1 * (span + abs(left)) if left < 0 else -0.1 * span
    ax.set_xlim(low, max(ax.get_xlim()[1], tolerance + 0.15 * (tolerance - low)))
    ax.axvspan(
        low,
        tolerance,
        color="#2ca02c",
        alpha=0.10,
        linewidth=0,
        label=f"admissible: excess bound <= {tolerance:.4g} nats",
    )
    ax.axvline(tolerance, color="#2ca02c", linestyle="--", linewidth=1)
    ax.axvline(0.0, color="gray", linestyle=":", linewidth=0.8)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    if title:
        ax.set_title(_wrapped(title, ax.get_window_extent().width * 72 / fig.dpi, 9), fontsize=9)
    ax.grid(alpha=0.3)
    legend_under(ax, columns=1 if len(points) <= 8 else 2)
    fig.canvas.draw()  # the limits and the legend settle before the numbers are placed in pixels
    _place_numbers(ax, points)
    return save_figure(fig, path)


#: ``method -> (means (K, N, D), stds (K, N, D), targets (N, D) or (N,))``
Predictives = Mapping[str, tuple[Tensor, Tensor, Tensor]]
#: the bands :func:`predictive_band` shades, widest first
BAND_LEVELS = (0.95, 0.5)


def calibration_curves(
    predictives: Predictives, path: str | os.PathLike | None = None, *, kind: str = "interval"
) -> Figure:
    """Observed against expected proportions (:func:`~posthoc.evaluation.gaussian_metrics.calibration_curve`),
    one line per method, with the diagonal of a calibrated predictive and each method's MACE in the legend."""
    fig = InlineFigure(figsize=(5.2, 4.2))
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1], color="grey", linewidth=1, label="calibrated")
    for style, (name, (means, stds, y)) in zip(method_styles(len(predictives)), predictives.items()):
        expected, observed = gaussian_metrics.calibration_curve(means, stds, y, kind=kind)
        error = float((observed - expected).abs().mean())
        ax.plot(expected.numpy(), observed.numpy(), label=f"{name} (MACE {error:.3f})", **style)
    what = "inside the central interval" if kind == "interval" else "below the quantile"
    ax.set(xlabel="expected proportion", ylabel=f"observed proportion {what}", xlim=(0, 1), ylim=(0, 1))
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    return save_figure(fig, path)


def error_against_std(predictives: Predictives, path: str | os.PathLike | None = None, *, bins: int = 10) -> Figure:
    """Per bin of predicted std (equal counts), the RMSE of the predictive mean against the bin's root mean
    predicted variance: a calibrated predictive lies on the diagonal (the picture behind ENCE)."""
    fig = InlineFigure(figsize=(5.2, 4.2))
    ax = fig.subplots()
    top = 0.0
    for style, (name, (means, stds, y)) in zip(method_styles(len(predictives)), predictives.items()):
        rmv, rmse = gaussian_metrics.binned_rmv_rmse(means, stds, y, bins=bins)
        ence = gaussian_metrics.ence(means, stds, y, bins=bins)
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
    fig = InlineFigure(figsize=(4.2 * len(predictives), 3.4))
    axes = fig.subplots(1, len(predictives), squeeze=False, sharey=True)
    order = x.flatten().argsort()
    grid = x.flatten()[order].numpy()
    for ax, (name, (means, stds)) in zip(axes[0], predictives.items()):
        for level, alpha in zip(BAND_LEVELS, (0.2, 0.35)):
            lower, upper = gaussian_metrics.mixture(means, stds).interval(level)
            ax.fill_between(
                grid,
                lower[order, 0].numpy(),
                upper[order, 0].numpy(),
                alpha=alpha,
                color="C0",
                linewidth=0,
                label=f"{level:.0%} interval",
            )
        ax.plot(grid, gaussian_metrics.predictive_mean(means)[order, 0].numpy(), color="C0", label="mean")
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
