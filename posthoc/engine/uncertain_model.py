""":class:`UncertainModel`: a trained classifier with a fitted post-hoc predictive.

It turns a :class:`~posthoc.core.method.Method`'s log-probabilities into a :class:`~posthoc.Prediction`, checks
inputs, streams large batches in chunks under the memory budget (a first chunk of :data:`PROBE_EXAMPLES` rows tells
the size of one example's samples), keeps the user's model in its own train/eval state, and saves the posterior.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from posthoc import settings
from posthoc.core import persistence
from posthoc.core.checks import check_shift, memory_bytes, positive_int
from posthoc.core.checks import generator as check_generator
from posthoc.core.chunks import budget_scope, rows_per_chunk
from posthoc.core.fit_record import FitRecord, counting, examples
from posthoc.core.inputs import (
    Inputs,
    check_attention,
    check_batch,
    check_finite,
    check_fit_loaders,
    check_rows_out,
    slice_inputs,
    to_device,
    unbatched_message,
)
from posthoc.core.likelihood import Likelihood
from posthoc.core.method import Method, chain_of
from posthoc.core.model_card import ModelCard
from posthoc.core.modules import eval_mode
from posthoc.core.prediction import Prediction, RegressionPrediction, concat
from posthoc.core.progress import stage, stages
from posthoc.engine.choice import make_choice, makes_choice, training_rows
from posthoc.engine.feature_store import open_store
from posthoc.engine.head import find_head
from posthoc.engine.held_out import HeldOut
from posthoc.engine.runner import RunOptions, small_dense_work
from posthoc.engine.selection import Tolerance, warn_kept_plain
from posthoc.errors import (
    ConfigError,
    HeadNotFoundError,
    InputError,
    NotFittedError,
    NumericalError,
    PosteriorFileError,
)
from posthoc.export.build import to_module

#: examples in the first chunk of ``predict``, which tells the size ``(S, C)`` of an example's samples
PROBE_EXAMPLES = 8
#: float32 copies of an example's ``(S, C)`` samples that ``predict`` holds at once (the method works beside one)
SAMPLE_COPIES = 2


def sample_row_bytes(part: Prediction) -> int:
    """Bytes of one float32 copy of one example's samples in ``part`` (0 for a deterministic predictive).

    Example:
        >>> import torch
        >>> from posthoc.core.prediction import Prediction
        >>> from posthoc.engine.uncertain_model import sample_row_bytes
        >>> sample_row_bytes(Prediction.from_probs(torch.full((3, 4), 0.25), torch.full((10, 3, 4), 0.25)))
        160
    """
    return 0 if part.samples is None else 4 * part.samples.shape[0] * part.num_classes


class UncertainModel(nn.Module):
    """An already trained classifier with a post-hoc predictive; built by :func:`posthoc.wrap`.

    Example:
        >>> import posthoc
        >>> from posthoc_apps.demo.examples import model, train_loader, x
        >>> um = posthoc.wrap(model, method="laplace").fit(train_loader)
        >>> pred = um.predict(x)
        >>> pred.epistemic.shape
        torch.Size([8])
    """

    def __init__(self, method: Method, spec: list[dict[str, Any]], fingerprint: str | None = None) -> None:
        super().__init__()
        self.method = method
        self.spec = spec
        #: fingerprint of the user's checkpoint the posterior belongs to (posthoc.core.persistence)
        self.fingerprint = fingerprint
        #: the data and cost of the last fit (saved with the posterior; ``None`` before fit)
        self.fit_record: FitRecord | None = None
        #: how the runner runs this model (``wrap(..., max_memory=...)``)
        self.run = RunOptions.from_spec(spec)

    @property
    def methods(self) -> list[str]:
        """The method names, inner first, e.g. ``["laplace", "temperature"]``."""
        return [entry["name"] for entry in self.spec]

    @property
    def likelihood(self) -> Likelihood:
        """The likelihood the predictive is over (``likelihood=`` of :func:`posthoc.wrap`)."""
        return self.method.likelihood

    @property
    def is_fitted(self) -> bool:
        return bool(self.method.fitted)

    @property
    def device(self) -> torch.device:
        """The device the model (and so the predictive) runs on."""
        return self.method.device

    def fit(
        self,
        train_loader: Iterable | None = None,
        val_loader: Iterable | None = None,
        *,
        progress: bool = True,
        shift: Any = "auto",
        tolerance: Tolerance | float | None = None,
        **fit_options: Any,
    ) -> UncertainModel:
        """Fit every method (inner first), make their held-out choices, and return ``self``.

        ``fit_options`` go to the method whose ``fit`` accepts them (e.g. SWAG's ``epochs``).

        Every held-out choice is made on ``val_loader`` by one rule (:mod:`posthoc.engine.selection`): the candidates
        whose bound on the NLL excess over the plain model is within ``tolerance`` are admissible, and of those the
        lowest NLL on perturbed copies wins. ``tolerance``: ``None`` is ``max(2 % of the plain model's held-out NLL,
        0.005 nats)``; a number is nats per example; or a :class:`~posthoc.Tolerance`. ``shift``: ``"auto"`` perturbs
        the validation batches with the kinds that suit the inputs (:mod:`posthoc.engine.held_out`); ``None`` uses the
        clean batches only; or a list of kind names (``"noise"``, ``"blur"``, ``"impulse"``, ``"token-replace"``,
        ``"feature-noise"``) and callables ``f(x, generator) -> x``.

        Example:
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import model, train_loader, val_loader
            >>> um = posthoc.wrap(model, method=["laplace", "temperature"]).fit(train_loader, val_loader)
            >>> um.summary()["selection"]["chosen"]      # temperature's choice on val_loader
            'clean fit at 0.75'
        """
        check_fit_loaders(train_loader, val_loader)
        _check_fit_options(self.method, fit_options)
        check_shift(shift)
        tolerance = Tolerance.of(tolerance)
        with self.run.scope(), stages("fit", progress=progress):
            self._fit_chain(train_loader, val_loader, progress, shift, tolerance, fit_options)
        return self

    def _fit_chain(
        self,
        train_loader: Iterable | None,
        val_loader: Iterable | None,
        progress: bool,
        shift: Any,
        tolerance: Tolerance,
        fit_options: dict[str, Any],
    ) -> None:
        """Each method's ``fit`` (inner first), then its choice on the held-out data read once, before any fit."""
        wall, cpu = time.perf_counter(), time.process_time()
        self.method.follow_model_device()
        if not self.method.works_on_copy:
            self.fingerprint = persistence.fingerprint(self.method.base_model)
        train_loader, val_loader = counting(train_loader), counting(val_loader)
        model = self.method.base_model
        store = open_store(model, _head_of(model), self.method.modules(), [val_loader, train_loader])
        with store.scope():
            self._fit_methods(train_loader, val_loader, progress, shift, tolerance, fit_options)
        self.fit_record = FitRecord(
            examples(train_loader),
            examples(val_loader),
            time.perf_counter() - wall,
            time.process_time() - cpu,
            features=store.summary(),
        )
        self._changed()

    def _fit_methods(
        self,
        train_loader: Iterable | None,
        val_loader: Iterable | None,
        progress: bool,
        shift: Any,
        tolerance: Tolerance,
        fit_options: dict[str, Any],
    ) -> None:
        chain = chain_of(self.method)
        held_out = None
        if val_loader is not None and any(makes_choice(method) for method in chain):
            # read before any fit: the plain model is the checkpoint as it was given
            stage("reading the held-out data", more=len(chain))
            held_out = self._read(val_loader, self.method.base_model, shift, tolerance, progress)
        for method in chain:
            stage(f"fitting {method.name}")
            _fit_one(method, train_loader, val_loader, progress, fit_options)
            if makes_choice(method):
                chosen_on = (
                    held_out
                    if val_loader is not None
                    else self._training_rows(method, train_loader, shift, tolerance, progress)
                )
                if chosen_on is not None:
                    make_choice(method, chosen_on, train_loader=train_loader, progress=progress)
                    _say_if_kept_plain(method, chosen_on)
            if method.requires_fit:
                method.fitted.fill_(True)

    def _changed(self) -> None:
        """Forget the predict path's cached module list and device: a fit or a choice may have built modules anew."""
        self.__dict__.pop("_served_modules", None)
        self.method.__dict__.pop("_followed", None)

    def _served(self) -> list[nn.Module]:
        """The method's modules, listed once (walking the tree costs more than a small model's forward pass)."""
        if "_served_modules" not in self.__dict__:
            self.__dict__["_served_modules"] = list(self.method.modules())
        return self.__dict__["_served_modules"]

    def _training_rows(
        self, method: Method, train_loader: Iterable | None, shift: Any, tolerance: Tolerance, progress: bool
    ) -> HeldOut | None:
        """The held-out data a method chooses on without a ``val_loader`` (its knob's ``training_rows``)."""
        rows = training_rows(method, train_loader)
        if rows is None:
            return None
        return self._read(rows, _plain_on(method, self.device), shift, tolerance, progress, from_training_data=True)

    def _read(self, loader: Iterable, model: nn.Module, shift: Any, tolerance: Any, progress: bool, **kw) -> HeldOut:
        """:meth:`HeldOut.read` of ``loader`` against the plain ``model``, at this model's likelihood and device."""
        return HeldOut.read(
            loader,
            model=model,
            likelihood=self.likelihood,
            shift=shift,
            tolerance=tolerance,
            device=self.device,
            progress=progress,
            **kw,
        )

    def choose(
        self,
        val_loader: Iterable | HeldOut,
        *,
        train_loader: Iterable | None = None,
        shift: Any = "auto",
        tolerance: Tolerance | float | None = None,
        progress: bool = True,
    ) -> UncertainModel:
        """Make every held-out choice again on ``val_loader``, keeping what :meth:`fit` learnt from the training data.

        The curvature, fine-tuned weights and feature banks stay; the knobs, calibrators and ``"auto"``'s method are
        chosen anew. ``train_loader`` is needed only by SWAG over layers with BatchNorm. ``val_loader`` may also be a
        :class:`~posthoc.engine.held_out.HeldOut` read on this model's checkpoint.

        Example:
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import model, train_loader, val_loader, test_loader
            >>> um = posthoc.wrap(model, method="laplace").fit(train_loader, val_loader)
            >>> um.choose(test_loader, tolerance=0.01).summary()["selection"]["tolerance"]   # new held-out data
            0.01
        """
        if self.method.requires_fit and not self.is_fitted:
            raise NotFittedError("um.choose re-makes the held-out choices of a fitted model: call um.fit first")
        check_shift(shift)
        if val_loader is None:
            raise InputError("um.choose needs labelled held-out batches: um.choose(val_loader)")
        if isinstance(val_loader, HeldOut):  # read already (the plain model must be this one's checkpoint)
            held_out = val_loader
        else:
            tolerance = Tolerance.of(tolerance)
            held_out = self._read(val_loader, _plain_on(self.method, self.device), shift, tolerance, progress)
        with self.run.scope():
            for method in chain_of(self.method):
                if makes_choice(method):
                    make_choice(method, held_out, train_loader=train_loader, progress=progress)
                    _say_if_kept_plain(method, held_out)
        self._changed()
        return self

    @torch.no_grad()
    def predict(
        self,
        x: Inputs,
        *,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
        chunk_size: int | None = None,
        keep_samples: bool = True,
        max_memory: int | None = None,
    ) -> Prediction | RegressionPrediction:
        """The predictive distribution for a batch ``x`` (on any device), computed in chunks of examples: a
        :class:`~posthoc.Prediction` over classes, or under ``likelihood="regression"`` a
        :class:`~posthoc.RegressionPrediction`.

        Args:
            num_samples: overrides the method's number of samples, where it samples.
            chunk_size: at most this many examples per chunk (default ``posthoc.settings.chunk_size``; smaller when
                the chunk's samples would exceed the memory budget).
            keep_samples: ``False`` drops the ``(S, N, C)`` samples after each chunk (the aleatoric / epistemic
                split is kept), so huge ``N`` streams in bounded memory.
            max_memory: bytes the per-sample tensors of one chunk may use (default: the wrap's ``max_memory``, else
                ``posthoc.settings.max_memory``).

        Example:
            >>> import torch
            >>> from posthoc_apps.demo.examples import um
            >>> pred = um.predict(torch.randn(5000, 4), keep_samples=False)   # streams 1,024 examples at a time
            >>> pred.probs.shape, pred.samples is None
            (torch.Size([5000, 3]), True)
        """
        if self.method.requires_fit and not self.is_fitted:
            raise NotFittedError(
                f"method '{'+'.join(self.methods)}' must be fitted before predicting: call "
                "um.fit(train_loader, val_loader) first"
            )
        positive_int(num_samples, "num_samples", none="the method's own")
        check_generator(generator)
        chunk_size = positive_int(settings.chunk_size if chunk_size is None else chunk_size, "chunk_size")
        budget = settings.memory_budget(memory_bytes(max_memory) or self.run.max_memory)
        total = check_batch(x, "um.predict", values=False)
        device = self.method.follow_model_device()  # read once per call: each chunk goes there
        options = {"num_samples": num_samples, "generator": generator}
        try:
            if self.likelihood.prediction_type is RegressionPrediction:
                with budget_scope(budget):
                    return self._predict_regression(x, total, chunk_size, keep_samples, device, options)
            with budget_scope(max(1, budget - budget // SAMPLE_COPIES)):
                return self._predict_classes(x, total, chunk_size, keep_samples, budget, device, options)
        except InputError as err:
            unbatched = unbatched_message(x, "um.predict")
            if unbatched is None:
                raise
            raise InputError(f"{unbatched} ({err})") from err

    def _predict_classes(
        self,
        x: Inputs,
        total: int,
        chunk_size: int,
        keep_samples: bool,
        budget: int,
        device: torch.device,
        options: dict[str, Any],
    ) -> Prediction:
        """The class predictive in chunks: a first small one tells the samples' size, the rest fit ``budget``."""
        first_size = min(total, chunk_size, PROBE_EXAMPLES)
        first = self._predict_chunk(slice_inputs(x, 0, first_size), device, options)
        if total == first_size:
            return first if keep_samples else dataclasses.replace(first, samples=None)
        step = rows_per_chunk(SAMPLE_COPIES * sample_row_bytes(first), max_memory=budget, limit=chunk_size)
        out = Prediction.empty_like(first, total, keep_samples)
        out.write(0, first)
        del first  # its samples would stay alive beside every later chunk's
        for start in range(first_size, total, step):
            part = slice_inputs(x, start, start + step)
            probs = out.probs[start : min(total, start + step)]  # written in place: no (N, C) copy per chunk
            out.write(start, self._predict_chunk(part, device, options, probs))
        return out

    def _predict_regression(
        self, x: Inputs, total: int, chunk_size: int, keep_samples: bool, device: torch.device, options: dict[str, Any]
    ) -> RegressionPrediction:
        """The regression predictive in chunks of ``chunk_size`` rows (no probe: a row holds only ``K x D`` components)."""
        parts = []
        for start in range(0, total, chunk_size):
            part = to_device(slice_inputs(x, start, start + chunk_size), device)
            check_finite(part)
            with eval_mode(self.method, self._served()):
                prediction = self.method.regression_predictive(part, **options)
            check_rows_out(prediction.mean, part, "um.predict")
            if torch.isnan(prediction.variance).any() or torch.isnan(prediction.mean).any():
                raise NumericalError(
                    "the predictive produced NaN; the model's outputs are not finite for these inputs "
                    "(check its weights and dtype, e.g. float16 overflow)"
                )
            parts.append(prediction)
        return concat(parts, keep_samples)

    def _predict_chunk(
        self, x: Inputs, device: torch.device, options: dict[str, Any], probs: Tensor | None = None
    ) -> Prediction:
        """One chunk's prediction on ``device``; ``options`` go to ``log_predictive`` (its samples and generator);
        ``probs``: where its probabilities go."""
        x = to_device(x, device)
        check_finite(x)
        check_attention(x)
        with eval_mode(self.method, self._served()):
            log_probs, samples = self.method.log_predictive(x, **options)
        check_rows_out(log_probs, x, "um.predict")
        elements = log_probs.numel() + (0 if samples is None else samples.numel())
        with small_dense_work(elements, log_probs.device):
            # normalised in float32 as they are exponentiated: methods may return log-probabilities whose
            # exp sums to 1 only up to their own rounding (huge logits lose ~1e-3 in a float32 log_softmax)
            log_probs = log_probs.float()
            samples = None if samples is None else samples.float().exp()
            prediction = Prediction.from_probs(torch.softmax(log_probs, dim=-1, out=probs), samples, log_probs)
            # a NaN log-probability makes its row's largest probability NaN: a scan of (N,), not of (N, C)
            if torch.isnan(prediction.confidence).any() or (samples is not None and torch.isnan(samples).any()):
                raise NumericalError(
                    "the predictive produced NaN; the model's logits are not finite for these inputs "
                    "(check its weights and dtype, e.g. float16 overflow)"
                )
            return prediction

    def __getattr__(self, name: str) -> Any:
        """A method's :attr:`~posthoc.core.method.Method.tools` (e.g. sparse-vd's ``um.prune()``), found in the chain."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            method = self._modules.get("method")
            for member in [] if method is None else chain_of(method):
                if name in member.tools:
                    return member.tool(name)
            raise

    def forward(self, x: Inputs) -> Tensor:
        """Predictive probabilities ``(N, C)`` (under a regression likelihood, the predictive mean ``(N, D)``)."""
        return self.likelihood.point(self.predict(x))

    def to_module(self, *, num_samples: int | None = None, seed: int = 0) -> nn.Module:
        """The fitted predictive as a self-contained ``nn.Module`` of plain torch ops, for serving without posthoc.

        ``module(x)`` gives the predictive probabilities ``(N, C)`` (float32), as ``um.predict(x).probs``; under a
        regression likelihood ``(mean, variance)``. ``torch.export``, ``torch.onnx.export`` and ``torch.compile`` take
        it. A sampling method exports ``num_samples`` fixed samples drawn once from ``seed``; a method whose samples are
        whole networks is refused with :class:`~posthoc.ExportError`. What exports, and how: docs/serving-export.md.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> import posthoc
            >>> um = posthoc.wrap(nn.Sequential(nn.Linear(4, 3)), method="none")
            >>> x = torch.randn(5, 4)
            >>> program = torch.export.export(um.to_module(), (x,))
            >>> torch.allclose(program.module()(x), um.predict(x).probs, atol=1e-6)
            True
        """
        positive_int(num_samples, "num_samples", none="the method's own")
        return to_module(self, num_samples=num_samples, seed=seed)

    def summary(self) -> ModelCard:
        """The model card: what the posterior is over, how it was fitted, and on which model.

        A dict (:class:`~posthoc.core.model_card.ModelCard`) with ``to_markdown()``; each method in the chain (inner
        first) adds its :meth:`Method.summary` once fitted.

        Example:
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import model
            >>> card = posthoc.wrap(model, method="none").summary()
            >>> card["random_variables"], card["fitted"]
            (0, True)
        """
        posterior = []
        for entry, method in zip(self.spec, chain_of(self.method)[-len(self.spec) :]):
            fitted = bool(method.fitted)
            posterior.append(
                {
                    "method": entry["name"],
                    "options": dict(entry["options"]),
                    "fitted": fitted,
                    **(method.summary() if fitted else {"random_variables": None}),
                    **(method.likelihood.summary() if fitted else {}),
                    "selection": method.selection if fitted else None,
                }
            )
        fingerprint = self.fingerprint or persistence.fingerprint(self.method.base_model)
        return ModelCard.of(
            posterior,
            self.fit_record,
            model_class=type(self.method.base_model).__qualname__,
            fingerprint=fingerprint,
            version=version(),
        )

    def save(self, path: str, *, dense: dict[str, Any] | None = None) -> None:
        """Write the fitted posterior (not the base weights) atomically to ``path``, with the fingerprint of the weights
        it was fitted on, so that :func:`posthoc.load` can refuse any other model (``dense``: a dense model's layout,
        passed by :meth:`posthoc.engine.dense.DenseModel.save`)."""
        if not self.is_fitted:
            raise NotFittedError("nothing to save: fit the model first (um.fit(...))")
        unsaveable = persistence.unsaveable_options(self.spec)
        if unsaveable:
            name, key, value = unsaveable[0]
            raise ConfigError(
                f"cannot save: option {key}={value!r} of '{name}' holds what a posterior file cannot keep "
                "(a callable or an object: a file keeps options as numbers, strings and lists of them, "
                "so that posthoc.load can rebuild the method); wrap with options a file can keep "
                f"(for '{name}': posthoc.available_methods()['{name}'] and its docs page), fit, and save"
            )
        if self.method.works_on_copy:
            current = self.fingerprint  # the user's checkpoint when it was copied; the copy's weights are saved
        else:
            current = persistence.fingerprint(self.method.base_model)
            if self.fingerprint is not None and current != self.fingerprint:  # None: needs no fit and had none
                raise PosteriorFileError(
                    "the wrapped model's weights changed after fit; the posterior no longer matches them. "
                    "Fit again before saving"
                )
        # the copy keeps the user's class name
        persistence.write(
            path,
            self.spec,
            current,
            type(self.method.base_model).__qualname__,
            self.method.posterior_state(),
            fit=None if self.fit_record is None else self.fit_record.to_dict(),
            dense=dense,
        )

    def extra_repr(self) -> str:
        return f"methods={self.methods}, fitted={self.is_fitted}"

    def __repr__(self) -> str:
        """One line: the method, what it chose, what it was fitted on and what the fit cost; not the network (``um.method``
        prints the modules).

        Example:
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import model, val_loader
            >>> posthoc.wrap(model, method="temperature")
            UncertainModel('temperature' on a Sequential, not fitted)
        """
        parts = [f"{'+'.join(self.methods)!r} on a {type(self.method.base_model).__qualname__}"]
        if not self.is_fitted:
            return f"UncertainModel({parts[0]}, not fitted)"
        selection = self.summary().get("selection") if self.method.requires_fit else None
        if selection:
            parts.append(f"chose {selection['knob']} {selection['chosen']!r}")
        record = self.fit_record
        if record is not None:
            seen = [
                f"{count} {what}"
                for count, what in ((record.train_examples, "training"), (record.val_examples, "held-out"))
                if count
            ]
            parts.append(f"fitted on {' and '.join(seen) or 'no counted'} examples in {record.wall_seconds:.1f} s")
        return f"UncertainModel({', '.join(parts)})"


def check_wrapped(um: Any, what: str) -> UncertainModel:
    """``um`` if it is a wrapped model (a dense one included); otherwise an :class:`InputError` for ``what`` that
    says how to get one.

    Example:
        >>> import torch
        >>> from posthoc.engine.uncertain_model import check_wrapped
        >>> check_wrapped(torch.nn.Linear(2, 2), "evaluate")
        Traceback (most recent call last):
        posthoc.errors.InputError: evaluate takes a wrapped model, got a Linear...
    """
    if isinstance(um, UncertainModel) or getattr(um, "dense_outputs", False):  # a dense model wraps one
        return um
    if isinstance(um, nn.Module):
        hint = "wrap it first: posthoc.wrap(model, method=...).fit(train_loader, val_loader)"
    elif isinstance(um, (Prediction, RegressionPrediction)):
        hint = "pass the wrapped model that made the prediction (um), which is run over the data"
    else:
        hint = "pass posthoc.wrap(model, method=...) fitted with .fit(...), then the data"
    raise InputError(f"{what} takes a wrapped model, got a {type(um).__name__}; {hint}")


def _check_fit_options(method: Method, fit_options: dict[str, Any]) -> None:
    accepted: dict[str, Any] = {}
    current: Method | None = method
    while current is not None:
        accepted.update(current.fit_option_defaults())
        current = getattr(current, "inner", None) if current.stacks else None
    unknown = sorted(set(fit_options) - set(accepted))
    if unknown:
        valid = ", ".join(f"{k}={v!r}" for k, v in sorted(accepted.items())) or "none"
        raise ConfigError(f"unknown fit option(s) {unknown}; valid fit options here: {valid}")


def version() -> str:
    """This posthoc's installed version (``"unknown (not installed)"`` for a checkout that is not installed)."""
    try:
        return importlib.metadata.version("posthoc")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _plain_on(method: Method, device: torch.device) -> nn.Module:
    """The user's checkpoint behind ``method`` (:attr:`Method.plain_model`) on ``device`` (a copy if it lives elsewhere)."""
    model = method.plain_model
    where = next((p.device for p in model.parameters()), device)
    return model if where == device else copy.deepcopy(model).to(device)


def _fit_one(
    method: Method,
    train_loader: Iterable | None,
    val_loader: Iterable | None,
    progress: bool,
    fit_options: dict[str, Any],
) -> None:
    """Fit one method of a chain on the training data (its inner ones are fitted already)."""
    own = {k: v for k, v in fit_options.items() if k in method.fit_option_defaults()}
    if method.requires_fit:
        if method.needs_val and val_loader is None:
            raise InputError(
                f"'{method.name}' is fitted on held-out data: call um.fit(train_loader, val_loader) "
                "with a validation loader that was not used for training"
            )
        if not method.needs_val and train_loader is None:
            raise InputError(f"'{method.name}' needs a training loader: call um.fit(train_loader)")
    options = {"options": method.make_fit_options(own)} if method.fit_option_defaults() else {}
    # a method that needs no fit may still use the data
    method.fit(train_loader, val_loader, progress=progress, **options)


def _head_of(model: nn.Module) -> nn.Module | None:
    """``model``'s ``nn.Linear`` head where it can be found without an input (the feature store keeps its input)."""
    try:
        _, head = find_head(model)
    except (HeadNotFoundError, RuntimeError):  # RuntimeError: a ScriptModule refuses get_submodule
        return None
    return head if isinstance(head, nn.Linear) else None


def _say_if_kept_plain(method: Method, held_out: HeldOut) -> None:
    """:func:`~posthoc.engine.selection.warn_kept_plain`, except for a choice made on training rows."""
    if method.last_selection is not None and not held_out.from_training_data:
        warn_kept_plain(method.last_selection, method=method.name, stacklevel=5)
