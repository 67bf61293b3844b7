"""``posthoc.conformal`` on a dense model: the mean coverage over a new image's valid positions, over many random
splits; the equal-count threshold against MAPIE on the flattened rows; bad inputs.

The synthetic "segmenter" is a 1x1 convolution that returns its input: the inputs are the logits ``(N, C, H, W)``.
Half of the images are hard (labels drawn from the softmax at temperature 3, a strongly overconfident model) and keep
only their first row of valid pixels; the easy half (temperature 0.7) keeps every pixel. Positions of one image share
its difficulty, so they are not exchangeable with each other, and an image's count of valid positions goes with its
difficulty: pooling the pixels unweighted would undercover the hard images, which the test checks too.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import posthoc
from posthoc.errors import ConfigError, InputError
from posthoc.guarantees.dense_conformal import DenseConformalPredictor

CLASSES, SIDE, IGNORE = 5, 8, 255
SPLITS, N_CAL, N_TEST, ALPHA = 300, 100, 100, 0.1

pytestmark = pytest.mark.usefixtures("one_thread")


def scenes(count: int, generator: torch.Generator, *, all_valid: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``(count, C, SIDE, SIDE)`` and masks ``(count, SIDE, SIDE)`` (module docs)."""
    logits = 2.0 * torch.randn(count, CLASSES, SIDE, SIDE, generator=generator)
    logits += torch.randn(count, CLASSES, 1, 1, generator=generator)  # a class bias per image
    hard = torch.rand(count, generator=generator) < 0.5
    temperature = torch.where(hard, 3.0, 0.7).view(-1, 1, 1, 1)
    cumulative = torch.softmax(logits / temperature, 1).cumsum(1)
    u = torch.rand(count, 1, SIDE, SIDE, generator=generator)
    masks = (cumulative < u).sum(1).clamp_max(CLASSES - 1)
    if not all_valid:
        masks[:, 1:] = torch.where(hard.view(-1, 1, 1), IGNORE, masks[:, 1:])
    return logits, masks


def identity_segmenter() -> nn.Module:
    conv = nn.Conv2d(CLASSES, CLASSES, 1)
    with torch.no_grad():
        conv.weight.copy_(torch.eye(CLASSES).view(CLASSES, CLASSES, 1, 1))
        conv.bias.zero_()
    return conv


@pytest.fixture(scope="module")
def dense_um():
    x, y = scenes(16, torch.Generator().manual_seed(0))
    return posthoc.wrap(identity_segmenter(), method="none", dense=True).fit(None, [(x, y)], progress=False)


def image_coverage(sets: torch.Tensor, masks: torch.Tensor) -> float:
    """The mean over images of the fraction of each image's valid positions whose set holds the label."""
    valid = masks != IGNORE
    hit = sets.gather(1, masks.clamp_max(CLASSES - 1)[:, None]).squeeze(1) & valid
    return float((hit.sum((1, 2)) / valid.sum((1, 2))).mean())


@pytest.mark.parametrize("score", ["lac", "aps"])
def test_mean_coverage_over_a_new_images_positions_over_random_splits(dense_um, score: str) -> None:
    """Per split: calibrate on N_CAL fresh images, measure the per-image coverage on N_TEST others. The mean over
    SPLITS splits lies in [1 - alpha, 1 - alpha + 2/(n + 1)] (the guarantee's two ends) within 3 standard errors.
    The same splits with the pixels pooled unweighted (the row conformal on the flattened valid positions) undercover
    by more than 3 standard errors: the per-image weights are what the guarantee needs."""
    generator = torch.Generator().manual_seed(1234)
    covered, pooled = [], []
    for split in range(SPLITS):
        x, y = scenes(N_CAL + N_TEST, generator)
        cp = posthoc.conformal(dense_um, [(x[:N_CAL], y[:N_CAL])], alpha=ALPHA, score=score, seed=split)
        assert isinstance(cp, DenseConformalPredictor) and cp.num_calibration == N_CAL
        sets = cp.sets(x[N_CAL:])
        assert sets.shape == x[N_CAL:].shape and sets.dtype == torch.bool
        covered.append(image_coverage(sets, y[N_CAL:]))
        rows, labels = x[:N_CAL].movedim(1, -1), y[:N_CAL]
        flat = posthoc.conformal(
            torch.softmax(rows[labels != IGNORE], -1), labels[labels != IGNORE], alpha=ALPHA, score=score, seed=split
        )
        test_rows = torch.softmax(x[N_CAL:], 1).movedim(1, -1)
        flat_sets = flat.sets(test_rows.reshape(-1, CLASSES)).reshape(test_rows.shape).movedim(-1, 1)
        pooled.append(image_coverage(flat_sets, y[N_CAL:]))
    covered, pooled = np.array(covered), np.array(pooled)
    se = covered.std(ddof=1) / math.sqrt(SPLITS)
    assert 1 - ALPHA - 3 * se <= covered.mean() <= 1 - ALPHA + 2 / (N_CAL + 1) + 3 * se, (covered.mean(), se)
    assert pooled.mean() < 1 - ALPHA - 3 * pooled.std(ddof=1) / math.sqrt(SPLITS), pooled.mean()


@pytest.mark.parametrize(("n_images", "alpha"), [(20, 0.1), (49, 0.05), (99, 0.2)])
def test_equal_counts_give_mapies_lac_threshold_on_the_flattened_rows(dense_um, n_images: int, alpha: float) -> None:
    """Every image with all m positions valid: the threshold is the ceil((n + 1)(1 - alpha) m)-th smallest pooled
    score, which is MAPIE's LAC quantile on the n·m flattened rows at the confidence level of that rank; the sets
    are MAPIE's sets (exactly)."""
    import mapie.classification as mapie
    from sklearn.base import BaseEstimator, ClassifierMixin

    class GivenProbabilities(ClassifierMixin, BaseEstimator):
        def fit(self, x, y):
            self.classes_ = np.arange(CLASSES)
            return self

        def predict_proba(self, x):
            return np.asarray(x, dtype=np.float64)

        def predict(self, x):
            return np.asarray(x).argmax(1)

    x, y = scenes(n_images + 10, torch.Generator().manual_seed(n_images), all_valid=True)
    cp = posthoc.conformal(dense_um, [(x[:n_images], y[:n_images])], alpha=alpha)
    m = SIDE * SIDE
    rank = math.ceil((n_images + 1) * (1 - alpha) * m - 1e-9)
    probs = torch.softmax(x, 1).movedim(1, -1).reshape(-1, CLASSES).double().numpy()
    labels = y.reshape(-1).numpy()
    rows = n_images * m
    reference = mapie.SplitConformalClassifier(
        GivenProbabilities().fit(probs, labels),
        confidence_level=(rank - 0.5) / (rows + 1),
        conformity_score="lac",
        prefit=True,
    )
    reference.conformalize(probs[:rows], labels[:rows])
    _, reference_sets = reference.predict_set(probs[rows:])
    quantile = float(reference._mapie_classifier.conformity_score_function_.quantiles_[0])
    assert float(cp.threshold) == pytest.approx(quantile, abs=1e-6)  # float32 probabilities against float64
    sets = cp.sets(x[n_images:]).movedim(1, -1).reshape(-1, CLASSES).numpy()
    assert (sets != reference_sets[:, :, 0]).mean() < 1e-3  # positions within float32 rounding of the threshold


def test_predict_fills_the_sets_and_tokens_keep_their_layout() -> None:
    """Token logits (N, T, V) give sets (N, T, V); predict's sets are sets()."""
    generator = torch.Generator().manual_seed(3)
    embed = nn.Embedding(7, 7)
    logits_of = nn.Sequential(embed)
    tokens = torch.randint(0, 7, (30, 6), generator=generator)
    labels = torch.randint(0, 7, (30, 6), generator=generator)
    labels[:, -1] = -100
    um = posthoc.wrap(logits_of, method="temperature", dense=True).fit(None, [(tokens, labels)], progress=False)
    cp = posthoc.conformal(um, [(tokens, labels)], alpha=0.2, score="aps", randomized=False)
    pred = cp.predict(tokens[:4])
    assert pred.sets.shape == (4, 6, 7) and torch.equal(pred.sets, cp.sets(pred))
    assert cp.num_positions == 30 * 5


def test_dense_conformal_refuses_what_it_does_not_support(dense_um) -> None:
    x, y = scenes(20, torch.Generator().manual_seed(1))
    with pytest.raises(ConfigError, match="mondrian"):
        posthoc.conformal(dense_um, [(x, y)], alpha=0.1, mondrian=True)
    with pytest.raises(InputError, match="loader"):
        posthoc.conformal(dense_um, y, alpha=0.1)
    with pytest.raises(InputError, match="calibration"):
        posthoc.conformal(dense_um, [(x[:5], y[:5])], alpha=0.1)  # 5 images < 1/alpha - 1
    with pytest.raises(InputError, match="do not match"):
        posthoc.conformal(dense_um, [(x, y[:, :4])], alpha=0.1)
    with pytest.raises(InputError, match="ignore index"):
        posthoc.conformal(dense_um, [(x, torch.full_like(y, IGNORE))], alpha=0.1)
