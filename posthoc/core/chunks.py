"""The one chunk planner: how many rows of work fit in the memory budget.

Every predictive that holds per-sample tensors declares the bytes ONE row keeps alive at the peak of its work; the
planner divides the budget by it. The budget is the runner's (:func:`budget_scope`), else
``posthoc.settings.max_memory``: a method never carries it.

Example:
    >>> from posthoc.core.chunks import chunks, rows_per_chunk
    >>> rows_per_chunk(100 * 10 * 4, max_memory=2**20)      # S=100 float32 samples of 10 classes
    262
    >>> [(s.start, s.stop) for s in chunks(600, 100 * 10 * 4, max_memory=2**20)]
    [(0, 262), (262, 524), (524, 600)]
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from posthoc import settings


@contextmanager
def budget_scope(max_memory: int | None) -> Iterator[None]:
    """Plan every chunk of the block under ``max_memory`` bytes (``None`` keeps the enclosing budget)."""
    if max_memory is None:
        yield
        return
    token = settings.RUNNER_BUDGET.set(max_memory)
    try:
        yield
    finally:
        settings.RUNNER_BUDGET.reset(token)


def current_budget() -> int:
    """The budget of the work running now: the innermost :func:`budget_scope`, else ``posthoc.settings.max_memory``."""
    return settings.memory_budget()


def rows_per_chunk(row_bytes: int, *, max_memory: int | None = None, limit: int | None = None) -> int:
    """Rows whose ``row_bytes`` each stay under the budget together; at least 1, at most ``limit``."""
    budget = settings.memory_budget(max_memory)
    rows = max(1, int(budget // max(1, int(row_bytes))))
    return rows if limit is None else max(1, min(rows, limit))


def chunks(total: int, row_bytes: int, *, max_memory: int | None = None, limit: int | None = None) -> Iterator[slice]:
    """Consecutive slices covering ``range(total)``, each of :func:`rows_per_chunk` rows."""
    step = rows_per_chunk(row_bytes, max_memory=max_memory, limit=limit)
    for start in range(0, total, step):
        yield slice(start, min(total, start + step))
