"""Where a model drops units: finding its own dropout, placing new dropout, and sampling masks.

A :class:`DropoutSite` (a module name, its input or output, a rate) is applied by :func:`sampling` through temporary
hooks that multiply activations by Bernoulli masks (:mod:`.masks`). The model stays in eval mode: BatchNorm keeps its
running statistics, its own ``nn.Dropout`` modules stay inert, and nothing is left behind, so inserting dropout needs
no copy of the model. Sites are the model's own ``nn.Dropout*`` modules (the 1d/2d/3d ones drop whole channels), timm's
functional ``drop_rate`` (a site on the classifier's input), or inserted dropout: ``where="head"``, ``"blocks"``
(:func:`block_names`) or module names (dropout on each one's input).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.methods.mc_dropout.sites import own_dropout_sites, sampling
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 3))
    >>> own_dropout_sites(net)
    [DropoutSite(name='2', at='output', p=0.2, channel_dims=0)]
    >>> with sampling(net, own_dropout_sites(net), generator=torch.Generator().manual_seed(0)):
    ...     logits = net(torch.randn(5, 4))  # a fresh mask for every row
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from posthoc.core.inputs import Inputs
from posthoc.engine.head import find_head
from posthoc.engine.hooks import hooked
from posthoc.errors import ConfigError
from posthoc.methods.mc_dropout.masks import dropped

#: rate of inserted dropout when ``p`` is neither given nor chosen: small, as dropout inserted into a model trained
#: without it costs in-distribution confidence (docs/methods/mc-dropout.md)
DEFAULT_INSERT_P = 0.05

_CHANNEL_DIMS = {nn.Dropout1d: 1, nn.Dropout2d: 2, nn.Dropout3d: 3}


@dataclass(frozen=True)
class DropoutSite:
    """Dropout applied to the ``at`` (``"input"`` or ``"output"``) of module ``name``; ``channel_dims`` is 0 for
    element-wise masks and ``k`` for ``nn.Dropout{k}d``-style masks that drop whole channels."""

    name: str
    at: str
    p: float
    channel_dims: int = 0


def own_dropout_sites(model: nn.Module) -> list[DropoutSite]:
    """The dropout the model was trained with: active ``nn.Dropout*`` modules and timm's ``drop_rate``.

    Example:
        >>> import torchvision
        >>> from posthoc.methods.mc_dropout.sites import own_dropout_sites
        >>> own_dropout_sites(torchvision.models.efficientnet_b0())[-1]
        DropoutSite(name='classifier.0', at='output', p=0.2, channel_dims=0)
    """
    sites = []
    for name, module in model.named_modules():
        if type(module) in (nn.Dropout, *_CHANNEL_DIMS) and module.p > 0:
            sites.append(DropoutSite(name, "output", float(module.p), _CHANNEL_DIMS.get(type(module), 0)))
    rate = _timm_functional_rate(model, sites)
    if rate > 0:
        head_name, _ = find_head(model)
        sites.append(DropoutSite(head_name, "input", rate))
    return sites


def _timm_functional_rate(model: nn.Module, module_sites: list[DropoutSite]) -> float:
    """timm's ``drop_rate`` when timm applies it functionally (no dropout module carries that rate)."""
    rate = getattr(model, "drop_rate", 0.0)
    if not isinstance(rate, (int, float)) or rate <= 0 or not hasattr(model, "forward_head"):
        return 0.0
    if any(abs(site.p - rate) < 1e-12 for site in module_sites):
        return 0.0
    return float(rate)


def block_names(model: nn.Module) -> list[str]:
    """The modules after which ``where="blocks"`` drops units: timm's ``feature_info`` stages, else ResNet's
    ``layer1..layerN``, else the children of a ``features`` ``nn.Sequential`` (else none).

    Example:
        >>> import torchvision
        >>> from posthoc.methods.mc_dropout.sites import block_names
        >>> block_names(torchvision.models.resnet18())
        ['layer1', 'layer2', 'layer3', 'layer4']
    """
    names = dict(model.named_modules())
    info = getattr(model, "feature_info", None)
    if isinstance(info, Sequence):
        stages = [entry.get("module") for entry in info if isinstance(entry, dict)]
        stages = [stage for stage in stages if stage in names and stage]
        if stages:
            return stages
    layers = sorted((n for n in names if re.fullmatch(r"layer\d+", n)), key=lambda n: int(n[5:]))
    if layers:
        return layers
    features = names.get("features")
    if isinstance(features, nn.Sequential) and len(features) > 1:
        return [f"features.{child}" for child, _ in features.named_children()]
    return []


def inserted_sites(
    model: nn.Module, where: str | Sequence[str], p: float, example: Inputs | None = None, head: str | None = None
) -> list[DropoutSite]:
    """Sites for new dropout of rate ``p``; ``where`` is ``"head"``, ``"blocks"`` or module names.

    Example:
        >>> import torchvision
        >>> from posthoc.methods.mc_dropout.sites import inserted_sites
        >>> inserted_sites(torchvision.models.resnet18(), "head", 0.1)
        [DropoutSite(name='fc', at='input', p=0.1, channel_dims=0)]
    """
    if where == "head":
        name = find_head(model, head, example)[0]
        return [DropoutSite(name, "input", head_dropout_rate(model, name) or p)]
    if where == "blocks":
        stages = block_names(model)
        if stages:
            head_name = find_head(model, head, example)[0]
            return [DropoutSite(name, "output", p) for name in stages] + [DropoutSite(head_name, "input", p)]
        linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        if not linears:
            raise ConfigError(
                f"where='blocks' found no stages and no nn.Linear in {type(model).__name__}; "
                "name the modules to put dropout before, e.g. where=['layer3', 'fc']"
            )
        return [DropoutSite(name, "input", p) for name in linears]
    return [DropoutSite(name, "input", p) for name in where]


def head_dropout_rate(model: nn.Module, head_name: str) -> float | None:
    """The rate of the model's own dropout right before its head, or ``None``: an ``nn.Dropout`` named ``dropout``
    beside the head (Hugging Face classifiers) or just before it in an ``nn.Sequential``.

    Example:
        >>> from torch import nn
        >>> from posthoc.methods.mc_dropout.sites import head_dropout_rate
        >>> head_dropout_rate(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 3)), "2")
        0.3
    """
    parent_name, _, child = head_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    candidate = getattr(parent, "dropout", None)
    if isinstance(parent, nn.Sequential):
        names = [name for name, _ in parent.named_children()]
        position = names.index(child)
        candidate = parent[position - 1] if position > 0 else None
    if type(candidate) is nn.Dropout and candidate.p > 0:
        return float(candidate.p)
    return None


def check_module_names(model: nn.Module, names: Sequence[str]) -> None:
    """Raise :class:`ConfigError` for names that are not modules of ``model``, listing valid ones."""
    available = {name for name, _ in model.named_modules() if name}
    missing = [name for name in names if name not in available]
    if missing:
        shown = sorted(available)
        listing = ", ".join(shown[:30]) + (" ..." if len(shown) > 30 else "")
        raise ConfigError(f"where names module(s) {missing} that the model does not have; available: {listing}")


def with_rate(sites: Sequence[DropoutSite], p: float) -> list[DropoutSite]:
    """The same sites, all with rate ``p``."""
    return [replace(site, p=p) for site in sites]


@contextmanager
def sampling(
    model: nn.Module,
    sites: Sequence[DropoutSite],
    *,
    generator: torch.Generator | None = None,
    units: dict[str, int] | None = None,
) -> Iterator[nn.Module]:
    """Make ``model`` drop units at ``sites`` (fresh masks per row and call) inside the context, through temporary
    hooks; a dict ``units`` gets each site's :func:`dropout_units` under its name."""
    with hooked((model.get_submodule(site.name), site.at, _dropping(site, generator, units)) for site in sites):
        yield model


def dropout_units(x: Any, channel_dims: int = 0) -> int:
    """How many units of one example of ``x`` a dropout mask draws for (whole channels for ``channel_dims > 0``).

    Example:
        >>> import torch
        >>> from posthoc.methods.mc_dropout.sites import dropout_units
        >>> dropout_units(torch.zeros(8, 16, 7, 7)), dropout_units(torch.zeros(8, 16, 7, 7), channel_dims=2)
        (784, 16)
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        return 0
    shape = x.shape[1:]
    if channel_dims and x.dim() >= channel_dims + 2:
        shape = shape[: len(shape) - channel_dims]
    return math.prod(shape)


def _dropping(site: DropoutSite, generator: torch.Generator | None, units: dict[str, int] | None) -> Callable[..., Any]:
    """The hook applying ``site``'s dropout to its module's first input (``at="input"``) or its output."""

    def drop(x: Any) -> Any:
        if units is not None:
            units[site.name] = dropout_units(x, site.channel_dims)
        return dropped(x, site.p, channel_dims=site.channel_dims, generator=generator)

    if site.at == "input":
        return lambda module, args: (drop(args[0]), *args[1:]) if args else args
    return lambda module, args, output: drop(output)
