"""Metrics of predictive quality: accuracy, NLL, ECE (equal-width, equal-mass, smooth), Brier, AURC, AUGRC; OOD AUROC,
AUPR (in and out), FPR at 95% TPR.

All take probabilities ``(N, C)`` and integer labels ``(N,)`` as tensors and return floats.

Example:
    >>> import torch
    >>> from posthoc.evaluation.metrics import accuracy
    >>> probs = torch.tensor([[0.8, 0.2], [0.3, 0.7]])
    >>> labels = torch.tensor([0, 0])
    >>> accuracy(probs, labels)
    0.5
"""

from __future__ import annotations

import torch
from sklearn.metrics import roc_auc_score
from torch import Tensor

from posthoc.core.calibration_error import bin_sums, binned_gap, equal_mass_gap
from posthoc.errors import InputError
from posthoc.evaluation.smooth_ece import smooth_ece_rows

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


def ece(probs: Tensor, labels: Tensor, bins: int = 15) -> float:
    """Top-label expected calibration error with ``bins`` equal-width bins ``(lo, hi]`` on [0, 1], as torchmetrics."""
    probs, labels = probs.double().cpu(), labels.cpu()
    confidence, predicted = probs.max(-1)
    edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64)
    return binned_gap(confidence, (predicted == labels).double(), edges)


def adaptive_ece(probs: Tensor, labels: Tensor, bins: int = 15) -> float:
    """Top-label ECE with equal-mass bins (torch-uncertainty's adaptive calibration error): no bin is empty and none
    holds most of the examples.

    Example:
        >>> import torch
        >>> from posthoc.evaluation.metrics import adaptive_ece
        >>> round(adaptive_ece(torch.tensor([[0.9, 0.1], [0.6, 0.4]]), torch.tensor([0, 1]), bins=2), 4)
        0.35
    """
    probs, labels = probs.double().cpu(), labels.cpu()
    confidence, predicted = probs.max(-1)
    return float(equal_mass_gap(confidence[None], (predicted == labels).double()[None], bins)[0])


def smooth_ece(probs: Tensor, labels: Tensor) -> float:
    """Top-label smooth ECE (Błasiok & Nakkiran, 2023; :mod:`posthoc.evaluation.smooth_ece`): no bins to choose, and
    continuous in the predictions.

    Example:
        >>> import torch
        >>> from posthoc.evaluation.metrics import smooth_ece
        >>> round(smooth_ece(torch.tensor([[0.75, 0.25]] * 4), torch.tensor([0, 0, 0, 0])), 3)
        0.25
    """
    probs, labels = probs.double().cpu(), labels.cpu()
    confidence, predicted = probs.max(-1)
    return float(smooth_ece_rows(confidence[None], (predicted == labels).double()[None])[0])


def classwise_ece(probs: Tensor, labels: Tensor, bins: int = 15) -> float:
    """Class-wise ECE: the equal-width ECE of each class's probability, averaged over classes."""
    probs, labels = probs.double().cpu(), labels.cpu()
    edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64)
    onehot = torch.nn.functional.one_hot(labels, probs.shape[-1]).double()
    return sum(binned_gap(probs[:, c], onehot[:, c], edges) for c in range(probs.shape[-1])) / probs.shape[-1]


def risk_coverage(confidence: Tensor, correct: Tensor) -> tuple[Tensor, Tensor]:
    """``(coverage, risk)``, each ``(N,)``: after keeping the ``k`` most confident examples, ``k / N`` and the error
    rate among them."""
    order = confidence.double().cpu().argsort(descending=True)
    errors = (~correct.cpu().bool()[order]).double()
    kept = torch.arange(1, errors.numel() + 1, dtype=torch.float64)
    return kept / errors.numel(), errors.cumsum(0) / kept


def aurc(probs: Tensor, labels: Tensor) -> float:
    """Area under the risk–coverage curve (lower is better), ranking by confidence."""
    confidence, predicted = probs.max(-1)
    _, risk = risk_coverage(confidence, predicted == labels)
    return float(risk.mean())


def augrc(probs: Tensor, labels: Tensor) -> float:
    """Area under the generalized risk–coverage curve (Traub et al., 2024; lower is better): at each coverage, the
    fraction of *all* examples that are accepted and wrong, averaged over the coverages ``k / N``. Unlike AURC it does
    not lean on the risk at low coverage, which rests on a handful of examples.

    Example:
        >>> import torch
        >>> from posthoc.evaluation.metrics import augrc
        >>> augrc(torch.tensor([[0.9, 0.1], [0.8, 0.2]]), torch.tensor([0, 1]))
        0.25
    """
    confidence, predicted = probs.max(-1)
    coverage, risk = risk_coverage(confidence, predicted == labels)
    return float((coverage * risk).mean())


def ood_auroc(in_scores: Tensor, out_scores: Tensor) -> float:
    """AUROC for telling OOD from in-distribution inputs, where a higher score means "more OOD".

    Example:
        >>> import torch
        >>> from posthoc.evaluation.metrics import ood_auroc
        >>> ood_auroc(torch.tensor([0.1, 0.2]), torch.tensor([0.9, 0.8]))
        1.0
    """
    if in_scores.numel() == 0 or out_scores.numel() == 0:
        raise InputError("OOD AUROC needs at least one in-distribution and one OOD example")
    scores = torch.cat([in_scores, out_scores]).double().cpu().numpy()
    is_ood = torch.cat([torch.zeros(in_scores.numel()), torch.ones(out_scores.numel())]).numpy()
    return float(roc_auc_score(is_ood, scores))


def _counts_above(negatives: Tensor, positives: Tensor) -> tuple[Tensor, Tensor]:
    """Positives and negatives scoring at least each distinct score, from the highest score down (float64)."""
    if negatives.numel() == 0 or positives.numel() == 0:
        raise InputError("OOD metrics need at least one in-distribution and one OOD example")
    scores = torch.cat([negatives, positives]).double().cpu()
    if bool(scores.isnan().any()):
        raise InputError("OOD scores contain NaN; check the model's outputs on these inputs")
    is_positive = torch.cat([torch.zeros(negatives.numel()), torch.ones(positives.numel())]).double()
    order = scores.argsort(descending=True)
    scores, is_positive = scores[order], is_positive[order]
    last_of_value = torch.cat([scores[1:] != scores[:-1], torch.tensor([True])])
    return is_positive.cumsum(0)[last_of_value], (1 - is_positive).cumsum(0)[last_of_value]


def aupr(in_scores: Tensor, out_scores: Tensor, positive: str = "out") -> float:
    """Area under the precision–recall curve (trapezoidal, as pytorch-ood), higher score = more OOD;
    ``positive="out"``: OOD is the positive class, ``"in"``: in-distribution is, lower scores first.

    Example:
        >>> import torch
        >>> from posthoc.evaluation.metrics import aupr
        >>> aupr(torch.tensor([0.1, 0.2]), torch.tensor([0.9, 0.8]), positive="in")
        1.0
    """
    if positive not in ("in", "out"):
        raise InputError(f"positive must be 'in' or 'out', got {positive!r}")
    negatives, positives = (in_scores, out_scores) if positive == "out" else (-out_scores, -in_scores)
    tps, fps = _counts_above(negatives.flatten(), positives.flatten())
    precision = torch.cat([torch.ones(1, dtype=torch.float64), tps / (tps + fps)])
    recall = torch.cat([torch.zeros(1, dtype=torch.float64), tps / tps[-1]])
    return float(((recall[1:] - recall[:-1]) * (precision[1:] + precision[:-1])).sum() / 2)


def fpr_at_tpr(in_scores: Tensor, out_scores: Tensor, tpr: float = 0.95) -> float:
    """Fraction of in-distribution examples flagged as OOD at the highest threshold that flags at least
    ``tpr`` of the OOD examples (OOD is the positive class, as in pytorch-ood's ``FPRAtTPR``); lower is better.

    Example:
        >>> import torch
        >>> from posthoc.evaluation.metrics import fpr_at_tpr
        >>> fpr_at_tpr(torch.tensor([0.1, 0.85]), torch.tensor([0.9, 0.8]))
        0.5
    """
    if not 0 <= tpr <= 1:
        raise InputError(f"tpr must lie in [0, 1], got {tpr!r}")
    tps, fps = _counts_above(in_scores.flatten(), out_scores.flatten())
    rates = torch.cat([torch.zeros(1, dtype=torch.float64), tps / out_scores.numel()])
    first = int(torch.searchsorted(rates, torch.tensor([float(tpr)], dtype=torch.float64))[0])
    return float(torch.cat([torch.zeros(1, dtype=torch.float64), fps / in_scores.numel()])[first])


def ood_metrics(in_scores: Tensor, out_scores: Tensor) -> dict[str, float]:
    """AUROC, AUPR-in, AUPR-out and FPR at 95% TPR of one OOD score (higher = more OOD).

    Example:
        >>> import torch
        >>> from posthoc.evaluation.metrics import ood_metrics
        >>> ood_metrics(torch.tensor([0.1, 0.2]), torch.tensor([0.9, 0.8]))["fpr95"]
        0.0
    """
    return {
        "auroc": ood_auroc(in_scores, out_scores),
        "aupr_in": aupr(in_scores, out_scores, "in"),
        "aupr_out": aupr(in_scores, out_scores, "out"),
        "fpr95": fpr_at_tpr(in_scores, out_scores, 0.95),
    }


def reliability_bins(probs: Tensor, labels: Tensor, bins: int = 15) -> tuple[Tensor, Tensor, Tensor]:
    """Per equal-width bin: mean confidence, accuracy and count (empty bins give NaN means)."""
    probs, labels = probs.double().cpu(), labels.cpu()
    confidence, predicted = probs.max(-1)
    edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64)
    count, conf_sum, acc_sum = bin_sums(confidence, (predicted == labels).double(), edges)
    return conf_sum / count, acc_sum / count, count
