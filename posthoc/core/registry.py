"""The registry: every post-hoc method registers itself here under its name.

``posthoc.wrap(model, method=name)`` builds the registered class of ``name``; a list of models is mixed by the
registered :data:`ENSEMBLE`, whose members are the named method.

Example:
    >>> from posthoc.core.method import Method
    >>> from posthoc.core.registry import available_methods, register
    >>> @register
    ... class Uniform(Method):
    ...     name = "uniform"
    >>> "uniform" in available_methods()
    True
"""

from __future__ import annotations

from typing import Any

from posthoc.core.method import Method
from posthoc.errors import ConfigError

REGISTRY: dict[str, type[Method]] = {}

#: the registered mixture that ``posthoc.wrap([m1, m2, ...])`` builds from a list of models; ``method=`` names
#: its members' method, so this name is none of :func:`available_methods`
ENSEMBLE = "ensemble"


def register(cls: type[Method]) -> type[Method]:
    """Class decorator adding a :class:`Method` to the registry under ``cls.name``."""
    if not isinstance(cls, type) or not issubclass(cls, Method):
        raise ConfigError(f"posthoc.register takes a subclass of posthoc.Method, got {cls!r}")
    if not isinstance(cls.name, str) or not cls.name:
        raise ConfigError(f"{cls.__name__} has no name to register under")
    REGISTRY[cls.name] = cls
    return cls


def method_names() -> list[str]:
    """The names ``method=`` offers on its own, sorted (an unlisted stage is still built by name in a chain)."""
    return sorted(name for name, cls in REGISTRY.items() if name != ENSEMBLE and cls.listed)


def available_methods() -> dict[str, dict[str, Any]]:
    """Every method ``method=`` takes, with its options and defaults.

    Example:
        >>> from posthoc.core.registry import available_methods
        >>> available_methods()["laplace"]["hessian"]
        'kron'
    """
    return {name: REGISTRY[name].option_defaults() for name in method_names()}


def method_class(name: str) -> type[Method]:
    """The registered class of method ``name``; unknown names fail with the valid ones listed."""
    if name == ENSEMBLE:
        raise ConfigError(
            f"'{ENSEMBLE}' is built from a list of models: pass posthoc.wrap([model_a, model_b, ...], "
            "method=...) with the method every member gets (default 'none', a deep ensemble)"
        )
    if not isinstance(name, str) or name not in REGISTRY:
        raise ConfigError(f"unknown method {name!r}; valid methods: {', '.join(method_names())}")
    return REGISTRY[name]
