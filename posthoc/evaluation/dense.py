"""Metrics of dense predictions (a segmentation map, a token sequence), per position, the ignore index respected.

:func:`dense_metrics` reads a dense :class:`~posthoc.Prediction` (``probs`` ``(N, C, *P)`` or ``(N, *P, C)``, from
``posthoc.wrap(model, dense=True)``) and labels ``(N, *P)``; every valid position is one example: NLL, ECE, Brier
and accuracy over positions, the mean intersection over union over classes (each class's IoU from the positions of
the whole set, a class absent from both the labels and the predictions left out, as torchmetrics'
``MulticlassJaccardIndex(average="macro", ignore_index=...)``), and the AUROC of the predictive entropy for errors
(how well the uncertainty map finds the wrong positions). :func:`evaluate_dense` runs a dense model over a loader
and gives a :class:`DenseReport` with its Markdown table; ``posthoc.evaluate`` hands a dense model to it.

Example:
    >>> import torch
    >>> from posthoc.core.prediction import Prediction, RegressionPrediction, concat
    >>> from posthoc.evaluation.dense import dense_metrics
    >>> probs = torch.tensor([[[0.9, 0.2], [0.6, 0.3]], [[0.1, 0.8], [0.4, 0.7]]])[None]  # (1, 2 classes, 2, 2)
    >>> labels = torch.tensor([[[0, 1], [1, 255]]])
    >>> flat = Prediction.from_probs(probs.movedim(1, -1).reshape(-1, 2))
    >>> fields = ("entropy", "aleatoric", "epistemic", "confidence", "label")
    >>> prediction = Prediction(probs, None, *(getattr(flat, n).reshape(1, 2, 2) for n in fields))
    >>> metrics = dense_metrics(prediction, labels, class_dim=1)
    >>> round(metrics["accuracy"], 4), round(metrics["mIoU"], 4)
    (0.6667, 0.5)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from posthoc.core.inputs import split_batch
from posthoc.core.prediction import Prediction, RegressionPrediction, concat
from posthoc.errors import InputError
from posthoc.evaluation import metrics
from posthoc.evaluation.table import markdown_rows

#: the metrics of :func:`dense_metrics`, in the order of the table
DENSE_METRICS = ("NLL", "ECE", "Brier", "accuracy", "mIoU", "AUROC(error)")
#: the metrics of :func:`dense_regression_metrics` (a per-position regressor), in the order of the table
DENSE_REGRESSION_METRICS = ("NLL", "RMSE", "coverage 90%", "width 90%", "mean std")


def valid_rows(prediction: Prediction, labels: Tensor, class_dim: int, ignore_index: int | None) -> tuple[Tensor, ...]:
    """``(probs (M, C), labels (M,), entropy (M,))`` of the valid positions (the ignore index left out)."""
    probs = prediction.probs.movedim(class_dim, -1)
    labels = labels.to(probs.device)
    if probs.shape[:-1] != labels.shape:
        raise InputError(
            f"labels {tuple(labels.shape)} do not match a dense prediction of probs {tuple(prediction.probs.shape)}: "
            "pass labels with the probabilities' shape less the class dimension"
        )
    num_classes = probs.shape[-1]
    if ignore_index is None:
        keep = labels != -100
        keep &= labels != 255 if num_classes <= 255 else keep
    else:
        keep = labels != ignore_index
    return probs[keep].float(), labels[keep].long(), prediction.entropy.to(probs.device)[keep].float()


def mean_iou(predicted: Tensor, labels: Tensor, num_classes: int) -> float:
    """The mean over classes of ``|pred ∩ label| / |pred ∪ label|`` over all positions (classes in neither left out)."""
    index = labels * num_classes + predicted
    confusion = torch.bincount(index, minlength=num_classes * num_classes).reshape(num_classes, num_classes).double()
    hits = confusion.diagonal()
    union = confusion.sum(0) + confusion.sum(1) - hits
    present = union > 0
    return float((hits[present] / union[present]).mean()) if present.any() else float("nan")


def error_auroc(uncertainty: Tensor, wrong: Tensor) -> float:
    """The AUROC of ``uncertainty`` for telling the wrong positions from the right ones (nan with only one kind)."""
    if wrong.all() or not wrong.any():
        return float("nan")
    return metrics.ood_auroc(uncertainty[~wrong], uncertainty[wrong])


def dense_metrics(
    prediction: Prediction, labels: Tensor, *, class_dim: int = 1, ignore_index: int | None = None
) -> dict[str, float]:
    """The per-position metrics of :data:`DENSE_METRICS` over the valid positions (see module docs)."""
    probs, labels, entropy = valid_rows(prediction, labels, class_dim, ignore_index)
    if labels.numel() == 0:
        raise InputError("every position is ignored: no label to evaluate on")
    wrong = probs.argmax(-1) != labels
    return {
        "NLL": metrics.nll(probs, labels),
        "ECE": metrics.ece(probs, labels),
        "Brier": metrics.brier(probs, labels),
        "accuracy": metrics.accuracy(probs, labels),
        "mIoU": mean_iou(probs.argmax(-1), labels, probs.shape[-1]),
        "AUROC(error)": error_auroc(entropy, wrong),
    }


def dense_regression_metrics(prediction: RegressionPrediction, targets: Tensor) -> dict[str, float]:
    """The per-position metrics of a per-position regressor's prediction (rows ``(N·P, D)``) against ``targets``
    ``(N·P, D)`` (NaN where a position has no target): the Gaussian NLL, the RMSE, the coverage and mean width of
    the central 90 % interval and the mean predictive std, over the positions whose targets are all finite. A
    recalibrated (isotonic) prediction is scored by its own density and interval; its std is not known (NaN).

    Example:
        >>> import torch
        >>> from posthoc.core.prediction import RegressionPrediction
        >>> from posthoc.evaluation.dense import dense_regression_metrics
        >>> prediction = RegressionPrediction.from_components(torch.zeros(1, 4, 1), None, torch.ones(1, 4, 1))
        >>> targets = torch.tensor([[0.0], [1.0], [-1.0], [float("nan")]])
        >>> round(dense_regression_metrics(prediction, targets)["RMSE"], 4)
        0.8165
    """
    keep = torch.isfinite(targets).all(-1)
    if not keep.any():
        raise InputError("every position's target is missing (NaN): nothing to evaluate on")
    y = torch.nan_to_num(targets.to(prediction.mean.dtype))
    low, high = prediction.interval(0.9)
    return {
        "NLL": float(-prediction.log_prob(y)[keep].double().mean() / targets.shape[-1]),
        "RMSE": float((prediction.mean - y)[keep].double().pow(2).mean().sqrt()),
        "coverage 90%": float(((y >= low) & (y <= high))[keep].double().mean()),
        "width 90%": float((high - low)[keep].double().mean()),
        "mean std": math.nan if prediction.recalibrated else float(prediction.std[keep].double().mean()),
    }


@dataclass
class DenseReport:
    """Per-position metrics of one or more dense models on one loader (:func:`evaluate_dense`)."""

    rows: dict[str, dict[str, float]] = field(default_factory=dict)
    positions: int = 0
    metrics: tuple[str, ...] = DENSE_METRICS

    def to_markdown(self) -> str:
        """The metrics as a Markdown table, one row per model."""
        header = ["method", *self.metrics]
        body = [[name, *(f"{values[m]:.4f}" for m in self.metrics)] for name, values in self.rows.items()]
        return markdown_rows(header, body)

    def _repr_markdown_(self) -> str:
        return self.to_markdown()


@torch.no_grad()
def evaluate_dense(
    models: dict[str, Any], loader: Iterable, *, ignore_index: int | None = None, **predict_options: Any
) -> DenseReport:
    """Run each dense model of ``models`` (name → ``posthoc.wrap(model, dense=True)`` fitted) over ``loader`` of
    ``(inputs, labels per position)`` and measure :data:`DENSE_METRICS` on all its valid positions at once
    (``predict_options``, e.g. ``generator=``, go to each ``predict``)."""
    report = DenseReport()
    for name, um in models.items():
        if um.regression:
            report.metrics = DENSE_REGRESSION_METRICS
            parts, targets = [], []
            for batch in loader:
                x, y = split_batch(batch)
                parts.append(um.predict(x, **predict_options))
                dim = um.position_rows[0].class_dim
                targets.append(y.movedim(dim, -1).reshape(-1, y.shape[dim]))
            rows = torch.cat(targets)
            report.rows[name] = dense_regression_metrics(concat(parts), rows)
            report.positions = int(torch.isfinite(rows).all(-1).sum())
            continue
        parts, labels = [], []
        for batch in loader:
            x, y = split_batch(batch)
            parts.append(um.predict(x, **predict_options))
            labels.append(y)
        rows = um.position_rows[0]
        prediction = Prediction(
            torch.cat([p.probs for p in parts]),
            None,
            *(
                torch.cat([getattr(p, n) for p in parts])
                for n in ("entropy", "aleatoric", "epistemic", "confidence", "label")
            ),
        )
        label = torch.cat(labels)
        index = ignore_index if ignore_index is not None else um.ignore_index
        report.rows[name] = dense_metrics(prediction, label, class_dim=rows.class_dim, ignore_index=index)
        report.positions = int(valid_rows(prediction, label, rows.class_dim, index)[1].numel())
    return report
