"""Progress of long loops: a bar on a terminal, one line per finished stage in a log.

Every long loop in posthoc reports through :func:`progress_bar`: on a terminal or in a notebook, tqdm's bar; anywhere
else (a file, a pipe, a CI log, where ``\\r`` redraws would leave one huge line) one line when the stage finishes,
e.g. ``[posthoc] laplace curvature: 40 batches in 1.2 s``; nothing with ``progress=False`` or
``posthoc.settings.progress = False``.

Example:
    >>> import io
    >>> import posthoc
    >>> from posthoc.core.progress import progress_bar
    >>> log = io.StringIO()
    >>> with posthoc.settings.override(progress=False):
    ...     list(progress_bar(range(3), desc="silent", stream=log)) and log.getvalue()
    ''
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any

from tqdm.auto import tqdm

from posthoc import settings

#: what the one line of a finished stage counts, when the caller does not say
UNIT = "steps"


def _in_notebook() -> bool:
    """Whether tqdm.auto chose its notebook bar (a Jupyter kernel with widgets), which draws no ``\\r``."""
    return any(base.__module__ == "tqdm.notebook" for base in tqdm.__mro__)


def interactive(stream: IO[str] | None = None) -> bool:
    """Whether a bar drawn on ``stream`` (standard error by default) is seen as a bar: a terminal or a notebook."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty()) or _in_notebook()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return _in_notebook()


class StageLine:
    """A stand-in for a tqdm bar off a terminal (iteration, ``update``, ``set_postfix``, ``close``): prints one line
    when the stage finishes, with the label, the steps, the time and the last postfix.

    Example:
        >>> from posthoc.core.progress import StageLine
        >>> import io
        >>> log = io.StringIO()
        >>> line = StageLine(total=4, desc="fit", unit="batches", stream=log)
        >>> line.update(4); line.set_postfix(loss=0.25); line.close(); line.close()
        >>> log.getvalue().split(" in ")[0], log.getvalue().count("\\n")
        ('[posthoc] fit: 4 batches', 1)
    """

    def __init__(
        self,
        iterable: Iterable | None = None,
        *,
        total: int | None = None,
        desc: str = "",
        unit: str = UNIT,
        stream: IO[str] | None = None,
    ) -> None:
        self.iterable, self.total, self.desc, self.unit, self.stream = iterable, total, desc, unit, stream
        self.n = 0
        self.postfix: dict[str, Any] = {}
        self.start = time.perf_counter()
        self.closed = False

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable or ():
            yield item
            self.n += 1
        self.close()

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, **values: Any) -> None:
        self.postfix = values

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def close(self) -> None:
        """Print the stage's line, once."""
        if self.closed:
            return
        self.closed = True
        count = f"{self.n}/{self.total}" if self.total is not None and self.total != self.n else f"{self.n}"
        fields = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.postfix.items())
        stream = sys.stderr if self.stream is None else self.stream
        if stream is sys.stderr and sys.stdout is not None:
            sys.stdout.flush()  # what was printed before the stage ends comes first when both go to one file
        elapsed = time.perf_counter() - self.start
        line = f"[posthoc] {self.desc or 'done'}: {count} {self.unit} in {elapsed:.1f} s"
        print(line + (f" ({fields})" if fields else ""), file=stream, flush=True)

    def __enter__(self) -> StageLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_bar(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    progress: bool = True,
    unit: str = UNIT,
    stream: IO[str] | None = None,
) -> Any:
    """The progress display of one stage, used as tqdm (see module docs); ``stream`` defaults to standard error.

    Example:
        >>> from posthoc.core.progress import progress_bar
        >>> import io
        >>> log = io.StringIO()
        >>> bar = progress_bar(total=2, desc="fine-tune", stream=log)
        >>> bar.update(); bar.update(); bar.close()
        >>> log.getvalue().split(" in ")[0]
        '[posthoc] fine-tune: 2 steps'
    """
    if not progress or not settings.progress:
        return tqdm(iterable, total=total, desc=desc, disable=True)
    if interactive(stream):
        return tqdm(iterable, total=total, desc=desc, leave=False, file=stream)
    return StageLine(iterable, total=total, desc=desc, unit=unit, stream=stream)
