"""Binned calibration error from confidences and correctness flags, shared by the metrics, their bootstrap and the
selection step."""

from __future__ import annotations

import torch
from torch import Tensor

#: equal-width bins of the ECE everywhere in posthoc (as torchmetrics' default is 15)
BINS = 15


def bin_sums(confidence: Tensor, correct: Tensor, edges: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per bin given by ``edges`` (bins ``(lo, hi]``): example count, sum of confidences, sum of correct flags."""
    confidence = confidence.double().cpu().contiguous()
    correct = correct.double().cpu()
    index = torch.bucketize(confidence, edges[1:-1])
    count = torch.zeros(len(edges) - 1, dtype=torch.float64).index_add_(0, index, torch.ones_like(confidence))
    conf_sum = torch.zeros_like(count).index_add_(0, index, confidence)
    acc_sum = torch.zeros_like(count).index_add_(0, index, correct)
    return count, conf_sum, acc_sum


def binned_gap(confidence: Tensor, correct: Tensor, edges: Tensor) -> float:
    """Sum over bins of ``|bin| / N * |accuracy - confidence|``."""
    _, conf_sum, acc_sum = bin_sums(confidence, correct, edges)
    return float((conf_sum - acc_sum).abs().sum() / max(confidence.numel(), 1))


def top_label_ece(confidence: Tensor, correct: Tensor, bins: int = BINS) -> float:
    """Top-label ECE of ``confidence`` ``(N,)`` against ``correct`` with ``bins`` equal-width bins on [0, 1].

    Example:
        >>> import torch
        >>> from posthoc.core.calibration_error import top_label_ece
        >>> top_label_ece(torch.tensor([1.0, 1.0]), torch.tensor([True, True]))
        0.0
    """
    return binned_gap(confidence, correct, torch.linspace(0, 1, bins + 1, dtype=torch.float64))


def equal_mass_gap(confidence: Tensor, correct: Tensor, bins: int = BINS) -> Tensor:
    """Top-label ECE with equal-mass bins of each row of ``confidence`` ``(B, n)`` against ``correct`` ``(B, n)``:
    ``(B,)``, float64.

    Each row is sorted by confidence (stable) and cut into ``bins`` runs whose sizes differ by at most one, the larger
    first (``torch.tensor_split``'s cut, as torch-uncertainty's adaptive calibration error), so confidences that crowd
    near 1 are not judged by two or three full bins.

    Example:
        >>> import torch
        >>> from posthoc.core.calibration_error import equal_mass_gap
        >>> equal_mass_gap(torch.tensor([[0.5, 0.5, 0.5, 0.5]]), torch.tensor([[1.0, 0.0, 1.0, 0.0]]), bins=2)
        tensor([0.], dtype=torch.float64)
    """
    confidence = confidence.double().cpu()
    order = confidence.argsort(dim=-1, stable=True)
    gap = (confidence - correct.double().cpu()).gather(-1, order)
    n = gap.shape[-1]
    sizes = torch.full((bins,), n // bins)
    sizes[: n % bins] += 1
    ends = sizes.cumsum(0)
    totals = torch.cat([torch.zeros(*gap.shape[:-1], 1, dtype=torch.float64), gap.cumsum(-1)], -1)
    return (totals[..., ends] - totals[..., ends - sizes]).abs().sum(-1) / max(n, 1)
