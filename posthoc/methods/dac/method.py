"""``"dac"``: density-aware calibration, a per-example temperature (a regressor's variance) that grows off the data.

Tomani, Buettner and Cremers (ICML 2023, "Beyond in-domain scenarios: robust density-aware calibration"): a
calibrator tuned on clean held-out data is confident wherever the model is, even far from anything it was trained
on. DAC gives each example its own temperature from how far its features lie from the training features, so that
confidence falls off the data and stays where the data is. It stacks on any method (``["laplace", "dac"]`` tempers
each of Laplace's samples); the mathematics, the feature bank's size and the options: docs/methods/dac.md.

The features are read at the head's input and the ends of the last two stages before it (:mod:`.layers`) by hooks
in the inner method's own forward pass; the distance is to the ``k``-th nearest row of a bank of training features.
The temperature ``T(x) = T0 (1 + sum_l w_l relu((log d_l(x) - a_l) / s_l))`` (:mod:`.temperature`; a regressor's
variance factor: :mod:`.variance`) is chosen by the selection step (:mod:`posthoc.engine.selection`) among the inner
predictive as it is, ``T0`` alone, and, for every anchor, the weights fitted with ``T0 = 1`` and shrunk by each
factor of :data:`SHRINKS`, each cross-fitted on the held-out examples. With ``T0 = 1`` every example nearer than the
anchor keeps the inner predictive exactly, so the in-distribution cost falls on the far tail only.

On dense outputs (``posthoc.wrap(model, method="dac", dense=True)``) every kept position is an example: its feature is
the per-position head's input (:mod:`posthoc.engine.dense_head`), intermediate maps are not read (pooled, they give one
row per input), and the bank is a uniform random subset of at most ``bank_positions`` training positions.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, train_loader, val_loader, regressor, reg_train_loader
    >>> from posthoc_apps.demo.examples import reg_val_loader, reg_x
    >>> um = posthoc.wrap(model, method=["laplace", "dac"]).fit(train_loader, val_loader)
    >>> card = um.summary()["posterior"][1]
    >>> card["layers"], card["bank_bytes"]
    (['3:input'], 65536)
    >>> reg = posthoc.wrap(regressor, method=["none", "dac"], likelihood="regression")
    >>> reg = reg.fit(reg_train_loader, reg_val_loader)
    >>> bool((reg.predict(reg_x).std >= reg.method.inner.regression_predictive(reg_x).std * (1 - 1e-6)).all())
    True
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.checks import memory_bytes, positive_int, positive_number, probability, unit_interval
from posthoc.core.inputs import KEEP, Inputs, check_finite_result, check_labels, iterate, label_rows
from posthoc.core.likelihood import Categorical, Gaussian, HeteroscedasticGaussian, real_targets
from posthoc.core.logits import log_mean_exp
from posthoc.core.method import LogPredictive, Method, predictive_of
from posthoc.core.modules import eval_mode, get_submodule
from posthoc.core.options import option
from posthoc.core.prediction import RegressionPrediction
from posthoc.core.registry import register
from posthoc.engine.feature_bank import Reservoir, kth_distance, normalised, rows_within
from posthoc.engine.feature_store import Tap
from posthoc.engine.fitted_stage import FittedOnHeldOut
from posthoc.engine.held_out import HeldOut
from posthoc.engine.runner import examples_over_ranks, gather_rows
from posthoc.engine.selection import Rows, Scores
from posthoc.errors import ConfigError, HeadNotFoundError, InputError, NotFittedError
from posthoc.methods.dac.export import DensityTemperature
from posthoc.methods.dac.layers import Capture, Site, auto_sites, named_sites, position_sites
from posthoc.methods.dac.temperature import (
    MIN_DISTANCE,
    Cached,
    Fitted,
    excess,
    fit,
    standardisation,
    temperatures,
    tempered,
)
from posthoc.methods.dac.variance import Spread, inflated

#: the default feature-bank budget
BANK_BYTES = 64 * 2**20
#: on dense outputs, the training positions the bank holds at most: every position of an input is a query, so the
#: distances cost (positions queried) x (bank rows); a uniform random subset of the training positions
BANK_POSITIONS = 16384
#: intermediate layers found automatically (besides the head's input)
AUTO_LAYERS = 2
#: the anchors (quantiles of the clean held-out log-distances) tried with ``anchor="auto"``
ANCHORS = (0.8, 0.9, 0.95)
#: how much the perturbed copies' NLL counts beside the clean one when the weights are fitted
STRENGTH = 1.0
#: the factors the fitted weights are shrunk by, tried with ``shrink="auto"`` (1: the weights as fitted)
SHRINKS = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)


def _check_layers(model: nn.Module, layers: Any) -> list[str] | None:
    if layers is None:
        return None
    if not isinstance(layers, (list, tuple)) or not all(isinstance(n, str) and n for n in layers):
        raise ConfigError(f"layers must be None (found automatically) or a list of module names, got {layers!r}")
    for name in layers:
        try:
            get_submodule(model, Site.parse(name).name)
        except HeadNotFoundError as err:
            raise ConfigError(f"layers: {err}") from None
    return list(layers)


def _shrunk(fitted: tuple[Tensor, Tensor, Fitted], shrink: float) -> tuple[Tensor, Tensor, Fitted]:
    """The fit with its weights multiplied by ``shrink``."""
    anchors, spreads, values = fitted
    return anchors, spreads, Fitted(values.temperature, [shrink * w for w in values.weights])


@dataclass
class _Cache:
    """DAC's held-out inputs: the inner predictions, log-distances and labels of the clean examples and of their
    perturbed copies (``None`` without them); a regressor's are :class:`~posthoc.methods.dac.variance.Spread`."""

    clean: Cached | Spread
    shifted: Cached | Spread | None

    def take(self, rows: Rows, anchors: Tensor, spreads: Tensor) -> tuple[Cached | Spread, Cached | Spread | None]:
        """The clean ``rows`` and their perturbed copies, their log-distances standardised by ``anchors`` and ``spreads``."""

        def part(cached: Cached | Spread, index: Tensor) -> Cached | Spread:
            if isinstance(cached, Spread):
                picked = cached.rows(index)
                picked.excess = excess(picked.excess, anchors, spreads)
                return picked
            dim = 0 if cached.log_probs.dim() == 2 else 1
            index = index.to(cached.labels.device)
            return Cached(
                cached.log_probs.index_select(dim, index),
                excess(cached.excess[index], anchors, spreads),
                cached.labels[index],
            )

        clean = part(self.clean, rows.clean)
        shifted = None if self.shifted is None or rows.shifted is None else part(self.shifted, rows.shifted)
        return clean, shifted

    def scores(self, fitted: tuple[Tensor, Tensor, Fitted] | None, rows: Rows) -> Scores:
        """The scores on ``rows`` of the tempered inner predictive (``None``: the inner predictive as it is)."""
        anchors = spreads = None
        if fitted is not None:
            anchors, spreads, values = fitted

        def factors(cached: Spread) -> Tensor:
            if fitted is None:
                return torch.ones(cached.excess.shape[0], dtype=torch.float64, device=cached.excess.device)
            return temperatures(
                cached.excess.double(),
                values.temperature,
                torch.tensor(values.weights, dtype=torch.float64, device=cached.excess.device),
            )

        def log_probs(cached: Cached) -> Tensor:
            if fitted is None:
                return log_mean_exp(cached.log_probs) if cached.log_probs.dim() == 3 else cached.log_probs
            t = temperatures(
                cached.excess,
                values.temperature,
                torch.tensor(values.weights, dtype=cached.excess.dtype, device=cached.excess.device),
            )
            return tempered(cached.log_probs, t)[0]

        zero = torch.zeros(self.clean.excess.shape[1], device=self.clean.excess.device)
        clean, shifted = self.take(
            rows, zero if anchors is None else anchors, torch.ones_like(zero) if spreads is None else spreads
        )
        if isinstance(clean, Spread):
            clean = clean.double()
            return Scores(
                clean.nlls(factors(clean)), None if shifted is None else shifted.double().nlls(factors(shifted))
            )
        if shifted is None:
            return Scores.of_log_probs(log_probs(clean), clean.labels)
        return Scores.of_log_probs(log_probs(clean), clean.labels, log_probs(shifted), shifted.labels)


@register
class DensityAwareCalibration(FittedOnHeldOut, Method):
    """A per-example temperature from k-NN feature distances at several layers (Tomani et al., 2023); stacks on any
    method. Under a regression likelihood the same factor multiplies the inner predictive's variance."""

    name = "dac"
    needs_val = True
    stacks = True
    knob_name = "density-aware temperature"
    likelihoods = (Categorical, Gaussian, HeteroscedasticGaussian)
    exports = ("classification",)

    @dataclass(frozen=True, kw_only=True)
    class Options(Method.Options):
        k: int = option(10, "which nearest training feature measures the distance")
        layers: list[str] | None = option(
            None, "module names read besides the head's input (None: two found); 'name:input' reads a module's input"
        )
        bank_bytes: int = option(BANK_BYTES, "bytes of the feature bank (a uniform random subset of the training set)")
        bank_positions: int = option(
            BANK_POSITIONS, "dense outputs: training positions in the bank at most (within bank_bytes too)"
        )
        anchor: float | str = option("auto", "the clean distance quantile up to which T stays T0 (auto: among ANCHORS)")
        shrink: float | str = option("auto", "the factor the fitted weights are multiplied by (auto: among SHRINKS)")
        strength: float = option(STRENGTH, "how much the perturbed copies' NLL counts beside the clean one")
        head: str | None = option(None, "the classifier head's module name (default: found)")
        max_iter: int = option(100, "L-BFGS iterations of each fit")

    def __init__(self, inner: Method, options: Options) -> None:
        anchor, shrink, head = options.anchor, options.shrink, options.head
        super().__init__(inner.base_model)
        self.inner = inner
        self.likelihood = inner.likelihood  # a regressor's: the variance is inflated instead of a temperature
        if self.regression:
            self.knob_name = "density-aware variance"
        self.k = positive_int(options.k, "k")
        self.layers = _check_layers(inner.base_model, options.layers)
        self.bank_bytes = memory_bytes(options.bank_bytes, "bank_bytes")
        if self.bank_bytes is None:
            raise ConfigError(f"bank_bytes must be a positive number of bytes, e.g. {BANK_BYTES} (64 MiB), got None")
        self.bank_positions = positive_int(options.bank_positions, "bank_positions")
        self.anchor = anchor if anchor == "auto" else probability(anchor, "anchor")
        self.shrink = shrink if shrink == "auto" else unit_interval(shrink, "shrink")
        self.strength = positive_number(options.strength, "strength")
        if head is not None and not isinstance(head, str):
            raise ConfigError(f"head must be a module name, got {type(head).__name__}")
        self.head = head
        self.max_iter = positive_int(options.max_iter, "max_iter")
        for name in ("bank", "widths", "anchors", "spreads", "weights", "meta"):
            self.register_buffer(name, None)
        self.register_buffer("temperature", torch.ones(()))
        self._capture: tuple[Tensor, Capture] | None = None
        self._planned_sites: list[Site] | None = None
        self._width_list: tuple[Tensor, list[int]] | None = None

    @property
    def base_model(self) -> nn.Module:
        return self.inner.base_model

    @property
    def regression(self) -> bool:
        """Whether the inner predictive is over real targets (then DAC inflates its variance: module docs)."""
        return self.likelihood.prediction_type is RegressionPrediction

    def _meta(self) -> dict[str, Any]:
        return {} if self.meta is None else json.loads(bytes(self.meta.cpu().tolist()).decode())

    def _set_meta(self, meta: dict[str, Any]) -> None:
        self.meta = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8, device=self.device)

    def sites(self) -> list[Site]:
        """The layers read, once fitted (``str(site)``: ``"features.3"``, ``"classifier.4:input"``)."""
        return [Site.parse(text) for text in self._meta().get("sites", [])]

    def _capturer(self) -> Capture:
        if self._capture is None or self._capture[0] is not self.meta:
            self._capture = (self.meta, Capture(self.base_model, self.sites()))
        return self._capture[1]

    def _widths(self) -> list[int]:
        """The layers' feature widths as Python ints (read from the buffer once per fit or load)."""
        if self._width_list is None or self._width_list[0] is not self.widths:
            self._width_list = (self.widths, [int(w) for w in self.widths.tolist()])
        return self._width_list[1]

    def _resolve(self, x: Inputs) -> list[Site]:
        if (
            isinstance(x, Mapping) and KEEP in x
        ):  # dense outputs: one row per kept position, the head's input its feature
            if self.layers is not None:
                raise ConfigError(
                    "dac on dense outputs reads the per-position head's input only (an intermediate feature map "
                    "gives no feature per position); drop layers="
                )
            return position_sites(self.base_model, x, head=self.head)
        if self.layers is None:
            return auto_sites(self.base_model, x, head=self.head, count=AUTO_LAYERS)
        sites = named_sites(self.base_model, self.layers, head=self.head, x=x)
        if not sites:
            raise ConfigError(
                "dac found no layer to read: the model has no head to find and layers=[] names none; "
                "pass layers=[module names]"
            )
        return sites

    @property
    def bank_rows(self) -> int:
        """Training examples in the feature bank (0 before fit)."""
        return 0 if self.bank is None else self.bank.numel() // sum(self._widths())

    def _banks(self) -> list[Tensor]:
        """One contiguous ``(rows, D_l)`` view per layer of the flat, layer-blocked :attr:`bank`."""
        rows, widths = self.bank_rows, self._widths()
        return [block.view(rows, w) for block, w in zip(self.bank.split([rows * w for w in widths]), widths)]

    def log_distances(self, features: list[Tensor]) -> Tensor:
        """``log d_l`` per example and layer ``(N, L)``: the distance of each layer's features to the ``k``-th nearest bank row."""
        k = min(self.k, self.bank_rows)
        columns = [kth_distance(normalised(f), bank, k) for f, bank in zip(features, self._banks())]
        return torch.stack(columns, dim=1).clamp_min(MIN_DISTANCE).log().float()

    def temperatures_of(self, features: list[Tensor]) -> Tensor:
        """The temperature ``T(x)`` of each example ``(N,)`` from its features at :meth:`sites`."""
        return temperatures(
            excess(self.log_distances(features), self.anchors, self.spreads), self.temperature, self.weights
        )

    def _with_features(
        self, predictive: Callable, x: Inputs, num_samples: int | None, generator: torch.Generator | None
    ) -> tuple[Any, list[Tensor]]:
        """The inner ``predictive`` of ``x`` and the features read during its forward pass."""
        capture = self._capturer()
        with capture.recording(label_rows(x)) as found:
            prediction = predictive(x, num_samples=num_samples, generator=generator)
        return prediction, capture.features(found, x)

    def _checked(self, features: list[Tensor], during: str) -> list[Tensor]:
        for site, values in zip(self.sites(), features):
            check_finite_result(values, f"the model's features at '{site}' (read by dac {during})")
        return features

    def to_module(self, export: Any) -> nn.Module:
        """The banks and the fitted temperature map stacked on the inner method's exported predictive
        (:mod:`posthoc.methods.dac.export`), reading the same forward pass."""
        if self.bank is None or self.weights is None:
            raise NotFittedError("dac is not fitted: call um.fit(train_loader, val_loader) first")
        sites = [(site.name, site.at) for site in self.sites()]
        banks = [bank.float().clone() for bank in self._banks()]
        inner = export.predictive(self.inner)
        backbone = export.backbone(self.base_model)
        taps = [backbone.add_tap(name, at) for name, at in sites]
        fitted = (self.anchors, self.spreads, self.temperature, self.weights)
        k = min(self.k, self.bank_rows)
        return DensityTemperature(inner, backbone, taps, banks, k, *(value.float().clone() for value in fitted))

    def log_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> LogPredictive:
        (log_probs, samples), features = self._with_features(self.inner.log_predictive, x, num_samples, generator)
        return tempered(log_probs if samples is None else samples, self.temperatures_of(features))

    def regression_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> RegressionPrediction:
        """The inner regression predictive with example ``i``'s variance times ``v(x_i)`` (module docs)."""
        prediction, features = self._with_features(self.inner.regression_predictive, x, num_samples, generator)
        return inflated(prediction, self.temperatures_of(features))

    def fit(self, train_loader: Iterable | None, val_loader: Iterable | None = None, *, progress: bool = True) -> None:
        """The feature bank from ``train_loader``; the temperature is fitted on held-out data by :meth:`choose`."""
        if train_loader is None:
            raise InputError(
                "'dac' compares features with the training features: call um.fit(train_loader, val_loader)"
            )
        with torch.no_grad(), eval_mode(self.inner):
            self._fit_bank(train_loader, progress)

    def feature_taps(self, x: Inputs) -> list[Tap]:
        """The layers this DAC will read, found on example inputs ``x``, so that the fit's feature store records them
        in the same pass as everything else (the bank then uses them)."""
        if self._planned_sites is None:
            self._planned_sites = self._resolve(x)
        return Capture(self.base_model, self._planned_sites).taps()

    def share_bank(self, other: DensityAwareCalibration) -> None:
        """Take ``other``'s fitted feature bank (same model and bank options) instead of reading the training data
        again: ``method="auto"`` fits one bank for all its DAC candidates."""
        self.bank, self.widths = other.bank, other.widths
        self._set_meta({key: value for key, value in other._meta().items() if key in ("sites", "seen")})

    def held_out_cache(self, held_out: HeldOut) -> _Cache:
        """The inner predictions, log-distances and labels of every clean and perturbed held-out example (seeded)."""
        with torch.no_grad(), eval_mode(self.inner):
            clean = self._held_out(held_out.clean())
            shifted = self._held_out(held_out.perturbed()) if held_out.shifted is not None else None
        self._set_meta({**self._meta(), "shift": held_out.description})
        return _Cache(clean, shifted)

    def configurations(self, cache: _Cache) -> list[tuple[str, tuple[float, bool, float] | None]]:
        """``(label, (anchor, T0 fitted, shrink))``: the inner predictive (``None``), ``T0`` alone (no weights), then for
        every anchor the weights fitted with ``T0 = 1`` and shrunk by each factor (module docs)."""
        anchors = ANCHORS if self.anchor == "auto" else (self.anchor,)
        shrinks = SHRINKS if self.shrink == "auto" else (self.shrink,)
        found: list[tuple[str, tuple[float, bool, float] | None]] = [
            ("inner predictive", None),
            ("temperature alone", (anchors[0], True, 0.0)),
        ]
        for anchor in anchors:
            found += [
                (f"anchor {anchor:g}, weights x{shrink:g}", (anchor, False, shrink)) for shrink in shrinks if shrink > 0
            ]
        return found

    def fit_and_score(self, cache: _Cache, configurations: list, fitting: Rows, scored: Rows) -> list[Scores | None]:
        fitted: dict[tuple[float, bool, bool], tuple[Tensor, Tensor, Fitted]] = {}  # one fit per anchor and base
        out = []
        for _, value in configurations:
            if value is None:
                out.append(cache.scores(None, scored))
                continue
            anchor, fitted_t0, shrink = value
            key = (anchor, fitted_t0, shrink > 0)
            if key not in fitted:
                fitted[key] = self._fitted(cache, anchor, fitted_t0, fitting, weights=shrink > 0)
            out.append(cache.scores(_shrunk(fitted[key], shrink), scored))
        return out

    def apply(self, cache: _Cache, value: tuple[float, bool, float] | None, held_out: HeldOut) -> None:
        """Keep configuration ``value`` fitted on every held-out row (``None``: ``T0 = 1`` and no weights)."""
        rows = held_out.layout.everything()
        if value is None:
            anchor = ANCHORS[1] if self.anchor == "auto" else self.anchor
            anchors, spreads = standardisation(cache.clean.excess[rows.clean], anchor)
            fitted = Fitted(1.0, [0.0] * len(anchors))
        else:
            anchor, fitted_t0, shrink = value
            anchors, spreads, fitted = _shrunk(
                self._fitted(cache, anchor, fitted_t0, rows, weights=shrink > 0, warn=True), shrink
            )
        self.anchors, self.spreads = anchors.to(self.device), spreads.to(self.device)
        self.temperature = torch.tensor(fitted.temperature, device=self.device)
        self.weights = torch.tensor(fitted.weights, dtype=torch.float32, device=self.device)
        self._set_meta({**self._meta(), "anchor": anchor, "shrink": None if value is None else value[2]})

    def _fitted(
        self, cache: _Cache, anchor: float, fitted_t0: bool, rows: Rows, *, weights: bool, warn: bool = False
    ) -> tuple[Tensor, Tensor, Fitted]:
        """``(anchors, spreads, T0 and weights)`` at ``anchor`` fitted on ``rows`` (``T0 = 1`` unless ``fitted_t0``)."""
        anchors, spreads = standardisation(cache.clean.excess[rows.clean], anchor)
        clean, shifted = cache.take(rows, anchors, spreads)
        values = fit(
            clean,
            shifted,
            strength=self.strength,
            weights=weights,
            fit_temperature=fitted_t0,
            max_iter=self.max_iter,
            warn=warn,
        )
        return anchors, spreads, values

    def _fit_bank(self, loader: Iterable, progress: bool) -> None:
        reservoir: Reservoir | None = None
        widths: list[int] = []
        for x, _ in iterate(
            loader, device=self.device, progress=progress, desc="dac: feature bank", require_labels=False
        ):
            if reservoir is None:
                self._set_meta({"sites": [str(site) for site in self._planned_sites or self._resolve(x)]})
            capture = self._capturer()
            with eval_mode(self.base_model):  # one forward pass, or the fit's stored features (feature_store)
                found = capture.features([None] * len(capture.sites), x)
            features = [normalised(f) for f in self._checked(found, "for its feature bank")]
            if reservoir is None:
                widths = [f.shape[1] for f in features]
                capacity = rows_within(widths, self.bank_bytes)
                if isinstance(x, Mapping) and KEEP in x:
                    capacity = min(capacity, self.bank_positions)
                reservoir = Reservoir(capacity, torch.Generator(device=self.device).manual_seed(0))
            reservoir.add(torch.cat(features, dim=1))
        assert reservoir is not None
        bank = reservoir.rows()
        if bank.shape[0] < self.k:
            warnings.warn(
                f"dac's k={self.k} exceeds the {bank.shape[0]} training examples in its bank; the distance "
                f"is to the farthest of them (k={bank.shape[0]}). Fit on more data or pass a smaller k",
                RuntimeWarning,
                stacklevel=3,
            )
        # layer-blocked: each layer's (rows, D_l) rows are contiguous, so its similarities are one plain matmul
        self.bank = torch.cat([block.reshape(-1) for block in bank.split(widths, dim=1)])
        self.widths = torch.tensor(widths, device=self.device)
        self._set_meta({**self._meta(), "seen": examples_over_ranks(reservoir.seen)})
        self._planned_sites = None

    def _held_out(self, batches: Iterable[tuple[Inputs, Tensor]]) -> Cached | Spread:
        """The inner predictions, log-distances (in :attr:`Cached.excess` until standardised) and labels of every
        example of ``batches`` (one pass, seeded), gathered over ranks."""
        if self.regression:
            return self._held_out_spread(batches)
        generator = torch.Generator(device=self.device).manual_seed(0)
        predictions, distances, labels = [], [], []
        for x, y in batches:
            (log_probs, samples), features = self._with_features(self.inner.log_predictive, x, None, generator)
            self._checked(features, "on the held-out data")
            check_finite_result(
                log_probs if samples is None else samples,
                f"the log-probabilities of {predictive_of(self.inner)} that dac is fitted on",
                log_probs=True,
            )
            predictions.append((log_probs if samples is None else samples).float())
            distances.append(self.log_distances(features))
            labels.append(check_labels(y, log_probs.shape[-1]))
        dim = 0 if predictions[0].dim() == 2 else 1
        return Cached(
            gather_rows(torch.cat(predictions, dim), dim),
            gather_rows(torch.cat(distances)),
            gather_rows(torch.cat(labels)),
        )

    def _held_out_spread(self, batches: Iterable[tuple[Inputs, Tensor]]) -> Spread:
        """:meth:`_held_out` for a regressor: the inner mixture's components, log-distances and targets."""
        generator = torch.Generator(device=self.device).manual_seed(0)
        means, variances, distances, targets = [], [], [], []
        for x, y in batches:
            prediction, features = self._with_features(self.inner.regression_predictive, x, None, generator)
            self._checked(features, "on the held-out data")
            check_finite_result(
                prediction.variance, f"the predictive variance of {predictive_of(self.inner)} that dac is fitted on"
            )
            means.append(prediction.component_means.double())
            variances.append((prediction.model_variances + prediction.noise).double())
            distances.append(self.log_distances(features))
            targets.append(real_targets(y, prediction.mean))
        return Spread(
            gather_rows(torch.cat(means, 1), 1),
            gather_rows(torch.cat(variances, 1), 1),
            gather_rows(torch.cat(distances)),
            gather_rows(torch.cat(targets)),
        )

    def summary(self) -> dict[str, Any]:
        """``random_variables``: ``T0`` and one weight per layer; the layers read, the fitted temperature (a regressor's
        variance scale ``V0``) and weights, the bank's rows and bytes, ``k``, and the perturbations the fit saw."""
        meta = self._meta()
        return {
            "random_variables": 1 + (0 if self.weights is None else int(self.weights.numel())),
            "layers": [str(site) for site in self.sites()],
            "variance_scale" if self.regression else "temperature": float(self.temperature),
            "weights": [] if self.weights is None else [round(float(w), 6) for w in self.weights],
            "bank_rows": self.bank_rows,
            "bank_bytes": 0 if self.bank is None else self.bank.element_size() * self.bank.numel(),
            "training_examples_seen": meta.get("seen"),
            "k": min(self.k, self.bank_rows) if self.bank is not None else self.k,
            "anchor": meta.get("anchor", self.anchor),
            "shrink": meta.get("shrink", self.shrink),
            "strength": self.strength,
            "shift": meta.get("shift"),
        }

    def extra_repr(self) -> str:
        weights = "unfitted" if self.weights is None else [round(float(w), 4) for w in self.weights]
        return f"k={self.k}, temperature={float(self.temperature):.4f}, weights={weights}"
