"""Metrics of predictive quality: accuracy, NLL, ECE, Brier, AURC, OOD AUROC.

All take probabilities ``(N, C)`` and integer labels ``(N,)`` as tensors and return floats.

Example:
    >>> probs = torch.tensor([[0.8, 0.2], [0.3, 0.7]])
    >>> labels = torch.tensor([0, 0])
    >>> accuracy(probs, labels)
    0.5
"""

from __future__ import annotations

import torch
from sklearn.metrics import roc_auc_score
from torch import Tensor

from posthoc.core.errors import InputError

EPS = 1e-12


def accuracy(probs: Tensor, labels: Tensor) -> float:
    """Fraction of examples whose most probable class is the label."""
    return float((probs.argmax(-1) == labels).double().mean())


def nll(probs: Tensor, labels: Tensor) -> float:
    """Mean negative log-likelihood of the labels (probabilities floored at 1e-12)."""
    picked = probs.double().gather(-1, labels[:, None]).squeeze(-1)
    return float(-picked.clamp_min(EPS).log().mean())


def brier(probs: Tensor, labels: Tensor) -> float:
    """Multi-class Brier score: mean over examples of ``sum_c (p_c - 1[y=c])^2``."""
    onehot = torch.nn.functional.one_hot(labels, probs.shape[-1]).double()
    return float(((probs.double() - onehot) ** 2).sum(-1).mean())


def _bin_sums(confidence: Tensor, correct: Tensor, edges: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per bin given by ``edges``: example count, sum of confidences, sum of correct flags."""
    index = torch.bucketize(confidence.contiguous(), edges[1:-1])
    count = torch.zeros(len(edges) - 1, dtype=torch.float64).index_add_(0, index, torch.ones_like(confidence))
    conf_sum = torch.zeros_like(count).index_add_(0, index, confidence)
    acc_sum = torch.zeros_like(count).index_add_(0, index, correct)
    return count, conf_sum, acc_sum


def _binned_gap(confidence: Tensor, correct: Tensor, edges: Tensor) -> float:
    """Sum over bins of ``|bin| / N * |accuracy - confidence|``."""
    _, conf_sum, acc_sum = _bin_sums(confidence, correct, edges)
    return float((conf_sum - acc_sum).abs().sum() / confidence.numel())


def ece(probs: Tensor, labels: Tensor, bins: int = 15) -> float:
    """Top-label expected calibration error with ``bins`` equal-width bins on [0, 1].

    A confidence equal to a bin's upper edge falls in that bin (bins are ``(lo, hi]``), as in
    torchmetrics.
    """
    probs, labels = probs.double().cpu(), labels.cpu()
    confidence, predicted = probs.max(-1)
    edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64)
    return _binned_gap(confidence, (predicted == labels).double(), edges)


def adaptive_ece(probs: Tensor, labels: Tensor, bins: int = 15) -> float:
    """Top-label ECE with equal-mass bins (each holds about ``N / bins`` examples)."""
    probs, labels = probs.double().cpu(), labels.cpu()
    confidence, predicted = probs.max(-1)
    order = confidence.argsort()
    correct = (predicted == labels).double()[order]
    gap = sum(float((c.sum() - a.sum()).abs()) for c, a in zip(confidence[order].tensor_split(bins), correct.tensor_split(bins)))
    return gap / confidence.numel()


def classwise_ece(probs: Tensor, labels: Tensor, bins: int = 15) -> float:
    """Class-wise ECE: the equal-width ECE of each class's probability, averaged over classes."""
    probs, labels = probs.double().cpu(), labels.cpu()
    edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64)
    onehot = torch.nn.functional.one_hot(labels, probs.shape[-1]).double()
    return sum(_binned_gap(probs[:, c], onehot[:, c], edges) for c in range(probs.shape[-1])) / probs.shape[-1]


def risk_coverage(confidence: Tensor, correct: Tensor) -> tuple[Tensor, Tensor]:
    """Selective risk at each coverage when keeping the most confident examples first.

    Returns ``(coverage, risk)``, each ``(N,)``: after keeping ``k`` examples, coverage ``k / N``
    and risk the error rate among them.
    """
    order = confidence.double().cpu().argsort(descending=True)
    errors = (~correct.cpu().bool()[order]).double()
    kept = torch.arange(1, errors.numel() + 1, dtype=torch.float64)
    return kept / errors.numel(), errors.cumsum(0) / kept


def aurc(probs: Tensor, labels: Tensor) -> float:
    """Area under the risk–coverage curve (lower is better), ranking by confidence."""
    confidence, predicted = probs.max(-1)
    _, risk = risk_coverage(confidence, predicted == labels)
    return float(risk.mean())


def ood_auroc(in_scores: Tensor, out_scores: Tensor) -> float:
    """AUROC for telling OOD from in-distribution inputs, where a higher score means "more OOD".

    Example:
        >>> ood_auroc(torch.tensor([0.1, 0.2]), torch.tensor([0.9, 0.8]))
        1.0
    """
    if in_scores.numel() == 0 or out_scores.numel() == 0:
        raise InputError("OOD AUROC needs at least one in-distribution and one OOD example")
    scores = torch.cat([in_scores, out_scores]).double().cpu().numpy()
    is_ood = torch.cat([torch.zeros(in_scores.numel()), torch.ones(out_scores.numel())]).numpy()
    return float(roc_auc_score(is_ood, scores))


def reliability_bins(probs: Tensor, labels: Tensor, bins: int = 15) -> tuple[Tensor, Tensor, Tensor]:
    """Per equal-width bin: mean confidence, accuracy and count (empty bins give NaN means)."""
    probs, labels = probs.double().cpu(), labels.cpu()
    confidence, predicted = probs.max(-1)
    edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64)
    count, conf_sum, acc_sum = _bin_sums(confidence, (predicted == labels).double(), edges)
    return conf_sum / count, acc_sum / count, count
