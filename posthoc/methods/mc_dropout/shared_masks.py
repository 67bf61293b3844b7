"""Dropout on a Linear head's input with masks shared across the batch: all samples in one matmul.

Sample ``s`` keeps the head's input features ``phi`` ``(N, D)`` where ``keep[s]`` is true, for every example alike:
``logits_s = (phi * m_s) @ W.T + b = phi @ (W * m_s).T + b`` with ``m_s = keep[s] / q``. Each example's predictive is
as with fresh masks per example; only samples of different examples become correlated. The product is formed on the
smaller side: the ``S`` masked weights ``(S, C, D)`` when the batch has at least as many examples as classes, else the
masked features ``(S, N, D)``, in groups sized under the memory budget.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.methods.mc_dropout.shared_masks import shared_mask_predictive
    >>> from posthoc.methods.mc_dropout.masks import keep_mask
    >>> head = nn.Linear(64, 8)
    >>> keep = keep_mask((100, 64), 0.25, generator=torch.Generator().manual_seed(0), device="cpu")
    >>> log_probs, samples = shared_mask_predictive(torch.randn(500, 64), head, keep, 0.25)
    >>> log_probs.shape, samples.shape
    (torch.Size([500, 8]), torch.Size([100, 500, 8]))
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posthoc.core.chunks import chunks
from posthoc.core.logits import log_mean_exp
from posthoc.methods.mc_dropout.masks import keep_probability


def shared_mask_predictive(phi: Tensor, head: nn.Linear, keep: Tensor, p: float) -> tuple[Tensor, Tensor]:
    """``(log_probs (N, C), samples (S, N, C))`` of ``head`` on ``phi`` with features kept where ``keep`` ``(S, D)``."""
    weight, bias = head.weight, head.bias
    scale = keep.to(weight.dtype).mul_(1.0 / keep_probability(p))
    (n, features), classes = phi.shape, weight.shape[0]
    on_weights = classes <= n
    class_dim = 1 if on_weights else 2
    shape = [scale.shape[0], n, n]
    shape[class_dim] = max(2, classes)  # a single logit z (a binary classifier) becomes the classes [0, z]
    logits = (phi.new_zeros if classes == 1 else phi.new_empty)(
        shape, dtype=torch.promote_types(weight.dtype, torch.float32)
    )
    masked = (classes if on_weights else n) * features
    for group in chunks(scale.shape[0], (masked + n * classes) * weight.element_size()):
        logits[group].narrow(class_dim, shape[class_dim] - classes, classes).copy_(
            _logits(phi, weight, bias, scale[group], on_weights)
        )
    samples = torch.log_softmax(logits, class_dim)
    del logits
    log_probs = log_mean_exp(samples)
    return (log_probs.T, samples.transpose(1, 2)) if on_weights else (log_probs, samples)


def _logits(phi: Tensor, weight: Tensor, bias: Tensor | None, scale: Tensor, on_weights: bool) -> Tensor:
    """Logits of the samples whose feature scales are ``scale`` ``(g, D)``: ``(g, C, N)`` on weights, else ``(g, N, C)``."""
    if on_weights:
        logits = torch.mm((weight * scale.unsqueeze(1)).flatten(0, 1), phi.T).view(scale.shape[0], -1, phi.shape[0])
        return logits if bias is None else logits.add_(bias.unsqueeze(1))
    logits = torch.matmul(phi * scale.unsqueeze(1), weight.T)
    return logits if bias is None else logits.add_(bias)
