"""Progress of long loops: a bar on a terminal, one line per finished stage in a log.

Every long loop in posthoc reports through :func:`progress_bar`: on a terminal or in a notebook, tqdm's bar (its
widget where ipywidgets is installed, its text bar otherwise: no warning); anywhere else (a file, a pipe, a CI log,
where ``\\r`` redraws would leave one huge line) one line when the stage finishes, e.g.
``[posthoc] laplace curvature: 40 batches in 1.2 s``; nothing with ``progress=False`` or
``posthoc.settings.progress = False``.

A fit of many stages (``"auto"``'s candidates) shows one bar over all of them instead (:func:`stages`): each stage
names itself with :func:`stage`, e.g. ``fit 3/9: fitting laplace``, the bar's ETA counts the stages left, and the
loops inside a stage draw nothing of their own. In a log, one line per finished stage.

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

import contextvars
import importlib.util
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import IO, Any

from tqdm.std import tqdm as text_tqdm

from posthoc import settings

#: what the one line of a finished stage counts, when the caller does not say
UNIT = "steps"


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel, whose output shows a redrawn text bar as one line.

    Example:
        >>> from posthoc.core.progress import in_notebook
        >>> in_notebook()
        False
    """
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return getattr(shell, "kernel", None) is not None


def bar_class() -> type:
    """The tqdm bar to draw: the notebook widget in a Jupyter kernel with ipywidgets, the text bar otherwise
    (tqdm.auto would warn ``IProgress not found`` in a kernel without ipywidgets)."""
    if in_notebook() and importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.notebook import tqdm as notebook_tqdm

        return notebook_tqdm
    return text_tqdm


def interactive(stream: IO[str] | None = None) -> bool:
    """Whether a bar drawn on ``stream`` (standard error by default) is seen as a bar: a terminal or a notebook."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty()) or in_notebook()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return in_notebook()


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
    if not progress or not settings.progress or _STAGES.get() is not None:  # off, or inside a stage of one bar
        return text_tqdm(iterable, total=total, desc=desc, disable=True)
    if interactive(stream):
        return bar_class()(iterable, total=total, desc=desc, leave=False, file=stream)
    return StageLine(iterable, total=total, desc=desc, unit=unit, stream=stream)


class Stages:
    """One bar over the named stages of a long fit (see module docs): :meth:`enter` starts the next one (finishing the
    one before) and may announce how many come after it; off a terminal each finished stage prints one line.

    Example:
        >>> import io
        >>> from posthoc.core.progress import Stages
        >>> log = io.StringIO()
        >>> bar = Stages("fit", stream=log)
        >>> bar.enter("fitting temperature", more=1); bar.enter("fitting laplace"); bar.close()
        >>> [line.split(": ")[1] for line in log.getvalue().splitlines()]
        ['fitting temperature', 'fitting laplace']
    """

    def __init__(self, desc: str, *, stream: IO[str] | None = None) -> None:
        self.desc, self.stream, self.total, self.done, self.label = desc, stream, 0, 0, ""
        self.started = time.perf_counter()
        self.bar = None
        self.drawn = interactive(stream)  # the bar is drawn from the first stage on

    def enter(self, label: str, more: int = 0) -> None:
        """Finish the current stage (if any) and start ``label``, with ``more`` stages announced after it."""
        self._finish()
        self.label, self.started = label, time.perf_counter()
        self.total = max(self.total, self.done + 1 + more)
        if self.drawn and self.bar is None:
            self.bar = bar_class()(total=self.total, desc=self.desc, leave=False, file=self.stream, unit="stage")
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.set_description_str(f"{self.desc} {self.done + 1}/{self.total}: {label}")

    def _finish(self) -> None:
        if not self.label:
            return
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            return
        stream = sys.stderr if self.stream is None else self.stream
        elapsed = time.perf_counter() - self.started
        print(f"[posthoc] {self.desc} {self.done}/{self.total}: {self.label}: {elapsed:.1f} s", file=stream, flush=True)
        self.label = ""

    def close(self) -> None:
        """Finish the last stage and remove the bar."""
        self._finish()
        self.label = ""
        if self.bar is not None:
            self.bar.close()
        self.bar, self.drawn = None, False


#: the one bar of the fit running in this context, if any
_STAGES: contextvars.ContextVar[Stages | None] = contextvars.ContextVar("posthoc_stages", default=None)


@contextmanager
def stages(desc: str, *, progress: bool = True, stream: IO[str] | None = None) -> Iterator[Stages | None]:
    """One bar over the stages of what runs inside (see module docs); nested, the outer bar stays the one.

    Example:
        >>> import io
        >>> from posthoc.core.progress import stage, stages
        >>> log = io.StringIO()
        >>> with stages("fit", stream=log):
        ...     stage("held-out data", more=1); stage("fitting temperature")
        >>> print(log.getvalue().replace("0.0 s", "0 s"), end="")
        [posthoc] fit 1/2: held-out data: 0 s
        [posthoc] fit 2/2: fitting temperature: 0 s
    """
    if not progress or not settings.progress or _STAGES.get() is not None:
        yield _STAGES.get()
        return
    bar = Stages(desc, stream=stream)
    token = _STAGES.set(bar)
    try:
        yield bar
    finally:
        _STAGES.reset(token)
        bar.close()


def stage(label: str, *, more: int = 0) -> None:
    """Name the stage that starts now on the fit's one bar (nothing outside :func:`stages`); ``more`` stages are
    announced to come after it."""
    bar = _STAGES.get()
    if bar is not None:
        bar.enter(label, more)
