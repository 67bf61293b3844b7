"""Held-out NLL of a predictive over a labelled loader, for choosing a posterior's spread on validation data.

Example:
    >>> held_out_nll(lambda x: torch.log_softmax(model(x), -1), val_loader, device="cpu")
    0.061
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from posthoc.core import distributed
from posthoc.core.inputs import Inputs, check_labels, iterate


@torch.no_grad()
def held_out_nll(log_probs: Callable[[Inputs], Tensor], loader: Iterable, *, device: torch.device | str) -> float:
    """Mean negative log-likelihood of ``log_probs(x) (N, C)`` over ``loader``'s labels (every rank's examples once)."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in iterate(loader, device=device, progress=False, desc="held-out NLL"):
        lp = log_probs(x)
        total[0] -= lp.gather(-1, check_labels(y, lp.shape[-1]).unsqueeze(-1)).double().sum()
        total[1] += lp.shape[0]
    total = distributed.all_reduce_sum(total) if distributed.active() else total
    return float(total[0] / total[1])
