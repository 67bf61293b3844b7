"""The pictures of a report and of a shift table, as functions of them: the library's
:class:`~posthoc.evaluation.report.Report` and :class:`~posthoc.evaluation.shift.ShiftTable` hold numbers and
Markdown; these draw them (:mod:`posthoc_apps.report.plots`), each to a PNG at ``path`` when given, and return the
matplotlib figure.

Example:
    >>> from posthoc_apps.report import confidence_plot, reliability_diagram, risk_coverage_curve, shift_plot
    >>> from posthoc_apps.demo.examples import report, shift_table
    >>> fig = reliability_diagram(report, "reliability.png")
    >>> fig = risk_coverage_curve(report, "risk_coverage.png")
    >>> fig = shift_plot(shift_table, "shift.png")
    >>> fig = confidence_plot(shift_table, "confidence.png", ["MAP", "laplace"])
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure

from posthoc.errors import ConfigError
from posthoc.evaluation.gaussian_report import ENCE_BINS
from posthoc.evaluation.report import Compared, Report, operating_points
from posthoc.evaluation.shift import CLEAN, MEAN, TITLES, ShiftTable
from posthoc_apps.report import ood_plots, plots


def _classifier(report: Report, what: str) -> Report:
    if report.kind == "gaussian":
        raise ConfigError(
            f"a {what} is a classifier's picture; a regressor's report draws calibration_curve(report) and "
            "error_against_std(report)"
        )
    return report


def _regressor(report: Report, what: str) -> Report:
    if report.kind != "gaussian":
        raise ConfigError(
            f"the {what} is a regressor's picture; a classifier's report draws reliability_diagram(report) and "
            "risk_coverage_curve(report)"
        )
    return report


def reliability_diagram(report: Report, path: str | os.PathLike | None = None) -> Figure:
    """The reliability diagram of a classifier's report: accuracy against confidence per bin."""
    report = _classifier(report, "reliability diagram")
    return plots.reliability_diagram({report.name: (report.probs, report.labels)}, path)


def risk_coverage_curve(report: Report, path: str | os.PathLike | None = None) -> Figure:
    """The risk–coverage curve, with the selective rule's operating point when one was measured."""
    report = _classifier(report, "risk-coverage curve")
    return plots.risk_coverage_curve(
        {report.name: (report.probs, report.labels)}, path, operating_points(report), report.target_risk
    )


def ood_histograms(report: Report, path: str | os.PathLike | None = None) -> Figure:
    """In-distribution against OOD histograms of every OOD score of ``report``, one panel each."""
    values = getattr(report, "ood_values", None)
    if not values:
        raise ConfigError("this report has no OOD scores: evaluate with ood_loader=... to draw their histograms")
    return ood_plots.ood_histograms(values, path, title=report.name)


def frontier(
    report: Report,
    *others: Report,
    shifts: Mapping[str, Sequence[Report]] | None = None,
    path: str | os.PathLike | None = None,
) -> Figure:
    """The frontier of ``report`` (the plain model) and ``others`` under ``shifts`` (as in
    :meth:`~posthoc.evaluation.report.Report.to_markdown`): each report's in-distribution NLL excess against its NLL
    under shift (the plain model, the recommended report and the few best)."""
    found = Compared.of([report, *others], shifts).verdict
    if not found.shifts:
        raise ConfigError(
            "the frontier puts NLL under shift on its y axis: pass shifts={name: [reports on the "
            "shifted test set, one per report]}"
        )
    return plots.frontier(found.frontier_points(), path, tolerance=found.tolerance, title="test data")


def _predictive(report: Report) -> dict:
    return {report.name: (report.means, report.stds, report.targets)}


def calibration_curve(report: Report, path: str | os.PathLike | None = None, *, kind: str = "interval") -> Figure:
    """A regressor's observed against expected proportions inside central intervals (``kind="quantile"``: below
    quantiles)."""
    return plots.calibration_curves(_predictive(_regressor(report, "calibration curve")), path, kind=kind)


def error_against_std(report: Report, path: str | os.PathLike | None = None) -> Figure:
    """A regressor's RMSE against predicted std per bin of std (the picture behind ENCE; fewer bins for fewer
    points)."""
    report = _regressor(report, "error against the predicted std")
    return plots.error_against_std(_predictive(report), path, bins=min(ENCE_BINS, report.targets.numel()))


def shift_plot(
    table: ShiftTable, path: str | os.PathLike | None = None, metrics: Sequence[str] | None = None
) -> Figure:
    """Each metric of ``table`` (default: its headline metrics; the mean over kinds) against severity, one line per
    method, the interval as a band; for named test sets, against the sets."""
    metrics = table.chosen_metrics(metrics)
    keys = [(kind, 0) for kind in table.kinds] if table.named else [(CLEAN, 0), *((MEAN, s) for s in table.severities)]
    xs = list(range(len(table.kinds))) if table.named else [0, *table.severities]
    series = {}
    for method in table.values:
        bounds = table.intervals.get(method)
        series[method] = {}
        for metric in metrics:
            lows = highs = None
            if bounds:
                pairs = [bounds[kind][severity][metric] for kind, severity in keys]
                lows, highs = [p[0] for p in pairs], [p[1] for p in pairs]
            series[method][metric] = (xs, [table.value(method, *key, metric) for key in keys], lows, highs)
    if not table.named:
        return plots.shift_plot(
            series, path, metrics, ylabels={m: f"{TITLES.get(m, m)} (mean over kinds)" for m in metrics}
        )
    return plots.shift_plot(
        series,
        path,
        metrics,
        tick_labels=table.kinds,
        xlabel="test set",
        ylabels={m: TITLES.get(m, m) for m in metrics},
    )


def confidence_plot(
    table: ShiftTable, path: str | os.PathLike | None = None, methods: Sequence[str] | None = None
) -> Figure:
    """Mean confidence and accuracy (means over the kinds) against severity for ``methods`` (default: all), the gap
    shaded (see :func:`posthoc_apps.report.plots.confidence_plot`)."""
    chosen = list(methods or table.values)
    return plots.confidence_plot(
        {m: table.confidence_series(m) for m in chosen}, path, title=f"mean over {', '.join(table.kinds)}"
    )
