"""Paths a user hands posthoc to write to: one check and one wording for every file posthoc writes.

A posterior or calibrator file, a report page and a plot each refuse the same bad paths alike, naming the path and
what to do, as the error type of their caller.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from posthoc.core.paths import output_file
    >>> folder = Path(tempfile.mkdtemp())
    >>> with output_file(folder / "out" / "plot.png", "the plot") as path:     # creates the folder out/
    ...     _ = path.write_bytes(b"...")
    >>> path.relative_to(folder)
    PosixPath('out/plot.png')
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from posthoc.errors import ConfigError, PosthocError


def as_path(path: Any, error: type[PosthocError] = ConfigError) -> Path:
    """``path`` as a :class:`~pathlib.Path`, refusing (as ``error``) anything but a non-empty string or path-like.

    Example:
        >>> from posthoc.core.paths import as_path
        >>> as_path(3)
        Traceback (most recent call last):
        posthoc.errors.ConfigError: a file path must be a non-empty string or pathlib.Path without NUL characters, got 3
    """
    if not isinstance(path, (str, os.PathLike)) or "\x00" in os.fspath(path) or not os.fspath(path):
        raise error(f"a file path must be a non-empty string or pathlib.Path without NUL characters, got {path!r}")
    return Path(path)


def reason(err: OSError) -> str:
    """An OS error in a few words, e.g. ``'Permission denied'`` (its text without the path)."""
    return err.strerror or str(err) or type(err).__name__


@contextmanager
def in_folder(path: Path, error: type[PosthocError] = ConfigError) -> Iterator[Path]:
    """Create the folder ``path`` will be written to; a failure to create it, or a file in it inside the block, is
    refused as ``error`` naming the folder."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield path
    except OSError as err:
        raise error(
            f"cannot save to {path}: the folder {path.parent} cannot be created or written "
            f"({reason(err)}); choose a path in a writable folder"
        ) from err


@contextmanager
def output_file(path: Any, what: str) -> Iterator[Path]:
    """The checked path to write ``what`` (e.g. ``"the report"``) to, its folder created; an OS failure while writing
    it is a :class:`ConfigError` naming the path."""
    path = as_path(path)
    if path.is_dir():
        raise ConfigError(f"cannot save {what} to {path}: it is a folder; pass a file path inside it")
    with in_folder(path):
        pass
    try:
        yield path
    except OSError as err:
        raise ConfigError(f"cannot save {what} to {path} ({reason(err)}); choose a path in a writable folder") from err
