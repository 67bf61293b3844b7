import math

import pytest
import torch
from torchmetrics.functional.classification import multiclass_calibration_error

from posthoc.evaluation import metrics
from posthoc.core.errors import InputError


def _random_predictions(n=2000, c=10, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, c, generator=generator) * 3
    labels = torch.distributions.Categorical(logits=logits * 0.7).sample()
    return logits.softmax(-1), labels


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ece_matches_torchmetrics(seed):
    probs, labels = _random_predictions(seed=seed)
    ours = metrics.ece(probs, labels, bins=15)
    theirs = float(multiclass_calibration_error(probs, labels, num_classes=10, n_bins=15, norm="l1"))
    assert ours == pytest.approx(theirs, abs=1e-6)
    assert ours > 0.01  # these predictions are miscalibrated on purpose


def test_perfect_predictions():
    labels = torch.tensor([0, 1, 2, 1])
    probs = torch.nn.functional.one_hot(labels, 3).float()
    assert metrics.accuracy(probs, labels) == 1.0
    assert metrics.nll(probs, labels) == pytest.approx(0.0, abs=1e-9)
    assert metrics.brier(probs, labels) == 0.0
    assert metrics.ece(probs, labels) == 0.0
    assert metrics.aurc(probs, labels) == 0.0


def test_nll_and_brier_by_hand():
    probs = torch.tensor([[0.5, 0.5], [0.9, 0.1]])
    labels = torch.tensor([0, 1])
    assert metrics.nll(probs, labels) == pytest.approx(-(math.log(0.5) + math.log(0.1)) / 2)
    assert metrics.brier(probs, labels) == pytest.approx((0.5 + (0.81 + 0.81)) / 2)


def test_aurc_ranks_by_confidence():
    # the one error has the lowest confidence: rejected first, so risk is 0 until full coverage
    probs = torch.tensor([[0.99, 0.01], [0.9, 0.1], [0.6, 0.4]])
    labels = torch.tensor([0, 0, 1])
    assert metrics.aurc(probs, labels) == pytest.approx((0 + 0 + 1 / 3) / 3)


def test_adaptive_and_classwise_ece_are_zero_when_calibrated_by_construction():
    probs = torch.tensor([[0.5, 0.5]] * 4)
    labels = torch.tensor([0, 1, 0, 1])
    assert metrics.adaptive_ece(probs, labels, bins=2) == pytest.approx(0.0)
    assert metrics.classwise_ece(probs, labels, bins=5) == pytest.approx(0.0)


def test_ood_auroc():
    assert metrics.ood_auroc(torch.tensor([0.1, 0.2]), torch.tensor([0.9, 0.8])) == 1.0
    assert metrics.ood_auroc(torch.tensor([0.9, 0.8]), torch.tensor([0.1, 0.2])) == 0.0
    with pytest.raises(InputError):
        metrics.ood_auroc(torch.tensor([]), torch.tensor([0.5]))
