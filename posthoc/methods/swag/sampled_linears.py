"""Per-sample weights for Linear layers inside a sample-major expanded batch.

With :class:`posthoc.engine.suffix.SuffixRunner`, rows ``s * m + i`` after the expansion point hold
sample ``s`` of example ``i``. While :func:`sampled_linears` is active, each named Linear layer
recomputes its output with sample ``s``'s weights for sample ``s``'s rows, in one batched matmul
(``torch.baddbmm``), so ``S`` weight samples of a network's suffix cost one expanded pass instead
of ``S`` full passes. The layer's own output (with its checkpoint weights) is discarded.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.methods.swag.sampled_linears import sampled_linears
    >>> from posthoc.engine.suffix import SuffixRunner
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> runner = SuffixRunner(net, "2")
    >>> weights = {"2.weight": torch.randn(5, 2, 4), "2.bias": torch.randn(5, 2)}
    >>> runner(torch.randn(7, 3), 5, stochastic=lambda: sampled_linears(net, weights, runner)).shape
    torch.Size([5, 7, 2])
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import Tensor, nn

from posthoc.core.modules import parameter_owners
from posthoc.engine.hooks import hooked
from posthoc.engine.suffix import Layout
from posthoc.errors import ConfigError


class HasLayout(Protocol):
    layout: Layout


@contextmanager
def sampled_linears(model: nn.Module, weights: dict[str, Tensor], runner: HasLayout) -> Iterator[None]:
    """Apply ``weights`` (``{"<module>.weight": (S, out, in), "<module>.bias": (S, out)}``) per sample.

    A Linear layer whose weight (or bias) is not in ``weights`` keeps its checkpoint value for it.
    """
    modules = parameter_owners(model, weights)
    for name in weights:
        owner, _, kind = name.rpartition(".")
        if not isinstance(modules[owner], nn.Linear) or kind not in ("weight", "bias"):
            raise ConfigError(
                f"'{name}' is not the weight or bias of a Linear layer; only those are sampled in batches"
            )

    def hook(name: str):
        def apply(module: nn.Linear, args: tuple, out: Tensor) -> Tensor:
            layout = runner.layout
            take = slice(layout.first, layout.first + layout.samples)
            weight = weights.get(f"{name}.weight")
            weight = weight[take] if weight is not None else module.weight.expand(layout.samples, -1, -1)
            bias = weights.get(f"{name}.bias")
            bias = bias[take] if bias is not None else module.bias
            rows = args[0].reshape(layout.samples, -1, module.in_features)  # (S, m * ..., in)
            if bias is None:
                sampled = torch.bmm(rows, weight.transpose(1, 2))
            else:
                sampled = torch.baddbmm(bias.expand(layout.samples, -1).unsqueeze(1), rows, weight.transpose(1, 2))
            return sampled.reshape(out.shape)

        return apply

    with hooked((module, "output", hook(name)) for name, module in modules.items()):
        yield
