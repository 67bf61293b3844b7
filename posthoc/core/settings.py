"""Library-wide settings: how much work one step may hold in memory, and whether long loops show progress.

Every method's ``max_memory`` option defaults to ``None``, meaning "use :data:`max_memory` at
call time"; ``UncertainModel.predict(..., max_memory=...)`` overrides it for one call. :data:`progress`
``False`` silences every progress bar and stage line (:mod:`posthoc.core.progress`), whatever a call's
``progress=`` says.

Example:
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

from posthoc.core.checks import positive_int
from posthoc.core.errors import ConfigError

#: examples per chunk in ``UncertainModel.predict`` (each chunk is moved to the device in turn)
chunk_size: int = 1024

#: bytes one batched sampling step may use (expanded activations, logit samples); work is chunked below it
max_memory: int = 512 * 2**20

#: whether long loops report progress (a bar on a terminal, one line per finished stage elsewhere); ``False``
#: turns it off everywhere, as ``progress=False`` does for one call
progress: bool = True


def memory_budget(option: int | None) -> int:
    """A method's ``max_memory`` option, or the library-wide :data:`max_memory` when it is ``None`` (refused
    unless it is a positive number of bytes)."""
    return positive_int(max_memory, "posthoc.settings.max_memory") if option is None else option


@contextmanager
def override(**values: int | bool) -> Iterator[None]:
    """Temporarily change settings, e.g. ``override(max_memory=2**28)`` or ``override(progress=False)``."""
    module = sys.modules[__name__]
    unknown = sorted(set(values) - {"chunk_size", "max_memory", "progress"})
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}; valid: chunk_size, max_memory, progress")
    for name, value in values.items():
        if name == "progress":
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
