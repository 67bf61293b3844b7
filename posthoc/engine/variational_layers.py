"""Factorised Gaussian posteriors over the weights of a trained network's Linear / Conv2d layers.

A :class:`LayerPosterior` holds its own parameters for one layer (the user's layer is never changed).
:class:`VariationalLayers` gathers them and, inside :meth:`VariationalLayers.sampling`, replaces each layer's output
with a draw by the *local reparameterisation* (Kingma, Salimans and Welling, 2015): given its input ``a`` the output is
Gaussian with mean ``a W_mu^T + b_mu`` and variance ``(a * a) W_var^T + b_var``, one independent draw per row. It is
exact for Linear layers; for Conv2d, positions are drawn independently (as Molchanov et al. 2017 do).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.engine.variational_layers import VariationalLayers
    >>> from posthoc.methods.vi.gaussian import GaussianLayer      # a mean-field Gaussian LayerPosterior
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    >>> layers = VariationalLayers(net, {"2": GaussianLayer(net[2], init_std=0.1, prior_std=1.0, prior_mean="zero")})
    >>> inputs = torch.randn(5, 4)
    >>> with layers.sampling(generator=torch.Generator().manual_seed(0)):
    ...     logits = net(inputs)      # the last layer's output is a draw
    >>> bool((logits != net(inputs)).all())
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posthoc.engine.hooks import hooked
from posthoc.engine.random_draws import randn
from posthoc.errors import ConfigError

#: the layer types whose weights can be variational
SUPPORTED = (nn.Linear, nn.Conv2d)
#: added to the output variance before its square root (a zero variance has no gradient through sqrt)
VARIANCE_FLOOR = 1e-16

Moments = tuple[Tensor, Tensor, Tensor | None, Tensor | None]


class LayerPosterior(nn.Module):
    """A factorised posterior over one layer's weight and bias; subclasses define :meth:`moments` and :meth:`kl`."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        if not isinstance(layer, SUPPORTED):
            raise ConfigError(f"variational layers are Linear or Conv2d, got {type(layer).__name__}")
        if isinstance(layer, nn.Conv2d) and layer.padding_mode != "zeros":
            raise ConfigError(f"Conv2d layers with padding_mode={layer.padding_mode!r} are not supported; use 'zeros'")
        self.__dict__["layer"] = layer  # a reference, not a submodule: its weights are not the posterior's

    def moments(self) -> Moments:
        """``(weight mean, weight variance, bias mean or None, bias variance or None)``, float32."""
        raise NotImplementedError

    def kl(self) -> Tensor:
        """The KL divergence of the posterior from the prior (a scalar)."""
        raise NotImplementedError

    def parameter_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """``(locations, scales)``: the parameters that move the means, and those that set the spreads."""
        raise NotImplementedError

    def output_moments(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and variance of the layer's output for input ``x`` under the posterior (float32)."""
        weight_mean, weight_var, bias_mean, bias_var = self.moments()
        x = x.float()
        if isinstance(self.layer, nn.Linear):
            return F.linear(x, weight_mean, bias_mean), F.linear(x * x, weight_var, bias_var)
        conv = self.layer
        options = (conv.stride, conv.padding, conv.dilation, conv.groups)
        return F.conv2d(x, weight_mean, bias_mean, *options), F.conv2d(x * x, weight_var, bias_var, *options)

    @property
    def num_variables(self) -> int:
        """Scalar random variables: the weights, and the bias where it has a variance."""
        _, weight_var, _, bias_var = self.moments()
        return weight_var.numel() + (0 if bias_var is None else bias_var.numel())


def sample_output(mean: Tensor, var: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw of ``N(mean, var)`` per element, from ``generator`` if given.

    Example:
        >>> import torch
        >>> from posthoc.engine.variational_layers import sample_output
        >>> sample_output(torch.zeros(2), torch.zeros(2)).abs().max() < 1e-7
        tensor(True)
    """
    noise = randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    return mean + (var + VARIANCE_FLOOR).sqrt() * noise


def select_layers(model: nn.Module, layers: str | Sequence[str]) -> list[str]:
    """Names of the Linear / Conv2d modules that ``layers`` (``"all"``, or module names, containers included) selects.

    Example:
        >>> from torch import nn
        >>> from posthoc.engine.variational_layers import select_layers
        >>> select_layers(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2)), "all")
        ['0', '2']
    """
    requested = layers
    if layers == "all":
        layers = [""]
    if isinstance(layers, str) or not isinstance(layers, Sequence) or not layers:
        raise ConfigError(f"layers must be 'all' or a non-empty list of module names, got {layers!r}")
    modules = dict(model.named_modules())
    chosen: list[str] = []
    for name in layers:
        if not isinstance(name, str) or name not in modules:
            raise ConfigError(f"layers names a module the model does not have: {name!r}")
        for sub, module in modules[name].named_modules():
            full = f"{name}.{sub}" if name and sub else name or sub
            if isinstance(module, SUPPORTED) and full not in chosen:
                chosen.append(full)
    if not chosen:
        raise ConfigError(f"layers={requested!r} selects no Linear or Conv2d module of {type(model).__name__}")
    return chosen


#: the key of a model that is its own layer (a bare ``nn.Linear``, whose module name is ``""``)
ROOT_KEY = "<model>"


def layer_key(name: str) -> str:
    """The ``nn.ModuleDict`` key of the layer called ``name`` (dots become slashes; ``""`` is :data:`ROOT_KEY`).

    Example:
        >>> from posthoc.engine.variational_layers import layer_key
        >>> layer_key("blocks.0.fc"), layer_key("")
        ('blocks/0/fc', '<model>')
    """
    return name.replace(".", "/") if name else ROOT_KEY


def layer_name(key: str) -> str:
    """The module name of the layer stored under ``key`` (:func:`layer_key` undone)."""
    return "" if key == ROOT_KEY else key.replace("/", ".")


class VariationalLayers(nn.Module):
    """The posteriors of several layers of ``model`` by module name, and the hooks that sample them."""

    def __init__(self, model: nn.Module, posteriors: dict[str, LayerPosterior]) -> None:
        super().__init__()
        self.names = list(posteriors)
        # module names hold dots, which ModuleDict keys may not
        self.posteriors = nn.ModuleDict({layer_key(name): p for name, p in posteriors.items()})
        self.__dict__["targets"] = {name: model.get_submodule(name) for name in self.names}

    def __getitem__(self, name: str) -> LayerPosterior:
        return self.posteriors[layer_key(name)]

    def kl(self) -> Tensor:
        """The summed KL of every layer."""
        return torch.stack([self[name].kl() for name in self.names]).sum()

    @property
    def num_variables(self) -> int:
        return sum(self[name].num_variables for name in self.names)

    def parameter_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """Every layer's ``(locations, scales)`` parameters together."""
        locations, scales = [], []
        for name in self.names:
            loc, scale = self[name].parameter_groups()
            locations += loc
            scales += scale
        return locations, scales

    @contextmanager
    def sampling(self, generator: torch.Generator | None = None) -> Iterator[None]:
        """Replace every selected layer's output with a local-reparameterisation draw (see module docs)."""

        def draw(name: str):
            posterior = self[name]

            def replace(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
                return sample_output(*posterior.output_moments(args[0]), generator).to(out.dtype)

            return replace

        with hooked((self.targets[name], "output", draw(name)) for name in self.names):
            yield
