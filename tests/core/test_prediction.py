import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posthoc.core.prediction import Prediction, entropy


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
