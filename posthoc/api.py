"""``wrap()``: the method registry and composition.

Example:
    >>> um = posthoc.wrap(model, method=["laplace", "temperature"], hessian="diag")
    >>> um.methods
    ['laplace', 'temperature']
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from posthoc.base import Method, UncertainModel
from posthoc.errors import ConfigError
from posthoc.surgery import uncompiled

REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator adding a :class:`Method` to the registry under ``cls.name``."""
    if not cls.name:
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


def _method_class(name: str) -> type[Method]:
    if not isinstance(name, str) or name not in REGISTRY:
        raise ConfigError(f"unknown method {name!r}; valid methods: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def _route_options(names: list[str], options: dict[str, Any]) -> list[dict[str, Any]]:
    """Give each option to every method in the chain that accepts it; refuse the rest."""
    accepted = [_method_class(name).option_defaults() for name in names]
    unknown = sorted(k for k in options if not any(k in valid for valid in accepted))
    if unknown:
        listing = "; ".join(
            f"{name}: " + (", ".join(f"{k}={v!r}" for k, v in valid.items()) or "(none)")
            for name, valid in zip(names, accepted)
        )
        raise ConfigError(f"unknown option(s) {unknown} for method {'+'.join(names)}; valid options — {listing}")
    return [{k: v for k, v in options.items() if k in valid} for valid in accepted]


def _module_as_name(model: nn.Module, key: str, value: Any) -> Any:
    """Options naming a module may pass the module itself; store its name so the spec can be saved."""
    if not isinstance(value, nn.Module):
        return value
    for name, module in model.named_modules():
        if module is value:
            return name
    raise ConfigError(f"option {key!r} is a module that is not part of the model; pass one of its modules or its name")


def methods_doc() -> str:
    """A docstring section listing every registered method with its options and defaults."""
    lines = ["", "    Methods (options and fit options, with defaults):", ""]
    for name, cls in sorted(REGISTRY.items()):
        summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        options = ", ".join(f"{k}={v!r}" for k, v in cls.option_defaults().items()) or "none"
        fit_options = ", ".join(f"{k}={v!r}" for k, v in cls.fit_option_defaults().items()) or "none"
        lines.append(f"    - ``{name}``: {summary} Options: {options}. Fit options: {fit_options}.")
    return "\n".join(lines) + "\n"


def wrap_spec(model: nn.Module, spec: list[dict[str, Any]]) -> UncertainModel:
    """Build an :class:`UncertainModel` from a spec ``[{"name": ..., "options": {...}}, ...]``."""
    from posthoc.persist import fingerprint

    model = uncompiled(model)
    method: Method | None = None
    source: str | None = None
    for position, entry in enumerate(spec):
        cls = _method_class(entry["name"])
        if cls.stacks:
            inner = method if method is not None else REGISTRY["none"](model)
            method = cls(inner, **entry["options"])
        elif method is not None:
            raise ConfigError(
                f"'{entry['name']}' cannot stack on top of '{spec[position - 1]['name']}'; only "
                f"{[n for n, c in REGISTRY.items() if c.stacks]} can come after another method"
            )
        elif cls.copies_model:
            source = fingerprint(model)
            method = cls(copy.deepcopy(model), **entry["options"])
        else:
            method = cls(model, **entry["options"])
    if method is None:
        raise ConfigError("method must name at least one method")
    return UncertainModel(method, spec, fingerprint=source)


def wrap(model: nn.Module, method: str | list[str] = "laplace", **options: Any) -> UncertainModel:
    """Wrap an already trained classifier with a post-hoc predictive.

    Args:
        model: a trained classifier returning logits ``(N, C)`` (timm, torchvision or any
            ``nn.Module``). It is never modified; methods that change weights work on a copy.
        method: a registered method name, or a list composing them, inner first, e.g.
            ``["laplace", "temperature"]`` (temperature is fitted on ``val_loader`` on top of
            the inner predictive).
        **options: method options; each goes to every method in the chain that accepts it.

    Returns:
        An :class:`UncertainModel`; call ``.fit(train_loader, val_loader)`` then ``.predict(x)``.

    Example:
        >>> um = posthoc.wrap(model, method="temperature").fit(val_loader=val_loader)
        >>> um.predict(x).probs.sum(-1)
        tensor([1., 1.])
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    names = [method] if isinstance(method, str) else list(method)
    if not names:
        raise ConfigError(f"method must name at least one method; valid methods: {', '.join(sorted(REGISTRY))}")
    options = {key: _module_as_name(model, key, value) for key, value in options.items()}
    routed = _route_options(names, options)
    spec = [{"name": name, "options": opts} for name, opts in zip(names, routed)]
    return wrap_spec(model, spec)
