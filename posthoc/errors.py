"""Exceptions raised by posthoc.

Every error a user can trigger derives from :class:`PosthocError`, so callers can catch one type; the subclasses also
derive from the matching built-in (``ValueError``, ``RuntimeError``) so generic handlers keep working.

Example:
    >>> import torch
    >>> import posthoc
    >>> try:
    ...     posthoc.wrap(torch.nn.Linear(2, 2), method="nope")
    ... except posthoc.PosthocError as err:
    ...     print(type(err).__name__)
    ConfigError
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class PosthocError(Exception):
    """Base class of every error posthoc raises on purpose."""


class ConfigError(PosthocError, ValueError):
    """An unknown method, an unknown option, or an option value out of range."""


class InputError(PosthocError, ValueError):
    """Data handed to posthoc (inputs, labels, logits, loaders) is not usable."""


class NotFittedError(PosthocError, RuntimeError):
    """A method that needs ``fit`` was asked to predict before it was fitted."""


class HeadNotFoundError(PosthocError, ValueError):
    """The classifier head of a model could not be located."""


class PosteriorFileError(PosthocError, ValueError):
    """A saved posterior is unreadable, from another format version, or for another model."""


class NumericalError(PosthocError, RuntimeError):
    """A computation produced NaN or inf and no safe recovery exists."""


class MissingDependencyError(PosthocError, ImportError):
    """An optional extra that a feature needs is not installed (the message names the ``pip install``)."""


class ExportError(PosthocError, ValueError):
    """A fitted predictive cannot be exported as a plain module (``um.to_module()``); the message says why and what
    to do instead."""


def exit_status(run: Callable[[], object]) -> int:
    """Run a command-line job: ``0`` on success; a posthoc error is printed as ``error: ...`` and gives ``2``.

    Example:
        >>> from posthoc.errors import exit_status
        >>> exit_status(lambda: None)
        0
    """
    try:
        run()
    except PosthocError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
