"""Pruning a sparse-VD posterior: which weights go, how sparse each layer is, and the pruned plain model.

A weight is pruned when its ``log alpha`` exceeds a threshold (3 in Molchanov et al. 2017:
``alpha > 20``, a dropout rate ``alpha / (1 + alpha)`` above 0.95). The random control prunes the
same number of weights in each layer, chosen uniformly at random (seeded).

Example:
    >>> import posthoc
    >>> from posthoc.methods.sparse_vd.pruning import pruned_copy, removed_weights, sparsity
    >>> from posthoc_apps.demo.examples import model, train_loader
    >>> um = posthoc.wrap(model, method="sparse-vd").fit(train_loader, epochs=10)
    >>> layers = um.method.layers                       # the fitted log alpha of each weight
    >>> removed = removed_weights(layers, 3.0)
    >>> sparsity(removed)["total"]                      # 2 % of the weights after 10 epochs
    0.02
    >>> type(pruned_copy(um.method.model, layers, removed)).__name__      # an ordinary nn.Module
    'Sequential'
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.checks import integer
from posthoc.engine.variational_layers import VariationalLayers
from posthoc.errors import ConfigError


def check_threshold(threshold: Any) -> float:
    """``threshold`` as a float if it is a finite number (a ``log alpha``), else a :class:`~posthoc.ConfigError`.

    Example:
        >>> from posthoc.methods.sparse_vd.pruning import check_threshold
        >>> check_threshold(3)
        3.0
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise ConfigError(
            f"threshold must be a finite number (a log alpha; 3.0 prunes weights with alpha > 20), got {threshold!r}"
        )
    return float(threshold)


def removed_weights(
    layers: VariationalLayers, threshold: float, *, random: bool = False, seed: int = 0
) -> dict[str, Tensor]:
    """Per layer name, a boolean mask of the weights to remove: ``log alpha > threshold``, or with
    ``random=True`` as many weights per layer chosen at random (from a generator seeded with ``seed``)."""
    threshold = check_threshold(threshold)
    integer(seed, "seed")
    removed = {name: (layers[name].log_alpha() > threshold).detach() for name in layers.names}
    if not random:
        return removed
    generator = torch.Generator().manual_seed(seed)
    shuffled = {}
    for name, mask in removed.items():
        chosen = torch.zeros(mask.numel(), dtype=torch.bool)
        chosen[torch.randperm(mask.numel(), generator=generator)[: int(mask.sum())]] = True
        shuffled[name] = chosen.reshape(mask.shape).to(mask.device)
    return shuffled


def sparsity(removed: dict[str, Tensor]) -> dict[str, Any]:
    """``{"total": fraction removed, "layers": {name: fraction}, "removed": count, "weights": count}``.

    Example:
        >>> import torch
        >>> from posthoc.methods.sparse_vd.pruning import sparsity
        >>> sparsity({"fc": torch.tensor([True, False, False, False])})
        {'total': 0.25, 'layers': {'fc': 0.25}, 'removed': 1, 'weights': 4}
    """
    count = sum(int(mask.sum()) for mask in removed.values())
    weights = sum(mask.numel() for mask in removed.values())
    layers = {name: int(mask.sum()) / mask.numel() for name, mask in removed.items()}
    return {"total": count / weights, "layers": layers, "removed": count, "weights": weights}


@contextmanager
def restricted(layers: VariationalLayers, removed: dict[str, Tensor]) -> Iterator[None]:
    """Within the context, the posterior has the ``removed`` weights at zero (mean and variance)."""
    for name in layers.names:
        layers[name].removed = removed[name]
    try:
        yield
    finally:
        for name in layers.names:
            layers[name].removed = None


@torch.no_grad()
def pruned_copy(
    model: nn.Module, layers: VariationalLayers, removed: dict[str, Tensor], *, sparse: bool = False
) -> nn.Module:
    """A deep copy of ``model`` whose variational layers hold the posterior means with the ``removed`` weights at zero:
    a plain ``nn.Module``. ``sparse=True`` stores the pruned Linear weights, frozen, in sparse CSR layout (Conv2d
    weights stay dense: PyTorch has no sparse convolution)."""
    pruned = copy.deepcopy(model)
    for name in layers.names:
        module, posterior = pruned.get_submodule(name), layers[name]
        weight = posterior.theta.detach().masked_fill(removed[name], 0.0).to(module.weight.device, module.weight.dtype)
        if sparse and isinstance(module, nn.Linear):
            module.weight = nn.Parameter(weight.to_sparse_csr(), requires_grad=False)
        else:
            module.weight.copy_(weight)
        if posterior.bias is not None:
            module.bias.copy_(posterior.bias.detach().to(module.bias.dtype))
    return pruned
