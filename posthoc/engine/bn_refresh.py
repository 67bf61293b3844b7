"""Recomputing BatchNorm statistics exactly over given batches (after the weights changed).

A model with new weights (a SWAG sample, an SWA average) needs its BatchNorm running statistics recomputed.
:func:`batchnorm_statistics` runs the batches with only the BatchNorm layers in training mode and accumulates each
layer's per-channel input mean and variance exactly over all examples and ranks (Chan's pairwise merge in float64), so
unequal batch sizes give the statistics of the whole data. Only :func:`refresh_batchnorm` changes the model.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.engine.bn_refresh import batchnorm_statistics, refresh_batchnorm
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).eval()
    >>> batches = [3.0 + torch.randn(64, 4) for _ in range(3)]
    >>> stats = batchnorm_statistics(net, batches)
    >>> sorted(stats)
    ['1.num_batches_tracked', '1.running_mean', '1.running_var']
    >>> refresh_batchnorm(net, batches)[1].num_batches_tracked   # writes them into the model
    tensor(3)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from posthoc.core import distributed
from posthoc.core.inputs import Inputs, run_model, run_model_with
from posthoc.core.modules import eval_mode
from posthoc.engine.hooks import hooked
from posthoc.errors import InputError


def batchnorm_layers(model: nn.Module, names: Iterable[str] | None = None) -> dict[str, _BatchNorm]:
    """The BatchNorm layers of ``model`` that keep running statistics (optionally only ``names``)."""
    layers = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, _BatchNorm) and module.track_running_stats and module.running_mean is not None
    }
    if names is not None:
        keep = set(names)
        layers = {name: module for name, module in layers.items() if name in keep}
    return layers


class _ChannelMoments:
    """Exact running per-channel mean and sum of squared deviations (float64)."""

    def __init__(self) -> None:
        self.count = 0
        self.mean: Tensor | None = None
        self.sum_sq: Tensor | None = None

    def add(self, x: Tensor) -> None:
        flat = x.detach().transpose(0, 1).reshape(x.shape[1], -1).double()
        count = flat.shape[1]
        mean = flat.mean(1)
        sum_sq = ((flat - mean[:, None]) ** 2).sum(1)
        if self.mean is None:
            self.count, self.mean, self.sum_sq = count, mean, sum_sq
            return
        total = self.count + count
        delta = mean - self.mean
        self.mean = self.mean + delta * (count / total)
        self.sum_sq = self.sum_sq + sum_sq + delta**2 * (self.count * count / total)
        self.count = total

    def merge_across_ranks(self) -> None:
        """Combine the moments of every ``torch.distributed`` rank exactly (a no-op in one process)."""
        if not distributed.active() or self.mean is None:
            return
        count = distributed.all_reduce_sum(
            torch.tensor(float(self.count), dtype=torch.float64, device=self.mean.device)
        )
        mean = distributed.all_reduce_sum(self.mean * self.count) / count
        # Σ_r [sum_sq_r + n_r (mean_r - mean)²] = Σ_r (sum_sq_r + n_r mean_r²) - N mean²
        squares = distributed.all_reduce_sum(self.sum_sq + self.count * self.mean**2)
        self.count, self.mean, self.sum_sq = int(count.item()), mean, (squares - count * mean**2).clamp_min(0)


@torch.no_grad()
def batchnorm_statistics(
    model: nn.Module,
    batches: Iterable[Inputs],
    *,
    parameters: Mapping[str, Tensor] | None = None,
    layers: Iterable[str] | None = None,
) -> dict[str, Tensor]:
    """Exact BatchNorm statistics of ``model`` over ``batches``, as ``{buffer name: tensor}``.

    ``parameters`` override some of the model's (e.g. a SWAG sample); ``layers`` names the BatchNorm layers to
    recompute (default: all). The model is left as it is. Returns each layer's ``running_mean``, ``running_var``
    (unbiased, as PyTorch stores it) and ``num_batches_tracked``.
    """
    selected = batchnorm_layers(model, layers)
    if not selected:
        return {}
    moments = {name: _ChannelMoments() for name in selected}
    state = dict(parameters or {})
    for name, module in selected.items():  # clones: the layers' in-place running updates land here
        state[f"{name}.running_mean"] = module.running_mean.clone()
        state[f"{name}.running_var"] = module.running_var.clone()
        if module.num_batches_tracked is not None:
            state[f"{name}.num_batches_tracked"] = module.num_batches_tracked.clone()
    hooks = [
        (module, "input", lambda mod, args, acc=moments[name]: acc.add(args[0])) for name, module in selected.items()
    ]
    num_batches = 0
    with eval_mode(model), hooked(hooks):
        for module in selected.values():
            module.train()
        for x in batches:
            run_model_with(model, state, x)
            num_batches += 1
    if num_batches == 0:
        raise InputError("no batches to recompute BatchNorm statistics on; pass at least one batch of training inputs")
    out: dict[str, Tensor] = {}
    for name, module in selected.items():
        acc = moments[name]
        acc.merge_across_ranks()
        if acc.mean is None:
            continue  # a layer this forward pass did not reach keeps its statistics
        if acc.count < 2:
            raise InputError(f"BatchNorm layer '{name}' saw a single value per channel; pass larger batches")
        out[f"{name}.running_mean"] = acc.mean.to(module.running_mean.dtype)
        out[f"{name}.running_var"] = (acc.sum_sq / (acc.count - 1)).to(module.running_var.dtype)
        if module.num_batches_tracked is not None:
            out[f"{name}.num_batches_tracked"] = torch.tensor(num_batches, device=module.num_batches_tracked.device)
    return out


def refresh_batchnorm(model: nn.Module, batches: Iterable[Inputs], *, layers: Iterable[str] | None = None) -> nn.Module:
    """Recompute the BatchNorm statistics of ``model`` over ``batches`` in place (:func:`batchnorm_statistics`)."""
    stats = batchnorm_statistics(model, batches, layers=layers)
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for key, value in stats.items():
            buffers[key].copy_(value)
    return model


def normalise_groups(layer: _BatchNorm, z: Tensor, mean: Tensor, var: Tensor) -> Tensor:
    """``layer``'s eval-mode BatchNorm of each group of rows of ``z`` ``(G, n, C, ...)`` with that group's statistics
    ``mean, var`` ``(G, C)``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from posthoc.engine.bn_refresh import normalise_groups
        >>> layer = nn.BatchNorm1d(2).eval()
        >>> z = torch.randn(3, 5, 2)
        >>> torch.allclose(normalise_groups(layer, z, torch.zeros(3, 2), torch.ones(3, 2))[1], layer(z[1]))
        True
    """
    g, weight, bias = mean.shape[0], layer.weight, layer.bias  # the groups side by side as G x C channels
    flat = torch.nn.functional.batch_norm(
        z.transpose(0, 1).flatten(1, 2),
        mean.flatten().to(z.dtype),
        var.flatten().to(z.dtype),
        None if weight is None else weight.repeat(g),
        None if bias is None else bias.repeat(g),
        False,
        0.0,
        layer.eps,
    )
    return flat.unflatten(1, (g, -1)).transpose(0, 1)


def per_batch_statistics(model: nn.Module, batches: Iterable[Inputs]) -> tuple[Tensor, Tensor]:
    """Every BatchNorm layer's input mean and unbiased variance over each batch, each layer normalising with its
    batch's statistics (``(S, channels of all layers)`` each): what Monte Carlo BatchNorm samples.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from posthoc.engine.bn_refresh import per_batch_statistics
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).eval()
        >>> means, variances = per_batch_statistics(net, [torch.randn(8, 3), torch.randn(8, 3)])
        >>> means.shape, variances.shape
        (torch.Size([2, 4]), torch.Size([2, 4]))
    """
    layers, found = list(batchnorm_layers(model).values()), []

    def record(layer: _BatchNorm, args: tuple, output: Tensor) -> Tensor:
        z = args[0].transpose(0, 1).flatten(1)  # (C, rows x positions)
        found.append((z.mean(1), z.var(1, unbiased=True)))
        return normalise_groups(layer, args[0][None], found[-1][0][None], found[-1][1][None])[0]

    stats = []
    with torch.no_grad(), eval_mode(model), hooked([(layer, "output", record) for layer in layers]):
        for x in batches:
            found.clear()
            run_model(model, x)
            stats.append([torch.cat(column) for column in zip(*found)])
    return torch.stack([m for m, _ in stats]), torch.stack([v for _, v in stats])
