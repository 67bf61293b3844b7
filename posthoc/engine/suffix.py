"""Stochastic-suffix execution: the deterministic prefix once, only the suffix per sample.

A sampling method (MC dropout, SWAG, iBNN) often makes only the end of a network stochastic. :class:`SuffixRunner`
runs the model once per example chunk and, at the *expansion point* (the input or output of the first stochastic
module), repeats the activation ``S`` times sample-major (row ``s * m + i`` is sample ``s`` of example ``i``), so the
suffix runs on ``S * m`` rows in ordinary batched ops with independent draws per row.

A probe pass of 2 examples x 2 samples (:meth:`SuffixRunner.prepare`, without the ``stochastic`` hooks, so seeded
results do not depend on it) measures the bytes per row for chunk planning under the memory budget, and checks the
expansion is sound; if not (a skip path around the point, a module called twice, the wrong row count), the runner
expands the model's input instead. Hooks that need the layout read :attr:`SuffixRunner.layout`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.engine.suffix import expanded_forward
    >>> from posthoc.methods.mc_dropout.sites import own_dropout_sites, sampling
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3)).eval()
    >>> sites = own_dropout_sites(net)
    >>> g = torch.Generator().manual_seed(0)
    >>> logits = expanded_forward(net, "2", torch.randn(5, 4), 10, stochastic=lambda: sampling(net, sites, generator=g))
    >>> logits.shape
    torch.Size([10, 5, 3])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.checks import memory_bytes, positive_int
from posthoc.core.chunks import chunks, rows_per_chunk
from posthoc.core.inputs import Inputs, batch_size, label_rows, run_model, slice_inputs
from posthoc.engine.feature_store import active_store
from posthoc.engine.hooks import hooked
from posthoc.errors import ConfigError, InputError

Stochastic = Callable[[], AbstractContextManager]


@dataclass(frozen=True)
class Layout:
    """The chunk being run: ``samples * examples`` rows at and after the expansion point, sample-major;
    ``first`` is the index of its first sample among all ``S`` (samples may run in groups)."""

    samples: int
    examples: int
    first: int = 0


#: live copies of the expanded activation while a stochastic module works on it (input, mask, output)
EXPANDED_COPIES = 3


@dataclass(frozen=True)
class _Plan:
    expand_input: bool  # True: the fallback (repeat the model's input)
    row_bytes: int  # bytes one row keeps alive at the peak after the expansion point
    input_row_bytes: int  # bytes of one example of the probed input

    def row_bytes_for(self, x: Inputs) -> int:
        """:attr:`row_bytes`, scaled to the size of ``x``'s examples."""
        return max(1, -(-self.row_bytes * _input_row_bytes(x) // self.input_row_bytes))


class SuffixRunner:
    """Run ``model`` with the batch expanded ``S`` times at module ``start`` (see module docs).

    ``start`` is the module name of the expansion point (``None``: the model's input), ``at`` its ``"input"`` or
    ``"output"``; ``max_memory`` bounds what one chunk keeps alive (``None``: the current budget).

    Example:
        >>> from posthoc.engine.suffix import SuffixRunner
        >>> from posthoc_apps.demo.examples import model, x
        >>> from posthoc.methods.mc_dropout.sites import own_dropout_sites, sampling
        >>> runner = SuffixRunner(model, "2", at="output")        # the model's dropout: expand the batch there
        >>> runner(x, 100, stochastic=lambda: sampling(model, own_dropout_sites(model))).shape
        torch.Size([100, 8, 3])
    """

    def __init__(
        self, model: nn.Module, start: str | None, *, at: str = "input", max_memory: int | None = None
    ) -> None:
        if at not in ("input", "output"):
            raise ConfigError(f"at must be 'input' or 'output', got {at!r}")
        memory_bytes(max_memory)
        if start is not None and start not in {name for name, _ in model.named_modules()}:
            raise ConfigError(f"the model has no module named {start!r} to expand the batch at")
        self.model, self.start, self.at, self.max_memory = model, start, at, max_memory
        self.layout = Layout(0, 0)
        self._plan: _Plan | None = None

    @property
    def expands_input(self) -> bool | None:
        """Whether the runner falls back to expanding the input (``None`` before it is prepared)."""
        return None if self._plan is None else self._plan.expand_input

    def prepare(self, x: Inputs) -> None:
        """Make the plan from example inputs ``x`` (one probe forward pass), once; later calls do nothing."""
        if self._plan is None:
            self._plan = self._probe(x)

    def __call__(self, x: Inputs, num_samples: int, *, stochastic: Stochastic = nullcontext) -> Tensor:
        """Return the model's outputs for ``num_samples`` samples: shape ``(S, N, ...)``, in chunks under the budget."""
        positive_int(num_samples, "num_samples")
        n = batch_size(x)
        if n == 0:
            raise InputError("got an empty batch (0 examples)")
        self.prepare(x)
        row_bytes, budget = self._plan.row_bytes_for(x), self.max_memory
        group = rows_per_chunk(row_bytes, max_memory=budget, limit=num_samples)
        pieces = []
        stored = self._stored_suffix_input(x)
        with stochastic():
            for examples in chunks(n, group * row_bytes, max_memory=budget):
                part, m = slice_inputs(x, examples.start, examples.stop), examples.stop - examples.start
                phi = None if stored is None else stored[examples.start : examples.stop]
                groups = [
                    self._run(part, samples.stop - samples.start, samples.start, phi)
                    for samples in chunks(num_samples, m * row_bytes, max_memory=budget)
                ]
                pieces.append(groups[0] if len(groups) == 1 else torch.cat(groups, 0))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 1)

    def _run(self, x: Inputs, samples: int, first: int, stored: Tensor | None = None) -> Tensor:
        m = batch_size(x)
        self.layout = Layout(samples, m, first)
        if stored is not None:
            out = self._suffix(_repeat_all(stored, samples, m))
        elif self._plan.expand_input or self.start is None:
            out = run_model(self.model, _repeat(x, samples, m))
        else:
            with _expansion(self.model, self.start, self.at, samples, m) as expansion:
                out = run_model(self.model, x)
            if expansion.calls != 1:
                raise InputError(
                    f"the expansion module {self.start!r} was called {expansion.calls} times in one forward pass"
                )
        rows = label_rows(x)
        if out.shape[0] != samples * rows:
            raise InputError(f"the model returned {out.shape[0]} rows for {samples} x {rows} expanded rows")
        return out.reshape(samples, rows, *out.shape[1:])

    def _stored_suffix_input(self, x: Inputs) -> Tensor | None:
        """The head's input stored for batch ``x`` in the fit's feature store, when the suffix is the head alone (the
        expansion point is the head's input, or an eval-mode identity such as dropout right before it); else ``None``."""
        store = active_store()
        if self._plan.expand_input or self.start is None or store is None or store.head is None:
            return None
        if not store.serves(self.model):
            return None
        module = self.model.get_submodule(self.start)
        if not ((self.at == "input" and module is store.head) or _feeds(self.model, self.start, store.head)):
            return None
        entry = store.entry(self.model, x)
        phi = None if entry is None else entry.head_input
        if phi is None or phi.dim() != 2 or phi.shape[0] != batch_size(x) or label_rows(x) != batch_size(x):
            return None
        self._suffix = lambda expanded: store.head(expanded if self.at == "input" else module(expanded))
        return phi

    def _probe(self, x: Inputs) -> _Plan:
        pair = slice_inputs(x, 0, 2) if batch_size(x) >= 2 else _repeat(x, 2, 1)
        if self.start is not None:
            with _expansion(self.model, self.start, self.at, 2, 2) as expansion:
                plan = _measure(self.model, pair, expansion, 2 * label_rows(pair))
            if plan is not None:
                return plan
        repeated = _repeat(pair, 2, 2)
        plan = _measure(self.model, repeated, None, label_rows(repeated))
        if plan is None:
            run_model(self.model, pair)  # raises the model's own error as an InputError
            raise InputError("the model's output does not have one row per input row; it cannot be sampled in batches")
        return plan


def expanded_forward(
    model: nn.Module,
    start: str | None,
    x: Inputs,
    num_samples: int,
    *,
    at: str = "input",
    stochastic: Stochastic = nullcontext,
    max_memory: int | None = None,
) -> Tensor:
    """One-off :class:`SuffixRunner` call: outputs ``(S, N, ...)`` with the batch expanded at ``start``."""
    return SuffixRunner(model, start, at=at, max_memory=max_memory)(x, num_samples, stochastic=stochastic)


@dataclass
class _Expansion:
    calls: int = 0
    expanded_bytes: int = 0  # size of the repeated tensors (they are no module's output)


@contextmanager
def _expansion(model: nn.Module, start: str, at: str, samples: int, examples: int) -> Iterator[_Expansion]:
    """Context: a hook that repeats ``start``'s input/output ``samples`` times on its first call."""
    state = _Expansion()

    def expand(value: Any) -> Any:
        state.calls += 1
        if state.calls != 1:
            return value
        repeated = _repeat_all(value, samples, examples)
        state.expanded_bytes = sum(t.numel() * t.element_size() for t in _tensors(repeated))
        return repeated

    hook = (lambda module, args: expand(args)) if at == "input" else (lambda module, args, output: expand(output))
    with hooked([(model.get_submodule(start), at, hook)], prepend=True):
        yield state


def _measure(model: nn.Module, x: Inputs, expansion: _Expansion | None, rows: int) -> _Plan | None:
    """Run ``x`` (2 examples, expanded to 2 samples: ``rows`` output rows); the plan, or ``None`` if the expansion is
    unsound."""
    largest = 0

    def record(module: nn.Module, args: tuple, output: Any) -> None:
        nonlocal largest
        if (expansion is None or expansion.calls >= 1) and isinstance(output, Tensor):
            largest = max(largest, output.numel() * output.element_size() // 4)

    try:
        with torch.no_grad(), hooked((module, "output", record) for module in model.modules()):
            out = run_model(model, x)
    except InputError:
        return None
    if out.dim() == 0 or out.shape[0] != rows:
        return None
    if expansion is not None and expansion.calls != 1:
        return None
    # the repeated tensor lives next to its masked copy and the mask: count it EXPANDED_COPIES times
    expanded = 0 if expansion is None else EXPANDED_COPIES * expansion.expanded_bytes // 4
    return _Plan(
        expansion is None, max(largest, expanded, out.numel() * out.element_size() // 4, 1), _input_row_bytes(x)
    )


#: modules that return their input unchanged in eval mode (so the head's stored input is also their output)
EVAL_IDENTITY = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.Identity)


def _feeds(model: nn.Module, name: str, head: nn.Module) -> bool:
    """Whether module ``name`` is an eval-mode identity whose output goes straight into ``head`` (its next sibling in
    an ``nn.Sequential``)."""
    module = model.get_submodule(name)
    if type(module) not in EVAL_IDENTITY or module.training:
        return False
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if not isinstance(parent, nn.Sequential):
        return False
    names = [key for key, _ in parent.named_children()]
    following = names.index(child) + 1
    return following < len(names) and parent[following] is head


def _input_row_bytes(x: Inputs) -> int:
    """Bytes of one example of ``x`` (at least 1)."""
    return max(
        1,
        sum(t.numel() * t.element_size() for t in _tensors(list(x.values()) if isinstance(x, Mapping) else x))
        // batch_size(x),
    )


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _repeat(x: Inputs, samples: int, examples: int) -> Inputs:
    if isinstance(x, Mapping):
        return {k: _repeat_all(v, samples, examples) for k, v in x.items()}
    return _repeat_all(x, samples, examples)


def _repeat_all(value: Any, samples: int, examples: int) -> Any:
    """Repeat every tensor whose first dimension is ``examples`` ``samples`` times, sample-major."""
    if isinstance(value, Tensor):
        if value.dim() and value.shape[0] == examples:
            return value.repeat(samples, *([1] * (value.dim() - 1)))
        return value
    if isinstance(value, tuple):
        return tuple(_repeat_all(v, samples, examples) for v in value)
    if isinstance(value, list):
        return [_repeat_all(v, samples, examples) for v in value]
    return value
