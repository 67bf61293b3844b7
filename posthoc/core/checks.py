"""Checks of user-given option values, with one wording for every method.

Example:
    >>> from posthoc.core.checks import positive_int
    >>> positive_int(5, "num_samples")
    5
    >>> positive_int(0, "num_samples")
    Traceback (most recent call last):
    posthoc.errors.ConfigError: num_samples must be a positive integer, got 0
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from posthoc.errors import ConfigError


def positive_int(value: Any, name: str, *, none: str | None = None) -> Any:
    """``value`` if it is an integer >= 1 (not a bool); ``none`` says what ``None`` means if it is allowed."""
    if value is None and none is not None:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = f" or None ({none})" if none is not None else ""
        raise ConfigError(f"{name} must be a positive integer{allowed}, got {value!r}")
    return value


def _because(why: str) -> str:
    return f" ({why})" if why else ""


def integer_at_least(value: Any, name: str, minimum: int, *, why: str = "") -> int:
    """``value`` if it is an integer >= ``minimum`` (not a bool); ``why`` says what the bound is for.

    Example:
        >>> from posthoc.core.checks import integer_at_least
        >>> integer_at_least(1, "folds", 2, why="cross-validation needs two folds or more")
        Traceback (most recent call last):
        posthoc.errors.ConfigError: folds must be an integer with folds >= 2 (cross-validation needs two folds or more), got 1
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer with {name} >= {minimum}{_because(why)}, got {value!r}")
    return value


def non_negative(value: Any, name: str, *, why: str = "") -> float:
    """``value`` as a float if it is a finite number >= 0 (not a bool); ``why`` says what the value means."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ConfigError(f"{name} must be a finite number >= 0{_because(why)}, got {value!r}")
    return float(value)


def positive_number(value: Any, name: str, *, why: str = "", none: str | None = None) -> Any:
    """``value`` as a float if it is a finite number > 0 (not a bool); ``none`` says what ``None`` means if allowed."""
    if value is None and none is not None:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        allowed = f" or None ({none})" if none is not None else ""
        raise ConfigError(f"{name} must be a finite number > 0{_because(why)}{allowed}, got {value!r}")
    return float(value)


def probability(value: Any, name: str, *, why: str = "") -> float:
    """``value`` as a float if it lies strictly inside ``(0, 1)`` (not a bool), e.g. a miscoverage ``alpha``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) < 1.0:
        raise ConfigError(f"{name} must be a number strictly between 0 and 1{_because(why)}, got {value!r}")
    return float(value)


def one_of(value: Any, name: str, choices: tuple[Any, ...]) -> Any:
    """``value`` if it is one of ``choices`` (compared by equality, never a bool for a non-bool choice)."""
    if any(value is choice or (not isinstance(value, bool) and value == choice) for choice in choices):
        return value
    raise ConfigError(f"{name} must be one of {choices}, got {value!r}")


def memory_bytes(value: Any, name: str = "max_memory") -> Any:
    """``value`` if it is ``None`` (the library-wide budget) or a positive number of bytes."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(
            f"{name} must be a positive number of bytes (or None for posthoc.settings.max_memory), got {value!r}"
        )
    return value


def check_shift(shift: Any) -> Any:
    """``shift`` if it is ``None``, ``"auto"`` or a non-empty list of kind names and callables ``f(x, generator)``."""
    if shift is None or (isinstance(shift, str) and shift == "auto"):
        return shift
    if isinstance(shift, (list, tuple)) and shift and all(isinstance(s, str) or callable(s) for s in shift):
        return shift
    raise ConfigError(
        f"shift must be None (clean validation data only), 'auto' (perturbations suited to the inputs) "
        f"or a non-empty list of fit-time kind names and callables f(x, generator) -> x; got {shift!r}"
    )


def generator(value: Any, name: str = "generator") -> Any:
    """``value`` if it is ``None`` (the global random state) or a ``torch.Generator`` (not a seed).

    Example:
        >>> from posthoc.core.checks import generator
        >>> generator(42)
        Traceback (most recent call last):
        posthoc.errors.ConfigError: generator must be a torch.Generator or None, got 42...
    """
    if value is None or isinstance(value, torch.Generator):
        return value
    hint = f"; for a seed pass {name}=torch.Generator().manual_seed({value})" if isinstance(value, int) else ""
    raise ConfigError(f"{name} must be a torch.Generator or None, got {value!r}{hint}")


def integer(value: Any, name: str) -> int:
    """``value`` if it is an integer (not a bool), e.g. a seed."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    return value


def fraction(value: Any, name: str) -> float:
    """``value`` as a float in ``[0, 1)`` (not a bool), e.g. a momentum or the burn-in share of a chain."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConfigError(f"{name} must be a fraction in [0, 1), got {value!r}")
    return float(value)


def unit_interval(value: Any, name: str) -> float:
    """``value`` as a float in ``[0, 1]`` (not a bool), e.g. how far a fit moves towards another."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def known_name(value: Any, what: str, names: Iterable[str]) -> str:
    """``value`` if it is one of ``names``; otherwise a :class:`ConfigError` listing them."""
    names = list(names)
    if not isinstance(value, str) or value not in names:
        raise ConfigError(f"unknown {what} {value!r}; valid: {', '.join(names)}")
    return value


def known_options(options: Mapping[str, Any], valid: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """``options`` if ``valid`` (option -> default) accepts each of them, else a :class:`ConfigError` listing them."""
    unknown = sorted(set(options) - set(valid))
    if unknown:
        listing = ", ".join(f"{k}={v!r}" for k, v in valid.items()) or "none"
        raise ConfigError(f"unknown option(s) {unknown} for {owner}; valid options: {listing}")
    return dict(options)
