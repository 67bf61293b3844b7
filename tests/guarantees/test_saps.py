"""SAPS (Huang et al. 2024): its scores and sets against TorchCP's ``SAPS`` on the same probabilities and draws.

TorchCP draws one ``U`` per class in rank order and scores a rank ``r`` (0-based) ``p_max + lam * (r - U)``, the top
class ``(1 - U) * p_max``: posthoc's ``u`` is ``1 - U``. Its deterministic scores (``U = 0``) are posthoc's
``randomized=False`` (``u = 1``). TorchCP computes in float32, so the scores agree to 1e-6 (values below 3).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torchcp.classification.predictor import SplitPredictor
from torchcp.classification.score import SAPS
from torchcp.utils.common import calculate_conformal_value

import posthoc
from posthoc.guarantees.scores import ConformityScore, saps_ranked

pytestmark = pytest.mark.usefixtures("one_thread")


def logits_and_labels(count: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(count, classes, generator=generator) + torch.linspace(-1, 1, classes)
    labels = torch.distributions.Categorical(logits=logits / 1.5).sample()
    return logits, labels


def torchcp_saps(weight: float, randomized: bool) -> SAPS:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return SAPS(weight=weight, randomized=randomized)


@pytest.mark.parametrize("weight", [0.05, 0.2, 0.5])
def test_randomised_scores_equal_torchcp_with_its_draws(weight: float) -> None:
    logits, _ = logits_and_labels(300, 12, seed=1)
    torch.manual_seed(5)
    reference = torchcp_saps(weight, randomized=True)(logits).double()
    torch.manual_seed(5)
    draws = torch.rand(logits.shape).double()  # TorchCP's U, one per class in rank order
    probs = logits.double().softmax(-1)
    ranked, order = probs.sort(dim=-1, descending=True, stable=True)
    ours = torch.empty_like(ranked).scatter_(-1, order, saps_ranked(ranked, 1 - draws, weight))
    assert torch.allclose(ours, reference, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("alpha", "weight"), [(0.05, 0.2), (0.1, 0.2), (0.1, 0.05), (0.2, 0.5)])
def test_deterministic_thresholds_and_sets_equal_torchcp(alpha: float, weight: float) -> None:
    logits, labels = logits_and_labels(1500, 20, seed=int(100 * alpha + 10 * weight))
    cal, test = slice(0, 500), slice(500, None)
    reference_scores = torchcp_saps(weight, randomized=False)(logits[cal])
    reference_threshold = calculate_conformal_value(reference_scores.gather(1, labels[cal, None]).squeeze(1), alpha)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        predictor = SplitPredictor(torchcp_saps(weight, randomized=False), alpha=alpha)
    reference_sets = predictor.predict_with_logits(logits[test], q_hat=reference_threshold).bool()
    cp = posthoc.conformal(logits[cal], labels[cal], alpha=alpha, score="saps", lam=weight, randomized=False)
    assert float(cp.threshold) == pytest.approx(float(reference_threshold), abs=1e-6)
    ours = cp.sets(logits[test])
    # equal, except where a class's score lies within float32 rounding of the threshold
    scores = ConformityScore("saps", randomized=False, lam=weight)(logits[test].double().softmax(-1))
    near = (scores - cp.threshold).abs() < 1e-6
    assert torch.equal(ours[~near], reference_sets[~near]) and near.float().mean() < 1e-3


def test_saps_sets_are_the_top_classes() -> None:
    logits, labels = logits_and_labels(2000, 15, seed=3)
    cp = posthoc.conformal(logits[:1000], labels[:1000], alpha=0.1, score="saps", seed=2)
    sets = cp.sets(logits[1000:])
    in_rank_order = sets.gather(1, logits[1000:].argsort(-1, descending=True))
    assert torch.equal(in_rank_order, in_rank_order.cummin(-1).values)
    assert "saps (randomised, lam=0.2)" in repr(cp)


def test_saps_options_are_checked() -> None:
    logits, labels = logits_and_labels(100, 5, seed=0)
    with pytest.raises(posthoc.ConfigError, match="lam must be a finite number > 0"):
        posthoc.conformal(logits, labels, score="saps", lam=0.0)
    with pytest.raises(posthoc.ConfigError, match="k_reg is an option of score='raps'"):
        posthoc.conformal(logits, labels, score="saps", k_reg=2)
