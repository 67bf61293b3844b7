"""The method registry: every post-hoc method registers itself here under its name.

Example:
    >>> @register
    ... class Uniform(Method):
    ...     name = "uniform"
    >>> "uniform" in available_methods()
    True
"""

from __future__ import annotations

from typing import Any

from posthoc.core.errors import ConfigError
from posthoc.core.method import Method

REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator adding a :class:`Method` to the registry under ``cls.name``."""
    if not isinstance(cls, type) or not issubclass(cls, Method):
        raise ConfigError(f"posthoc.register takes a subclass of posthoc.Method, got {cls!r}")
    if not isinstance(cls.name, str) or not cls.name:
        raise ConfigError(f"{cls.__name__} has no name to register under")
    REGISTRY[cls.name] = cls
    return cls


def available_methods() -> dict[str, dict[str, Any]]:
    """Every registered method with its options and defaults.

    Example:
        >>> sorted(available_methods())[:2]
        ['laplace', 'mc-dropout']
    """
    return {name: cls.option_defaults() for name, cls in sorted(REGISTRY.items())}


def method_class(name: str) -> type[Method]:
    """The registered class of method ``name``; unknown names fail with the valid ones listed."""
    if not isinstance(name, str) or name not in REGISTRY:
        raise ConfigError(f"unknown method {name!r}; valid methods: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def methods_doc() -> str:
    """A docstring section listing every registered method with its options and defaults."""
    lines = ["", "    Methods (options and fit options, with defaults):", ""]
    for name, cls in sorted(REGISTRY.items()):
        summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        options = ", ".join(f"{k}={v!r}" for k, v in cls.option_defaults().items()) or "none"
        fit_options = ", ".join(f"{k}={v!r}" for k, v in cls.fit_option_defaults().items()) or "none"
        lines.append(f"    - ``{name}``: {summary} Options: {options}. Fit options: {fit_options}.")
    return "\n".join(lines) + "\n"
