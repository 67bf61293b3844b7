"""KFAC and diagonal GGN of Linear layers from forward hooks: for models BackPACK cannot run.

BackPACK needs tensor inputs and a rule for every module between the loss and the covered layers, which a
``transformers`` model (LayerNorm, attention, dict inputs) lacks. Here ``nn.Linear`` layers (LoRA adapters) are hooked
alone: their input ``a`` and output gradient ``g`` for ``C`` backward passes of ``v_c = sqrt(p_c) (e_c - p)``, as
``Σ_c v_c v_cᵀ = diag(p) - p pᵀ`` is the softmax's exact GGN (BackPACK's KFLR). Over ``T`` positions this is the
KFAC-reduce of Eschenhagen et al. (2023): ``ā = mean_t a_t`` (over the ``attention_mask``), ``ĝ = Σ_t g_t``,
``A = Σ_n ā āᵀ / N``, ``G = Σ_n Σ_c ĝ ĝᵀ``. ``"diag"`` is the exact GGN diagonal.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.methods.laplace.hooked_kfac import hooked_ggn
    >>> net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    >>> blocks, loss = hooked_ggn(net, ["0.weight", "2.weight", "2.bias"], "kron", [(torch.randn(8, 4), torch.randint(0, 3, (8,)))])
    >>> [tuple(b.out_eigvecs.shape) for b in blocks], blocks[0].in_eigvals.shape
    ([(5, 5), (3, 3), (3, 3)], torch.Size([4]))
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from posthoc.core.inputs import Inputs
from posthoc.core.modules import eval_mode
from posthoc.engine.runner import sum_over_ranks
from posthoc.errors import ConfigError
from posthoc.methods.laplace.structure import FLOAT64, Curvature
from posthoc.methods.laplace.structures import structure_class
from posthoc.methods.laplace.subset_glm import covered_linear_layers, tapped_forward

#: structures this engine offers (``"kron"`` is the exact-GGN KFAC, BackPACK's KFLR)
HOOKED_STRUCTURES = ("kron", "diag")


def _position_weights(x: Inputs, a: Tensor) -> Tensor:
    """``(n, T)`` weights that average a layer's ``(n, T, in)`` inputs over the real positions."""
    mask = x.get("attention_mask") if isinstance(x, Mapping) else None
    if isinstance(mask, Tensor) and mask.dim() == 2 and mask.shape == a.shape[:2]:
        weights = mask.to(a.dtype)
    else:
        weights = a.new_ones(a.shape[:2])
    return weights / weights.sum(1, keepdim=True).clamp_min(1)


def _square_root_directions(logits: Tensor) -> Tensor:
    """``(C, n, C)``: ``v_c = sqrt(p_c) (e_c - p)`` per example, so ``Σ_c v_c v_cᵀ = diag(p) - p pᵀ``."""
    probs = torch.softmax(logits.detach().to(FLOAT64), dim=-1)
    eye = torch.eye(probs.shape[1], dtype=FLOAT64, device=probs.device)
    return (probs.T.sqrt()[:, :, None] * (eye[:, None, :] - probs[None])).to(logits.dtype)


def hooked_ggn(
    model: nn.Module, param_names: list[str], structure: str, batches: Iterable[tuple[Inputs, Tensor]]
) -> tuple[list[Curvature], Tensor]:
    """KFAC-reduce (``"kron"``) or diagonal GGN blocks of ``param_names``, and the summed cross-entropy at the checkpoint."""
    if structure not in HOOKED_STRUCTURES:
        raise ConfigError(f"hessian={structure!r} is not offered for this subset; use one of {HOOKED_STRUCTURES}")
    layers = covered_linear_layers(model, param_names)
    out_factor: dict[str, Tensor] = {}
    in_factor: dict[str, Tensor] = {}
    diagonal: dict[str, Tensor] = {}
    loss, count = torch.zeros((), dtype=FLOAT64), 0
    with eval_mode(model):
        for x, y in batches:
            logits, taps = tapped_forward(model, layers, x)
            loss = loss.to(logits.device) + torch.nn.functional.cross_entropy(
                logits.detach().to(FLOAT64), y, reduction="sum"
            )
            count += y.shape[0]
            directions = _square_root_directions(logits)
            leaves = [taps[name][1] for name in layers]
            for c, direction in enumerate(directions):
                grads = torch.autograd.grad((logits * direction).sum(), leaves, retain_graph=c < len(directions) - 1)
                for name, g in zip(layers, grads):
                    _accumulate(
                        name, taps[name][0], g, x, structure, out_factor, in_factor if c == 0 else None, diagonal
                    )
    loss, count, out_factor, in_factor, diagonal = sum_over_ranks((loss, count, out_factor, in_factor, diagonal))
    blocks = []
    for name in param_names:
        layer, _, field = name.rpartition(".")
        if structure == "diag":
            sums = [diagonal[layer][:, :-1] if field == "weight" else diagonal[layer][:, -1]]
        else:
            sums = [out_factor[layer]] + ([in_factor[layer]] if field == "weight" else [])
        blocks.append(structure_class(structure).from_sums(sums, count, name))
    return blocks, loss


def _accumulate(
    name: str,
    a: Tensor,
    g: Tensor,
    x: Inputs,
    structure: str,
    out_factor: dict[str, Tensor],
    in_factor: dict[str, Tensor] | None,
    diagonal: dict[str, Tensor],
) -> None:
    """Add one backward direction's contribution of layer ``name`` (inputs ``a``, output gradients ``g``)."""
    a, g = a.to(FLOAT64), g.to(FLOAT64)
    if a.dim() == 2:
        a, g = a[:, None], g[:, None]
    a, g = a.reshape(a.shape[0], -1, a.shape[-1]), g.reshape(g.shape[0], -1, g.shape[-1])  # (n, T, in), (n, T, out)
    if structure == "diag":
        augmented = torch.cat([a, a.new_ones(*a.shape[:2], 1)], dim=-1)  # the bias column
        per_example = torch.einsum("nto,nti->noi", g, augmented)
        diagonal[name] = diagonal.get(name, 0) + per_example.square().sum(0)
        return
    summed = g.sum(1)  # ĝ (n, out)
    out_factor[name] = out_factor.get(name, 0) + summed.T @ summed
    if in_factor is not None:
        mean = torch.einsum("nt,nti->ni", _position_weights(x, a).to(a.dtype), a)  # ā (n, in)
        in_factor[name] = in_factor.get(name, 0) + mean.T @ mean
