"""``posthoc.conformal`` and ``posthoc.selective`` for a regressor: the coverage guarantee through a wrapped model over
many random splits, the RegressionPrediction path, and the errors for misuse."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_regression import _trained_mlp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.errors import ConfigError, InputError
from posthoc.guarantees.intervals import conformal_intervals


def _draw(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh examples from the distribution ``_trained_mlp`` was trained on (y = 2 x0 + noise of std 0.4)."""
    x = torch.randn(n, 3, generator=generator)
    return x, 2 * x[:, :1] + 0.4 * torch.randn(n, 1, generator=generator)


@pytest.fixture(scope="module")
def regressor() -> posthoc.UncertainModel:
    net, loader, _ = _trained_mlp()
    return posthoc.wrap(net, method="laplace", likelihood="regression").fit(loader, progress=False)


@pytest.mark.parametrize("score", ["normalized", "absolute", "cqr"])
def test_coverage_through_the_wrapped_model_holds_over_many_random_splits(regressor, score: str) -> None:
    # As tests/guarantees/test_conformal_intervals.py: averaged over splits, 1 - alpha <= coverage <= 1 - alpha + 1/(n + 1);
    # the mean's standard error is at most sqrt(alpha (1 - alpha) / n_cal) / sqrt(splits); 4 of them of slack.
    splits, n_cal, n_test, alpha = 300, 40, 100, 0.1
    generator = torch.Generator().manual_seed(0)
    coverages = []
    for _ in range(splits):
        x, y = _draw(n_cal + n_test, generator)
        cp = posthoc.conformal(
            regressor,
            DataLoader(TensorDataset(x[:n_cal], y[:n_cal]), batch_size=32),
            alpha=alpha,
            progress=False,
            **({} if score == "normalized" else {"score": score}),
        )
        assert cp.score == score and cp.num_calibration == n_cal
        lower, upper = cp.intervals(x[n_cal:])
        coverages.append(float(((lower <= y[n_cal:]) & (y[n_cal:] <= upper)).double().mean()))
    mean, slack = float(np.mean(coverages)), 4 * math.sqrt(alpha * (1 - alpha) / n_cal) / math.sqrt(splits)
    assert 1 - alpha - slack <= mean <= 1 - alpha + 1 / (n_cal + 1) + slack


def test_a_regression_prediction_and_its_targets_give_the_intervals_of_conformal_intervals(regressor) -> None:
    x, y = _draw(300, torch.Generator().manual_seed(1))
    calibration, test = regressor.predict(x[:200]), regressor.predict(x[200:])
    cp = posthoc.conformal(calibration, y[:200, 0], alpha=0.2)  # (N,) targets for one output
    reference = conformal_intervals(y[:200], mean=calibration.mean, std=calibration.std, alpha=0.2)
    torch.testing.assert_close(cp.threshold, reference.threshold, rtol=0, atol=0)
    for got, want in zip(cp.intervals(test), reference.intervals(mean=test.mean, std=test.std)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # through the model: the same intervals as from its prediction (laplace is deterministic)
    by_model = posthoc.conformal(regressor, [(x[:200], y[:200])], alpha=0.2, progress=False)
    for got, want in zip(by_model.intervals(x[200:]), cp.intervals(test)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_normalized_intervals_follow_the_predictive_std_and_absolute_ones_do_not(regressor) -> None:
    x, y = _draw(200, torch.Generator().manual_seed(2))
    points = torch.cat([torch.zeros(1, 3), torch.full((1, 3), 6.0)])  # the second far outside the training inputs
    std = regressor.predict(points).std[:, 0]
    assert std[1] > 1.2 * std[0]
    for score in ("normalized", "absolute"):
        lower, upper = posthoc.conformal(regressor, [(x, y)], score=score, progress=False).intervals(points)
        width = (upper - lower)[:, 0]
        expected = std[1] / std[0] if score == "normalized" else 1.0
        assert float(width[1] / width[0]) == pytest.approx(float(expected), rel=1e-6)  # the std is float32


def _classifier() -> posthoc.UncertainModel:
    torch.manual_seed(0)
    return posthoc.wrap(nn.Linear(3, 4), method="none")


def test_misuse_is_refused_with_what_to_do(regressor) -> None:
    x, y = _draw(50, torch.Generator().manual_seed(3))
    cp = posthoc.conformal(regressor, [(x, y)], progress=False)
    with pytest.raises(ConfigError, match="sets are for classifiers.*cp.intervals"):
        cp.sets(x)
    with pytest.raises(ConfigError, match="unknown regression conformal score 'aps'"):
        posthoc.conformal(regressor, [(x, y)], score="aps", progress=False)
    with pytest.raises(ConfigError, match="mondrian configure conformal sets for classifiers"):
        posthoc.conformal(regressor, [(x, y)], mondrian=True, progress=False)
    for option in ({"condition": "cluster"}, {"non_empty": True}, {"shift_loader": [(x,)]}):
        with pytest.raises(ConfigError, match="not supported for a regressor"):
            posthoc.conformal(regressor, [(x, y)], progress=False, **option)
    with pytest.raises(InputError, match="loader of"):
        posthoc.conformal(regressor, y)
    with pytest.raises(InputError, match=r"targets have shape \(49, 1\)"):
        posthoc.conformal(regressor.predict(x), y[:49])
    from_prediction = posthoc.conformal(regressor.predict(x), y)
    with pytest.raises(InputError, match="takes one too"):
        from_prediction.intervals(x)
    classifier = _classifier()
    with pytest.raises(InputError, match="classifier's"):
        from_prediction.intervals(classifier.predict(x))
    # a classifier given regression targets, and a classifier's conformal object asked for intervals
    with pytest.raises(InputError, match="looks like regression targets.*likelihood='regression'"):
        posthoc.conformal(classifier, [(x, y[:, 0])], progress=False)
    sets = posthoc.conformal(classifier, [(x, torch.arange(50) % 4)], progress=False)
    with pytest.raises(ConfigError, match="intervals are for regressors.*cp.sets"):
        sets.intervals(x)


def test_selective_refuses_a_regressor_and_says_what_to_use(regressor) -> None:
    x, y = _draw(50, torch.Generator().manual_seed(4))
    for source, targets in ((regressor, [(x, y)]), (regressor.predict(x), y)):
        with pytest.raises(ConfigError, match="for classifiers for now.*std.*posthoc.conformal"):
            posthoc.selective(source, targets)
