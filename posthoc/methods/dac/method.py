"""``"dac"``: density-aware calibration, a per-example temperature that grows where the training data ends.

Tomani, Buettner and Cremers (ICML 2023, "Beyond in-domain scenarios: robust density-aware
calibration"): a calibrator tuned on clean held-out data is confident wherever the model is, even
far from anything it was trained on. DAC gives each example its own temperature from how far its
features lie from the training features, at several layers, so that confidence falls off the data
and stays where the data is. It stacks on any method: ``["none", "dac"]`` tempers the plain model,
``["laplace", "dac"]`` each of Laplace's samples.

- **Features** at the head's input and the ends of the last two stages before it
  (:mod:`posthoc.methods.dac.layers`; ``layers=[module names]`` overrides the intermediate ones),
  captured by hooks during the inner method's own forward pass: DAC costs no second forward.
- **A feature bank** per layer from ``train_loader``: unit-normalised, pooled features of a uniform
  random subset of the training examples, as many as ``bank_bytes`` allows. It holds
  ``rows x sum_l D_l x 4`` bytes: on ImageNet with a ResNet-50 read at ``layer2``, ``layer3`` and the
  head's input (512 + 1024 + 2048 = 3,584 floats per example) the default 64 MiB keeps 4,681 of
  the 1.28 M images, and 1 GiB keeps 74,898 (6 %); predicting costs ``B x rows x sum_l D_l`` more
  multiply-adds per batch of ``B``, chunked under ``max_memory``.
- **The distance** of an example at each layer is the Euclidean distance of its normalised
  features to the ``k``-th nearest bank row (:func:`posthoc.engine.feature_bank.kth_distance`, as the
  ``"knn"`` OOD score).
- **The temperature** ``T(x) = T0 (1 + sum_l w_l relu((log d_l(x) - a_l) / s_l))`` equals ``T0`` for
  every example closer to the training features than the ``anchor`` quantile of the clean held-out
  examples at every layer, and grows with the distance beyond it (:mod:`posthoc.methods.dac.temperature`).
- **Fit**: ``T0`` and ``w`` minimise the NLL over the clean validation batches and, with
  ``shift="auto"`` (the default of ``um.fit``), their perturbed copies at graded strengths
  (:func:`posthoc.engine.held_out.shifted_held_out`), while the clean NLL stays within
  ``val_tolerance`` (relative) of the inner predictive's with ``T0`` alone; ``shift=None`` fits on
  the clean batches only. The inner predictions and the distances are computed once per held-out
  pass (with a seeded generator) and the fit runs on that cache.

Example:
    >>> um = posthoc.wrap(model, method=["laplace", "dac"]).fit(train_loader, val_loader)
    >>> card = um.summary()["posterior"][1]
    >>> card["layers"], card["bank_bytes"]
    (['features.3', 'features.7', 'classifier.4:input'], 1075200)
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core import distributed
from posthoc.core.checks import memory_bytes, non_negative, positive_int, probability
from posthoc.core.errors import ConfigError, HeadNotFoundError, InputError
from posthoc.core.inputs import Inputs, batch_size, check_finite_result, check_labels, iterate, run_model
from posthoc.core.logits import class_log_probs
from posthoc.core.method import LogPredictive, Method, predictive_of
from posthoc.core.modules import eval_mode, get_submodule
from posthoc.core.registry import register
from posthoc.engine.feature_bank import Reservoir, kth_distance, normalised, rows_within
from posthoc.engine.held_out import shifted_held_out
from posthoc.methods.dac.layers import Capture, Site, auto_sites, named_sites
from posthoc.methods.dac.temperature import HeldOut, excess, fit, standardisation, temperatures, tempered

#: the default feature-bank budget
BANK_BYTES = 64 * 2**20
#: intermediate layers found automatically (besides the head's input)
AUTO_LAYERS = 2
#: at most this many bytes of cached held-out predictions per pass; beyond it, examples are subsampled
CACHE_BYTES = 1 << 30
#: distances below this are taken as this before the log (a query equal to its k-th neighbour)
MIN_DISTANCE = 1e-6


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


@register
class DensityAwareCalibration(Method):
    """A per-example temperature from k-NN feature distances at several layers (Tomani et al., 2023); stacks on any method.

    Args:
        inner: the method whose predictive is tempered.
        k: which nearest training feature measures the distance.
        layers: module names whose outputs are read besides the head's input (``None``: the ends of
            the last two stages before the head); ``"name:input"`` reads a module's input.
        bank_bytes: bytes of the feature bank; beyond them a uniform random subset of the training
            examples is kept.
        anchor: the quantile of the clean held-out distances up to which the temperature stays ``T0``.
        val_tolerance: how much (relative) the clean held-out NLL may exceed the clean-only temperature's.
        head: the classifier head's module name (default: found as for last-layer methods).
        max_memory: bytes of similarities one distance step may hold (``None``: ``posthoc.settings.max_memory``).
        max_iter: L-BFGS iterations of each fit.
    """

    name = "dac"
    needs_val = True
    stacks = True

    def __init__(self, inner: Method, *, k: int = 10, layers: list[str] | None = None, bank_bytes: int = BANK_BYTES,
                 anchor: float = 0.9, val_tolerance: float = 0.01, head: str | None = None,
                 max_memory: int | None = None, max_iter: int = 100) -> None:
        super().__init__(inner.base_model)
        self.inner = inner
        self.k = positive_int(k, "k")
        self.layers = _check_layers(inner.base_model, layers)
        self.bank_bytes = memory_bytes(bank_bytes, "bank_bytes")
        if self.bank_bytes is None:
            raise ConfigError(f"bank_bytes must be a positive number of bytes, e.g. {BANK_BYTES} (64 MiB), got None")
        self.anchor = probability(anchor, "anchor")
        self.val_tolerance = non_negative(val_tolerance, "val_tolerance")
        if head is not None and not isinstance(head, str):
            raise ConfigError(f"head must be a module name, got {type(head).__name__}")
        self.head = head
        self.max_memory = memory_bytes(max_memory)
        self.max_iter = positive_int(max_iter, "max_iter")
        for name in ("bank", "widths", "anchors", "spreads", "weights", "meta"):
            self.register_buffer(name, None)
        self.register_buffer("temperature", torch.ones(()))
        self._capture: tuple[Tensor, Capture] | None = None
        self._width_list: tuple[Tensor, list[int]] | None = None

    @property
    def base_model(self) -> nn.Module:
        return self.inner.base_model

    # ---- structure -------------------------------------------------------------------------
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
        if self.layers is None:
            return auto_sites(self.base_model, x, head=self.head, count=AUTO_LAYERS)
        sites = named_sites(self.base_model, self.layers, head=self.head, x=x)
        if not sites:
            raise ConfigError("dac found no layer to read: the model has no head to find and layers=[] names none; "
                              "pass layers=[module names]")
        return sites

    # ---- distances and temperatures ----------------------------------------------------------
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
        columns = [kth_distance(normalised(f), bank, k, max_memory=self.max_memory)
                   for f, bank in zip(features, self._banks())]
        return torch.stack(columns, dim=1).clamp_min(MIN_DISTANCE).log().float()

    def temperatures_of(self, features: list[Tensor]) -> Tensor:
        """The temperature ``T(x)`` of each example ``(N,)`` from its features at :meth:`sites`."""
        return temperatures(excess(self.log_distances(features), self.anchors, self.spreads), self.temperature, self.weights)

    def _inner_with_features(self, x: Inputs, num_samples: int | None, generator: torch.Generator | None,
                             max_memory: int | None = None) -> tuple[Tensor, Tensor | None, list[Tensor]]:
        capture = self._capturer()
        with capture.recording(batch_size(x)) as found:
            log_probs, samples = self.inner.log_predictive(x, num_samples=num_samples, generator=generator, max_memory=max_memory)
        return log_probs, samples, capture.features(found, x)

    def log_predictive(self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None,
                       max_memory: int | None = None) -> LogPredictive:
        log_probs, samples, features = self._inner_with_features(x, num_samples, generator, max_memory)
        return tempered(log_probs if samples is None else samples, self.temperatures_of(features))

    # ---- fit ---------------------------------------------------------------------------------
    def fit(self, train_loader: Iterable | None, val_loader: Iterable | None = None, *, progress: bool = True,
            shift: Any = "auto") -> None:
        if train_loader is None:
            raise InputError("'dac' compares features with the training features: call um.fit(train_loader, val_loader)")
        with torch.no_grad(), eval_mode(self.inner):
            self._fit_bank(train_loader, progress)
            clean = self._held_out(val_loader, progress, "dac: held-out")
            shifted_loader = shifted_held_out(val_loader, self._plain_log_probs, shift, device=self.device)
            shifted = None if shifted_loader is None else self._held_out(shifted_loader, progress, "dac: perturbed held-out")
        anchors, spreads = standardisation(clean.excess, self.anchor)  # .excess holds log-distances until here
        for held in (clean, shifted):
            if held is not None:
                held.excess = excess(held.excess, anchors, spreads)
        levels = 0 if shifted_loader is None else len(shifted_loader.levels)
        chosen = fit(clean, shifted, levels=levels, tolerance=self.val_tolerance, max_iter=self.max_iter)
        self.anchors, self.spreads = anchors.to(self.device), spreads.to(self.device)
        self.temperature = torch.tensor(chosen.temperature, device=self.device)
        self.weights = torch.tensor(chosen.weights, dtype=torch.float32, device=self.device)
        self._set_meta({**self._meta(), "shift": None if shifted_loader is None else shifted_loader.description,
                        "clean_nll": chosen.clean_nll, "reference_nll": chosen.reference_nll,
                        "combined_nll": chosen.combined_nll, "kept": chosen.kept})

    def _plain_log_probs(self, x: Inputs) -> Tensor:
        with eval_mode(self.base_model):
            return class_log_probs(run_model(self.base_model, x))

    def _fit_bank(self, loader: Iterable, progress: bool) -> None:
        reservoir: Reservoir | None = None
        widths: list[int] = []
        for x, _ in iterate(loader, device=self.device, progress=progress, desc="dac: feature bank", require_labels=False):
            if reservoir is None:
                self._set_meta({"sites": [str(site) for site in self._resolve(x)]})
            capture = self._capturer()
            with eval_mode(self.base_model), capture.recording(batch_size(x)) as found:
                run_model(self.base_model, x)
            features = capture.features(found, x)
            for site, values in zip(self.sites(), features):
                check_finite_result(values, f"the model's features at '{site}' (read by dac for its feature bank)")
            features = [normalised(f) for f in features]
            if reservoir is None:
                widths = [f.shape[1] for f in features]
                reservoir = Reservoir(rows_within(widths, self.bank_bytes), torch.Generator(device=self.device).manual_seed(0))
            reservoir.add(torch.cat(features, dim=1))
        assert reservoir is not None
        bank = reservoir.rows()
        if bank.shape[0] < self.k:
            warnings.warn(f"dac's k={self.k} exceeds the {bank.shape[0]} training examples in its bank; the distance "
                          f"is to the farthest of them (k={bank.shape[0]}). Fit on more data or pass a smaller k",
                          RuntimeWarning, stacklevel=3)
        # layer-blocked: each layer's (rows, D_l) rows are contiguous, so its similarities are one plain matmul
        self.bank = torch.cat([block.reshape(-1) for block in bank.split(widths, dim=1)])
        self.widths = torch.tensor(widths, device=self.device)
        self._set_meta({**self._meta(), "seen": distributed.total_examples(reservoir.seen)})

    def _held_out(self, loader: Iterable, progress: bool, desc: str) -> HeldOut:
        """The inner predictions, log-distances and labels of every example of ``loader`` (one pass, seeded)."""
        generator = torch.Generator(device=self.device).manual_seed(0)
        predictions, distances, labels = [], [], []
        for x, y in iterate(loader, device=self.device, progress=progress, desc=desc):
            log_probs, samples, features = self._inner_with_features(x, None, generator)
            for site, values in zip(self.sites(), features):
                check_finite_result(values, f"the model's features at '{site}' (read by dac on the held-out data)")
            check_finite_result(log_probs if samples is None else samples,
                                f"the log-probabilities of {predictive_of(self.inner)} that dac is fitted on", log_probs=True)
            predictions.append((log_probs if samples is None else samples).float())
            distances.append(self.log_distances(features))
            labels.append(check_labels(y, log_probs.shape[-1]))
        dim = 0 if predictions[0].dim() == 2 else 1
        held = HeldOut(distributed.gather_cat(torch.cat(predictions, dim), dim),
                       distributed.gather_cat(torch.cat(distances)), distributed.gather_cat(torch.cat(labels)))
        size = held.log_probs.element_size() * held.log_probs.numel()
        if size > CACHE_BYTES:
            rows = held.labels.numel()
            keep = torch.randperm(rows, generator=torch.Generator().manual_seed(0))[: max(1, rows * CACHE_BYTES // size)]
            keep = keep.to(held.labels.device)
            held = HeldOut(held.log_probs.index_select(dim, keep), held.excess[keep], held.labels[keep])
        return held

    # ---- card and files -------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """``random_variables``: ``T0`` and one weight per layer; the layers read, the fitted temperature
        and weights, the bank's rows and bytes, ``k``, and the perturbations the fit saw."""
        meta = self._meta()
        return {
            "random_variables": 1 + (0 if self.weights is None else int(self.weights.numel())),
            "layers": [str(site) for site in self.sites()],
            "temperature": float(self.temperature),
            "weights": [] if self.weights is None else [round(float(w), 6) for w in self.weights],
            "bank_rows": self.bank_rows,
            "bank_bytes": 0 if self.bank is None else self.bank.element_size() * self.bank.numel(),
            "training_examples_seen": meta.get("seen"),
            "k": min(self.k, self.bank_rows) if self.bank is not None else self.k,
            "anchor": self.anchor,
            "shift": meta.get("shift"),
            "clean_nll": meta.get("clean_nll"),
            "reference_nll": meta.get("reference_nll"),
            "combined_nll": meta.get("combined_nll"),
            "kept": meta.get("kept"),
        }

    def extra_repr(self) -> str:
        weights = "unfitted" if self.weights is None else [round(float(w), 4) for w in self.weights]
        return f"k={self.k}, temperature={float(self.temperature):.4f}, weights={weights}"
