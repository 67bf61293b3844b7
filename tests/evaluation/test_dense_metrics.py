"""Per-position metrics of dense predictions (posthoc.evaluation.dense), checked against torchmetrics and scikit-learn."""

from __future__ import annotations

import pytest
import torch
from sklearn.metrics import roc_auc_score
from torchmetrics.classification import MulticlassAccuracy, MulticlassJaccardIndex

from posthoc.core.prediction import Prediction
from posthoc.evaluation.dense import DENSE_METRICS, dense_metrics

FIELDS = ("entropy", "aleatoric", "epistemic", "confidence", "label")


def _dense(probs: torch.Tensor) -> Prediction:
    """A dense prediction from probs (N, C, H, W)."""
    n, c, h, w = probs.shape
    flat = Prediction.from_probs(probs.movedim(1, -1).reshape(-1, c))
    return Prediction(probs, None, *(getattr(flat, name).reshape(n, h, w) for name in FIELDS))


@pytest.fixture
def case():
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(2 * torch.randn(6, 5, 9, 9, generator=generator), dim=1)
    labels = torch.randint(0, 5, (6, 9, 9), generator=generator)
    labels[torch.rand(6, 9, 9, generator=generator) < 0.2] = 255
    return probs, labels


def test_accuracy_and_miou_match_torchmetrics(case):
    probs, labels = case
    metrics = dense_metrics(_dense(probs), labels)
    accuracy = MulticlassAccuracy(5, average="micro", ignore_index=255)(probs, labels)
    iou = MulticlassJaccardIndex(5, average="macro", ignore_index=255)(probs, labels)
    assert metrics["accuracy"] == pytest.approx(float(accuracy), abs=1e-6)
    assert metrics["mIoU"] == pytest.approx(float(iou), abs=1e-6)


def test_nll_and_error_auroc_over_valid_positions(case):
    probs, labels = case
    metrics = dense_metrics(_dense(probs), labels)
    valid = labels != 255
    rows, targets = probs.movedim(1, -1)[valid], labels[valid]
    assert metrics["NLL"] == pytest.approx(float(torch.nn.functional.nll_loss(rows.log(), targets)), rel=1e-5)
    entropy = -(rows * rows.log()).sum(-1)
    wrong = (rows.argmax(-1) != targets).numpy()
    assert metrics["AUROC(error)"] == pytest.approx(roc_auc_score(wrong, entropy.numpy()), abs=1e-6)
    assert set(metrics) == set(DENSE_METRICS)


def test_ignored_positions_change_nothing(case):
    probs, labels = case
    other = probs.clone()
    ignored = (labels == 255)[:, None].expand_as(other)
    other[ignored] = torch.softmax(torch.randn(int(ignored.sum()) // 5, 5), -1).flatten()
    assert dense_metrics(_dense(probs), labels) == dense_metrics(_dense(other), labels)
    as_tokens = labels.clone()
    as_tokens[labels == 255] = -100  # the other default ignore index
    assert dense_metrics(_dense(probs), labels) == dense_metrics(_dense(probs), as_tokens)
    custom = labels.clone()
    custom[labels == 255] = 7
    assert dense_metrics(_dense(probs), custom, ignore_index=7) == dense_metrics(_dense(probs), labels)
