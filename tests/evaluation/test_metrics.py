import math

import numpy as np
import pytest
import relplot
import torch
from torch_uncertainty.metrics.classification import AUGRC, AdaptiveCalibrationError
from torchmetrics.functional.classification import multiclass_calibration_error

from posthoc.errors import InputError
from posthoc.evaluation import metrics
from posthoc.evaluation.smooth_ece import smooth_ece_rows


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


# ---------------------------------------------------------------- smooth ECE, adaptive ECE, AUGRC against their peers


def _mixed_predictions(n: int, seed: int, c: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded predictions, overconfident on half the examples and underconfident on the other half: bins then
    differ in the sign of their gap, so that binnings differ (with one sign everywhere every binning's ECE is
    ``|mean(confidence - correct)|``)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, c, generator=generator, dtype=torch.float64) * 3
    sharpness = torch.where(torch.arange(n) % 2 == 0, 0.6, 1.6).double()[:, None]
    labels = torch.multinomial((logits * sharpness).softmax(-1), 1, generator=generator).squeeze(-1)
    return logits.softmax(-1), labels


@pytest.mark.parametrize("n, seed", [(37, 0), (500, 1), (2000, 2), (5000, 3)])
def test_smooth_ece_matches_relplot(n, seed):
    """The same algorithm as relplot's smECE step by step (grids, bisection); only the convolution differs (FFT
    against numpy's direct sum), so the values agree far inside the 1e-3 the issue asks for."""
    probs, labels = _mixed_predictions(n=n, seed=seed)
    confidence, correct = relplot.multiclass_logits_to_confidences(probs.numpy(), labels.numpy(), probs=True)
    theirs = float(relplot.smECE(confidence, correct))
    ours = metrics.smooth_ece(probs, labels)
    assert ours == pytest.approx(theirs, abs=1e-6)
    assert ours > 0.01  # miscalibrated on purpose: a value of zero would not test anything


def test_smooth_ece_matches_relplot_on_calibrated_and_on_tied_confidences():
    generator = torch.Generator().manual_seed(4)
    confidence = 0.5 + 0.5 * torch.rand(3000, generator=generator, dtype=torch.float64)
    cases = {
        "calibrated": (confidence, (torch.rand(3000, generator=generator) < confidence).double()),
        "tied": (confidence.round(decimals=1), (torch.rand(3000, generator=generator) < 0.6).double()),
        "tiny": (confidence[:5], torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)),
    }
    for name, (conf, correct) in cases.items():
        ours = float(smooth_ece_rows(conf[None], correct[None])[0])
        assert ours == pytest.approx(float(relplot.smECE(conf.numpy(), correct.numpy())), abs=1e-6), name


def test_smooth_ece_rows_are_independent_of_their_batch():
    """Rows bisect their own bandwidths: one batch gives each row the value it gets alone."""
    probs, labels = _mixed_predictions(n=400, seed=5)
    confidence, predicted = probs.double().max(-1)
    correct = (predicted == labels).double()
    index = torch.randint(400, (6, 400), generator=torch.Generator().manual_seed(0))
    together = smooth_ece_rows(confidence[index], correct[index])
    alone = [metrics.smooth_ece(probs[row], labels[row]) for row in index]
    assert together.tolist() == pytest.approx(alone, abs=1e-12)
    assert len({round(v, 6) for v in alone}) == 6  # the resamples differ, so the rows are not trivially equal


@pytest.mark.parametrize("seed", [0, 1])
def test_adaptive_ece_matches_torch_uncertainty_and_numpy(seed):
    """Oracles: torch-uncertainty's AdaptiveCalibrationError (it computes in float32, hence 1e-6) and a
    direct numpy computation over ``numpy.array_split`` of the confidence-sorted examples (float64, 1e-12)."""
    probs, labels = _mixed_predictions(n=1003, seed=seed)  # 1003 = 15 * 66 + 13: bins of 67 and 66 examples
    ours = metrics.adaptive_ece(probs, labels, bins=15)
    peer = AdaptiveCalibrationError(task="multiclass", num_bins=15, norm="l1", num_classes=10)
    peer.update(probs, labels)
    assert ours == pytest.approx(float(peer.compute()), abs=1e-6)
    confidence, predicted = probs.double().max(-1)
    order = np.argsort(confidence.numpy(), kind="stable")
    gaps = (confidence.numpy() - (predicted == labels).double().numpy())[order]
    direct = sum(abs(part.sum()) for part in np.array_split(gaps, 15)) / len(gaps)
    assert ours == pytest.approx(direct, abs=1e-12)
    assert abs(ours - metrics.ece(probs, labels)) > 1e-4  # equal-mass bins are not the equal-width ones


@pytest.mark.parametrize("n, seed", [(50, 0), (2000, 1)])
def test_augrc_matches_torch_uncertainty(n, seed):
    """torch-uncertainty integrates the generalized risk g_k = errors among the first k / N over coverage k / N with
    the trapezoid rule and divides by the span 1 - 1/N; posthoc averages g_k as it averages the risk in AURC. The
    two are tied exactly: ours = theirs * (1 - 1/N) + (g_1 + g_N) / (2N), up to torch-uncertainty's float32 coverage
    grid (1e-6)."""
    probs, labels = _mixed_predictions(n=n, seed=seed)
    peer = AUGRC()
    peer.update(probs, labels)
    theirs = float(peer.compute())
    confidence, predicted = probs.max(-1)
    errors = (predicted != labels).double()[confidence.argsort(descending=True)]
    first, last = float(errors[0]) / n, float(errors.sum()) / n
    ours = metrics.augrc(probs, labels)
    assert ours == pytest.approx(theirs * (1 - 1 / n) + (first + last) / (2 * n), abs=1e-6)
    assert abs(ours - theirs) <= 1 / n
    # the probability that, of two examples drawn with replacement, the first is wrong and ranked no later
    wrong = errors.bool()
    rank = torch.arange(n)
    pairs = (wrong[:, None] & (rank[:, None] <= rank[None, :])).double().mean()
    assert ours == pytest.approx(float(pairs), abs=1e-12)


def test_augrc_is_zero_for_perfect_predictions_and_lower_for_a_better_ranking():
    labels = torch.tensor([0, 1, 2, 1])
    assert metrics.augrc(torch.nn.functional.one_hot(labels, 3).float(), labels) == 0.0
    probs = torch.tensor([[0.99, 0.01], [0.9, 0.1], [0.6, 0.4]])
    well_ranked = metrics.augrc(probs, torch.tensor([0, 0, 1]))  # the error is the least confident
    badly_ranked = metrics.augrc(probs, torch.tensor([1, 0, 0]))  # the error is the most confident
    assert well_ranked == pytest.approx(1 / 9) and badly_ranked == pytest.approx(3 / 9)
