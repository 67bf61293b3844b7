"""The cells and rows of the reports' Markdown tables.

Example:
    >>> cell(0.12345, (0.1, 0.15))
    '0.1235 [0.1000, 0.1500]'
    >>> markdown_rows(["method", "NLL"], [["laplace", "0.1235"]])
    '| method | NLL |\\n|---|---|\\n| laplace | 0.1235 |'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def cell(value: float | None, interval: tuple[float, float] | None = None) -> str:
    """A metric to 4 decimals, with its bootstrap interval when given; ``–`` when not measured."""
    if value is None:
        return "–"
    return f"{value:.4f}" if interval is None else f"{value:.4f} [{interval[0]:.4f}, {interval[1]:.4f}]"


def markdown_rows(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown pipe table: the header, its rule, one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def shared_level(reports: Sequence[Any], name: str) -> str:
    """``=0.1`` when every report that has ``name`` set shares one value (for a column header), else ``""``."""
    values = {getattr(r, name) for r in reports if getattr(r, name) is not None}
    return f"={values.pop():g}" if len(values) == 1 else ""
