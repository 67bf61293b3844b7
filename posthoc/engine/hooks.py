"""Temporary forward hooks, always removed: the one way posthoc reaches inside a model.

A hook is ``(module, at, function)``: ``at="input"`` a forward pre-hook, ``at="output"`` a forward hook.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.engine.hooks import called_in_order, hooked
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))
    >>> seen = []
    >>> with hooked([(net[2], "input", lambda module, args: seen.append(args[0].shape))]):
    ...     _ = net(torch.randn(4, 2))
    >>> seen
    [torch.Size([4, 3])]
    >>> called_in_order(net, {"first": net[0], "last": net[2]}, torch.randn(1, 2))
    ['first', 'last']
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from posthoc.core.inputs import Inputs, run_model
from posthoc.errors import ConfigError

Hook = tuple[nn.Module, str, Callable[..., Any]]


@contextmanager
def hooked(hooks: Iterable[Hook], *, prepend: bool = False) -> Iterator[None]:
    """Register ``hooks`` for the duration of the context (see module docs)."""
    handles = []
    try:
        for module, at, function in hooks:
            if at == "input":
                handles.append(module.register_forward_pre_hook(function, prepend=prepend))
            elif at == "output":
                handles.append(module.register_forward_hook(function, prepend=prepend))
            else:
                raise ConfigError(f"a hook acts on a module's 'input' or 'output', got {at!r}")
        yield
    finally:
        for handle in handles:
            handle.remove()


def called_in_order(model: nn.Module, modules: Mapping[str, nn.Module], x: Inputs, *, at: str = "input") -> list[str]:
    """The keys of ``modules`` in the order one forward pass of ``x`` (first row only) calls them."""
    order: list[str] = []

    def seen(key: str) -> Callable[..., None]:
        return lambda *args: None if key in order else order.append(key)

    first_row = {k: v[:1] for k, v in x.items()} if isinstance(x, Mapping) else x[:1]
    with torch.no_grad(), hooked((module, at, seen(key)) for key, module in modules.items()):
        run_model(model, first_row)
    return order
