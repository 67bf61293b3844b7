"""What a guarantee delivers on a labelled test set: coverage and size of sets, deferral and selective risk.

Example:
    >>> import torch
    >>> from posthoc.guarantees.measures import class_coverage_gap, coverage, deferral_rate, mean_set_size, selective_risk
    >>> sets = torch.tensor([[True, False], [True, True]])
    >>> coverage(sets, torch.tensor([1, 0])), mean_set_size(sets)
    (0.5, 1.5)
    >>> class_coverage_gap(sets, torch.tensor([1, 0]), alpha=0.1)     # class 0 covered (+0.1), class 1 not (-0.9)
    0.5
    >>> deferral_rate(torch.tensor([True, False])), selective_risk(torch.tensor([True, False]), torch.tensor([False, True]))
    (0.5, 1.0)
"""

from __future__ import annotations

import torch
from torch import Tensor


def coverage(sets: Tensor, labels: Tensor) -> float:
    """The fraction of examples whose set ``(N, C)`` holds the true label."""
    return float(sets.gather(1, labels.reshape(-1, 1).to(sets.device)).double().mean())


def class_coverage_gap(sets: Tensor, labels: Tensor, alpha: float) -> float:
    """CovGap (Ding et al. 2023): the mean over the classes present in ``labels`` of ``|coverage of the class - (1 -
    alpha)|``; 0 when every class is covered at exactly its target."""
    labels = labels.reshape(-1).to(sets.device)
    hit = sets.gather(1, labels[:, None]).squeeze(1).double()
    counts = torch.bincount(labels, minlength=sets.shape[1]).double()
    per_class = torch.zeros(sets.shape[1], dtype=torch.float64, device=sets.device).index_add_(0, labels, hit)
    present = counts > 0
    return float((per_class[present] / counts[present] - (1 - alpha)).abs().mean())


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
