"""Multiplicative node variables on the inputs of a model's ``Conv2d`` / ``Linear`` layers.

Each selected layer gets one latent variable per input node (per input channel of a Conv, per input feature of a
Linear, per last-dimension feature for token or channels-last inputs), following a mixture of ``K`` Gaussians
``q(z) = 1/K sum_k N(mu_k, sigma_k^2)`` with ``sigma = softplus(rho)``. They are applied by forward pre-hooks
(``x -> x * z``) that exist only inside :meth:`NodeSet.sampling`, so the model's modules and ``state_dict`` keys stay
as they are and, outside it, the model computes exactly what the checkpoint computes. A layer's input must be the
batch, or the batch repeated batch-major (``B * m`` rows, e.g. attention windows: each block of ``m`` rows shares
its example's variables).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.methods.ibnn.nodes import NodeSet
    >>> net = nn.Sequential(nn.Flatten(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    >>> nodes = NodeSet(net, components=2)
    >>> nodes.layer_names
    ['1', '3']
    >>> with nodes.sampling(torch.arange(6) % 2):
    ...     out = net(torch.randn(6, 4))
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posthoc.core.checks import positive_int
from posthoc.engine.head import find_head
from posthoc.engine.hooks import hooked
from posthoc.engine.random_draws import randn
from posthoc.errors import ConfigError, HeadNotFoundError, InputError

NODE_LAYERS = (nn.Conv2d, nn.Linear)
#: the smallest initial standard deviation (a draw of ``|N(init_std, spread^2)|`` near 0 is raised to it)
MIN_INIT_STD = 1e-4


def node_count(layer: nn.Module) -> int:
    """Number of input nodes of a ``Conv2d`` (input channels) or ``Linear`` (input features)."""
    return layer.in_channels if isinstance(layer, nn.Conv2d) else layer.in_features


def count_nodes(model: nn.Module, layers: Sequence[str] | None = None, *, stem: bool = True, head: bool = True) -> int:
    """Node variables per mixture component that iBNN puts on ``model`` (the paper's Table 1 counts), without fitting.

    Example:
        >>> import torchvision
        >>> from posthoc.methods.ibnn.nodes import count_nodes
        >>> count_nodes(torchvision.models.resnet50(weights=None))
        24579
    """
    return sum(node_count(m) for _, m in select_layers(model, layers, stem=stem, head=head))


def inverse_softplus(std: Tensor) -> Tensor:
    """``rho`` with ``softplus(rho) == std``; ``std = 0`` gives ``-inf`` (an exact zero std)."""
    return torch.where(std > 20, std, torch.log(torch.expm1(std)))


def select_layers(
    model: nn.Module, layers: Sequence[str] | None = None, *, stem: bool = True, head: bool = True
) -> list[tuple[str, nn.Module]]:
    """The ``Conv2d`` / ``Linear`` layers (subclasses included) that get node variables: those in the modules ``layers``
    (``None``: all), less the first one unless ``stem`` and the classifier head (else the last) unless ``head``.

    Example:
        >>> import torchvision
        >>> from posthoc.methods.ibnn.nodes import select_layers
        >>> [name for name, _ in select_layers(torchvision.models.resnet18(), head=False)][:2]
        ['conv1', 'layer1.0.conv1']
    """
    every = [(name, m) for name, m in model.named_modules() if isinstance(m, NODE_LAYERS)]
    if not every:
        raise ConfigError(
            f"{type(model).__name__} has no nn.Conv2d or nn.Linear layer to attach node variables to; "
            "iBNN needs at least one"
        )
    if layers is None:
        chosen = list(every)
    else:
        if isinstance(layers, str) or not all(isinstance(name, str) for name in layers):
            raise ConfigError(f"layers must be a list of module names, e.g. ['layer4', 'fc'], got {layers!r}")
        known = dict(model.named_modules())
        missing = [name for name in layers if name not in known]
        if missing:
            shown = ", ".join(name for name, _ in every[:20]) + (" ..." if len(every) > 20 else "")
            raise ConfigError(f"layers {missing} do not exist in {type(model).__name__}; Conv/Linear layers: {shown}")
        wanted = {id(m) for name in layers for m in known[name].modules() if isinstance(m, NODE_LAYERS)}
        chosen = [(name, m) for name, m in every if id(m) in wanted]
    if not stem:
        chosen = [(name, m) for name, m in chosen if m is not every[0][1]]
    if not head:
        try:
            head_module = find_head(model)[1]
        except HeadNotFoundError:
            head_module = every[-1][1]
        chosen = [(name, m) for name, m in chosen if m is not head_module]
    if not chosen:
        raise ConfigError(
            f"the selection (layers={list(layers) if layers is not None else None}, stem={stem}, head={head}) "
            "matches no nn.Conv2d / nn.Linear layer; name layers that contain some, or include the stem/head"
        )
    return chosen


class NodeVariables(nn.Module):
    """The ``K``-component Gaussian mixture over the ``D`` input nodes of one layer: ``mean`` and ``rho`` ``(K, D)``,
    the standard deviations ``softplus(rho)``, starting at ``N(1, init_mean_std^2)`` and
    ``|N(init_std, init_std_spread^2)|``."""

    def __init__(
        self,
        nodes: int,
        components: int,
        *,
        init_mean_std: float,
        init_std: float,
        generator: torch.Generator,
        init_std_spread: float = 0.0,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        mean = 1.0 + init_mean_std * torch.randn(components, nodes, generator=generator)
        std = torch.full((components, nodes), float(init_std))
        if init_std_spread > 0:
            std = (std + init_std_spread * torch.randn(components, nodes, generator=generator)).abs()
        self.mean = nn.Parameter(mean.to(device))
        self.rho = nn.Parameter(inverse_softplus(std.clamp_min(MIN_INIT_STD)).to(device))

    @property
    def std(self) -> Tensor:
        """``(K, D)`` component standard deviations."""
        return F.softplus(self.rho)

    def draw(self, components: Tensor, generator: torch.Generator | None, sample: bool, scale: float = 1.0) -> Tensor:
        """``(B, D)`` node values for examples routed to ``components``, their noise scaled by ``scale``;
        the component means if not ``sample``."""
        mean = self.mean.index_select(0, components)
        if not sample:
            return mean
        noise = randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        return mean + scale * self.std.index_select(0, components) * noise


class NodeSet(nn.Module):
    """Node variables for a model's selected layers, applied by forward pre-hooks while sampling.

    The selected layers (:func:`select_layers`) are held as plain references (no ``state_dict`` keys), so a deep copy of
    a method holding both the model and its ``NodeSet`` acts on the copied layers. ``prior_std`` is ``s`` of the prior
    ``N(1, s^2)``; the initialisation is :class:`NodeVariables`'s, seeded by ``seed``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        components: int = 4,
        prior_std: float = 0.1,
        init_mean_std: float = 0.05,
        init_std: float = 0.05,
        init_std_spread: float = 0.0,
        layers: Sequence[str] | None = None,
        stem: bool = True,
        head: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_node_options(components, prior_std, init_mean_std, init_std, init_std_spread)
        selected = select_layers(model, layers, stem=stem, head=head)
        device = next((p.device for p in model.parameters()), None)
        generator = torch.Generator().manual_seed(seed)
        self.components = components
        self.prior_std = float(prior_std)
        self.layer_names = [name for name, _ in selected]
        init = {"init_mean_std": init_mean_std, "init_std": init_std, "init_std_spread": init_std_spread}
        self.groups = nn.ModuleList(
            NodeVariables(node_count(m), components, **init, generator=generator, device=device) for _, m in selected
        )
        self.register_buffer("called", torch.ones(len(selected), dtype=torch.bool, device=device))
        self._route: Tensor | None = None
        self._generator: torch.Generator | None = None
        self._sample = True
        self._scale = 1.0
        self._seen: set[int] = set()
        self._largest_input = 0
        self._layers = [m for _, m in selected]

    def _augment(self, index: int, module: nn.Module, args: tuple) -> tuple | None:
        if not args or not isinstance(args[0], Tensor):
            return None
        x = args[0]
        self._seen.add(index)
        self._largest_input = max(self._largest_input, x[0].numel() * x.element_size() if x.dim() else 0)
        z = self.groups[index].draw(self._route, self._generator, self._sample, self._scale).to(x.dtype)
        return (x * _broadcastable(z, x, module, self.layer_names[index]), *args[1:])

    @contextmanager
    def sampling(
        self, components: Tensor, *, generator: torch.Generator | None = None, sample: bool = True, scale: float = 1.0
    ) -> Iterator[NodeSet]:
        """Turn the hooks on: example ``i`` of each forward uses component ``components[i]`` ``(B,)`` and nodes
        ``z = mu_k + scale * sigma_k * eps`` (``sample=False``: the component means)."""
        components = components.to(self.called.device, torch.long)
        if components.numel() and (components.min() < 0 or components.max() >= self.components):
            raise InputError(f"component indices must lie in [0, {self.components}), got {components.tolist()[:8]}...")
        self._route, self._generator, self._sample, self._scale = components, generator, sample, scale
        self._seen, self._largest_input = set(), 0
        try:
            with hooked((layer, "input", partial(self._augment, index)) for index, layer in enumerate(self._layers)):
                yield self
        finally:
            self._route, self._generator = None, None

    @property
    def seen(self) -> list[str]:
        """Names of the layers whose hooks ran inside the last :meth:`sampling` block."""
        return [self.layer_names[i] for i in sorted(self._seen)]

    @property
    def largest_input_bytes(self) -> int:
        """Bytes of the largest per-example layer input seen inside the last :meth:`sampling` block."""
        return self._largest_input

    def mark_called(self) -> None:
        """Record which layers ran in the last forward: the others never touch the output (e.g. weights
        read directly by a functional attention) and are left out of the KL."""
        flags = torch.zeros_like(self.called)
        flags[sorted(self._seen)] = True
        self.called.copy_(flags)

    def kl(self) -> Tensor:
        """KL to the prior with the component-mean approximation, summed over nodes of called layers: the mixture is
        replaced by the law ``N(mbar, vbar)`` of the mean of one draw per component (``mbar = 1/K sum_k mu_k``,
        ``vbar = 1/K^2 sum_k sigma_k^2``), whose KL to ``N(1, s^2)`` is closed form (exact for ``K = 1``)."""
        total = self.called.new_zeros((), dtype=torch.float32)
        s2 = self.prior_std**2
        for group, called in zip(self.groups, self.called.tolist()):
            if not called:
                continue
            k = group.mean.shape[0]
            mean = group.mean.float().mean(0)
            var = group.std.float().square().sum(0) / k**2
            total = total + (0.5 * (math.log(s2) - var.log()) + (var + (mean - 1).square()) / (2 * s2) - 0.5).sum()
        return total

    @torch.no_grad()
    def set_(self, mean: float | Tensor | None = None, std: float | Tensor | None = None) -> None:
        """Set every layer's component means and/or standard deviations (broadcast to ``(K, D)``; ``std=0``: the
        nodes are deterministic)."""
        for group in self.groups:
            if mean is not None:
                group.mean.copy_(torch.as_tensor(mean, dtype=group.mean.dtype).expand_as(group.mean))
            if std is not None:
                value = torch.as_tensor(std, dtype=group.rho.dtype).expand_as(group.rho)
                group.rho.copy_(inverse_softplus(value))

    @property
    def nodes_per_component(self) -> int:
        """Node variables per mixture component (the paper's Table 1 count for the selected layers)."""
        return sum(g.mean.shape[1] for g in self.groups)

    def extra_repr(self) -> str:
        return (
            f"layers={len(self.layer_names)}, nodes={self.nodes_per_component}, components={self.components}, "
            f"prior_std={self.prior_std}"
        )


def check_node_options(
    components: int, prior_std: float, init_mean_std: float, init_std: float, init_std_spread: float = 0.0
) -> None:
    """Refuse out-of-range node options with the valid range."""
    positive_int(components, "components")
    for name, value, allow_zero in (
        ("prior_std", prior_std, False),
        ("init_mean_std", init_mean_std, True),
        ("init_std", init_std, False),
        ("init_std_spread", init_std_spread, True),
    ):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{name} must be a finite number {bound}, got {value!r}")


def _broadcastable(z: Tensor, x: Tensor, module: nn.Module, name: str) -> Tensor:
    """Shape ``(B, D)`` node values to multiply a layer input ``x`` (rows batch-major, nodes on the
    channel axis of a Conv, on the last axis otherwise)."""
    rows, nodes = z.shape
    if x.dim() < 2 or x.shape[0] % rows != 0:
        raise InputError(
            f"layer '{name}' got an input of shape {tuple(x.shape)} whose first dimension is not the batch "
            f"({rows} examples); node variables need batch-first layer inputs: exclude this layer with layers=..."
        )
    if x.shape[0] != rows:
        z = z.repeat_interleave(x.shape[0] // rows, dim=0)
    if isinstance(module, nn.Conv2d):
        return z.reshape(z.shape[0], nodes, *([1] * (x.dim() - 2)))
    return z.reshape(z.shape[0], *([1] * (x.dim() - 2)), nodes)
