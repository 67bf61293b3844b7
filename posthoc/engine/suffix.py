"""Stochastic-suffix execution: the deterministic prefix once, only the suffix per sample.

A sampling method (MC dropout, SWAG, iBNN) often makes only the end of a network stochastic.
:class:`SuffixRunner` runs the model once per example chunk and, at the *expansion point* (the
input or output of one module, the first stochastic one), repeats the activation ``S`` times
sample-major: rows ``s * m + i`` hold sample ``s`` of example ``i``. Everything before that point
runs once per example; everything after it runs on ``S * m`` rows in ordinary batched ops, so
stochastic hooks inside the suffix draw independent randomness per sample and per example.
For head-only dropout this is one backbone pass plus one matmul for all samples.

Chunks are sized by a probe forward pass (2 examples, 2 samples, cached per input shape) that
measures the largest activation per row after the expansion point, so that one chunk's largest
activation stays under ``max_memory`` (default: ``posthoc.settings.max_memory``). The probe also checks that the expansion is sound: if a
skip path carries un-expanded activations around the expansion point (a residual add inside a
block), the module is called more than once, or the output does not have ``S * m`` rows, the
runner falls back to expanding the model's input (full forward passes, still batched).

Stochastic hooks are entered through ``stochastic``, a zero-argument callable returning a context
manager; it is not entered for the probe, so the probe draws no randomness and seeded results do
not depend on whether a probe ran. Hooks that need the layout read :attr:`SuffixRunner.layout`.

Example:
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3)).eval()
    >>> sites = own_dropout_sites(net)
    >>> g = torch.Generator().manual_seed(0)
    >>> logits = expanded_forward(net, "2", torch.randn(5, 4), 10, stochastic=lambda: sampling(net, sites, generator=g))
    >>> logits.shape
    torch.Size([10, 5, 3])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core import settings
from posthoc.core.inputs import Inputs, batch_size, run_model
from posthoc.core.errors import ConfigError, InputError

#: default bound on the largest activation of one chunk after the expansion point

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
    row_bytes: int  # largest activation per row after the expansion point


class SuffixRunner:
    """Run ``model`` with the batch expanded ``S`` times at module ``start`` (see module docs).

    Args:
        model: the network (kept as it is; only temporary hooks are added during a call).
        start: the module name of the expansion point, or ``None`` to expand the model's input.
        at: expand the module's ``"input"`` (default) or its ``"output"``.
        max_memory: bound in bytes on the largest activation of one chunk after the expansion point
            (``None``: ``posthoc.settings.max_memory`` at call time).

    Example:
        >>> runner = SuffixRunner(model, "classifier.3", at="output")
        >>> runner(x, 100, stochastic=lambda: sampling(model, sites)).shape
        torch.Size([100, 8, 10])
    """

    def __init__(self, model: nn.Module, start: str | None, *, at: str = "input", max_memory: int | None = None) -> None:
        if at not in ("input", "output"):
            raise ConfigError(f"at must be 'input' or 'output', got {at!r}")
        if max_memory is not None and (not isinstance(max_memory, int) or max_memory < 1):
            raise ConfigError(f"max_memory must be a positive number of bytes (or None), got {max_memory!r}")
        if start is not None:
            names = {name for name, _ in model.named_modules()}
            if start not in names:
                raise ConfigError(f"the model has no module named {start!r} to expand the batch at")
        self.model, self.start, self.at, self.max_memory = model, start, at, max_memory
        self.layout = Layout(0, 0)
        self._plans: dict[Any, _Plan] = {}

    @property
    def expands_input(self) -> bool | None:
        """Whether the last call fell back to expanding the input (``None`` before any call)."""
        if not self._plans:
            return None
        return next(reversed(self._plans.values())).expand_input

    def __call__(self, x: Inputs, num_samples: int, *, stochastic: Stochastic = nullcontext) -> Tensor:
        """Return the model's outputs for ``num_samples`` samples: shape ``(S, N, ...)``."""
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ConfigError(f"num_samples must be a positive integer, got {num_samples!r}")
        n = batch_size(x)
        if n == 0:
            raise InputError("got an empty batch (0 examples)")
        plan = self._plan(x)
        rows = max(1, settings.memory_budget(self.max_memory) // max(1, plan.row_bytes))
        group = min(num_samples, rows)
        chunk = max(1, min(n, rows // group))
        pieces = []
        with stochastic():
            for first in range(0, n, chunk):
                part = _rows(x, first, min(n, first + chunk))
                groups = [self._run(part, min(group, num_samples - s), plan.expand_input, s) for s in range(0, num_samples, group)]
                pieces.append(groups[0] if len(groups) == 1 else torch.cat(groups, 0))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 1)

    def _run(self, x: Inputs, samples: int, expand_input: bool, first: int = 0) -> Tensor:
        m = batch_size(x)
        self.layout = Layout(samples, m, first)
        if expand_input or self.start is None:
            out = run_model(self.model, _repeat(x, samples, m))
        else:
            with _expansion(self.model, self.start, self.at, samples, m) as calls:
                out = run_model(self.model, x)
            if calls[0] != 1:
                raise InputError(f"the expansion module {self.start!r} was called {calls[0]} times in one forward pass")
        if out.shape[0] != samples * m:
            raise InputError(f"the model returned {out.shape[0]} rows for {samples} x {m} expanded rows")
        return out.reshape(samples, m, *out.shape[1:])

    def _plan(self, x: Inputs) -> _Plan:
        key = _signature(x)
        if key not in self._plans:
            self._plans[key] = self._probe(x)
        return self._plans[key]

    def _probe(self, x: Inputs) -> _Plan:
        n = batch_size(x)
        pair = _rows(x, 0, 2) if n >= 2 else _repeat(x, 2, 1)
        if self.start is not None:
            plan = _measure(self.model, pair, _expansion(self.model, self.start, self.at, 2, 2))
            if plan is not None:
                return plan
        plan = _measure(self.model, _repeat(pair, 2, 2), None)
        if plan is None:
            run_model(self.model, pair)  # raises the model's own error as an InputError
            raise InputError("the model's output does not have one row per input row; it cannot be sampled in batches")
        return plan


def expanded_forward(model: nn.Module, start: str | None, x: Inputs, num_samples: int, *, at: str = "input",
                     stochastic: Stochastic = nullcontext, max_memory: int | None = None) -> Tensor:
    """One-off :class:`SuffixRunner` call: outputs ``(S, N, ...)`` with the batch expanded at ``start``.

    Example:
        >>> expanded_forward(model, "fc", x, 20, stochastic=lambda: sampling(model, sites)).shape
        torch.Size([20, 8, 10])
    """
    return SuffixRunner(model, start, at=at, max_memory=max_memory)(x, num_samples, stochastic=stochastic)


class _expansion:
    """Context: hook that repeats ``start``'s input/output ``samples`` times on its first call."""

    def __init__(self, model: nn.Module, start: str, at: str, samples: int, examples: int) -> None:
        self.module, self.at, self.samples, self.examples = model.get_submodule(start), at, samples, examples
        self.calls = [0]
        self.expanded_bytes = 0  # size of the repeated tensors (they are no module's output)

    def __enter__(self) -> list[int]:
        def expand(value: Any) -> Any:
            if self.calls[0] != 1:
                return value
            repeated = _repeat_all(value, self.samples, self.examples)
            self.expanded_bytes = sum(t.numel() * t.element_size() for t in _tensors(repeated))
            return repeated

        def pre_hook(module: nn.Module, args: tuple) -> tuple:
            self.calls[0] += 1
            return expand(args)

        def post_hook(module: nn.Module, args: tuple, output: Any) -> Any:
            self.calls[0] += 1
            return expand(output)

        if self.at == "input":
            self.handle = self.module.register_forward_pre_hook(pre_hook, prepend=True)
        else:
            self.handle = self.module.register_forward_hook(post_hook, prepend=True)
        return self.calls

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()


def _measure(model: nn.Module, x: Inputs, expansion: _expansion | None) -> _Plan | None:
    """Run ``x`` (2 examples, expanded to 2 samples); the plan, or ``None`` if the expansion is unsound."""
    largest = [0]

    def record(module: nn.Module, args: tuple, output: Any) -> None:
        if (expansion is None or expansion.calls[0] >= 1) and isinstance(output, Tensor):
            largest[0] = max(largest[0], output.numel() * output.element_size() // 4)

    hooks = [m.register_forward_hook(record) for m in model.modules()]
    try:
        with torch.no_grad(), (expansion if expansion is not None else nullcontext()):
            out = model(**x) if isinstance(x, Mapping) else model(x)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return None
    finally:
        for hook in hooks:
            hook.remove()
    if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] != 4:
        return None
    if expansion is not None and expansion.calls[0] != 1:
        return None
    # the repeated tensor lives next to its masked copy and the mask: count it three times
    expanded = 0 if expansion is None else EXPANDED_COPIES * expansion.expanded_bytes // 4
    return _Plan(expansion is None, max(largest[0], expanded, out.numel() * out.element_size() // 4, 1))


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _signature(x: Inputs) -> Any:
    if isinstance(x, Mapping):
        return tuple(sorted((k, tuple(v.shape[1:]), v.dtype) for k, v in x.items() if isinstance(v, Tensor)))
    return tuple(x.shape[1:]), x.dtype


def _rows(x: Inputs, first: int, last: int) -> Inputs:
    if isinstance(x, Mapping):
        return {k: v[first:last] if isinstance(v, Tensor) else v for k, v in x.items()}
    return x[first:last]


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
