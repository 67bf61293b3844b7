"""One CPU thread for small dense work, where torch's intra-op threads only wait on each other: a detail of the runner.

``torch.set_num_threads`` changes the whole process, so the runner narrows only as
``posthoc.settings.narrow_threads`` allows: by default (``"auto"``) only while no other Python thread is alive, so a
multi-threaded server's threads are never changed under it (``docs/scale.md``, Threads).

Example:
    >>> import torch
    >>> from posthoc.core.threads import single_thread_if
    >>> matrix = torch.eye(520) + 0.01 * torch.ones(520, 520)
    >>> with single_thread_if(matrix.device.type == "cpu" and matrix.shape[0] <= 1024):
    ...     values, vectors = torch.linalg.eigh(matrix)
    >>> round(float(values.max()), 2)
    6.2
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from posthoc import settings

#: temporaries (bytes) below which a chunk of tensor work runs on one CPU thread (thread start-up costs more)
SMALL_WORK_BYTES = 4 * 2**20


def may_narrow() -> bool:
    """Whether ``posthoc.settings.narrow_threads`` lets the runner narrow now (``"auto"``: only this thread runs).

    Example:
        >>> from posthoc import settings
        >>> from posthoc.core.threads import may_narrow
        >>> with settings.override(narrow_threads=False):
        ...     may_narrow()
        False
    """
    policy = settings.thread_policy()
    return not other_threads() if policy == "auto" else policy


def other_threads() -> list[threading.Thread]:
    """The live Python threads beside this one that could run torch work (tqdm's progress-bar monitor cannot)."""
    here = threading.current_thread()
    return [t for t in threading.enumerate() if t is not here and type(t).__name__ != "TMonitor"]


@contextmanager
def single_thread_if(small: bool) -> Iterator[None]:
    """Run the block on one torch thread when ``small`` and :func:`may_narrow` (and more than one is set), then
    restore the count."""
    previous = torch.get_num_threads()
    narrowed = small and previous > 1 and may_narrow()
    if narrowed:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if narrowed:
            torch.set_num_threads(previous)
