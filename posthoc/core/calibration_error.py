"""Binned calibration error from confidences and correctness flags, shared by the metrics and the selection step.

Example:
    >>> top_label_ece(torch.tensor([0.9, 0.6]), torch.tensor([1.0, 0.0]))
    0.35
"""

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
    """Top-label expected calibration error of ``confidence`` (the predicted class's probability, ``(N,)``) against
    ``correct`` (whether that class is the label), with ``bins`` equal-width bins on [0, 1].

    Example:
        >>> top_label_ece(torch.tensor([1.0, 1.0]), torch.tensor([True, True]))
        0.0
    """
    return binned_gap(confidence, correct, torch.linspace(0, 1, bins + 1, dtype=torch.float64))
