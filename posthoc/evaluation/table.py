"""The cells and rows of the reports' Markdown tables.

Example:
    >>> from posthoc.evaluation.table import bold_best, cell, markdown_rows
    >>> cell(0.12345, (0.1, 0.15))
    '0.1235 [0.1000, 0.1500]'
    >>> cell(0.0213, (0.0233, 0.0770))           # the estimate outside its interval is marked, and explained
    '0.0213 [0.0233, 0.0770]†'
    >>> markdown_rows(["method", "NLL"], [["laplace", "0.1235"]])
    '| method | NLL |\\n|---|---|\\n| laplace | 0.1235 |'
    >>> bold_best(["0.1235 [0.1000, 0.1500]", "0.2000"], [0.1235, 0.2], "nll")
    ['**0.1235** [0.1000, 0.1500]', '0.2000']
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

#: metrics where a larger value is better (accuracy, OOD detection)
HIGHER_IS_BETTER = frozenset({"accuracy", "ood_auroc", "ood_auroc_mi", "auroc", "aupr_in", "aupr_out"})
#: metrics where a smaller value is better (proper scores, calibration errors, risk, false alarms)
LOWER_IS_BETTER = frozenset(
    {
        "nll",
        "ece",
        "adaptive_ece",
        "smooth_ece",
        "brier",
        "aurc",
        "augrc",
        "rmse",
        "mae",
        "crps",
        "mace",
        "ence",
        "fpr95",
    }
)
#: how the best-entry marks are explained under a table
BEST_CAPTION = (
    "Bold: the best entry of each column (higher is better for accuracy and AUROC; lower for NLL, the "
    "ECEs, Brier, AURC, AUGRC, RMSE, MAE, CRPS, MACE, ENCE and FPR95; coverage, widths, set sizes and "
    "times are not ranked)."
)


#: the mark of an estimate that lies outside its own bootstrap interval (:data:`OUTSIDE_NOTE` says why)
OUTSIDE = "†"
#: why an estimate can lie outside its bootstrap interval
OUTSIDE_NOTE = (
    f"{OUTSIDE} The estimate lies outside its bootstrap interval: its resamples lie on one side of it, biased by more "
    "than their spread. A mean of absolute gaps (ECE, MACE, ENCE) does this on a small test set: resampling repeats "
    "examples and adds noise to every bin's gap, and the absolute value turns that noise into a larger error. The "
    "estimate itself is biased the same way, so the error on new data is likely below it. A BCa or basic bootstrap "
    "interval contains the estimate exactly when this percentile interval does, so neither would help; the interval "
    "shows the spread of the resampled statistic."
)


def cell(value: float | None, interval: tuple[float, float] | None = None) -> str:
    """A metric to 4 decimals, with its bootstrap interval when given (marked :data:`OUTSIDE` when the value lies
    outside it); ``–`` when not measured."""
    if value is None:
        return "–"
    if interval is None:
        return f"{value:.4f}"
    outside = math.isfinite(value) and not interval[0] <= value <= interval[1]
    return f"{value:.4f} [{interval[0]:.4f}, {interval[1]:.4f}]" + (OUTSIDE if outside else "")


def outside_note(table: str) -> str:
    """``table`` followed by :data:`OUTSIDE_NOTE` when one of its cells is marked :data:`OUTSIDE` (else unchanged).

    Example:
        >>> from posthoc.evaluation.table import outside_note
        >>> outside_note("| ECE |\\n|---|\\n| 0.0213 [0.0233, 0.0770]† |").endswith("spread of the resampled statistic.")
        True
    """
    return f"{table}\n\n{OUTSIDE_NOTE}" if OUTSIDE in table else table


def markdown_rows(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown pipe table: the header, its rule, one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def shared_level(reports: Sequence[Any], name: str) -> str:
    """``=0.1`` when every report that has ``name`` set shares one value (for a column header), else ``""``."""
    values = {getattr(r, name) for r in reports if getattr(r, name) is not None}
    return f"={values.pop():g}" if len(values) == 1 else ""


def better(metric: str) -> int | None:
    """``+1`` when a larger ``metric`` is better, ``-1`` when a smaller one is, ``None`` when it has no direction
    (coverage should match its level, a width or a time is a cost to read next to others).

    Example:
        >>> from posthoc.evaluation.table import better
        >>> better("accuracy"), better("nll"), better("coverage_90")
        (1, -1, None)
    """
    return 1 if metric in HIGHER_IS_BETTER else -1 if metric in LOWER_IS_BETTER else None


def best_rows(values: Iterable[float | None], metric: str, digits: int = 4) -> set[int]:
    """The positions of the best of ``values`` for ``metric`` (ties at the ``digits`` shown all count); none for a
    metric without a direction or fewer than two measured values.

    Example:
        >>> from posthoc.evaluation.table import best_rows
        >>> best_rows([0.3, 0.1, None, 0.10001], "nll")
        {1, 3}
    """
    direction = better(metric)
    shown = [None if v is None or not math.isfinite(v) else round(v, digits) for v in values]
    measured = [v for v in shown if v is not None]
    if direction is None or len(measured) < 2:
        return set()
    best = max(measured) if direction > 0 else min(measured)
    return {i for i, v in enumerate(shown) if v == best}


def bold(text: str) -> str:
    """A cell with its leading value in bold: ``0.12 [0.1, 0.2]`` -> ``**0.12** [0.1, 0.2]``."""
    value, space, rest = text.partition(" ")
    return f"**{value}**{space}{rest}"


def bold_best(cells: Sequence[str], values: Sequence[float | None], metric: str) -> list[str]:
    """``cells`` (one per row) with the best value's cells in bold (:func:`best_rows`)."""
    best = best_rows(values, metric)
    return [bold(text) if i in best else text for i, text in enumerate(cells)]


def markdown_table(reports: Sequence[Any], extra: dict[str, list[str]] | None = None) -> str:
    """Markdown rows of several reports of one kind: the kind's metric columns, the guarantees any report measured and
    ``extra`` columns (header -> one cell per report), the best entry of each metric column in bold.

    Example:
        >>> from posthoc.evaluation.table import markdown_table
        >>> from posthoc.evaluation.report import Report
        >>> import torch
        >>> report = Report.from_gaussian("MAP", torch.zeros(1, 4, 1), torch.ones(1, 4, 1), torch.zeros(4))
        >>> print(markdown_table([report]).splitlines()[0])
        | method | RMSE | MAE | NLL | CRPS | cov 50% | width 50% | cov 90% | width 90% | cov 95% | width 95% | MACE | ENCE |
    """
    kind = reports[0].metric_set
    extra = {**kind.guarantee_columns(reports), **(extra or {})}
    header = ["method", *kind.HEADERS, *extra]
    columns = [
        bold_best([cell(getattr(r, c), r.intervals.get(c)) for r in reports], [getattr(r, c) for r in reports], c)
        for c in kind.COLUMNS
    ]
    rows = [
        [report.name, *(column[i] for column in columns), *(col[i] for col in extra.values())]
        for i, report in enumerate(reports)
    ]
    return outside_note(markdown_rows(header, rows))
