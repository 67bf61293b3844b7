"""What a guarantee delivers on a labelled test set: coverage and size of sets, deferral and selective risk.

Example:
    >>> import torch
    >>> from posthoc.guarantees.measures import coverage, deferral_rate, mean_set_size, selective_risk
    >>> sets = torch.tensor([[True, False], [True, True]])
    >>> coverage(sets, torch.tensor([1, 0])), mean_set_size(sets)
    (0.5, 1.5)
    >>> deferral_rate(torch.tensor([True, False])), selective_risk(torch.tensor([True, False]), torch.tensor([False, True]))
    (0.5, 1.0)
"""

from __future__ import annotations

from torch import Tensor


def coverage(sets: Tensor, labels: Tensor) -> float:
    """The fraction of examples whose set ``(N, C)`` holds the true label."""
    return float(sets.gather(1, labels.reshape(-1, 1).to(sets.device)).double().mean())


def mean_set_size(sets: Tensor) -> float:
    """The mean number of classes per set."""
    return float(sets.sum(-1).double().mean())


def deferral_rate(accepted: Tensor) -> float:
    """The fraction of examples not accepted (deferred)."""
    return 1.0 - float(accepted.double().mean())


def selective_risk(accepted: Tensor, correct: Tensor) -> float | None:
    """The error rate among accepted examples (``None`` if none is accepted)."""
    if not bool(accepted.any()):
        return None
    return 1.0 - float(correct[accepted].double().mean())
