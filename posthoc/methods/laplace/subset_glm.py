"""The linearised (GLM) predictive of a Laplace posterior over several Linear layers.

Around the checkpoint the logits are linear in the covered weights, so the block-diagonal posterior gives Gaussian
logits ``N(f*(x), Σ_blocks J Σ_block Jᵀ)``. A Linear layer's Jacobian for logit ``c`` is ``g_c aᵀ`` (``Σ_t g_c,t a_tᵀ``
over ``T`` positions): each block needs the layer's input ``a`` and the output gradients ``g_c``, from ``C`` backward
passes to zero tensors that hooks add to the outputs (no weight gradient). Unlike weight sampling (``pred="nn"``) this
(laplace-torch's ``pred_type="glm"``) does not let the prior's spread in unprobed directions wreck the predictions.

Example:
    >>> from torch import nn
    >>> from posthoc.methods.laplace.subset_glm import covered_linear_layers
    >>> net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    >>> layers = covered_linear_layers(net, ["0.weight", "0.bias", "2.weight", "2.bias"])
    >>> sorted(layers)
    ['0', '2']
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from posthoc.core.inputs import Inputs, run_model
from posthoc.core.modules import parameter_owners
from posthoc.engine.hooks import hooked
from posthoc.errors import ConfigError, InputError
from posthoc.methods.laplace.glm_predictive import DenseLogitGaussian
from posthoc.methods.laplace.structure import Curvature


def covered_linear_layers(model: nn.Module, param_names: list[str]) -> dict[str, nn.Linear]:
    """The Linear modules that own ``param_names``; a clear error for any other layer type."""
    layers = parameter_owners(model, param_names)
    for name, module in layers.items():
        if not isinstance(module, nn.Linear):
            raise ConfigError(
                f"pred='glm' over several layers covers Linear layers; '{name}' is a "
                f"{type(module).__name__}. Use pred='nn' (weight samples), or name Linear layers only"
            )
    return layers


def _tap(taps: dict[str, tuple[Tensor, Tensor]], name: str) -> Callable[[nn.Module, tuple, Tensor], Tensor]:
    """A forward hook recording the layer's input and adding a zero leaf to its output, whose gradient is ``∂f/∂z``."""

    def hook(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        leaf = torch.zeros_like(out, requires_grad=True)
        taps[name] = (args[0].detach(), leaf)
        return out + leaf

    return hook


def tapped_forward(
    model: nn.Module, layers: dict[str, nn.Linear], x: Inputs
) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]]:
    """The logits of ``x`` and, per layer, its (detached) input and the zero leaf added to its output."""
    taps: dict[str, tuple[Tensor, Tensor]] = {}
    with torch.enable_grad(), hooked((layer, "output", _tap(taps, name)) for name, layer in layers.items()):
        logits = run_model(model, x)
    if set(taps) != set(layers):
        missing = sorted(set(layers) - set(taps))
        raise InputError(
            f"the covered layers {missing} were not called in the forward pass; pass layers the model uses"
        )
    return logits, taps


def positions_per_row(model: nn.Module, layers: dict[str, nn.Linear], row: Inputs) -> int:
    """The most positions (tokens, patches) one example feeds any of ``layers`` (1 for ``(N, features)`` inputs)."""
    seen = [1]
    with (
        torch.no_grad(),
        hooked(
            (layer, "input", lambda module, args: seen.append(args[0][0].numel() // module.in_features))
            for layer in layers.values()
        ),
    ):
        run_model(model, row)
    return max(seen)


def logit_gaussian(
    model: nn.Module, layers: dict[str, nn.Linear], blocks: list[Curvature], x: Inputs, prior_precision: float
) -> DenseLogitGaussian:
    """Gaussian logits ``N(f*(x), J Σ Jᵀ)`` of a block-diagonal posterior over ``layers`` for inputs ``x``."""
    logits, factors = jacobian_factors(model, layers, x)
    out = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
    return DenseLogitGaussian(logits.to(out), jacobian_covariance(factors, blocks, prior_precision))


def jacobian_factors(
    model: nn.Module, layers: dict[str, nn.Linear], x: Inputs
) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]]:
    """The outputs ``(n, C)`` of ``x`` (detached) and, per layer, the outputs' gradients in its output ``g``
    ``(n, C, [T,] out)`` and its inputs ``a`` ``(n, [T,] in)`` (float64): what ``J Σ Jᵀ`` needs at any prior.

    Example:
        >>> from posthoc.methods.laplace.subset_glm import covered_linear_layers, jacobian_factors
        >>> from posthoc_apps.demo.examples import model, x
        >>> logits, factors = jacobian_factors(model, covered_linear_layers(model, ["3.weight"]), x)
        >>> logits.shape, factors["3"][0].shape, factors["3"][1].shape   # g: (n, C, out), a: (n, in)
        (torch.Size([8, 3]), torch.Size([8, 3, 3]), torch.Size([8, 64]))
    """
    logits, taps = tapped_forward(model, layers, x)
    with torch.enable_grad():
        logits = logits[:, None] if logits.dim() == 1 else logits  # one output squeezed to (n,): its (n, 1)
        leaves = [taps[name][1] for name in layers]
        classes = logits.shape[-1]
        gradients = [[] for _ in leaves]  # per layer: C tensors (n, [T,] out)
        for c in range(classes):
            for store, grad in zip(
                gradients, torch.autograd.grad(logits[:, c].sum(), leaves, retain_graph=c < classes - 1)
            ):
                store.append(grad)
    dtype = torch.promote_types(logits.dtype, torch.float64)
    factors = {}
    for name, grads in zip(layers, gradients):
        g = torch.stack(grads, 1).to(dtype)  # (n, C, [T,] out)
        a = taps[name][0].to(dtype)
        if a.dim() > 2:
            a, g = a.reshape(a.shape[0], -1, a.shape[-1]), g.reshape(*g.shape[:2], -1, g.shape[-1])
        factors[name] = (g, a)
    return logits.detach(), factors


def jacobian_covariance(
    factors: dict[str, tuple[Tensor, Tensor]], blocks: list[Curvature], prior_precision: float
) -> Tensor:
    """``Σ_blocks J Σ_block Jᵀ`` ``(n, C, C)`` from :func:`jacobian_factors` at ``prior_precision``."""
    by_name = {block.name: block for block in blocks}
    covariance = None
    for name, (g, a) in factors.items():
        for field, inputs in (("weight", a), ("bias", None)):
            block = by_name.get(f"{name}.{field}")
            if block is not None:
                term = block.jacobian_variance(g, inputs, prior_precision)
                covariance = term if covariance is None else covariance + term
    return covariance


def bytes_per_row(layers: dict[str, nn.Linear], classes: int, samples: int = 0, positions: int = 1) -> int:
    """Float64 bytes of :func:`logit_gaussian` per input row, with ``samples`` logit draws over ``positions`` tokens."""
    width = sum(layer.out_features + layer.in_features for layer in layers.values())
    if positions > 1:
        width = positions * width + sum(layer.out_features * layer.in_features for layer in layers.values())
    return 8 * classes * (2 * width + 3 * classes + 3 * samples)
