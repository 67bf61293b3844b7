"""ABNN's Bayesian normalisation layer (BNL), as hooks on a network's own BatchNorm layers.

A BatchNorm layer returns ``γ ⊙ x̂ + β``; its Bayesian version (Franchi et al., CVPR 2024) multiplies the affine scale
by random noise at training *and* test time::

    BNL(z) = γ ⊙ x̂ ⊙ (1 + α ε) + β,    ε ~ N(0, 1) per activation, drawn at every forward pass,

as torch-uncertainty's ``BatchNormAdapter2d``. From the layer's own output ``u = γ x̂ + β`` the BNL is
``u + α ε (u - β)`` (:func:`bayesian_normalisation`), so no layer is replaced: :func:`noisy` hooks the model's
BatchNorm layers for the duration of a context.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from posthoc.engine.hooks import hooked


def bayesian_normalisation(output: Tensor, bias: Tensor | None, noise: Tensor, alpha: float) -> Tensor:
    """``γ x̂ (1 + α ε) + β`` from a BatchNorm layer's output ``γ x̂ + β`` (``(N, C, ...)``), its bias ``β`` (``None``: 0)
    and the noise ``ε`` (the output's shape).

    Example:
        >>> import torch
        >>> from posthoc.methods.abnn.layers import bayesian_normalisation
        >>> out, bias = torch.tensor([[3.0, 1.0]]), torch.tensor([1.0, 1.0])
        >>> bayesian_normalisation(out, bias, torch.ones(1, 2), alpha=0.5)    # γx̂ = [2, 0] scaled by 1.5
        tensor([[4., 1.]])
    """
    scaled = output if bias is None else output - bias.reshape(1, -1, *([1] * (output.dim() - 2)))
    return torch.addcmul(output, noise, scaled, value=alpha)  # one fused pass: the noise is the size of the activations


@contextmanager
def noisy(layers: Iterable[nn.Module], alpha: float, *, generator: torch.Generator | None = None) -> Iterator[None]:
    """Within the context, ``layers`` (BatchNorm layers) act as Bayesian normalisation layers with noise ``α``; each
    call draws fresh noise from ``generator`` (``None``: the global generator). ``α = 0`` leaves them as they are.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from posthoc.methods.abnn.layers import noisy
        >>> bn = nn.BatchNorm2d(2).eval()
        >>> z = torch.randn(3, 2, 4, 4)
        >>> with noisy([bn], alpha=0.1, generator=torch.Generator().manual_seed(0)):
        ...     torch.equal(bn(z), bn(z))                  # a new draw at every call
        False
    """
    if alpha == 0:
        yield
        return

    def hook(layer: nn.Module, args: tuple, output: Tensor) -> Tensor:
        noise = torch.randn(output.shape, generator=generator, device=output.device, dtype=output.dtype)
        return bayesian_normalisation(output, layer.bias, noise, alpha)

    with hooked([(layer, "output", hook) for layer in layers]):
        yield
