"""The demo's progress: one bar with an ETA on a terminal, one plain line per finished step in a log.

``posthoc demo`` runs a dozen steps of very different lengths (loading the digits, fitting each row, drawing the
report). :class:`Steps` shows them as one tqdm bar whose total is the steps' expected seconds, so that its ETA
follows the work left rather than the count of steps, and writes each step's seconds above the bar as it finishes.
Off a terminal (output redirected to a file, a pipe, a CI log) there is no bar and no ``\\r`` frame: one line per
finished step. Warnings raised inside a step are printed once each, after the step's line, without the source line
Python's default warning display adds.

Example:
    >>> from posthoc_apps.demo.steps import Steps
    >>> import io, warnings
    >>> log = io.StringIO()
    >>> steps = Steps({"load": 1.0, "fit": 3.0}, stream=log)
    >>> with steps.step("load"):
    ...     pass
    >>> with steps.step("fit"):
    ...     warnings.warn("a warning raised twice", RuntimeWarning)
    ...     warnings.warn("a warning raised twice", RuntimeWarning)
    >>> steps.close()
    >>> print(log.getvalue().replace("0.0 s", "0 s"), end="")
    [posthoc demo] 1/2 load: 0 s
    [posthoc demo] 2/2 fit: 0 s
    [posthoc demo]   warning: a warning raised twice
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import IO

from posthoc.core.progress import bar_class, interactive

#: what each line starts with
PREFIX = "[posthoc demo]"
#: the bar's look: the expected seconds it counts are shown as time, not as a count of steps
BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar}| {elapsed} elapsed, about {remaining} left"


class Steps:
    """Named steps with their expected seconds (``weights``), run one after the other by :meth:`step`.

    ``enabled=False`` prints nothing (``posthoc demo --quiet``); ``stream`` is where it writes (standard error by
    default). :attr:`seconds` holds each finished step's wall time.
    """

    def __init__(self, weights: Mapping[str, float], *, enabled: bool = True, stream: IO[str] | None = None) -> None:
        self.weights = dict(weights)
        self.enabled, self.stream = enabled, stream
        self.seconds: dict[str, float] = {}
        self.seen: set[tuple[type, str]] = set()
        self.bar = None
        if enabled and interactive(stream):
            self.bar = bar_class()(
                total=sum(self.weights.values()), desc=PREFIX, bar_format=BAR_FORMAT, file=stream, leave=False
            )

    def _write(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=sys.stderr if self.stream is None else self.stream, flush=True)

    @contextmanager
    def step(self, label: str) -> Iterator[None]:
        """Run one step: time it, keep its warnings, then write its line (and each new warning once) and advance
        the bar by its expected seconds."""
        if self.bar is not None:
            self.bar.set_description_str(f"{PREFIX} {label}")
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        self.seconds[label] = time.perf_counter() - start
        done = f"{len(self.seconds)}/{len(self.weights)}"
        self._write(f"{PREFIX} {done} {label}: {self.seconds[label]:.1f} s")
        for warning in caught:
            key = (warning.category, str(warning.message))
            if key not in self.seen:
                self.seen.add(key)
                self._write(f"{PREFIX}   warning: {warning.message}")
        if self.bar is not None:
            self.bar.update(self.weights.get(label, 0.0))

    def close(self) -> None:
        """Remove the bar (the step lines stay)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
