"""Weighted conformal sets under covariate shift (Tibshirani et al. 2019): coverage over 300 draws of a synthetic
shift, the weighted quantile against TorchCP's ``WeightedPredictor``, a wrapped model with a shift loader, errors.

The synthetic shift: features ``x ~ N(0, I)`` (2-D) at calibration, ``N((1.5, 0), I)`` at deployment; the labels
follow ``p(y | x)``, the same in both, whose noise grows with ``x_1``, while the model's probabilities do not see that
noise. Deployment moves mass to where the model is overconfident, so unweighted sets undercover there.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torchcp.classification.predictor import WeightedPredictor
from torchcp.classification.score import LAC

import posthoc
from posthoc.guarantees.covariate_shift import WeightedConformalPredictor, weighted_thresholds
from posthoc.guarantees.measures import coverage
from posthoc_apps.demo import data

pytestmark = pytest.mark.usefixtures("one_thread")

CLASSES = 4
DIRECTIONS = torch.tensor([[2.0, 0.0, -2.0, 0.0], [0.0, 2.0, 0.0, -2.0]], dtype=torch.float64)
SHIFT = torch.tensor([1.5, 0.0], dtype=torch.float64)


def draw(count: int, generator: torch.Generator, shifted: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features ``(count, 2)``, the model's logits ``(count, 4)`` and labels drawn from the true ``p(y | x)``."""
    features = torch.randn(count, 2, generator=generator, dtype=torch.float64) + (SHIFT if shifted else 0.0)
    logits = features @ DIRECTIONS
    noise = torch.sigmoid(2.0 * features[:, :1])  # the true logits flatten as x_1 grows
    true_probs = torch.softmax(logits * (1.2 - noise), -1)
    labels = torch.multinomial(true_probs, 1, generator=generator).squeeze(1)
    return features, logits, labels


def test_weighted_sets_cover_under_the_shift_and_unweighted_ones_do_not() -> None:
    generator, alpha, draws = torch.Generator().manual_seed(0), 0.1, 300
    weighted, plain, sizes = [], [], []
    for seed in range(draws):
        cal_features, cal_logits, cal_labels = draw(400, generator, shifted=False)
        shift_features, _, _ = draw(400, generator, shifted=True)
        test_features, test_logits, test_labels = draw(400, generator, shifted=True)
        cp = posthoc.conformal(
            cal_logits, cal_labels, alpha=alpha, features=cal_features, shift_features=shift_features, seed=seed
        )
        weighted.append(coverage(cp.sets(test_logits, features=test_features), test_labels))
        plain.append(coverage(posthoc.conformal(cal_logits, cal_labels, alpha=alpha).sets(test_logits), test_labels))
        sizes.append(cp.effective_sample_size)
    assert 0.88 <= np.mean(weighted) <= 0.93, np.mean(weighted)
    assert np.mean(plain) < 0.87, np.mean(plain)  # the unweighted sets undercover under the shift
    # the weights concentrate on the calibration points that look deployed: fewer effective examples than 400
    assert 50 < np.median(sizes) < 300, np.median(sizes)


def test_without_a_shift_the_weighted_sets_stay_at_the_level() -> None:
    generator, alpha = torch.Generator().manual_seed(1), 0.1
    covered = []
    for _ in range(100):
        cal_features, cal_logits, cal_labels = draw(400, generator, shifted=False)
        shift_features, _, _ = draw(400, generator, shifted=False)
        test_features, test_logits, test_labels = draw(400, generator, shifted=False)
        cp = posthoc.conformal(
            cal_logits, cal_labels, alpha=alpha, features=cal_features, shift_features=shift_features
        )
        covered.append(coverage(cp.sets(test_logits, features=test_features), test_labels))
        assert cp.effective_sample_size > 300  # no shift: the weights stay near 1
    assert 0.89 <= np.mean(covered) <= 0.925


def test_the_weighted_quantile_equals_torchcps_given_its_pairing() -> None:
    """TorchCP 1.2.1 sorts the calibration weights apart from the scores (``w_sorted = sort(w)``) and so pairs the
    k-th smallest weight with the k-th smallest score; given that pairing, posthoc's weighted quantile gives TorchCP's
    sets exactly (float32 scores: to 1e-6). Tibshirani's weights are each score's own; with equal weights the two
    agree, and so do both with split conformal."""
    generator = torch.Generator().manual_seed(2)
    cal_features, cal_logits, cal_labels = draw(300, generator, shifted=False)
    shift_features, _, _ = draw(300, generator, shifted=True)
    test_features, test_logits, _ = draw(200, generator, shifted=True)
    cp = posthoc.conformal(
        cal_logits, cal_labels, alpha=0.1, features=cal_features, shift_features=shift_features, max_weight=None
    )
    assert isinstance(cp, WeightedConformalPredictor) and cp.clipped == 0

    class Columns(nn.Module):
        def __init__(self, columns: slice) -> None:
            super().__init__()
            self.columns = columns

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, self.columns]

    class Domain(nn.Module):  # posthoc's fitted domain classifier: P(calibration), P(deployment)
        def forward(self, features: torch.Tensor) -> torch.Tensor:
            deployed = torch.sigmoid(cp.ratio.log_odds(features.double()))
            return torch.stack([1 - deployed, deployed], 1).float()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = WeightedPredictor(
            LAC(),
            model=Columns(slice(0, CLASSES)),
            image_encoder=Columns(slice(CLASSES, None)),
            domain_classifier=Domain(),
            device="cpu",
            alpha=0.1,
        )
    reference.calculate_threshold(cal_logits.float(), cal_labels, alpha=0.1)
    reference.source_image_features = cal_features.float()
    reference.evaluate([(torch.cat([test_logits, test_features], 1).float(), torch.zeros(200, dtype=torch.long))])
    reference_sets = reference.predict(torch.cat([test_logits, test_features], 1).float()).bool()

    test_weights = cp.ratio(test_features)
    as_torchcp_pairs = weighted_thresholds(cp.sorted_scores, cp.sorted_weights.sort().values, test_weights, 0.1)
    scores = 1 - test_logits.softmax(-1)
    near = (scores - as_torchcp_pairs[:, None]).abs() < 1e-6
    assert torch.equal((scores <= as_torchcp_pairs[:, None])[~near], reference_sets[~near])
    # equal weights: one threshold, the split conformal one, in both
    equal = torch.ones_like(cp.sorted_weights)
    split = posthoc.conformal(cal_logits, cal_labels, alpha=0.1)
    assert torch.equal(
        weighted_thresholds(cp.sorted_scores, equal, torch.ones(5, dtype=torch.float64), 0.1), split.threshold.expand(5)
    )


def test_clipping_caps_the_weights_and_counts_them() -> None:
    generator = torch.Generator().manual_seed(3)
    cal_features, cal_logits, cal_labels = draw(400, generator, shifted=False)
    shift_features = draw(400, generator, shifted=True)[0] + 2.0  # a strong shift: large ratios
    capped = posthoc.conformal(
        cal_logits, cal_labels, features=cal_features, shift_features=shift_features, max_weight=5.0
    )
    free = posthoc.conformal(
        cal_logits, cal_labels, features=cal_features, shift_features=shift_features, max_weight=None
    )
    assert float(capped.weights.max()) == 5.0 and capped.clipped > 0 and free.clipped == 0
    assert float(free.weights.max()) > 5.0
    assert "effective_sample_size" in repr(capped)


def test_a_wrapped_model_with_a_shift_loader(digits: data.DigitsSplits, digits_model: torch.nn.Module) -> None:
    um = posthoc.wrap(digits_model, method="none").fit()
    shifted = data.rotated(digits.test, 30)
    half = len(shifted) // 2
    unlabelled = [(shifted.tensors[0][:half],)]
    cp = posthoc.conformal(um, data.loader(digits.calibration, 300), alpha=0.1, shift_loader=unlabelled, progress=False)
    x, y = shifted.tensors[0][half:], shifted.tensors[1][half:]
    sets = cp.sets(x)
    assert sets.shape == (len(y), digits.num_classes) and cp.effective_sample_size < len(digits.calibration)
    plain = posthoc.conformal(um, data.loader(digits.calibration, 300), alpha=0.1, progress=False)
    assert coverage(sets, y) >= coverage(plain.sets(x), y)  # larger sets where the rotated digits look unlike any
    assert torch.equal(cp.predict(x).sets, sets)
    with pytest.raises(posthoc.InputError, match="need each test point's features"):
        cp.sets(um.predict(x))


def test_shift_errors() -> None:
    generator = torch.Generator().manual_seed(4)
    features, logits, labels = draw(100, generator, shifted=False)
    cases = [
        (dict(shift_features=features), posthoc.ConfigError, "features= and the deployment points' shift_features="),
        (dict(features=features, shift_features=features[:, :1]), posthoc.InputError, "1 columns"),
        (dict(features=features[:50], shift_features=features), posthoc.InputError, "50 rows of features"),
        (
            dict(features=features, shift_features=features, condition="class"),
            posthoc.ConfigError,
            "cannot be combined",
        ),
        (dict(features=features, shift_features=features, max_weight=0), posthoc.ConfigError, "max_weight"),
        (dict(shift_loader=[(features,)]), posthoc.ConfigError, "shift_loader= is for a wrapped model"),
    ]
    for options, error, message in cases:
        with pytest.raises(error, match=message):
            posthoc.conformal(logits, labels, **options)
    cp = posthoc.conformal(logits, labels, features=features, shift_features=features)
    with pytest.raises(posthoc.InputError, match="need each test point's features"):
        cp.sets(logits)
