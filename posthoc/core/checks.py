"""Checks of user-given option values, with one wording for every method.

Example:
    >>> positive_int(5, "num_samples")
    5
    >>> positive_int(0, "num_samples")
    Traceback (most recent call last):
    posthoc.core.errors.ConfigError: num_samples must be a positive integer, got 0
"""

from __future__ import annotations

from typing import Any

from posthoc.core.errors import ConfigError


def positive_int(value: Any, name: str, *, none: str | None = None) -> Any:
    """``value`` if it is an integer >= 1 (not a bool); ``none`` says what ``None`` means if it is allowed."""
    if value is None and none is not None:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = f" or None ({none})" if none is not None else ""
        raise ConfigError(f"{name} must be a positive integer{allowed}, got {value!r}")
    return value


def non_negative(value: Any, name: str) -> float:
    """``value`` as a float if it is a number >= 0 (not a bool), e.g. a penalty weight."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)


def memory_bytes(value: Any, name: str = "max_memory") -> Any:
    """``value`` if it is ``None`` (the library-wide budget) or a positive number of bytes."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{name} must be a positive number of bytes (or None for posthoc.settings.max_memory), got {value!r}")
    return value


def check_shift(shift: Any) -> Any:
    """``shift`` if it is ``None``, ``"auto"`` or a non-empty list of kind names and callables ``f(x, generator) -> x``.

    Example:
        >>> check_shift(["noise", "blur"])
        ['noise', 'blur']
    """
    if shift is None or (isinstance(shift, str) and shift == "auto"):
        return shift
    if isinstance(shift, (list, tuple)) and shift and all(isinstance(s, str) or callable(s) for s in shift):
        return shift
    raise ConfigError(f"shift must be None (clean validation data only), 'auto' (perturbations suited to the inputs) "
                      f"or a non-empty list of fit-time kind names and callables f(x, generator) -> x; got {shift!r}")


def integer(value: Any, name: str) -> int:
    """``value`` if it is an integer (not a bool), e.g. a seed.

    Example:
        >>> integer(0, "seed")
        0
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    return value


def positive_finite(value: Any, name: str, *, none: str | None = None) -> Any:
    """``value`` as a float if it is a finite number > 0 (not a bool), e.g. a learning rate; ``none`` says what
    ``None`` means if it is allowed.

    Example:
        >>> positive_finite(1e-3, "lr"), positive_finite(None, "lr", none="set from the model")
        (0.001, None)
    """
    if value is None and none is not None:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        allowed = f", or None ({none})" if none is not None else ""
        raise ConfigError(f"{name} must be a positive finite number{allowed}, got {value!r}")
    return float(value)


def finite_non_negative(value: Any, name: str, *, meaning: str = "") -> float:
    """``value`` as a float if it is a finite number >= 0 (not a bool), e.g. a tolerance; ``meaning`` is added to
    the message.

    Example:
        >>> finite_non_negative(0.02, "val_tolerance")
        0.02
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ConfigError(f"{name} must be a finite number >= 0{meaning}, got {value!r}")
    return float(value)


def fraction(value: Any, name: str) -> float:
    """``value`` as a float in ``[0, 1)`` (not a bool), e.g. a momentum or the burn-in share of a chain.

    Example:
        >>> fraction(0.5, "burn_in")
        0.5
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConfigError(f"{name} must be a fraction in [0, 1), got {value!r}")
    return float(value)
