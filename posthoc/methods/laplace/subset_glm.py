"""The linearised (GLM) predictive of a Laplace posterior over several Linear layers.

Around the checkpoint the logits are linear in the covered weights, ``f(x) ≈ f*(x) + J(x) Δθ``,
so the block-diagonal posterior (one KFAC or diagonal block per parameter, from BackPACK) gives
Gaussian logits ``N(f*(x), Σ_blocks J Σ_block Jᵀ)``. For a Linear layer with input ``a`` and
output ``z``, the Jacobian of logit ``c`` in its weight is ``g_c aᵀ`` with ``g_c = ∂f_c/∂z``, so
the ``C x C`` covariance needs only ``a`` and the ``C`` output gradients ``g_c``:

- KFAC weight block ``(G ⊗ A + δI)⁻¹``: ``Σ_i (U_Gᵀ g_c)_i (U_Gᵀ g_c')_i w_i`` with
  ``w_i = Σ_j (U_Aᵀ a)_j² / (λ_i μ_j + δ)``; bias block: ``w_i = 1 / (λ_i + δ)``;
- diagonal block ``1 / (h + δ)``: ``Σ_o g_c,o g_c',o v_o`` with ``v_o = Σ_j a_j² / (h_oj + δ)``.

The gradients come from ``C`` backward passes per chunk to zero tensors that temporary hooks
(:func:`posthoc.engine.hooks.hooked`) add to the layers' outputs, so frozen weights need no
gradients and no weight gradient is formed. A layer applied over ``T`` positions (LoRA adapters on every token) has
the Jacobian ``Σ_t g_c,t a_tᵀ``, formed per example in the KFAC eigenbasis. This is the predictive
that laplace-torch calls ``pred_type="glm"``; unlike weight sampling (``pred="nn"``) it does not let the prior's spread in
directions the data never probed wreck the network's predictions.

Example:
    >>> net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    >>> layers = covered_linear_layers(net, ["0.weight", "0.bias", "2.weight", "2.bias"])
    >>> sorted(layers)
    ['0', '2']
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from posthoc.core.errors import ConfigError, InputError
from posthoc.core.inputs import Inputs, run_model
from posthoc.core.modules import parameter_owners
from posthoc.engine.hooks import hooked
from posthoc.methods.laplace.curvature import ParamCurvature
from posthoc.methods.laplace.glm_predictive import LogitGaussian


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


def tapped_forward(model: nn.Module, layers: dict[str, nn.Linear], x: Inputs) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]]:
    """The logits of ``x`` with gradients enabled and, per layer, its (detached) input and the zero leaf
    added to its output, whose gradient is ``∂/∂z`` of whatever is differentiated."""
    taps: dict[str, tuple[Tensor, Tensor]] = {}
    with torch.enable_grad(), hooked((layer, "output", _tap(taps, name)) for name, layer in layers.items()):
        logits = run_model(model, x)
    if set(taps) != set(layers):
        missing = sorted(set(layers) - set(taps))
        raise InputError(f"the covered layers {missing} were not called in the forward pass; pass layers the model uses")
    return logits, taps


def positions_per_row(model: nn.Module, layers: dict[str, nn.Linear], row: Inputs) -> int:
    """The most positions (tokens, patches) one example feeds any of ``layers`` (1 for ``(N, features)`` inputs)."""
    seen = [1]
    with torch.no_grad(), hooked((layer, "input", lambda module, args: seen.append(args[0][0].numel() // module.in_features))
                                 for layer in layers.values()):
        run_model(model, row)
    return max(seen)


def logit_gaussian(model: nn.Module, layers: dict[str, nn.Linear], blocks: list[ParamCurvature], x: Inputs,
                   prior_precision: float) -> LogitGaussian:
    """Gaussian logits ``N(f*(x), J Σ Jᵀ)`` of a block-diagonal posterior over ``layers`` for inputs ``x``.

    A layer applied over positions (inputs ``(N, T, features)``, e.g. LoRA adapters on every token)
    has the Jacobian ``Σ_t g_c,t a_tᵀ`` per example, formed in the posterior's eigenbasis."""
    logits, taps = tapped_forward(model, layers, x)
    with torch.enable_grad():
        leaves = [taps[name][1] for name in layers]
        classes = logits.shape[-1]
        gradients = [[] for _ in leaves]  # per layer: C tensors (n, [T,] out)
        for c in range(classes):
            for store, grad in zip(gradients, torch.autograd.grad(logits[:, c].sum(), leaves, retain_graph=c < classes - 1)):
                store.append(grad)
    dtype = torch.promote_types(logits.dtype, torch.float64)
    covariance = logits.new_zeros((logits.shape[0], classes, classes), dtype=dtype)
    by_name = {block.name: block for block in blocks}
    for name, grads in zip(layers, gradients):
        g = torch.stack(grads, 1).to(dtype)  # (n, C, [T,] out)
        a = taps[name][0].to(dtype)
        if a.dim() > 2:
            a, g = a.reshape(a.shape[0], -1, a.shape[-1]), g.reshape(*g.shape[:2], -1, g.shape[-1])
        weight = by_name.get(f"{name}.weight")
        if weight is not None:
            covariance += _weight_term(g, a, weight, prior_precision) if a.dim() == 2 else _positional_weight_term(g, a, weight, prior_precision)
        bias = by_name.get(f"{name}.bias")
        if bias is not None:
            covariance += _bias_term(g if g.dim() == 3 else g.sum(2), bias, prior_precision)
    values, vectors = torch.linalg.eigh(covariance)
    out = logits.detach().dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
    return LogitGaussian(logits.detach().to(out), values.clamp_min(0).sqrt().to(out), vectors.to(out))


def bytes_per_row(layers: dict[str, nn.Linear], classes: int, samples: int = 0, positions: int = 1) -> int:
    """Float64 temporaries of :func:`logit_gaussian` per input row (gradients, rotations, C x C
    covariance and eigenvectors), plus ``samples`` logit draws for the MC link; layers applied over
    ``positions`` tokens also hold their ``T`` gradients and inputs and the ``C`` per-example Jacobians."""
    width = sum(layer.out_features + layer.in_features for layer in layers.values())
    if positions > 1:
        width = positions * width + sum(layer.out_features * layer.in_features for layer in layers.values())
    return 8 * classes * (2 * width + 3 * classes + 3 * samples)


def _weight_term(g: Tensor, a: Tensor, block: ParamCurvature, prior_precision: float) -> Tensor:
    if block.diagonal is not None:
        spread = a.square() @ (1.0 / (block.diagonal.to(g.dtype) + prior_precision)).T  # (n, out)
        return torch.einsum("nco,no,ndo->ncd", g, spread, g)
    rotated = g @ block.out_eigvecs.to(g.dtype)  # (n, C, out)
    psi_sq = (a @ block.in_eigvecs.to(g.dtype)).square()  # (n, in)
    inverse = 1.0 / (torch.outer(block.in_eigvals, block.out_eigvals).to(g.dtype) + prior_precision)  # (in, out)
    return torch.einsum("nci,ni,ndi->ncd", rotated, psi_sq @ inverse, rotated)


def _positional_weight_term(g: Tensor, a: Tensor, block: ParamCurvature, prior_precision: float) -> Tensor:
    """``J Σ Jᵀ`` of a weight used at ``T`` positions: ``g (n, C, T, out)``, ``a (n, T, in)``."""
    if block.diagonal is not None:
        jacobian = torch.einsum("ncto,nti->ncoi", g, a)
        return torch.einsum("ncoi,oi,ndoi->ncd", jacobian, 1.0 / (block.diagonal.to(g.dtype) + prior_precision), jacobian)
    jacobian = torch.einsum("ncto,nti->ncoi", g @ block.out_eigvecs.to(g.dtype), a @ block.in_eigvecs.to(g.dtype))
    inverse = 1.0 / (torch.outer(block.out_eigvals, block.in_eigvals).to(g.dtype) + prior_precision)  # (out, in)
    return torch.einsum("ncoi,oi,ndoi->ncd", jacobian, inverse, jacobian)


def _bias_term(g: Tensor, block: ParamCurvature, prior_precision: float) -> Tensor:
    if block.diagonal is not None:
        return torch.einsum("nco,o,ndo->ncd", g, 1.0 / (block.diagonal.to(g.dtype) + prior_precision), g)
    rotated = g @ block.out_eigvecs.to(g.dtype)
    return torch.einsum("nci,i,ndi->ncd", rotated, 1.0 / (block.out_eigvals.to(g.dtype) + prior_precision), rotated)
