"""ABNN's training loss: the cross-entropy with random class weights per mode, plus the Gaussian prior on the weights.

Each mode has its own random class weights ``η`` (the paper's "random prior", which sends the modes to different
places; :func:`random_class_weights`). The loss of a batch is the weighted cross-entropy, normalised as
``nn.CrossEntropyLoss(weight=η)`` is, plus a zero-mean Gaussian prior ``λ/2 ||ω||²`` on every trained weight:

    L(ω) = Σ_i η_{y_i} (−log p(y_i | x_i, ω)) / Σ_i η_{y_i} + λ/2 ||ω||².

Example:
    >>> import torch
    >>> from posthoc.methods.abnn.loss import abnn_loss, random_class_weights
    >>> weights = random_class_weights(4, 2.0, torch.Generator().manual_seed(0))
    >>> sorted(weights.tolist())                     # ⌊√4⌋ = 2 of the 4 classes weigh 2
    [1.0, 1.0, 2.0, 2.0]
    >>> logits, y = torch.zeros(3, 4), torch.tensor([0, 1, 2])
    >>> float(abnn_loss(logits, y, weights, [torch.ones(2)], weight_decay=0.5))   # log 4 + 0.25 * 2
    1.886294...
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor


def random_class_weights(classes: int, random_prior: float, generator: torch.Generator) -> Tensor:
    """``(C,)`` class weights: 1, and ``random_prior`` for ``⌊√C⌋`` classes drawn with ``generator``.

    Example:
        >>> import torch
        >>> from posthoc.methods.abnn.loss import random_class_weights
        >>> random_class_weights(9, 3.0, torch.Generator().manual_seed(1)).sum()    # 6 ones and 3 threes
        tensor(15.)
    """
    weights = torch.ones(classes)
    weights[torch.randperm(classes, generator=generator)[: math.isqrt(classes)]] = random_prior
    return weights


def abnn_loss(
    logits: Tensor, y: Tensor, class_weights: Tensor, parameters: Iterable[Tensor], *, weight_decay: float
) -> Tensor:
    """The loss of one batch: class-weighted cross-entropy of ``logits (N, C)`` at labels ``y`` plus
    ``weight_decay / 2`` times the squared norm of ``parameters`` (see module docs)."""
    data = F.cross_entropy(logits, y, weight=class_weights.to(logits.device, logits.dtype))
    if weight_decay == 0:
        return data
    return data + 0.5 * weight_decay * sum(p.pow(2).sum() for p in parameters)
