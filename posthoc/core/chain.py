"""Building a chain of methods from a spec: the first method around a model, the stacking ones on top of it.

A spec is a list of entries ``{"name": ..., "options": {...}}`` (the first may carry ``"likelihood"``, and for an
ensemble ``"members"`` and ``"batched"``), inner first: what ``posthoc.wrap`` records and a posterior file saves.

Example:
    >>> from posthoc.core.chain import build_chain
    >>> from posthoc_apps.demo.examples import model
    >>> method, source = build_chain(model, [{"name": "laplace", "options": {}}, {"name": "temperature", "options": {}}])
    >>> type(method).__name__, type(method.inner).__name__
    ('TemperatureScaling', 'LastLayerLaplace')
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from posthoc.core import persistence
from posthoc.core.likelihood import Likelihood, make_likelihood
from posthoc.core.method import Method
from posthoc.core.modules import uncompiled
from posthoc.core.registry import ENSEMBLE, REGISTRY, method_class, method_names
from posthoc.errors import ConfigError

#: how to calibrate a regressor's predictive, which ``wrap`` does not stack a calibrator on (yet)
CALIBRATE_REGRESSOR = (
    "fit posthoc.calibrate(mean=pred.mean, std=pred.std, targets=y_val, method='variance-scaling' "
    "| 'isotonic' | 'auto') on the wrapped regressor's held-out prediction pred = um.predict(x_val), "
    "then cal.calibrate(um.predict(x)) is the calibrated RegressionPrediction"
)


#: options of ``wrap`` that steer the runner (``posthoc.engine.runner.RunOptions``), not a method: the spec keeps
#: them under ``"run"`` in its first entry (a file of an earlier release, among a method's options)
RUN_OPTION_NAMES = ("max_memory",)


#: options of earlier releases that no method takes any more, and what replaced them
RETIRED_OPTIONS = {
    "val_tolerance": "every held-out choice now takes one tolerance, um.fit(..., tolerance=...): nats per "
    "example (default: max(2 % of the plain model's held-out NLL, 0.005 nats)), judged "
    "with a one-sided 95 % bound"
}


def route_options(names: list[str], options: dict[str, Any]) -> list[dict[str, Any]]:
    """Give each option to every method in the chain that accepts it; refuse the rest.

    Example:
        >>> from posthoc.core.chain import route_options
        >>> route_options(["laplace", "temperature"], {"hessian": "diag"})
        [{'hessian': 'diag'}, {}]
    """
    retired = sorted(set(options) & set(RETIRED_OPTIONS))
    if retired:
        raise ConfigError(f"option {retired[0]!r} was removed: {RETIRED_OPTIONS[retired[0]]}")
    accepted = [method_class(name).option_defaults() for name in names]
    options = {k: v for k, v in options.items() if k not in RUN_OPTION_NAMES}
    unknown = sorted(k for k in options if not any(k in valid for valid in accepted))
    if unknown:
        listing = "; ".join(
            f"{name}: " + (", ".join(f"{k}={v!r}" for k, v in valid.items()) or "(none)")
            for name, valid in zip(names, accepted)
        )
        raise ConfigError(f"unknown option(s) {unknown} for method {'+'.join(names)}; valid options — {listing}")
    return [{k: v for k, v in options.items() if k in valid} for valid in accepted]


def spec_of(
    names: list[str], routed: list[dict[str, Any]], likelihood: Likelihood, run: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The saved spec: one entry per method; the first records the likelihood unless it is classification."""
    spec = [{"name": name, "options": opts} for name, opts in zip(names, routed)]
    config = likelihood.config()
    if config is not None:
        spec[0]["likelihood"] = config
    if run:
        spec[0]["run"] = dict(run)
    return spec


#: which Laplace posteriors take a likelihood other than the classifier's (the rest: every scope but subset='lora')
LAPLACE_SCOPES = {"heteroscedastic": "subset='last_layer' only"}
LAPLACE_SCOPE = "not subset='lora'"


def check_handles(cls: type[Method], name: str, likelihood: Likelihood) -> None:
    """Refuse, at ``wrap()``, a method that does not predict under ``likelihood``, naming the ones that do."""
    if cls.handles(likelihood):
        return
    able = [n for n in method_names() if REGISTRY[n].algorithm({}).handles(likelihood)]
    scope = f" with these options ({cls.__name__})" if REGISTRY[name].algorithm({}).handles(likelihood) else ""
    calibrator = (
        f"; '{name}' calibrates a classifier's probabilities, and wrap does not stack a calibrator on a "
        f"regressor yet: wrap without it and {CALIBRATE_REGRESSOR}"
        if cls.stacks and likelihood.name != "classification"
        else ""
    )
    raise ConfigError(
        f"method '{name}'{scope} does not do likelihood={likelihood.name!r} yet; the methods that do: "
        f"{', '.join(able) or 'none'}"
        + (f" (laplace: {LAPLACE_SCOPES.get(likelihood.name, LAPLACE_SCOPE)})" if "laplace" in able else "")
        + calibrator
    )


def base_method(model: nn.Module, entry: dict[str, Any]) -> tuple[Method, str | None]:
    """The first method of a chain around ``model`` under the entry's likelihood, and the fingerprint of ``model`` if
    the method copies it."""
    cls = method_class(entry["name"]).algorithm(entry["options"])
    likelihood = make_likelihood(entry.get("likelihood"))
    check_handles(cls, entry["name"], likelihood)
    source = None
    if cls.copies_model:
        method, source = cls.build(copy.deepcopy(model), **entry["options"]), persistence.fingerprint(model)
        method.keep_plain_model(model)
    else:
        method = cls.build(model, **entry["options"])
    method.use_likelihood(likelihood)
    return method, source


def stack_on(method: Method, spec: list[dict[str, Any]], start: int) -> Method:
    """Stack the methods ``spec[start:]`` on ``method``, in order; only stacking methods can come after another one."""
    for position in range(start, len(spec)):
        entry = spec[position]
        cls = method_class(entry["name"]).algorithm(entry["options"])
        check_handles(cls, entry["name"], method.likelihood)
        if not cls.stacks:
            raise ConfigError(
                f"'{entry['name']}' cannot stack on top of '{spec[position - 1]['name']}'; only "
                f"{[n for n in method_names() if REGISTRY[n].stacks]} can come after another method"
            )
        method = cls.build(method, **entry["options"])
    return method


def build_chain(model: nn.Module | list[nn.Module], spec: list[dict[str, Any]]) -> tuple[Method, str | None]:
    """The chain of ``spec`` around ``model`` (a list of models: the ensemble of ``spec[0]`` around each, the rest
    stacked on it), and the fingerprint of the user's checkpoint where the first method copies it (``None``: at fit).
    A stacking method first in ``spec`` is stacked on the plain model (``"none"``)."""
    if not spec:
        raise ConfigError("method must name at least one method")
    spec = [
        {**entry, "options": {k: v for k, v in entry.get("options", {}).items() if k not in RUN_OPTION_NAMES}}
        for entry in spec
    ]
    if isinstance(model, (list, tuple)):
        method, source = REGISTRY[ENSEMBLE].around([uncompiled(m) for m in model], spec[0], base_method)
        method.use_likelihood(make_likelihood(spec[0].get("likelihood")))
        return stack_on(method, spec, 1), source
    model = uncompiled(model)
    if method_class(spec[0]["name"]).algorithm(spec[0]["options"]).stacks:
        plain, _ = base_method(model, {"name": "none", "options": {}, "likelihood": spec[0].get("likelihood")})
        return stack_on(plain, spec, 0), None
    method, source = base_method(model, spec[0])
    return stack_on(method, spec, 1), source
