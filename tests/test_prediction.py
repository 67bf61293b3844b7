import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posthoc.core.prediction import Prediction, entropy


def test_entropy_is_safe_at_zero_probability():
    assert entropy(torch.tensor([1.0, 0.0, 0.0])).item() == 0.0
    assert math.isclose(entropy(torch.full((4,), 0.25)).item(), math.log(4), rel_tol=1e-6)


def test_deterministic_prediction_has_no_epistemic_part():
    pred = Prediction.from_probs(torch.tensor([[0.7, 0.2, 0.1]]))
    assert pred.samples is None
    assert torch.equal(pred.aleatoric, pred.entropy)
    assert pred.epistemic.item() == 0.0
    assert pred.label.item() == 0 and math.isclose(pred.confidence.item(), 0.7, rel_tol=1e-6)


def test_disagreeing_confident_samples_are_all_epistemic():
    samples = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    pred = Prediction.from_probs(samples.mean(0), samples)
    assert pred.aleatoric.item() == 0.0
    assert math.isclose(pred.epistemic.item(), math.log(2), rel_tol=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(2, 7), st.integers(0, 2**31 - 1))
def test_decomposition_adds_up(num_samples, n, c, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_samples, n, c, generator=generator) * 5
    samples = logits.softmax(-1)
    pred = Prediction.from_probs(samples.mean(0), samples)
    assert torch.allclose(pred.aleatoric + pred.epistemic, pred.entropy, atol=1e-5)
    assert (pred.epistemic >= 0).all() and (pred.entropy <= math.log(c) + 1e-5).all()
