import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posthoc.core.prediction import Prediction, entropy, softmax_entropy


def _entropy64(probs: np.ndarray) -> np.ndarray:
    """Shannon entropy in nats over the last axis, in float64, written apart from posthoc's."""
    logs = np.log(np.where(probs > 0, probs, 1.0))
    return -(probs * logs).sum(-1)


def test_entropy_is_safe_at_zero_probability():
    assert entropy(torch.tensor([1.0, 0.0, 0.0])).item() == 0.0
    assert math.isclose(entropy(torch.full((4,), 0.25)).item(), math.log(4), rel_tol=1e-6)


def test_deterministic_prediction_has_no_epistemic_part():
    pred = Prediction.from_probs(torch.tensor([[0.7, 0.2, 0.1]]))
    assert pred.samples is None
    assert torch.equal(pred.aleatoric, pred.entropy)
    assert pred.epistemic.item() == 0.0
    assert pred.label.item() == 0 and math.isclose(pred.confidence.item(), 0.7, rel_tol=1e-6)


def test_agreeing_samples_have_no_epistemic_part():
    sample = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    samples = sample.expand(5, 2, 3)
    pred = Prediction.from_probs(samples.mean(0), samples)
    assert torch.allclose(pred.aleatoric, pred.entropy, atol=1e-6)
    assert torch.allclose(pred.epistemic, torch.zeros(2), atol=1e-6)


def test_disagreeing_confident_samples_are_all_epistemic():
    samples = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    pred = Prediction.from_probs(samples.mean(0), samples)
    assert pred.aleatoric.item() == 0.0
    assert math.isclose(pred.epistemic.item(), math.log(2), rel_tol=1e-6)


def test_mutual_information_of_a_hand_computed_example():
    """Two samples (0.9, 0.1) and (0.1, 0.9): H[mean] = log 2, E[H] = -(0.9 log 0.9 + 0.1 log 0.1)."""
    samples = torch.tensor([[[0.9, 0.1], [0.5, 0.5]], [[0.1, 0.9], [0.5, 0.5]]])
    pred = Prediction.from_probs(samples.mean(0), samples)
    expected_aleatoric = -(0.9 * math.log(0.9) + 0.1 * math.log(0.1))
    assert torch.allclose(pred.entropy, torch.tensor([math.log(2), math.log(2)]), atol=1e-6)
    assert torch.allclose(pred.aleatoric, torch.tensor([expected_aleatoric, math.log(2)]), atol=1e-6)
    assert math.isclose(pred.epistemic[0].item(), math.log(2) - expected_aleatoric, abs_tol=1e-6)
    assert math.isclose(pred.epistemic[0].item(), 0.368064, abs_tol=1e-6)
    assert abs(pred.epistemic[1].item()) < 1e-7, "identical samples carry no mutual information"


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(2, 7), st.integers(0, 2**31 - 1))
def test_decomposition_matches_an_independent_float64_computation(num_samples, n, c, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_samples, n, c, generator=generator) * 5
    samples = logits.softmax(-1)
    pred = Prediction.from_probs(samples.mean(0), samples)
    p = samples.double().numpy()
    total, aleatoric = _entropy64(p.mean(0)), _entropy64(p).mean(0)
    np.testing.assert_allclose(pred.entropy.numpy(), total, atol=1e-5)
    np.testing.assert_allclose(pred.aleatoric.numpy(), aleatoric, atol=1e-5)
    np.testing.assert_allclose(pred.epistemic.numpy(), total - aleatoric, atol=1e-5)
    disagree = (p.max(0) - p.min(0)).max(-1) > 0.1
    assert (pred.epistemic.numpy()[disagree] > 0).all(), "samples that disagree must carry mutual information"


def test_entropy_from_log_probs_matches_float64_within_float32_round_off():
    """``softmax_entropy`` (no log per class) against the float64 entropy: 20,000 classes, flat to peaked rows,
    log-probabilities off their normalisation by a constant, and rows with ``-inf`` (probability exactly 0), which
    take the per-class path; within 2e-6 relative (float32 round-off of a pairwise sum), as ``entropy`` is."""
    generator = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.01, 1.0, 5.0, 30.0, 200.0]).repeat(4)[:, None]
    log_probs = (torch.randn(20, 20_000, generator=generator) * scales).log_softmax(-1) + 3.0
    log_probs[3, :100] = float("-inf")
    log_probs[7, 5:] = float("-inf")
    probs = torch.softmax(log_probs, -1)
    found = softmax_entropy(probs, log_probs, *probs.max(-1))
    exact = _entropy64(torch.softmax(log_probs.double(), -1).numpy())
    assert np.allclose(found.double().numpy(), exact, rtol=2e-6, atol=2e-6)
    assert np.allclose(entropy(probs).double().numpy(), exact, rtol=2e-6, atol=2e-6)
    assert (found >= 0).all()


def test_entropy_from_log_probs_keeps_a_nan_row_nan():
    log_probs = torch.tensor([[0.0, float("nan"), -1.0], [0.0, -1.0, -2.0]])
    probs = torch.softmax(log_probs, -1)
    found = Prediction.from_probs(probs, None, log_probs)
    assert torch.isnan(found.entropy[0]) and torch.isnan(found.confidence[0])
    assert math.isclose(found.entropy[1].item(), entropy(probs[1]).item(), rel_tol=1e-6)
