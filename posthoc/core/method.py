"""The contract every post-hoc method implements: :class:`Method`.

A method turns an already trained model into a predictive: log-probabilities ``(N, C)`` and, when it samples,
per-sample log-probabilities ``(S, N, C)``; its fitted state lives in buffers so that the posterior can be saved.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from posthoc.core.inputs import Inputs
from posthoc.core.json_state import as_record
from posthoc.core.knob import Knob
from posthoc.core.likelihood import Categorical, Likelihood
from posthoc.core.options import Options as BaseOptions
from posthoc.core.prediction import RegressionPrediction
from posthoc.errors import ConfigError, NotFittedError

LogPredictive = tuple[Tensor, Tensor | None]


class Method(nn.Module):
    """Base class of a post-hoc method (subclass it and register it with :func:`posthoc.register`).

    The contract, what a method implements (everything else, memory, threads, ranks and the held-out data, is the
    runner's, :mod:`posthoc.engine`):

    - ``Options``: a frozen, keyword-only dataclass (a subclass of :class:`posthoc.core.options.Options`) whose
      fields are the options ``wrap`` takes, with their types and defaults. ``__init__(self, model, options)``
      reads them (``options.num_samples``), checks them with its own messages and sets up the method's buffers.
      :meth:`build` makes ``Options`` from keywords, refusing unknown names; the saved spec keeps the keywords.
    - ``FitOptions``: the same for the options of ``fit`` (none by default); ``fit`` then takes them as
      ``options=``.
    - :meth:`fit`: the method's work on the training data (curvature, fine-tuning, a feature bank).
    - :meth:`knob`: its held-out choice, declared (its name, candidates, scores and how one is applied); the runner
      makes it through the selection step.
    - :meth:`log_predictive` (classification) and, for a regression likelihood in :attr:`likelihoods`,
      :meth:`regression_predictive`.
    - :meth:`summary`: what the posterior is over, for the model card.
    - :meth:`posterior_state` / :meth:`load_posterior_state` where the fitted state is more than the buffers.

    A method whose fitting needs depend on its options derives ``requires_fit`` and ``needs_val`` as properties
    (``"mc-dropout"`` with ``p="auto"``) and sets ``fitted`` once they are known.

    Example:
        >>> import torch
        >>> from dataclasses import dataclass
        >>> from posthoc.core.method import Method
        >>> from posthoc_apps.demo.examples import model
        >>> class Flat(Method):
        ...     name, requires_fit = "flat", False
        ...     @dataclass(frozen=True, kw_only=True)
        ...     class Options(Method.Options):
        ...         scale: float = 2.0
        ...     def __init__(self, model, options=Options()):
        ...         super().__init__(model)
        ...         self.scale = float(options.scale)
        ...     def log_predictive(self, x, *, num_samples=None, generator=None):
        ...         return torch.log_softmax(self.model(x) / self.scale, -1), None
        >>> Flat.build(model, scale=4.0).scale
        4.0
    """

    #: the registry name, e.g. ``"laplace"``
    name: ClassVar[str] = ""
    #: whether ``predict`` needs ``fit`` first
    requires_fit: ClassVar[bool] = True
    #: whether ``fit`` needs a held-out ``val_loader``
    needs_val: ClassVar[bool] = False
    #: whether it is built around another method (``inner``) instead of a model, and maps its predictive
    stacks: ClassVar[bool] = False
    #: whether it works on (and saves) its own copy of the weights
    copies_model: ClassVar[bool] = False
    #: its public methods that the ``UncertainModel`` offers as its own (``"sparse-vd"``: ``um.prune()``)
    tools: ClassVar[tuple[str, ...]] = ()
    #: whether ``method=`` offers it on its own (a stage that needs what ``fit`` cannot give, such as the deployment
    #: data of ``"label-shift"``, is built by its function and still saves, loads and stacks by name)
    listed: ClassVar[bool] = True
    #: the likelihood classes it handles (a regression one needs :meth:`regression_predictive`); ``wrap`` refuses others
    likelihoods: ClassVar[tuple[type[Likelihood], ...]] = (Categorical,)
    #: whether, under ``likelihood="regression"``, it predicts with one observation noise per output
    per_output_noise: ClassVar[bool] = False
    #: the tasks (``"classification"``, ``"regression"``) whose predictive :meth:`to_module` exports
    exports: ClassVar[tuple[str, ...]] = ()
    #: why the other tasks cannot be exported (:meth:`export_blocker`)
    export_refusal: ClassVar[str | None] = None
    #: the options ``wrap`` takes (the fields of a dataclass; see the class docs)
    Options: ClassVar[type[BaseOptions]] = BaseOptions
    #: the options ``fit`` takes (none by default)
    FitOptions: ClassVar[type[BaseOptions]] = BaseOptions

    def __init__(self, model: nn.Module, options: BaseOptions | None = None) -> None:
        """The base part of a method around ``model``; a subclass reads its ``options`` in its own ``__init__``."""
        super().__init__()
        self.model = model
        #: the likelihood of the targets (set by ``wrap`` through :meth:`use_likelihood`); its fitted noise is saved
        self.likelihood: Likelihood = Categorical()
        declared = type(self).requires_fit  # a property where the instance derives it (it sets ``fitted`` itself)
        self.register_buffer("fitted", torch.tensor(declared is False))
        #: the record of the held-out choice (:meth:`knob`) as JSON bytes (``None``: no choice made)
        self.register_buffer("selection_record", None)

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """The options ``wrap`` accepts for this method, with their defaults: the fields of :attr:`Options`."""
        return cls.Options.defaults()

    @classmethod
    def build(cls, model: nn.Module, **options: Any) -> Method:
        """The method around ``model`` (a stacked method: the method it stacks on) with ``options`` (the rest at their
        defaults); an unknown option fails with a :class:`~posthoc.errors.ConfigError` listing the valid ones.

        Example:
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import model
            >>> posthoc.methods.laplace.Laplace.build(model, hessian="diag").hessian
            'diag'
        """
        return cls(model, cls.Options.make(options, f"method '{cls.name}'"))

    @classmethod
    def suits(cls, model: nn.Module) -> bool:
        """Whether this method with its defaults makes sense on ``model`` as a candidate of ``method="auto"`` (MC
        dropout: the model has dropout of its own to sample)."""
        return True

    @classmethod
    def algorithm(cls, options: dict[str, Any]) -> type[Method]:
        """The class that runs this method with ``options``: one registered name may front several
        algorithms (``"laplace"``: last-layer closed forms or a layer subset), chosen at ``wrap()``."""
        return cls

    @classmethod
    def fit_option_defaults(cls) -> dict[str, Any]:
        """The options ``fit`` accepts for this method, with their defaults: the fields of :attr:`FitOptions`."""
        return cls.FitOptions.defaults()

    @classmethod
    def make_fit_options(cls, values: dict[str, Any]) -> BaseOptions:
        """The :attr:`FitOptions` of ``values`` (an ensemble makes its members')."""
        return cls.FitOptions.make(values, f"fit of '{cls.name}'")

    @property
    def base_model(self) -> nn.Module:
        """The model this method was built around (the inner one's for stacked methods)."""
        return self.model

    @property
    def plain_model(self) -> nn.Module:
        """The checkpoint as the user gave it, which every held-out choice is judged against (kept by
        :meth:`keep_plain_model` where the method works on a copy; a stacked method asks the one it is built around)."""
        kept = self.__dict__.get("_plain_model")
        if kept is not None:
            return kept
        return self.inner.plain_model if self.stacks else self.model

    def keep_plain_model(self, model: nn.Module) -> None:
        """Remember the user's ``model`` (not as a submodule: it is neither saved nor moved with the method)."""
        self.__dict__["_plain_model"] = model

    @property
    def device(self) -> torch.device:
        """The device of the model's first parameter (CPU for a model without parameters)."""
        return next((p.device for p in self.base_model.parameters()), torch.device("cpu"))

    def follow_model_device(self) -> torch.device:
        """Move the buffers of this method and the methods it wraps to the model's device (a model moved after
        ``wrap`` is followed by its posterior); return it."""
        device = self.device
        if self.__dict__.get("_followed") == device:  # nothing moved since the last call
            return device
        for module in self.modules():
            if isinstance(module, Method):
                for name, value in module._buffers.items():
                    if value is not None and value.device != device:
                        module._buffers[name] = value.to(device)
        self.__dict__["_followed"] = device
        return device

    @property
    def works_on_copy(self) -> bool:
        """Whether ``base_model`` is a private copy of the user's model (so its weights may change)."""
        return self.copies_model or (self.stacks and self.inner.works_on_copy)

    def fit(self, train_loader: Iterable | None, val_loader: Iterable | None = None, *, progress: bool = True) -> None:
        """Do the method-specific work on the training data; the held-out choice is :meth:`knob`'s, made after."""
        self.fitted.fill_(True)

    def knob(self) -> Knob | None:
        """This method's held-out choice as a :class:`~posthoc.core.knob.Knob` (``None``: it makes none), which the
        runner (:func:`posthoc.engine.choice.make_choice`) makes after :meth:`fit` and again in ``um.choose``."""
        return None

    @property
    def last_selection(self) -> Any:
        """The :class:`posthoc.engine.selection.Selection` of the last held-out choice in this process (``None`` after a
        load, or without one)."""
        return self.__dict__.get("_last_selection")

    @property
    def selection(self) -> dict[str, Any] | None:
        """The record of the last held-out choice (``Selection.to_dict()``), or ``None`` if none was made."""
        return as_record(self.selection_record)

    @classmethod
    def handles(cls, likelihood: Likelihood) -> bool:
        """Whether this method predicts under ``likelihood`` (one of :attr:`likelihoods`)."""
        return type(likelihood) in cls.likelihoods

    def use_likelihood(self, likelihood: Likelihood) -> None:
        """Predict under ``likelihood`` (``wrap`` calls it once, before ``fit``); refuses one the method does not handle.

        Example:
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import model
            >>> from posthoc.core.likelihood import Gaussian
            >>> posthoc.wrap(model, method="temperature").method.use_likelihood(Gaussian())
            Traceback (most recent call last):
            posthoc.errors.ConfigError: 'temperature' does not do likelihood='regression'
        """
        if not self.handles(likelihood):
            raise ConfigError(f"'{self.name}' does not do likelihood={likelihood.name!r}")
        if getattr(likelihood, "per_output", False) and not self.per_output_noise:
            raise ConfigError(
                f"'{self.name}' ({type(self).__name__}) uses one observation noise shared by the outputs, "
                "but noise_std gives one per output; pass posthoc.Gaussian(noise_std=<one float>) or use a "
                "method with a noise per output (none, last-layer laplace, mc-dropout, ensembles of them)"
            )
        self.likelihood = likelihood

    def check_fitted(self, what: str) -> None:
        """Refuse to report ``what`` (e.g. ``"um.sparsity()"``) before ``fit``, as :meth:`tool` shows."""
        if self.requires_fit and not bool(self.fitted):
            raise NotFittedError(
                f"{what} reads the fitted posterior of '{self.name}', which is not fitted yet: call "
                "um.fit(train_loader) first (or posthoc.load a saved one)"
            )

    def tool(self, name: str) -> Callable[..., Any]:
        """The method's tool ``name`` (one of :attr:`tools`), refusing to run before ``fit``.

        Example:
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import model
            >>> posthoc.wrap(model, method="sparse-vd").method.tool("prune")()      # as um.prune()
            Traceback (most recent call last):
            posthoc.errors.NotFittedError: um.prune() reads the fitted posterior of 'sparse-vd'...
        """
        function = getattr(self, name)

        @functools.wraps(function)
        def fitted_only(*args: Any, **kwargs: Any) -> Any:
            self.check_fitted(f"um.{name}()")
            return function(*args, **kwargs)

        return fitted_only

    def log_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> LogPredictive:
        """Return ``(log_probs (N, C), sample_log_probs (S, N, C) or None)`` for inputs ``x``."""
        raise NotImplementedError

    def regression_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> RegressionPrediction:
        """The predictive over real targets for ``x`` under a regression :attr:`likelihood`: the mixture around
        :meth:`sampled_outputs` (a predictive that is not a mixture of sampled networks overrides this)."""
        return self.likelihood.predictive(self.sampled_outputs(x, num_samples=num_samples, generator=generator))

    def sampled_outputs(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> Tensor:
        """``(S, N, O)``: the model's raw outputs for ``x`` under ``S`` draws of the posterior."""
        raise NotImplementedError

    def export_blocker(self, *, regression: bool = False) -> str | None:
        """Why ``um.to_module()`` cannot export this method (``None``: it can), known before anything is fitted.

        Example:
            >>> import posthoc
            >>> from torch import nn
            >>> posthoc.wrap(nn.Linear(4, 3), method="none").method.export_blocker() is None
            True
        """
        if ("regression" if regression else "classification") in self.exports:
            return None
        task = " under a regression likelihood" if regression else ""
        return self.export_refusal or f"it has no exported form{task} yet"

    def to_module(self, export: Any) -> nn.Module:
        """The fitted predictive as a plain module (``um.to_module()`` calls it with a
        :class:`posthoc.export.build.Export`): ``(log_probs, samples or None)``, or under a regression likelihood
        ``(means (K, N, D), variances (K, N, D))``, built from the same functions as the predictive."""
        raise export.refusal(self, self.export_blocker(regression=export.regression) or "it has no exported form yet")

    def summary(self) -> dict[str, Any]:
        """What this method's posterior is over, for the model card, as plain Python values: ``random_variables``
        (how many scalar random variables the posterior has), ``layers`` (the module names involved) and what the
        method chose at fit (e.g. ``prior_precision``).

        Example:
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import model
            >>> posthoc.wrap(model, method="none").method.summary()
            {'random_variables': 0, 'layers': []}
        """
        return {"random_variables": 0, "layers": []}

    def posterior_state(self) -> dict[str, Tensor]:
        """The tensors that make up the fitted posterior; the base weights only if the method copied them."""
        state = {name: value for name, value in self._buffers.items() if value is not None}
        state.update({name: value.detach() for name, value in self._parameters.items() if value is not None})
        for name, child in self.named_children():
            if name == "model" and not self.copies_model:
                continue
            child_state = child.posterior_state() if isinstance(child, Method) else child.state_dict()
            state.update({f"{name}.{key}": value for key, value in child_state.items()})
        return state

    def load_posterior_state(self, state: dict[str, Tensor]) -> None:
        """Load tensors saved by :meth:`posterior_state`; buffers may change shape (e.g. ``None`` before fit)."""
        load_tensors(self, state)


def load_tensors(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Set the buffers (replaced, so they may change shape) and parameters (keeping their device) of ``module`` named
    by the keys of ``state``; a key naming neither raises ``KeyError``.

    Example:
        >>> import torch
        >>> import posthoc
        >>> from posthoc.core.method import load_tensors
        >>> from posthoc_apps.demo.examples import logits, labels
        >>> calibrator = posthoc.calibrate(logits, labels)
        >>> load_tensors(calibrator, {"temperature": torch.tensor(1.5)})
        >>> calibrator.temperature
        tensor(1.5000)
    """
    for key, value in state.items():
        owner_name, _, attr = key.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        current = getattr(owner, attr, None)
        if isinstance(current, nn.Parameter):
            with torch.no_grad():
                current.data = value.to(current.device)
        elif attr in owner._buffers:
            owner._buffers[attr] = value
        else:
            raise KeyError(key)


#: why a method whose samples are whole networks has no exported form
SAMPLES_NETWORKS = (
    "its samples are networks with their inner weights or nodes perturbed, which need the network run "
    "once per sample (no fixed tensor program on the head's input)"
)


def chain_of(method: Method) -> list[Method]:
    """The methods of a chain, inner first (a stacked method alone has the plain model inside)."""
    return (chain_of(method.inner) if method.stacks else []) + [method]


def predictive_of(method: Method) -> str:
    """How a message names ``method``'s predictive: ``"the model"`` for ``"none"``, else the method's quoted name."""
    return "the model" if method.name == "none" else f"'{method.name}'"
