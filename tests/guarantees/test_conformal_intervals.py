"""Split conformal intervals for regression: the coverage guarantee over many random splits, and MAPIE as oracle."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from mapie.regression import ConformalizedQuantileRegressor, SplitConformalRegressor
from sklearn.ensemble import GradientBoostingRegressor
from sklearn.linear_model import LinearRegression

from posthoc.errors import ConfigError, InputError
from posthoc.guarantees.intervals import conformal_intervals


def _heteroscedastic(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x in [0, 1], y = sin(2 pi x) + noise of std 0.05 + x: returns x, y and the true noise std."""
    x = torch.rand(n, generator=generator, dtype=torch.float64)
    noise = 0.05 + x
    return x, torch.sin(2 * math.pi * x) + noise * torch.randn(n, generator=generator, dtype=torch.float64), noise


def _predictions(x: torch.Tensor, noise: torch.Tensor, score: str) -> dict[str, torch.Tensor]:
    """A slightly wrong model: its mean is off by 0.1, its std 1.5x too wide, its quantiles too narrow."""
    mean = torch.sin(2 * math.pi * x) + 0.1
    if score == "absolute":
        return {"mean": mean}
    if score == "normalized":
        return {"mean": mean, "std": 1.5 * noise}
    return {"lower": mean - 0.8 * noise, "upper": mean + 0.8 * noise}


@pytest.mark.parametrize("score", ["absolute", "normalized", "cqr"])
@pytest.mark.parametrize("alpha", [0.1, 0.2])
def test_coverage_holds_over_many_random_splits(score: str, alpha: float) -> None:
    # The guarantee: averaged over calibration and test draws, 1 - alpha <= coverage <= 1 - alpha + 1 / (n + 1)
    # for continuous scores. 400 splits of 50 calibration and 200 test examples: the mean coverage's standard
    # error is at most sqrt(alpha (1 - alpha) / 50) / sqrt(400) (calibration draw dominates); 4 of them.
    splits, n_cal, n_test = 400, 50, 200
    generator = torch.Generator().manual_seed(0)
    coverages = []
    for _ in range(splits):
        x, y, noise = _heteroscedastic(n_cal + n_test, generator)
        predictions = _predictions(x, noise, score)
        calibration = {k: v[:n_cal] for k, v in predictions.items()}
        test = {k: v[n_cal:] for k, v in predictions.items()}
        ci = conformal_intervals(y[:n_cal], alpha=alpha, **calibration)
        assert ci.score == score
        lower, upper = ci.intervals(**test)
        coverages.append(float(((lower[:, 0] <= y[n_cal:]) & (y[n_cal:] <= upper[:, 0])).double().mean()))
    mean, slack = float(np.mean(coverages)), 4 * math.sqrt(alpha * (1 - alpha) / n_cal) / math.sqrt(splits)
    assert 1 - alpha - slack <= mean <= 1 - alpha + 1 / (n_cal + 1) + slack


def test_normalized_intervals_follow_the_noise_where_absolute_ones_cannot() -> None:
    generator = torch.Generator().manual_seed(1)
    x, y, noise = _heteroscedastic(4000, generator)
    coverage = {}
    for score in ("absolute", "normalized"):
        predictions = _predictions(x, noise, score)
        ci = conformal_intervals(y[:2000], alpha=0.1, **{k: v[:2000] for k, v in predictions.items()})
        lower, upper = ci.intervals(**{k: v[2000:] for k, v in predictions.items()})
        inside = (lower[:, 0] <= y[2000:]) & (y[2000:] <= upper[:, 0])
        noisy = x[2000:] > 0.8
        coverage[score] = (float(inside[noisy].double().mean()), float(inside[~noisy].double().mean()))
    # absolute: one width, too narrow where the noise is large; normalized: close to 0.9 in both parts
    assert coverage["absolute"][0] < 0.8
    assert abs(coverage["normalized"][0] - 0.9) < 0.05 and abs(coverage["normalized"][1] - 0.9) < 0.05


def _regression_data(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, (900, 2))
    return x, x @ np.array([2.0, -1.0]) + np.sin(6 * x[:, 0]) + rng.normal(0, 0.3 + x[:, 1], 900)


def test_absolute_intervals_equal_mapies() -> None:
    x, y = _regression_data(2)
    model = LinearRegression().fit(x[:300], y[:300])
    ours = conformal_intervals(torch.tensor(y[300:600]), mean=torch.tensor(model.predict(x[300:600])), alpha=0.1)
    lower, upper = ours.intervals(mean=torch.tensor(model.predict(x[600:])))
    mapie = SplitConformalRegressor(model, confidence_level=0.9, conformity_score="absolute", prefit=True)
    mapie.conformalize(x[300:600], y[300:600])
    _, bounds = mapie.predict_interval(x[600:])
    # the same order statistic of the same float64 residuals, added to the same predictions
    np.testing.assert_allclose(lower[:, 0].numpy(), bounds[:, 0, 0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(upper[:, 0].numpy(), bounds[:, 1, 0], rtol=0, atol=1e-12)


def test_cqr_intervals_equal_mapies() -> None:
    x, y = _regression_data(3)
    quantile_models = [
        GradientBoostingRegressor(loss="quantile", alpha=a, n_estimators=30, random_state=0).fit(x[:300], y[:300])
        for a in (0.05, 0.95, 0.5)
    ]
    ours = conformal_intervals(
        torch.tensor(y[300:600]),
        lower=torch.tensor(quantile_models[0].predict(x[300:600])),
        upper=torch.tensor(quantile_models[1].predict(x[300:600])),
        alpha=0.1,
    )
    lower, upper = ours.intervals(
        lower=torch.tensor(quantile_models[0].predict(x[600:])), upper=torch.tensor(quantile_models[1].predict(x[600:]))
    )
    mapie = ConformalizedQuantileRegressor(quantile_models, confidence_level=0.9, prefit=True)
    mapie.conformalize(x[300:600], y[300:600])
    # Romano et al.'s score max(lower - y, y - upper) is MAPIE's symmetric correction (its default corrects each side
    # at alpha / 2)
    _, bounds = mapie.predict_interval(x[600:], symmetric_correction=True)
    np.testing.assert_allclose(lower[:, 0].numpy(), bounds[:, 0, 0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(upper[:, 0].numpy(), bounds[:, 1, 0], rtol=0, atol=1e-12)


def test_each_output_gets_its_own_threshold() -> None:
    generator = torch.Generator().manual_seed(4)
    y = torch.randn(500, 2, generator=generator, dtype=torch.float64) * torch.tensor([1.0, 10.0])
    ci = conformal_intervals(y, mean=torch.zeros(500, 2), alpha=0.1)
    assert ci.threshold.shape == (2,) and 5 < float(ci.threshold[1] / ci.threshold[0]) < 20


def test_misuse_is_refused_with_what_to_pass() -> None:
    y, mean = torch.randn(100), torch.zeros(100)
    with pytest.raises(InputError, match="pass the predictions"):
        conformal_intervals(y)
    with pytest.raises(InputError, match="both lower and upper"):
        conformal_intervals(y, lower=mean)
    with pytest.raises(InputError, match="100"):
        conformal_intervals(y, mean=mean[:90])
    with pytest.raises(InputError, match="std must be > 0"):
        conformal_intervals(y, mean=mean, std=torch.zeros(100))
    with pytest.raises(InputError, match="NaN"):
        conformal_intervals(y, mean=torch.full((100,), float("nan")))
    with pytest.raises(InputError, match="at least 19 calibration examples"):
        conformal_intervals(y[:10], mean=mean[:10], alpha=0.05)
    with pytest.raises(ConfigError, match="alpha must be a number strictly between 0 and 1"):
        conformal_intervals(y, mean=mean, alpha=1.5)
    ci = conformal_intervals(y, mean=mean, std=torch.ones(100))
    with pytest.raises(InputError, match="calibrated with the 'normalized' score"):
        ci.intervals(mean=mean)
    absolute = conformal_intervals(y, mean=mean, std=torch.ones(100), score="absolute")
    assert absolute.score == "absolute" and absolute.intervals(mean=mean, std=torch.ones(100))[0].shape == (100, 1)
