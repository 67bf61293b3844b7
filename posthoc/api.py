"""``wrap()`` and ``load()``: building an :class:`UncertainModel` from methods, and from a saved posterior."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from posthoc.core import persistence
from posthoc.core.chain import CALIBRATE_REGRESSOR, RETIRED_OPTIONS, build_chain, route_options, spec_of
from posthoc.core.checkpoint import load_checkpoint
from posthoc.core.fit_record import FitRecord
from posthoc.core.likelihood import Likelihood, make_likelihood
from posthoc.core.modules import get_submodule, uncompiled
from posthoc.core.registry import method_class, method_names
from posthoc.engine.dense import DenseModel, PositionRows
from posthoc.engine.head import output_width
from posthoc.engine.runner import RunOptions, split_run_options
from posthoc.engine.uncertain_model import UncertainModel
from posthoc.engine.uncertain_model import version as posthoc_version
from posthoc.errors import ConfigError, PosteriorFileError, PosthocError
from posthoc.methods.auto.method import as_candidate
from posthoc.methods.calibration.per_position import AUTO_CANDIDATES as POSITION_AUTO_CANDIDATES
from posthoc.methods.calibration.per_position import POSITION_CALIBRATORS, PositionCalibration

#: ``posthoc.calibrate``'s regression calibrators that are no registered method
REGRESSION_CALIBRATORS = ("variance-scaling", "auto")


def _refuse_regression_calibrators(names: list[str], likelihood: Likelihood) -> None:
    """Refuse a regression calibrator in ``method=``, pointing to ``posthoc.calibrate`` on the predictions."""
    regression = likelihood.name != "classification"
    # "auto" alone is the method chosen on held-out data; stacked on another method it can only mean the calibrator
    found = [
        n
        for i, n in enumerate(names)
        if isinstance(n, str) and n in REGRESSION_CALIBRATORS and (regression or n != "auto") and (n != "auto" or i > 0)
    ]
    if found:
        raise ConfigError(
            f"'{found[0]}' calibrates a regressor's predictions and wrap does not stack it on a method yet: "
            f"wrap without it and {CALIBRATE_REGRESSOR}"
        )


def _module_as_name(model: nn.Module, key: str, value: Any) -> Any:
    """Options naming a module may pass the module itself; store its name so the spec can be saved. A ``head=`` name is
    checked here, at ``wrap()``, for every method that takes one (a typo would otherwise surface at ``fit``, or never
    where the head goes unused)."""
    if key == "head" and isinstance(value, str):
        get_submodule(model, value)
    if not isinstance(value, nn.Module):
        return value
    for name, module in model.named_modules():
        if module is value:
            return name
    raise ConfigError(f"option {key!r} is a module that is not part of the model; pass one of its modules or its name")


def wrap_spec(model: nn.Module | list[nn.Module], spec: list[dict[str, Any]]) -> UncertainModel:
    """Build an :class:`UncertainModel` from a spec ``[{"name": ..., "options": {...}}, ...]`` (:func:`build_chain`),
    after checking that the model's output width suits the spec's likelihood where its structure shows it."""
    if spec:
        likelihood = make_likelihood(spec[0].get("likelihood"))
        for member in model if isinstance(model, (list, tuple)) else [model]:
            width = output_width(member) if isinstance(member, nn.Module) else None
            if width is not None:
                likelihood.check_width(width)
    with RunOptions.from_spec(spec).scope():  # a method may check at build what its posterior will hold
        method, source = build_chain(model, spec)
    return UncertainModel(method, spec, fingerprint=source)


def _member_models(entries: list[Any], builder: Callable[[], nn.Module] | None) -> list[Any]:
    """The members: modules as given, checkpoint paths read (``weights_only``) into ``builder()`` one by one."""
    paths = [entry for entry in entries if isinstance(entry, (str, os.PathLike))]
    if paths and builder is None:
        raise ConfigError(
            f"ensemble members given as checkpoint paths ({paths[0]!s}, ...) need builder=, a function "
            "returning the untrained architecture that each state_dict is loaded into"
        )
    if builder is not None and not callable(builder):
        raise ConfigError(f"builder must be a function returning an nn.Module, got {type(builder).__name__}")
    return [
        load_checkpoint(builder(), entry).eval() if isinstance(entry, (str, os.PathLike)) else entry
        for entry in entries
    ]


def _wrap_ensemble(
    entries: list[Any], names: list[str], options: dict[str, Any], likelihood: Likelihood
) -> UncertainModel:
    """``wrap`` for a list of models: the first (non-stacking) method on every member, the stackers on the mixture."""
    batched = options.pop("batched", None)
    models = _member_models(entries, options.pop("builder", None))
    if len(models) == 1:
        warnings.warn(
            "posthoc.wrap got a list with one model: wrapping it as a single model (an ensemble needs two or more)",
            UserWarning,
            stacklevel=3,
        )
        return wrap(models[0], names, likelihood=likelihood, **options)
    if method_class(names[0]).stacks:
        names = ["none", *names]
    options = {key: _module_as_name(models[0], key, value) for key, value in options.items()}
    run, options = split_run_options(options)
    spec = spec_of(names, route_options(names, options), likelihood, RunOptions(**run).to_spec())
    spec[0].update(members=len(models), batched=batched)
    return wrap_spec(models, spec)


def wrap(
    model: nn.Module | list[nn.Module],
    method: str | list[str] | None = None,
    *,
    likelihood: str | Likelihood = "classification",
    dense: bool = False,
    class_dim: int | None = None,
    ignore_index: int | None = None,
    **options: Any,
) -> UncertainModel | DenseModel:
    """Wrap an already trained classifier or regressor (or several: an ensemble) with a post-hoc predictive.

    Args:
        model: a trained classifier returning logits ``(N, C)``, never modified (methods that change weights work on
            a copy). A list of them is an ensemble: the first method is fitted on every member, the predictive is
            their equal-weight mixture with the members' samples kept, and the stacking methods after it are fitted
            on the mixture. ``batched`` chooses the vmapped forward of plain members of one architecture (default:
            on CUDA only). Members may be checkpoint paths with ``builder=``, a function returning the architecture.
        method: a registered method name, or a list composing them, inner first, e.g. ``["laplace",
            "temperature"]``. Default: ``"auto"`` for one model (the method chosen on ``val_loader``), ``"none"`` (a
            deep ensemble) for a list.
        likelihood: ``"classification"``, ``"regression"`` (a Gaussian observation noise fitted at ``fit``;
            ``posthoc.Gaussian(noise_std=...)`` fixes it) or ``"heteroscedastic"`` (outputs ``(N, 2D)``: means,
            then log-variances). Methods that do not handle it refuse here and name those that do.
        dense: ``True`` for a model whose logits carry positions, ``(N, C, H, W)`` or ``(N, T, V)``: a
            :class:`~posthoc.engine.dense.DenseModel` is returned (methods: :data:`DENSE_METHODS`), with the
            logits' ``class_dim`` (default: from the labels' shape) and the label ``ignore_index`` of positions
            left out (default: -100, and 255 for at most 255 classes); with ``likelihood="regression"``, outputs
            ``(N, D, H, W)`` and targets of that shape, NaN where there is none (:data:`DENSE_REGRESSION_METHODS`: a
            method, and a regressor's calibrator fitted on the valid held-out positions after it, e.g.
            ``["laplace", "variance-scaling"]``).
        **options: method options; each goes to every method in the chain that accepts it
            (``posthoc.available_methods()`` lists them). ``max_memory`` is the runner's, for every method.

    Example:
        >>> import posthoc
        >>> from posthoc_apps.demo.examples import model, val_loader, x
        >>> um = posthoc.wrap(model, method="temperature").fit(val_loader=val_loader)
        >>> um.predict(x).probs.shape           # eight inputs, three classes
        torch.Size([8, 3])
        >>> posthoc.wrap(model, method=["laplace", "temperature"], hessian="diag").methods   # inner first
        ['laplace', 'temperature']
    """
    if method is None:
        method = "none" if isinstance(model, (list, tuple)) else "auto"
    if not isinstance(method, (str, list, tuple)):
        raise ConfigError(
            f"method must be a method name or a list of them, e.g. method=['laplace', 'temperature'], "
            f"got {type(method).__name__}; valid methods: {', '.join(method_names())}"
        )
    names = [method] if isinstance(method, str) else list(method)
    if not names:
        raise ConfigError(f"method must name at least one method; valid methods: {', '.join(method_names())}")
    if dense:
        return _wrap_dense(model, names, likelihood, class_dim, ignore_index, options)
    likelihood = make_likelihood(likelihood)
    _refuse_regression_calibrators(names, likelihood)
    if isinstance(model, (list, tuple)):
        return _wrap_ensemble(list(model), names, dict(options), likelihood)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module (or a list of them), got {type(model).__name__}")
    options = {key: _module_as_name(model, key, value) for key, value in options.items()}
    run, options = split_run_options(options)
    return wrap_spec(model, spec_of(names, route_options(names, options), likelihood, RunOptions(**run).to_spec()))


@contextlib.contextmanager
def _built_from(path: str | os.PathLike) -> Iterator[None]:
    """Build what a file's spec names; a method, likelihood or option this posthoc does not know (a file from a newer
    posthoc) is a :class:`PosteriorFileError` naming this version, not the builder's raw ``TypeError``."""
    try:
        yield
    except (ConfigError, TypeError) as err:
        raise PosteriorFileError(
            f"{path} names a method, likelihood or option that this posthoc (version {posthoc_version()}, posterior "
            f"format {persistence.FORMAT_VERSION}) cannot build ({err}); it was probably saved by a newer posthoc: "
            "upgrade posthoc to load it, or fit and save it again with this one"
        ) from err


def _check_complete(path: str | os.PathLike, um: UncertainModel, state: dict[str, Any]) -> None:
    """Refuse a file that lacks a likelihood's fitted tensor, which would load and then fail at ``predict`` (method
    tensors that later versions added are not required)."""
    missing = sorted(
        key for key in set(um.method.posterior_state()) - set(state) if key.split(".")[-2:-1] == ["likelihood"]
    )
    if missing:
        raise PosteriorFileError(
            f"{path} lacks the fitted tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} "
            f"that {'+'.join(um.methods)} holds; it is incomplete or from another posthoc version: "
            "fit and save it again"
        )


def _position_rows(
    path: str | os.PathLike, model: Any, layout: dict[str, Any], *, ensemble: bool
) -> PositionRows | list[PositionRows]:
    """The row model(s) of a dense file's ``model`` (a list for an ensemble), with the saved ``layout``."""
    given = list(model) if isinstance(model, (list, tuple)) else [model]
    if not all(isinstance(member, nn.Module) for member in given) or isinstance(model, (list, tuple)) != ensemble:
        raise PosteriorFileError(
            f"{path} holds the posterior of an ensemble with dense outputs; pass the list of its members, in the "
            "order they were wrapped"
            if ensemble
            else f"{path} holds the posterior of one model with dense outputs; pass that model"
        )
    rows = [PositionRows(uncompiled(member), layout["class_dim"], split_head=layout["split_head"]) for member in given]
    for member in rows:
        member.tensor_key = layout["tensor_key"]
    return rows if ensemble else rows[0]


def load(
    path: str | os.PathLike, model: nn.Module | list[nn.Module], *, likelihood: str | None = None
) -> UncertainModel | DenseModel:
    """Rebuild the saved posterior around ``model``, refusing a model other than the one it was fitted on.

    A dense model's file (``wrap(..., dense=True)``, a list of models too) comes back as that dense model.
    An ensemble's file loads onto the list of its members, in the order they were wrapped. The file's likelihood comes
    back with it; ``likelihood=`` (a name) refuses a file of another likelihood.

    Example:
        >>> from torch import nn
        >>> import posthoc
        >>> from posthoc_apps.demo.examples import model, train_loader
        >>> posthoc.wrap(model, method="laplace").fit(train_loader).save("net.laplace.pt")
        >>> um = posthoc.load("net.laplace.pt", model)
        >>> members = [nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)) for _ in range(3)]
        >>> posthoc.wrap(members, method="laplace").fit(train_loader).save("three.laplace.pt")
        >>> ensemble = posthoc.load("three.laplace.pt", members)
        >>> posthoc.load("three.laplace.pt", members[::-1])
        Traceback (most recent call last):
        posthoc.errors.PosteriorFileError: three.laplace.pt: member 0 given is saved member 2;...
    """
    payload = persistence.read(path, kind="posterior")
    for entry in payload["spec"]:  # the choice those options steered is in the file already
        entry["options"] = {key: value for key, value in entry.get("options", {}).items() if key not in RETIRED_OPTIONS}
    with _built_from(path):
        saved = make_likelihood(payload["spec"][0].get("likelihood") if payload["spec"] else None).name
    if likelihood is not None and make_likelihood(likelihood).name != saved:
        raise PosteriorFileError(
            f"{path} holds a posterior for likelihood={saved!r}, not {likelihood!r}: load it with "
            f"likelihood={saved!r}, or fit and save a {likelihood} posterior"
        )
    saved_members = persistence.ensemble_members(payload)
    layout = payload.get("dense")
    if layout is not None:
        model = _position_rows(path, model, layout, ensemble=saved_members is not None)
    if isinstance(model, (list, tuple)):
        if saved_members is None:
            raise PosteriorFileError(
                f"{path} holds the posterior of one model ({payload['model_class']}), not of an "
                "ensemble; pass that model, not a list"
            )
        models = [uncompiled(m) for m in model]
        if all(isinstance(m, nn.Module) for m in models):  # anything else is refused by the ensemble's member check
            persistence.check_ensemble_members(str(path), saved_members, [persistence.fingerprint(m) for m in models])
        with _built_from(path):
            um = wrap_spec(models, payload["spec"])
        found = payload["fingerprint"]
    else:
        if saved_members is not None:
            raise PosteriorFileError(
                f"{path} holds an ensemble of {len(saved_members)} members; load it onto the "
                "list of its members: posthoc.load(path, [m1, m2, ...])"
            )
        model = uncompiled(model)
        found = persistence.fingerprint(model)
        if found != payload["fingerprint"]:
            raise PosteriorFileError(
                f"{path} was fitted on a different model ({payload['model_class']}, fingerprint "
                f"{payload['fingerprint'][:12]}) than the one given ({type(model).__qualname__}, "
                f"fingerprint {found[:12]}): architecture or weights differ. Load it onto the exact "
                "checkpoint it was fitted on, or fit again"
            )
        with _built_from(path):
            um = wrap_spec(model, payload["spec"])
    _check_complete(path, um, payload["state"])
    try:
        um.method.load_posterior_state(payload["state"])
    except PosthocError:
        raise
    except (KeyError, AttributeError, RuntimeError, TypeError, ValueError) as err:
        raise PosteriorFileError(
            f"{path} does not match the method it names ({type(err).__name__}: {err}); "
            "fit and save it again with this posthoc"
        ) from err
    um.fingerprint = found
    um.fit_record = FitRecord.from_dict(payload.get("fit"))
    um.to(um.device)
    if layout is None:
        return um
    dense = DenseModel.restored(um, model, layout)
    if layout.get("calibration") is not None:
        dense.calibration = PositionCalibration.restored(layout["calibration"], source=str(path)).to(um.device)
    return dense


#: the methods that work on dense outputs (``dense=True``), and the candidates of ``"auto"`` there
DENSE_METHODS = ("none", "temperature", "vector", "auto", "laplace", "mc-dropout", "dac")
#: the methods that work on per-position regression outputs (``dense=True, likelihood="regression"``): a method, a
#: calibrator (:data:`DENSE_REGRESSION_CALIBRATORS`), or a method followed by a calibrator
DENSE_REGRESSION_METHODS = ("none", "laplace", "mc-dropout", *POSITION_CALIBRATORS)
#: the calibrators of a per-position regressor, fitted on the valid held-out positions after its method
DENSE_REGRESSION_CALIBRATORS = POSITION_CALIBRATORS
#: what ``"auto"`` chooses between on per-position regression outputs (the image as the unit of its bound)
DENSE_REGRESSION_AUTO_CANDIDATES = POSITION_AUTO_CANDIDATES
#: the dense methods that split the network at its per-position head (:mod:`posthoc.engine.dense_head`)
DENSE_HEAD_METHODS = ("laplace", "mc-dropout", "dac")
DENSE_AUTO_CANDIDATES = ("none", "temperature")


def _wrap_dense(
    model: nn.Module | list[nn.Module],
    names: list[str],
    likelihood: str | Likelihood,
    class_dim: int | None,
    ignore_index: int | None,
    options: dict[str, Any],
) -> DenseModel:
    """A model with per-position outputs (:mod:`posthoc.engine.dense`): the methods on its rows, the runner on its
    positions."""
    kind = likelihood if isinstance(likelihood, str) else make_likelihood(likelihood).name
    if kind not in ("classification", "regression"):
        raise ConfigError(
            "dense=True takes likelihood='classification' (class indices per position) or 'regression' (real targets "
            "per position; posthoc.Gaussian(noise_std=...) fixes the noise)"
        )
    calibration = None
    if kind == "regression":
        refused = [name for name in names if name not in DENSE_REGRESSION_METHODS]
        usage = (
            f"with dense=True and likelihood='regression' use {', '.join(map(repr, DENSE_REGRESSION_METHODS))}, or "
            "one of 'none', 'laplace', 'mc-dropout' followed by a calibrator, e.g. ['laplace', 'variance-scaling']"
        )
        if refused:
            raise ConfigError(f"method {refused[0]!r} does not work on dense regression outputs yet; {usage}")
        given = names
        if names[-1] in DENSE_REGRESSION_CALIBRATORS:
            calibration = PositionCalibration(names[-1])
            names = names[:-1] or ["none"]
        if len(names) > 1 or names[0] in DENSE_REGRESSION_CALIBRATORS:
            raise ConfigError(f"{'+'.join(given)} is no chain that dense regression takes; {usage}")
        options = {**options, "likelihood": likelihood}
    if names == ["auto"] and "candidates" not in options:
        options = {**options, "candidates": list(DENSE_AUTO_CANDIDATES)}
    used = list(names)  # auto's candidates run on the same rows: they are checked and split the head as methods do
    if "auto" in names:
        used += [name for value in options.get("candidates") or () for name in as_candidate(value)["method"]]
    refused = [name for name in used if name not in DENSE_METHODS]
    if refused:
        raise ConfigError(
            f"method {refused[0]!r} does not work on dense outputs yet; with dense=True use "
            f"{', '.join(map(repr, DENSE_METHODS))}, or an ensemble (a list of models with method='none')"
        )
    if "laplace" in used and options.get("subset", "last_layer") != "last_layer":
        raise ConfigError(
            "Laplace on dense outputs is last-layer only (the per-position head, KFAC over positions); drop subset="
        )
    split_head = any(name in DENSE_HEAD_METHODS for name in used)
    if isinstance(model, (list, tuple)):
        rows = [PositionRows(member, class_dim, split_head=split_head) for member in model]
        return DenseModel(wrap(rows, names, **options), rows, ignore_index, calibration)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module (or a list of them), got {type(model).__name__}")
    rows = PositionRows(model, class_dim, split_head=split_head)
    return DenseModel(wrap(rows, names, **options), rows, ignore_index, calibration)
