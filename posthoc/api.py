"""``wrap()`` and ``load()``: building an :class:`UncertainModel` from methods, and from a saved posterior.

Example:
    >>> um = posthoc.wrap(model, method=["laplace", "temperature"], hessian="diag")
    >>> um.methods
    ['laplace', 'temperature']
"""

from __future__ import annotations

import copy
import os
from typing import Any

from torch import nn

from posthoc.core import persistence
from posthoc.core.errors import ConfigError, PosteriorFileError
from posthoc.core.fit_record import FitRecord
from posthoc.core.method import Method
from posthoc.core.modules import uncompiled
from posthoc.core.registry import REGISTRY, method_class
from posthoc.core.uncertain_model import UncertainModel


def _route_options(names: list[str], options: dict[str, Any]) -> list[dict[str, Any]]:
    """Give each option to every method in the chain that accepts it; refuse the rest."""
    accepted = [method_class(name).option_defaults() for name in names]
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


def wrap_spec(model: nn.Module, spec: list[dict[str, Any]]) -> UncertainModel:
    """Build an :class:`UncertainModel` from a spec ``[{"name": ..., "options": {...}}, ...]``."""
    model = uncompiled(model)
    method: Method | None = None
    source: str | None = None
    for position, entry in enumerate(spec):
        cls = method_class(entry["name"]).algorithm(entry["options"])
        if cls.stacks:
            inner = method if method is not None else REGISTRY["none"](model)
            method = cls(inner, **entry["options"])
        elif method is not None:
            raise ConfigError(
                f"'{entry['name']}' cannot stack on top of '{spec[position - 1]['name']}'; only "
                f"{[n for n, c in REGISTRY.items() if c.stacks]} can come after another method"
            )
        elif cls.copies_model:
            source = persistence.fingerprint(model)
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


def load(path: str | os.PathLike, model: nn.Module) -> UncertainModel:
    """Rebuild the saved posterior around ``model``, refusing a model other than the one it was fitted on.

    Example:
        >>> um = posthoc.load("net.laplace.pt", model)
    """
    payload = persistence.read(path)
    model = uncompiled(model)
    found = persistence.fingerprint(model)
    if found != payload["fingerprint"]:
        raise PosteriorFileError(
            f"{path} was fitted on a different model ({payload['model_class']}, fingerprint "
            f"{payload['fingerprint'][:12]}) than the one given ({type(model).__qualname__}, "
            f"fingerprint {found[:12]}): architecture or weights differ. Load it onto the exact "
            "checkpoint it was fitted on, or fit again"
        )
    um = wrap_spec(model, payload["spec"])
    try:
        um.method.load_posterior_state(payload["state"])
    except (KeyError, AttributeError) as err:
        raise PosteriorFileError(f"{path} does not match the method it names: unexpected entry {err}") from err
    um.fingerprint = found
    um.fit_record = FitRecord.from_dict(payload.get("fit"))
    um.to(um.device)
    return um
