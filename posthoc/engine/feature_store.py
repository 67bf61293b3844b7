"""The features of one fit, computed once: what every candidate, stage and knob reads of the backbone.

During :meth:`UncertainModel.fit` the engine opens one :class:`FeatureStore` on the user's checkpoint. Each batch it
sees (a training batch read through :func:`~posthoc.core.inputs.iterate`, a clean held-out batch, a perturbed copy)
is known by where it comes from and its position there (``(source, index)``, checked against its labels). The first
time a method asks for that batch's features, one forward pass records everything any method asked for: the model's
output, the head's input and the pooled activations of tapped layers (DAC's). Every later request, from another
candidate of ``auto``, another stage of a chain, another rung of a knob or another rate of MC dropout's grid, reads
the stored tensors instead of running the backbone again.

The store serves only the checkpoint as it was given: the same module object, in eval mode, with the weights it had
when the store opened (a method that changes them in place turns the store off). It lives within the memory budget
(:func:`posthoc.settings.memory_budget`); past it, entries go to a memory-mapped temporary file, and if that cannot be
written they are recomputed when asked for. :attr:`FeatureStore.record` says which. It is dropped when the fit ends.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.engine.feature_store import FeatureStore, features_of
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    >>> seen = []
    >>> _ = net[0].register_forward_hook(lambda module, args, out: seen.append(len(args[0])))
    >>> x, y = torch.randn(5, 4), torch.arange(5) % 3
    >>> with FeatureStore(net, net[2]).scope() as store:
    ...     batches = list(store.track([(x, y)], "held-out"))
    ...     first, again = features_of(net, x), features_of(net, x)
    >>> seen, first.head_input.shape, again is first
    ([5], torch.Size([5, 8]), True)
"""

from __future__ import annotations

import contextvars
import dataclasses
import os
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from posthoc import settings
from posthoc.core.fit_record import reads_once
from posthoc.core.inputs import Inputs, batch_observer, label_rows, run_model, split_batch
from posthoc.engine.hooks import hooked
from posthoc.errors import PosthocError

#: ``reduce(activation, rows) -> (rows, D) or None``: what a tap keeps of a layer's activation
Reduce = Callable[[Tensor, int], Tensor | None]


@dataclasses.dataclass(frozen=True)
class Tap:
    """A layer's ``output`` (or ``input``) that the store records, reduced by ``reduce`` (e.g. pooled to ``(N, D)``)."""

    name: str
    at: str
    reduce: Reduce

    @property
    def key(self) -> str:
        return f"{self.name}:{self.at}:{getattr(self.reduce, '__qualname__', repr(self.reduce))}"


@dataclasses.dataclass
class Entry:
    """One batch's stored features: the model's ``output``, the head's input and each tap's reduced activation."""

    labels: Tensor | None
    output: Tensor
    head_input: Tensor | None
    taps: dict[str, Tensor | None]

    def nbytes(self) -> int:
        tensors = [self.output, self.head_input, *self.taps.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


_ACTIVE: contextvars.ContextVar[FeatureStore | None] = contextvars.ContextVar("posthoc_feature_store", default=None)


def active_store() -> FeatureStore | None:
    """The store of the fit in progress (``None`` outside a fit)."""
    return _ACTIVE.get()


def _anchor(x: Inputs) -> Tensor | None:
    """The tensor that identifies a batch: ``x`` itself, or the first tensor of a dict."""
    if isinstance(x, Tensor):
        return x
    if isinstance(x, Mapping):
        return next((v for v in x.values() if isinstance(v, Tensor)), None)
    return None


class FeatureStore:
    """One forward pass per example of a fit, shared by everything that reads the backbone (see module docs).

    ``model``: the user's checkpoint; ``head``: its ``nn.Linear`` head (``None``: only outputs and taps are stored);
    ``max_bytes``: what the stored features may hold in memory (default: the memory budget when the store opens).
    """

    def __init__(self, model: nn.Module, head: nn.Module | None, *, max_bytes: int | None = None) -> None:
        self.model = model
        self.head = head
        self.max_bytes = settings.memory_budget() if max_bytes is None else max_bytes
        self.taps: dict[str, Tap] = {}
        self._entries: dict[tuple, Entry] = {}
        self._keys: dict[int, tuple[weakref.ref, tuple, Tensor | None]] = {}
        self._version = _weights_version(model)
        self._spill: tempfile.TemporaryDirectory | None = None
        self._held = 0
        self._pinned: dict[int, Any] = {}
        #: what the store did: ``passes`` (rows the backbone ran for it), ``served`` (rows read back), ``mode``
        #: (``"memory"``, ``"memory-mapped"`` or ``"recomputed"``) and the bytes held in memory and on disk
        self.record: dict[str, Any] = {"mode": "memory", "rows_computed": 0, "rows_served": 0, "bytes": 0, "spilled": 0}
        self.enabled = True

    # ---- scope -----------------------------------------------------------------------------------------------
    @contextmanager
    def scope(self) -> Iterator[FeatureStore]:
        """Serve features inside the block; everything stored is dropped when it ends."""
        token = _ACTIVE.set(self)
        observed = batch_observer.set(lambda loader, index, x, y: self.know(x, (_source_key(loader), index), y, loader))
        try:
            yield self
        finally:
            batch_observer.reset(observed)
            _ACTIVE.reset(token)
            self.close()

    def close(self) -> None:
        """Drop every entry and the temporary file."""
        self._entries.clear()
        self._keys.clear()
        self._pinned.clear()
        if self._spill is not None:
            self._spill.cleanup()
            self._spill = None

    def summary(self) -> dict[str, Any]:
        """What the store did, for the fit record: where its features lived and the rows computed and read back."""
        return dict(self.record)

    # ---- knowing batches -------------------------------------------------------------------------------------
    def track(self, batches: Iterable[tuple[Inputs, Tensor | None]], source: Any) -> Iterator[tuple[Inputs, Any]]:
        """``batches`` passed through, each known as ``(source, position)`` for as long as its tensor lives."""
        if not isinstance(source, (str, int, tuple)):
            self._pinned[id(source)] = source  # its id names its batches: kept alive, so never reused in this fit
        for index, (x, y) in enumerate(batches):
            self.know(x, (_source_key(source), index), y)
            yield x, y

    def know(self, x: Inputs, key: tuple, labels: Tensor | None, source: Any = None) -> None:
        """Know batch ``x`` as ``key`` (its ``labels`` tell a later batch at the same key apart)."""
        anchor = _anchor(x)
        if anchor is None or not self.enabled:
            return
        if source is not None:
            self._pinned[id(source)] = source
        self._keys[id(anchor)] = (weakref.ref(anchor), key, labels)
        if len(self._keys) > 4 * max(len(self._entries), 256):  # forget batches that no longer live
            self._keys = {k: v for k, v in self._keys.items() if v[0]() is not None}

    def _key(self, x: Inputs) -> tuple[tuple, Tensor | None] | None:
        anchor = _anchor(x)
        found = None if anchor is None else self._keys.get(id(anchor))
        if found is None or found[0]() is not anchor:
            return None
        return found[1], found[2]

    # ---- serving ---------------------------------------------------------------------------------------------
    def serves(self, model: nn.Module) -> bool:
        """Whether features of ``model`` may come from this store (the checkpoint, in eval mode, weights unchanged)."""
        if not self.enabled or model is not self.model or model.training:
            return False
        if _weights_version(model) != self._version:
            self.enabled = False  # a method changed the weights in place: nothing stored describes them now
            self.close()
            return False
        return True

    def entry(self, model: nn.Module, x: Inputs, taps: Sequence[Tap] = ()) -> Entry | None:
        """The stored features of batch ``x`` (computed by one forward pass the first time); ``None`` when this store
        cannot serve ``model`` or does not know ``x``."""
        if not self.serves(model):
            return None
        known = self._key(x)
        if known is None:
            return None
        key, labels = known
        for tap in taps:
            self.taps.setdefault(tap.key, tap)
        found = self._entries.get(key)
        if found is not None and _same(found.labels, labels) and all(tap.key in found.taps for tap in taps):
            self.record["rows_served"] += found.output.shape[0]
            return found
        entry = self._compute(x, labels)
        self._keep(key, entry)
        return entry

    def _compute(self, x: Inputs, labels: Tensor | None) -> Entry:
        captured: dict[str, Any] = {}
        taps = list(self.taps.values())

        def record_head(module: nn.Module, args: tuple, out: Tensor) -> None:
            captured.setdefault("head", (args[0], out))

        def record(tap: Tap, rows: list[int]) -> Callable[..., None]:
            def hook(module: nn.Module, args: tuple, *output: Any) -> None:
                if tap.key not in captured:
                    value = _first_tensor(args if tap.at == "input" else output[0])
                    captured[tap.key] = None if value is None else tap.reduce(value, rows[0])

            return hook

        rows = [0]
        hooks = [(self.model.get_submodule(tap.name), tap.at, record(tap, rows)) for tap in taps]
        if self.head is not None:
            hooks.append((self.head, "output", record_head))
        rows[0] = label_rows(x)
        with torch.no_grad(), hooked(hooks):
            output = run_model(self.model, x)
        head_input = None
        if "head" in captured:
            phi, out = captured["head"]
            head_input = phi.detach() if out is output or _squeezed(out, output) else None
        self.record["rows_computed"] += output.shape[0]
        return Entry(labels, output.detach(), head_input, {tap.key: captured.get(tap.key) for tap in taps})

    def _keep(self, key: tuple, entry: Entry) -> None:
        size = entry.nbytes()
        old = self._entries.pop(key, None)
        if old is not None and not getattr(old, "on_disk", False):
            self._held -= old.nbytes()
        if self._held + size <= self.max_bytes:
            self._held += size
            self._entries[key] = entry
        else:
            mapped = self._mapped(entry)
            if mapped is None:
                self.record["mode"] = "recomputed"
                return
            if self.record["mode"] == "memory":
                self.record["mode"] = "memory-mapped"
            self.record["spilled"] += size
            self._entries[key] = mapped
        self.record["bytes"] = self._held

    def _mapped(self, entry: Entry) -> Entry | None:
        """``entry`` with its tensors in a memory-mapped temporary file (``None`` if it cannot be written)."""
        try:
            if self._spill is None:
                self._spill = tempfile.TemporaryDirectory(prefix="posthoc-features-")
            path = os.path.join(self._spill.name, f"{len(os.listdir(self._spill.name))}.npy")

            def mapped(tensor: Tensor | None, suffix: str) -> Tensor | None:
                if tensor is None or tensor.device.type != "cpu":
                    return tensor
                array = np.lib.format.open_memmap(
                    path + suffix, mode="w+", dtype=_numpy_dtype(tensor), shape=tensor.shape
                )
                array[...] = tensor.numpy()
                return torch.from_numpy(array)

            out = Entry(
                entry.labels,
                mapped(entry.output, "o"),
                mapped(entry.head_input, "h"),
                {k: mapped(v, f"t{i}") for i, (k, v) in enumerate(entry.taps.items())},
            )
            out.on_disk = True  # type: ignore[attr-defined]
            return out
        except (OSError, TypeError, ValueError):
            return None


def open_store(
    model: nn.Module, head: nn.Module | None, methods: Iterable[nn.Module], loaders: Sequence[Iterable | None]
) -> FeatureStore:
    """The store of one fit on ``model``: every module among ``methods`` with a ``feature_taps(x)`` (DAC) names its
    layers on the first batch of ``loaders`` first, so that one pass records them with the head's input."""
    store = FeatureStore(model, head)
    takers = [m for m in methods if callable(getattr(m, "feature_taps", None))]
    example = _first_inputs(loaders) if takers else None
    if example is None:
        return store
    for taker in takers:
        try:
            for tap in taker.feature_taps(example):
                store.taps.setdefault(tap.key, tap)
        except PosthocError:  # the method says so itself, at its fit
            continue
    return store


def _first_inputs(loaders: Sequence[Iterable | None]) -> Inputs | None:
    """The inputs of the first batch of the first loader that can be read again (``None`` if none can)."""
    for loader in loaders:
        if loader is None or reads_once(loader):
            continue
        for batch in loader:
            x, _ = split_batch(batch, require_labels=False)
            return x
    return None


def features_of(model: nn.Module, x: Inputs, taps: Sequence[Tap] = ()) -> Entry | None:
    """The active store's :class:`Entry` for batch ``x`` of ``model`` (``None`` outside a fit or for another model)."""
    store = active_store()
    return None if store is None else store.entry(model, x, taps)


def head_features(model: nn.Module, head: nn.Module, x: Inputs) -> tuple[Tensor, Tensor] | None:
    """``(phi, output)`` of batch ``x`` from the active store, when its head is ``head``; else ``None``."""
    store = active_store()
    if store is None or store.head is not head:
        return None
    entry = store.entry(model, x)
    if entry is None or entry.head_input is None or entry.head_input.dim() != 2:
        return None
    return entry.head_input, entry.output


def plain_output(model: nn.Module, x: Inputs) -> Tensor:
    """``run_model(model, x)``, read from the active store where it holds ``x``."""
    entry = features_of(model, x)
    return run_model(model, x) if entry is None else entry.output


@contextmanager
def tracked_batches(batches: Iterable[tuple[Inputs, Any]], source: Any) -> Iterator[Iterable[tuple[Inputs, Any]]]:
    """``batches``, known to the active store as ``source`` (unchanged outside a fit)."""
    store = active_store()
    yield batches if store is None else store.track(batches, source)


def _source_key(source: Any) -> Any:
    return source if isinstance(source, (str, int, tuple)) else (type(source).__name__, id(source))


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:  # a pass that did not ask for the labels (DAC's bank): the position decides
        return True
    return a.shape == b.shape and bool(torch.equal(a, b))


def _first_tensor(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in (_first_tensor(v) for v in value) if t is not None), None)
    return None


def _squeezed(out: Tensor, output: Tensor) -> bool:
    return out.dim() == 2 and out.shape[1] == 1 and tuple(output.shape) == (out.shape[0],)


def _numpy_dtype(tensor: Tensor) -> Any:
    return torch.empty(0, dtype=tensor.dtype).numpy().dtype


def _weights_version(model: nn.Module) -> tuple[tuple[int, int], ...]:
    """Where each weight and buffer lives and how often it was changed in place: equal only for the same weights."""
    return tuple((t.data_ptr(), t._version) for t in (*model.parameters(), *model.buffers()))
