"""The pictures and the HTML page of the library's reports: ``posthoc`` computes the numbers and writes Markdown
(``report.to_markdown()``, shown as its tables in a notebook); this package draws them (matplotlib is imported here
only).

- :mod:`~posthoc_apps.report.figures`: a report's or a shift table's figures, each ``f(report, path=None)``;
- :mod:`~posthoc_apps.report.page`: ``write_html(report, path, *others, shifts=...)``, the self-contained page, and
  ``html_view(report)``, the same without the page around it (``IPython.display.HTML(html_view(report))``);
- :mod:`~posthoc_apps.report.plots` and :mod:`~posthoc_apps.report.ood_plots`: the drawing, on plain tensors;
- :mod:`~posthoc_apps.report.sections`: the verdict's and auto's selection's Markdown with their frontiers, for the
  report folders that ``posthoc evaluate`` and ``posthoc demo`` write.

Example:
    >>> import posthoc_apps.report as present
    >>> from posthoc_apps.demo.examples import report
    >>> fig = present.reliability_diagram(report, "reliability.png")
    >>> present.write_html(report, "report.html")
    PosixPath('report.html')
"""

from posthoc_apps.report.figures import (
    calibration_curve,
    confidence_plot,
    error_against_std,
    frontier,
    ood_histograms,
    reliability_diagram,
    risk_coverage_curve,
    shift_plot,
)
from posthoc_apps.report.page import html_view, write_html

__all__ = [
    "calibration_curve",
    "confidence_plot",
    "error_against_std",
    "frontier",
    "html_view",
    "ood_histograms",
    "reliability_diagram",
    "risk_coverage_curve",
    "shift_plot",
    "write_html",
]
