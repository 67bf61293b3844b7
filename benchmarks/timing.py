"""Timing helpers shared by the benchmarks: medians of repeats, wall and process CPU time.

Machines are shared and noisy, so every benchmark times the plain forward pass and the method
back to back in one process and reports ratios of medians. A timing whose CPU/wall ratio is far
below the thread count was contended: :func:`measure` flags it so it is re-run, not reported.

Example:
    >>> plain = measure(lambda: model(x))
    >>> method = measure(lambda: um.predict(x))
    >>> print(f"{method.wall / plain.wall:.2f}x")
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Median wall and process-CPU seconds over the repeats."""

    wall: float
    cpu: float

    @property
    def cpu_per_wall(self) -> float:
        return self.cpu / self.wall if self.wall > 0 else float("nan")

    @property
    def contended(self) -> bool:
        """True when the process got less than half a core while running (a neighbour was busy)."""
        return self.cpu_per_wall < 0.5


def measure(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> Timing:
    """Run ``fn`` ``warmup`` times, then time ``repeats`` runs; return the medians."""
    for _ in range(warmup):
        fn()
    walls, cpus = [], []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return Timing(statistics.median(walls), statistics.median(cpus))


def once(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall and process-CPU seconds of one call of ``fn`` (no warm-up): for benchmarks that interleave their own
    rounds and take the medians themselves."""
    timing = measure(fn, repeats=1, warmup=0)
    return timing.wall, timing.cpu


def paired(
    reference: Callable[[], object], fn: Callable[[], object], repeats: int = 11, warmup: int = 1
) -> tuple[Timing, Timing, float]:
    """Time ``reference`` and ``fn`` alternately, ``repeats`` pairs: their medians and the median of the per-pair
    ratios ``fn / reference``, which a neighbour's load (slowing both runs of a pair alike) moves far less than a
    ratio of two separately taken medians.

    Example:
        >>> plain, fitted, ratio = paired(lambda: model(x), lambda: um.fit(loader))
    """
    pairs = [
        (
            measure(reference, repeats=1, warmup=warmup if k == 0 else 0),
            measure(fn, repeats=1, warmup=warmup if k == 0 else 0),
        )
        for k in range(repeats)
    ]
    first = Timing(statistics.median(a.wall for a, _ in pairs), statistics.median(a.cpu for a, _ in pairs))
    second = Timing(statistics.median(b.wall for _, b in pairs), statistics.median(b.cpu for _, b in pairs))
    return first, second, statistics.median(b.wall / a.wall for a, b in pairs)


def row(name: str, timing: Timing, reference: Timing) -> str:
    """A Markdown row: name, seconds, ratio to the reference, CPU/wall (flagged when contended)."""
    flag = " (contended: re-run)" if timing.contended else ""
    return f"| {name} | {timing.wall:.4f} | {timing.wall / reference.wall:.2f}x | {timing.cpu_per_wall:.2f}{flag} |"


HEADER = "| what | wall s (median) | ratio to plain forward | cpu/wall |\n|---|---|---|---|"
