"""The verdict and auto's selection as sections of a report folder: their Markdown, with the frontier drawn to a PNG
beside it (:func:`posthoc_apps.report.plots.frontier`). The verdict itself, its numbers and its Markdown, is the
library's (:mod:`posthoc.evaluation.verdict`); what draws it lives here, with the other pictures.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from statistics import NormalDist
from typing import Any

from posthoc.core.model_card import selection_table
from posthoc.engine.selection import CONFIDENCE
from posthoc.evaluation.verdict import FRONTIER_FILE, SELECTION_FRONTIER_FILE, Verdict, selection_points
from posthoc_apps.report import plots


def verdict_section(found: Verdict, out_dir: str | os.PathLike | None, *, title: str | None = None) -> str:
    """The verdict's Markdown with its frontier, drawn to ``out_dir/frontier.png`` when the rows were measured under
    shift (``title`` on the plot); without shifts or without ``out_dir``, the verdict alone.

    Example:
        >>> from pathlib import Path
        >>> from posthoc_apps.report.sections import verdict_section
        >>> from posthoc_apps.demo.examples import verdict
        >>> section = verdict_section(verdict, ".")      # draws ./frontier.png
        >>> print(section)
        ## Verdict
        <BLANKLINE>
        **Use `laplace`**: picked on the test data, ...
        <BLANKLINE>
        ![frontier: in-distribution cost against NLL under shift](frontier.png)
        ...
        >>> Path("frontier.png").exists()
        True
    """
    points = found.frontier_points()
    if not points or out_dir is None:
        return found.markdown()
    plots.frontier(points, Path(out_dir) / FRONTIER_FILE, tolerance=found.tolerance, title=title)
    return found.markdown(FRONTIER_FILE)


def selection_section(
    selection: Mapping[str, Any], out_dir: str | os.PathLike | None, *, heading: str = "##", label: str = "auto"
) -> str:
    """How ``method="auto"`` chose on held-out data: its selection record as a table and the frontier of its
    candidates (drawn to ``out_dir/selection_frontier.png`` when they were scored on perturbed copies and ``out_dir``
    is given).

    Example:
        >>> from posthoc_apps.report.sections import selection_section
        >>> from posthoc_apps.demo.examples import um
        >>> print(selection_section(um.summary()["selection"], "report"))
        ## How `auto` chose, on held-out data
        ...
    """
    lines = [f"{heading} How `{label}` chose, on held-out data", "", *selection_table(dict(selection)), ""]
    points = selection_points(selection)
    if points and out_dir is not None:
        plots.frontier(
            points,
            Path(out_dir) / SELECTION_FRONTIER_FILE,
            tolerance=float(selection["tolerance"]),
            ylabel="NLL on the fit-time perturbed copies",
            title=f"{label}'s candidates on held-out data (NLL excess cross-fitted)",
            chosen_word="chosen",
        )
        lines += [
            f"![{label}'s candidates on held-out data]({SELECTION_FRONTIER_FILE})",
            "",
            f"Bars: the excess from its mean to the bound that decides admissibility ({CONFIDENCE:.0%}, on new "
            f"data of the held-out size) and as far below; the perturbed NLL ± {NormalDist().inv_cdf(CONFIDENCE):.2f} "
            "standard errors; shaded: admissible; star: chosen.",
            "",
        ]
    return "\n".join(lines)
