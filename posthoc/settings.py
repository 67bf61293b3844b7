"""Library-wide settings: how much work one step may hold in memory, whether small work may run on one thread, and
whether long loops show progress.

``posthoc.wrap(..., max_memory=...)`` defaults to ``None``, meaning "use :data:`max_memory` at call time";
``UncertainModel.predict(..., max_memory=...)`` overrides it for one call. :data:`progress` ``False`` silences every
progress bar and stage line (:mod:`posthoc.core.progress`), whatever a call's ``progress=`` says.

Example:
    >>> from posthoc_apps.demo.examples import um, x
    >>> import posthoc.settings
    >>> posthoc.settings.max_memory = 256 * 2**20      # sample in chunks under 256 MiB
    >>> with posthoc.settings.override(chunk_size=4096):
    ...     pred = um.predict(x)
    >>> posthoc.settings.progress = False                # no progress bars, no stage lines
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from posthoc.errors import ConfigError

#: examples per chunk in ``UncertainModel.predict`` (each chunk is moved to the device in turn)
chunk_size: int = 1024

#: bytes one batched sampling step may use (expanded activations, logit samples); work is chunked below it
max_memory: int = 512 * 2**20

#: whether long loops report progress (a bar on a terminal, one line per finished stage elsewhere); ``False``
#: turns it off everywhere, as ``progress=False`` does for one call
progress: bool = True


#: whether the runner may run small dense work on one torch thread, where intra-op threads only wait on each other.
#: ``torch.set_num_threads`` changes the whole process, so ``"auto"`` narrows only while no other Python thread is
#: alive; ``False`` never narrows; ``True`` always does (docs/scale.md).
narrow_threads: bool | str = "auto"


#: the runner's budget (bytes) for the work running now in this context (``posthoc.core.chunks.budget_scope``)
RUNNER_BUDGET: ContextVar[int | None] = ContextVar("posthoc_memory_budget", default=None)


def positive_int(value: object, name: str) -> int:
    """``value`` if it is an integer >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def memory_budget(option: int | None = None) -> int:
    """``option`` bytes, else the runner's budget for the work running now, else the library-wide :data:`max_memory`
    (refused unless it is a positive number of bytes)."""
    if option is not None:
        return option
    scoped = RUNNER_BUDGET.get()
    return scoped if scoped is not None else positive_int(max_memory, "posthoc.settings.max_memory")


def thread_policy(value: object = None) -> bool | str:
    """``value`` (default: :data:`narrow_threads`) if it is ``True``, ``False`` or ``"auto"``.

    Example:
        >>> from posthoc.settings import thread_policy
        >>> thread_policy("auto")
        'auto'
    """
    value = narrow_threads if value is None else value
    if not (value is True or value is False or value == "auto"):
        raise ConfigError(f"posthoc.settings.narrow_threads must be True, False or 'auto', got {value!r}")
    return value


@contextmanager
def override(**values: int | bool | str) -> Iterator[None]:
    """Temporarily change settings, e.g. ``override(max_memory=2**28)`` or ``override(progress=False)``."""
    module = sys.modules[__name__]
    unknown = sorted(set(values) - {"chunk_size", "max_memory", "narrow_threads", "progress"})
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}; valid: chunk_size, max_memory, narrow_threads, progress")
    for name, value in values.items():
        if name == "narrow_threads":
            thread_policy(value)
        elif name == "progress":
            if not isinstance(value, bool):
                raise ConfigError(f"posthoc.settings.progress must be True or False, got {value!r}")
        else:
            positive_int(value, f"posthoc.settings.{name}")
    previous = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(module, name, value)
