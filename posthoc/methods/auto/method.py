"""``"auto"``: the selection step choosing the method itself, for this model and this held-out data.

``posthoc.wrap(model, method="auto").fit(train_loader, val_loader)`` fits every candidate (by default the cheap
ones, :func:`default_candidates`), makes each one's own held-out choices, and keeps the one the selection step
(:mod:`posthoc.engine.selection`) picks: among the candidates whose held-out NLL excess over the plain model is, at
95 % confidence, within ``fit(..., tolerance=...)``, the one of lowest NLL on the perturbed copies of the validation
batches (without them, ``shift=None``, the lowest clean NLL). The plain model (``"none"``) is always a candidate and
always admissible, so ``auto`` is never worse in distribution than the tolerance allows.

Every candidate is judged on examples its own held-out choice did not see: a knob by re-making the choice on four
folds and scoring the fifth (:func:`~posthoc.engine.selection.out_of_fold`); a stacked calibrator or DAC by its
cross-fitted scores. What candidates share is computed once: the held-out batches and the plain model's scores, each
inner method (``"laplace"`` and ``["laplace", "dac"]`` share one posterior) and DAC's feature bank. The record of
every candidate is ``um.summary()["selection"]``; the chosen chain saves, loads and predicts like the method itself.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, train_loader, val_loader, x
    >>> um = posthoc.wrap(model, method="auto").fit(train_loader, val_loader)
    >>> um.summary()["selection"]["chosen"]
    'laplace+dac'
    >>> um.predict(x).probs.shape
    torch.Size([8, 3])
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.chain import base_method, route_options, spec_of, stack_on
from posthoc.core.inputs import Inputs, batch_size, run_model, slice_inputs
from posthoc.core.json_state import as_record, record_tensor
from posthoc.core.knob import Knob
from posthoc.core.likelihood import Categorical, Gaussian, Likelihood
from posthoc.core.method import LogPredictive, Method, chain_of
from posthoc.core.modules import eval_mode
from posthoc.core.options import option
from posthoc.core.prediction import RegressionPrediction
from posthoc.core.progress import stage
from posthoc.core.registry import method_class, register
from posthoc.engine.choice import make_choice, makes_choice, record_selection, training_rows
from posthoc.engine.feature_store import active_store
from posthoc.engine.fitted_stage import FittedOnHeldOut
from posthoc.engine.held_out import HeldOut
from posthoc.engine.selection import Scores, Selection, out_of_fold
from posthoc.errors import ConfigError, InputError, PosthocError

#: the default candidates of a classifier, most conservative first (MC dropout only on a model with dropout)
CLASSIFICATION_CANDIDATES: tuple[tuple[str, ...], ...] = (
    ("none",),
    ("temperature",),
    ("vector",),
    ("laplace",),
    ("mc-dropout",),
    ("none", "dac"),
    ("laplace", "dac"),
)
#: the default candidates of a regressor
REGRESSION_CANDIDATES: tuple[tuple[str, ...], ...] = (("none",), ("laplace",), ("mc-dropout",))
#: timed repeats of a candidate's predict on one held-out batch (the median is kept)
PREDICT_REPEATS = 3
#: rows of the held-out batch a candidate's predict cost is timed on
PREDICT_ROWS = 64


def default_candidates(model: nn.Module, likelihood: Likelihood) -> list[dict[str, Any]]:
    """The cheap candidates that suit ``model`` (:meth:`Method.suits`) under ``likelihood``, as ``{"method": [...]}``.

    Example:
        >>> from posthoc.methods.auto.method import default_candidates
        >>> from posthoc.core.likelihood import Categorical
        >>> from posthoc_apps.demo import zoo
        >>> [c["method"] for c in default_candidates(zoo.pretrained("digits_bn_cnn"), Categorical())]
        [['none'], ['temperature'], ['vector'], ['laplace'], ['none', 'dac'], ['laplace', 'dac']]
    """
    table = CLASSIFICATION_CANDIDATES if isinstance(likelihood, Categorical) else REGRESSION_CANDIDATES
    return [{"method": list(chain)} for chain in table if all(method_class(name).suits(model) for name in chain)]


def as_candidate(value: Any) -> dict[str, Any]:
    """A candidate as ``{"method": [names], **options}`` from a name, a list of names, or such a dict."""
    if isinstance(value, str):
        return {"method": [value]}
    if isinstance(value, (list, tuple)) and value and all(isinstance(name, str) for name in value):
        return {"method": list(value)}
    if isinstance(value, dict) and "method" in value:
        found = as_candidate(value["method"])
        return {**{k: v for k, v in value.items() if k != "method"}, "method": found["method"]}
    raise ConfigError(
        f"an auto candidate is a method name, a list of names (a chain, e.g. ['laplace', 'dac']) or a "
        f"dict {{'method': [...], **options}}, got {value!r}"
    )


def candidate_label(candidate: dict[str, Any]) -> str:
    """``"laplace+dac"``, with its options where it has any: ``"laplace+dac (hessian='full')"``.

    Example:
        >>> from posthoc.methods.auto.method import candidate_label
        >>> candidate_label({"method": ["laplace", "dac"]})
        'laplace+dac'
    """
    options = {k: v for k, v in candidate.items() if k != "method"}
    text = "+".join(candidate["method"])
    return text + (f" ({', '.join(f'{k}={v!r}' for k, v in options.items())})" if options else "")


@dataclass
class _Part:
    """One candidate while ``auto`` fits: its chain, its label and spec, and what it cost."""

    label: str
    spec: list[dict[str, Any]]
    chain: Method
    inner: Method
    fit_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


@register
class AutoMethod(Method):
    """The method chosen on held-out data among candidates (see module docs)."""

    name = "auto"
    likelihoods = (Categorical, Gaussian)
    exports = ("classification", "regression")  # the chosen method's own are checked as it is exported

    @dataclass(frozen=True, kw_only=True)
    class Options(Method.Options):
        candidates: Sequence[Any] | None = option(
            None, "None (the defaults) or method names, chains and {'method': [...], **options} dicts; none is added"
        )
        keep_candidates: bool = option(False, "keep every fitted candidate after the choice (um.fitted_candidates)")

    def __init__(self, model: nn.Module, options: Options) -> None:
        candidates, keep_candidates = options.candidates, options.keep_candidates
        super().__init__(model)
        if candidates is not None and (
            isinstance(candidates, (str, dict)) or not isinstance(candidates, Sequence) or not candidates
        ):
            raise ConfigError(
                f"candidates must be None (the defaults) or a non-empty list of methods, chains or dicts, "
                f"got {candidates!r}"
            )
        self.candidate_option = None if candidates is None else [as_candidate(value) for value in candidates]
        for candidate in self.candidate_option or []:
            if "auto" in candidate["method"]:
                raise ConfigError("'auto' cannot be a candidate of itself")
        if not isinstance(keep_candidates, bool):
            raise ConfigError(f"keep_candidates must be True or False, got {keep_candidates!r}")
        self.keep_candidates = keep_candidates
        #: every candidate's fitted chain by label, after a choice with ``keep_candidates=True`` (not saved)
        self.fitted_candidates: dict[str, Method] = {}
        #: the chosen chain's spec as JSON bytes (``None`` before fit)
        self.register_buffer("chosen_spec", None)
        self.chosen: Method | None = None
        #: the candidates' chains while ``auto`` fits (registered, so that they follow the model's device)
        self.candidate_chains = nn.ModuleList()
        self._parts: list[_Part] = []
        self._plain_seconds: float | None = None  # a plain forward on the timed rows, once per choice

    # ---- candidates ------------------------------------------------------------------------------------------------
    def candidates(self) -> list[dict[str, Any]]:
        """The candidates for this model and likelihood, the plain model first."""
        found = self.candidate_option or default_candidates(self.model, self.likelihood)
        if not any(candidate["method"] == ["none"] and len(candidate) == 1 for candidate in found):
            found = [{"method": ["none"]}, *found]
        return found

    def use_likelihood(self, likelihood: Likelihood) -> None:
        """As :meth:`Method.use_likelihood`; every candidate is then built (so a bad one is refused at ``wrap``)."""
        super().use_likelihood(likelihood)
        self._parts = self._build(self.candidates())
        self.candidate_chains = nn.ModuleList(part.chain for part in self._parts)

    def _build(self, candidates: list[dict[str, Any]]) -> list[_Part]:
        """Every candidate's chain, those with the same first method and options sharing it; a default candidate that
        refuses this model is left out (its reason in :attr:`left_out`), one given by the user is refused."""
        inners: dict[str, Method] = {}
        parts = []
        self.left_out: dict[str, str] = {}
        for candidate in candidates:
            try:
                parts.append(self._part(candidate, inners))
            except PosthocError as err:
                if self.candidate_option is not None:
                    raise
                self.left_out[candidate_label(candidate)] = str(err)
                _warn_left_out(candidate_label(candidate), str(err))
        return parts

    def _part(self, candidate: dict[str, Any], inners: dict[str, Method]) -> _Part:
        """One candidate's chain (its first method shared with candidates that start alike, through ``inners``)."""
        names = candidate["method"]
        options = {k: v for k, v in candidate.items() if k != "method"}
        if method_class(names[0]).algorithm(options).stacks:
            names = ["none", *names]
        spec = spec_of(names, route_options(names, options), self.likelihood)
        key = json.dumps(spec[0], sort_keys=True, default=str)
        if key not in inners:
            inners[key], _ = base_method(self.model, spec[0])
        return _Part(candidate_label(candidate), spec, stack_on(inners[key], spec, 1), inners[key])

    # ---- fit and choose --------------------------------------------------------------------------------------------
    def fit(self, train_loader: Iterable | None, val_loader: Iterable | None = None, *, progress: bool = True) -> None:
        """Fit every candidate's methods on the training data (a shared inner method once; one DAC feature bank);
        without a ``val_loader`` there is nothing to choose on, and ``auto`` is last-layer ``laplace``."""
        if val_loader is None:
            laplace = [part for part in self._parts if part.label == "laplace"]
            if not laplace:
                raise InputError(
                    "'auto' chooses between its candidates on held-out data, and without one falls back to "
                    "'laplace', which is not among these candidates: call um.fit(train_loader, val_loader)"
                )
            self._parts = laplace
            self.candidate_chains = nn.ModuleList(part.chain for part in laplace)
        fitted: dict[int, float] = {}
        banks: dict[str, Method] = {}
        refused: dict[int, PosthocError] = {}
        for index, part in enumerate(self._parts):
            stage(f"fitting candidate {part.label}", more=2 * len(self._parts) - index - 1)
            for method in chain_of(part.chain):
                if id(method) in refused:
                    break
                if id(method) not in fitted:
                    start = time.perf_counter()
                    try:
                        self._fit_part(method, banks, train_loader, val_loader, progress)
                    except PosthocError as err:  # a default that refuses this model at fit (Laplace, one logit)
                        if self.candidate_option is not None:
                            raise
                        refused[id(method)] = err
                        break
                    fitted[id(method)] = time.perf_counter() - start
                part.fit_seconds += fitted[id(method)]
        self._drop(
            lambda part: any(id(method) in refused for method in chain_of(part.chain)),
            lambda part: str(next(refused[id(m)] for m in chain_of(part.chain) if id(m) in refused)),
        )

    def _fit_part(
        self,
        method: Method,
        banks: dict[str, Method],
        train_loader: Iterable | None,
        val_loader: Iterable | None,
        progress: bool,
    ) -> None:
        """Fit one method of a candidate on the training data; a DAC bank of the same options is shared, not re-read."""
        shared = banks.get(_bank_key(method)) if hasattr(method, "share_bank") else None
        if shared is not None:
            method.share_bank(shared)
        else:
            method.fit(train_loader, val_loader, progress=progress)
            if hasattr(method, "share_bank"):
                banks[_bank_key(method)] = method
        method.fitted.fill_(True)

    def _drop(self, refused: Any, reason: Any) -> None:
        """Leave out the candidates ``refused(part)`` says cannot run here, keeping ``reason(part)`` in :attr:`left_out`
        and saying so once (:func:`_warn_left_out`)."""
        for part in [part for part in self._parts if refused(part)]:
            self.left_out[part.label] = reason(part)
            _warn_left_out(part.label, self.left_out[part.label])
        self._parts = [part for part in self._parts if not refused(part)]
        self.candidate_chains = nn.ModuleList(part.chain for part in self._parts)

    def knob(self) -> Knob:
        """The method, among the candidates' chains (its own ``choose``: every candidate makes its own choices first,
        and is scored out of fold); without a ``val_loader``, the training rows ``laplace`` chooses its prior on."""
        return Knob(
            name="method",
            choose=self._choose,
            training_rows=lambda rows: training_rows(self._parts[0].inner, rows) if len(self._parts) == 1 else None,
        )

    def _choose(self, held_out: HeldOut, train_loader: Iterable | None, progress: bool) -> Selection | None:
        """Make every candidate's own held-out choices and keep the chain the selection step picks (module docs); once
        only the chosen chain is kept, a new choice re-makes that chain's own choices."""
        if not self._parts:
            for method in chain_of(self._chosen()):
                make_choice(method, held_out, train_loader=train_loader, progress=progress)
            return None
        if held_out.from_training_data:  # no validation data: the fall-back laplace makes its own choice (fit)
            (part,) = self._parts
            make_choice(part.inner, held_out, train_loader=train_loader, progress=progress)
            self._keep(part)
            return None
        chosen_inner: dict[int, float] = {}
        scores, refusals = [], {}
        self._plain_seconds = None
        for part in self._parts:
            stage(f"scoring candidate {part.label}")
            start = time.perf_counter()
            try:
                if id(part.inner) not in chosen_inner:
                    make_choice(part.inner, held_out, train_loader=train_loader, progress=progress)
                    chosen_inner[id(part.inner)] = time.perf_counter() - start
                start = time.perf_counter()
                scores.append(self._scores(part, held_out, train_loader, progress))
            except PosthocError as err:  # a default that refuses the held-out data (vector: too few of a class)
                if self.candidate_option is not None:  # as at fit: a candidate the user named is refused loudly
                    raise
                refusals[part.label] = f"refused the held-out data: {err}"
                continue
            seconds = part.fit_seconds + chosen_inner[id(part.inner)] + time.perf_counter() - start
            part.extra = {"fit_seconds": round(seconds, 3), "predict_cost": self._predict_cost(part.chain, held_out)}
        self._drop(lambda part: part.label in refusals, lambda part: refusals[part.label])
        if not self._parts:
            raise InputError(f"no candidate of 'auto' accepts this held-out data: {refusals}")
        selection = held_out.select(
            [(part.label, index) for index, part in enumerate(self._parts)],
            scores,
            knob="method",
            rank_without_shift="clean",
            extra=lambda index: self._parts[index].extra,
        )
        selection.left_out = dict(self.left_out)
        record_selection(self, selection)
        self._keep(self._parts[selection.value])
        return None

    def _scores(self, part: _Part, held_out: HeldOut, train_loader: Iterable | None, progress: bool) -> Scores:
        """The candidate's held-out scores on examples its own choice did not see (module docs)."""
        stackers = chain_of(part.chain)[1:]
        if not stackers:
            if part.inner.name == "none":
                return held_out.plain
            selection = part.inner.last_selection
            if selection is not None and makes_choice(part.inner):
                return out_of_fold(selection, held_out.plain, held_out.layout)
            return held_out.method_scores(part.inner)
        for stacker in stackers[:-1]:  # stacked under another one: chosen on all the held-out data
            make_choice(stacker, held_out, train_loader=train_loader, progress=progress)
        last = stackers[-1]
        if not isinstance(last, FittedOnHeldOut):
            make_choice(last, held_out, train_loader=train_loader, progress=progress)
            return held_out.method_scores(last)
        cache = last.held_out_cache(held_out)
        selection = last.cross_fitted_selection(cache, held_out, last.configurations(cache))
        record_selection(last, selection)
        last.apply(cache, selection.value, held_out)  # fitted on every row: the candidate predicts as it would be kept
        return selection.scores[selection.index]

    def _predict_cost(self, chain: Method, held_out: HeldOut) -> float:
        """The median time of the chain's predictive on :data:`PREDICT_ROWS` held-out rows over a plain forward's.

        The plain forward is timed once per choice. Where the fit's feature store holds the backbone's part of the
        first held-out batch, the chain's predictive is timed on it without the backbone (what it adds to a plain
        forward), scaled to :data:`PREDICT_ROWS` rows, plus the plain forward."""
        whole, _ = next(iter(held_out.clean()))
        x = slice_inputs(whole, 0, PREDICT_ROWS)
        classes = self.likelihood.prediction_type is not RegressionPrediction
        store = active_store()

        def timed(call: Any) -> float:
            times = []
            for _ in range(PREDICT_REPEATS):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        def predict(inputs: Inputs) -> Any:
            return chain.log_predictive(inputs) if classes else chain.regression_predictive(inputs)

        with torch.no_grad(), eval_mode(chain):
            if self._plain_seconds is None:
                self._plain_seconds = timed(lambda: run_model(self.model, x))
            plain = self._plain_seconds
            computed = None if store is None else store.record["rows_computed"]
            if store is not None:
                predict(whole)  # the first call may compute the batch's features once; the timed ones read them
            if store is not None and store.record["rows_computed"] == computed:
                method = plain + timed(lambda: predict(whole)) * batch_size(x) / batch_size(whole)
            else:
                method = timed(lambda: predict(x))
        return round(method / max(plain, 1e-9), 2)

    def _keep(self, part: _Part) -> None:
        """Keep the chosen chain and drop the other candidates."""
        for method in chain_of(part.chain):
            method.fitted.fill_(True)
        self.chosen = part.chain
        self.chosen_spec = record_tensor({"label": part.label, "spec": part.spec}, self.device)
        if self.keep_candidates:
            self.fitted_candidates = {other.label: other.chain for other in self._parts}
            return
        self._parts = []
        self.candidate_chains = nn.ModuleList()

    # ---- predict, card and file ------------------------------------------------------------------------------------
    def to_module(self, export: Any) -> nn.Module:
        """The chosen method's exported predictive."""
        return export.predictive(self._chosen())

    def _chosen(self) -> Method:
        if self.chosen is None:
            raise ConfigError("'auto' has not chosen a method yet: call um.fit(train_loader, val_loader)")
        return self.chosen

    def log_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> LogPredictive:
        return self._chosen().log_predictive(x, num_samples=num_samples, generator=generator)

    def regression_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> RegressionPrediction:
        return self._chosen().regression_predictive(x, num_samples=num_samples, generator=generator)

    @property
    def selection(self) -> dict[str, Any] | None:
        """The record of the method choice; without one (no validation data) the chosen chain's own last choice."""
        own = super().selection
        if own is not None or self.chosen is None:
            return own
        return next((method.selection for method in reversed(chain_of(self.chosen)) if method.selection), None)

    @property
    def chosen_label(self) -> str | None:
        """The chosen candidate, e.g. ``"laplace+dac"`` (``None`` before fit)."""
        found = as_record(self.chosen_spec)
        return None if found is None else found["label"]

    def summary(self) -> dict[str, Any]:
        """The chosen chain: its label, methods and, per method, its own card (what it chose)."""
        if self.chosen is None:
            return {"random_variables": None, "layers": []}
        cards = [
            {"method": method.name, **method.summary(), "selection": method.selection}
            for method in chain_of(self.chosen)
        ]
        return {
            "random_variables": sum(int(card.get("random_variables") or 0) for card in cards),
            "layers": list(dict.fromkeys(layer for card in cards for layer in card.get("layers", []))),
            "chosen": self.chosen_label,
            "chosen_posterior": cards,
            **({"left_out": dict(self.left_out)} if getattr(self, "left_out", None) else {}),
        }

    def posterior_state(self) -> dict[str, Tensor]:
        """Auto's own buffers (the chosen spec, the record) and the chosen chain's posterior under ``chosen.``."""
        state = {name: value for name, value in self._buffers.items() if value is not None}
        if self.chosen is not None:
            state.update({f"chosen.{key}": value for key, value in self.chosen.posterior_state().items()})
        return state

    def load_posterior_state(self, state: dict[str, Tensor]) -> None:
        """Rebuild the chosen chain from its saved spec, then load its posterior into it."""
        record = as_record(state.get("chosen_spec"))
        if record is None:
            raise KeyError("chosen_spec")
        chain = self._chain_of(record["spec"])
        self._parts, self.candidate_chains = [], nn.ModuleList()
        chain.load_posterior_state(
            {key[len("chosen.") :]: value for key, value in state.items() if key.startswith("chosen.")}
        )
        for method in chain_of(chain):
            method.fitted.fill_(True)
        self.chosen = chain
        super().load_posterior_state({key: value for key, value in state.items() if not key.startswith("chosen.")})

    def _chain_of(self, spec: list[dict[str, Any]]) -> Method:
        method, _ = base_method(self.model, spec[0])
        return stack_on(method, spec, 1)

    def extra_repr(self) -> str:
        return f"chosen={self.chosen_label!r}"


def _warn_left_out(label: str, reason: str) -> None:
    """One warning per candidate ``auto`` leaves out: which and why (also in ``um.summary()["selection"]["left_out"]``)."""
    warnings.warn(f"'auto' leaves out the candidate '{label}': {reason}", RuntimeWarning, stacklevel=5)


def _bank_key(method: Method) -> str:
    """What makes two DAC feature banks equal: the options that shape the bank."""
    return json.dumps({key: getattr(method, key, None) for key in ("k", "layers", "bank_bytes", "head")}, default=str)
