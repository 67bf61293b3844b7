"""Calibration for regression: variance scaling (Levi et al. 2019), isotonic recalibration of the CDF (Kuleshov
et al. 2018), ``auto`` among them, and ``posthoc.calibrate(mean=..., std=..., targets=...)``.

Oracles: a known miscalibration factor, the closed form against the numerical optimum, uniform PIT (MACE), and
uncertainty-toolbox's ``iso_recal`` on the same data.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import scipy.stats
import torch

import posthoc
from posthoc.core.prediction import RegressionPrediction
from posthoc.errors import ConfigError, InputError
from posthoc.evaluation.gaussian_metrics import calibration_error, components
from posthoc.methods.calibration.auto import quantile_crps
from posthoc.methods.calibration.base import as_prediction
from posthoc.methods.calibration.variance_scaling import closed_form_scale, numerical_scale


def _data(n: int, seed: int, width: float = 1.0, shift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Means, stds and targets drawn from ``N(mean + shift std, (width std)²)``: calibrated for width 1, shift 0."""
    g = torch.Generator().manual_seed(seed)
    mean, std = torch.randn(n, generator=g, dtype=torch.float64), 0.5 + torch.rand(n, generator=g, dtype=torch.float64)
    return mean, std, mean + std * (shift + width * torch.randn(n, generator=g, dtype=torch.float64))


def _mace(prediction: RegressionPrediction, y: torch.Tensor) -> float:
    """uncertainty-toolbox's MACE (quantile kind) from the prediction's own CDF, 100 levels."""
    pit = prediction.cdf(y).flatten()
    expected = torch.linspace(0, 1, 100, dtype=torch.float64)
    return float(((pit[:, None] <= expected).double().mean(0) - expected).abs().mean())


# ------------------------------------------------------------------------------ variance scaling
def test_variance_scaling_recovers_a_known_factor() -> None:
    """Stds twice too wide: ``s² = mean(z²) / 4`` with ``z`` standard normal, so ``s`` has standard error
    ``0.5 sqrt(2 / n) / 2 = 0.005`` at n = 5,000; 4 standard errors allowed (0.02). Two outputs, 0.5 and 3."""
    mean, std, y = _data(5000, 0)
    _, std2, y2 = _data(5000, 1)
    calibrator = posthoc.calibrate(
        mean=torch.stack([mean, mean], 1),
        std=torch.stack([2 * std, std / 3], 1),
        targets=torch.stack([y, mean + (y2 - _data(5000, 1)[0]) * std / std2], 1),
    )
    assert calibrator.scale[0].item() == pytest.approx(0.5, abs=0.02)
    assert calibrator.scale[1].item() == pytest.approx(3.0, abs=0.12)


def test_closed_form_equals_the_numerical_optimum_for_one_gaussian() -> None:
    """Golden-section search on the exact NLL finds the closed form to 1e-6 relative (80 steps shrink the bracket
    by 0.618^80)."""
    mean, std, y = _data(2000, 2, width=1.7)
    prediction = as_prediction(mean, std)
    closed, numerical = closed_form_scale(prediction, y[:, None]), numerical_scale(prediction, y[:, None])
    assert closed.item() == pytest.approx(1.7, abs=0.06)
    assert numerical.item() == pytest.approx(closed.item(), rel=1e-6)


def test_variance_scaling_of_a_mixture_keeps_it_exact() -> None:
    """A 3-component mixture scaled by s: its std is exactly s times, and its NLL-optimal s recovers 0.5 (stds of
    the mixture twice too wide; 0.03 allowed on 4,000 points)."""
    g = torch.Generator().manual_seed(3)
    means = torch.randn(3, 4000, 1, generator=g, dtype=torch.float64)
    prediction = RegressionPrediction.from_components(means, None, torch.full((1, 1, 1), 0.5, dtype=torch.float64))
    scaled = prediction.scaled(torch.tensor([2.0], dtype=torch.float64))
    torch.testing.assert_close(scaled.std, 2 * prediction.std, rtol=1e-12, atol=0)
    torch.testing.assert_close(scaled.mean, prediction.mean, rtol=1e-12, atol=1e-12)
    component = torch.randint(0, 3, (4000,), generator=g)
    y = means[component, torch.arange(4000), 0] + math.sqrt(0.5) * torch.randn(4000, generator=g, dtype=torch.float64)
    fitted = posthoc.methods.calibration.variance_scaling.VarianceScaling().fit(scaled, y)
    assert fitted.scale.item() == pytest.approx(0.5, abs=0.03)


# ------------------------------------------------------------------------------ isotonic
def test_isotonic_makes_the_pit_uniform() -> None:
    """Biased and too wide (targets ~ N(mean + 0.3 std, (0.5 std)²)): MACE falls from > 0.1 to < 0.02 on 5,000 new
    points (measured 0.13 -> ~0.005)."""
    mean, std, y = _data(5000, 4, width=0.5, shift=0.3)
    test_mean, test_std, test_y = _data(5000, 5, width=0.5, shift=0.3)
    calibrator = posthoc.calibrate(mean=mean, std=std, targets=y, method="isotonic")
    before = as_prediction(test_mean, test_std)
    after = calibrator.predict(test_mean, test_std)
    assert calibration_error(*components(before), test_y, kind="quantile") > 0.1
    assert _mace(after, test_y) < 0.02
    lower, upper = after.interval(0.9)
    covered = float(((lower[:, 0] <= test_y) & (test_y <= upper[:, 0])).double().mean())
    assert covered == pytest.approx(0.9, abs=0.02)  # binomial sd 0.004 at n = 5,000
    torch.testing.assert_close(after.cdf(after.quantile(0.3)), torch.full_like(after.mean, 0.3), atol=1e-6, rtol=0)


def test_isotonic_agrees_with_uncertainty_toolbox() -> None:
    """uct fits the inverse map (observed -> expected proportion) on its calibration curve (1,000 levels here), ours
    the map itself on every PIT value of the same 5,000 points. Measured: the recalibrated levels ``R⁻¹(q)`` differ
    by <= 0.012 (uct's is systematically ~0.01 nearer 0.5 in the tails), so the quantiles ``Φ⁻¹(recal(q))`` and
    ``F⁻¹(R⁻¹(q))`` by <= 0.048 std; allowed 0.015 and 0.06 std. The central 90% interval of
    ``get_prediction_interval`` (recalibrated on interval proportions) differs by <= 0.028 std; allowed 0.04."""
    import uncertainty_toolbox as uct
    from uncertainty_toolbox.metrics_calibration import get_prediction_interval, get_proportion_lists_vectorized

    mean, std, y = _data(5000, 6, width=0.6)
    ours = posthoc.calibrate(mean=mean, std=std, targets=y, method="isotonic").predict(mean, std)
    args = (mean.numpy(), std.numpy(), y.numpy())
    exp, obs = get_proportion_lists_vectorized(*args, num_bins=1000, prop_type="quantile")
    recal = uct.recalibration.iso_recal(exp, obs)
    for q in (0.05, 0.25, 0.5, 0.75, 0.95):
        level = recal.predict(np.array([q]))[0]
        assert ours.recalibration.inverse(torch.tensor([q])).item() == pytest.approx(level, abs=0.015)
        theirs = scipy.stats.norm.ppf(level, loc=args[0], scale=args[1])
        assert (np.abs(ours.quantile(q)[:, 0].numpy() - theirs) / args[1]).max() < 0.06
    exp, obs = get_proportion_lists_vectorized(*args, num_bins=1000, prop_type="interval")
    bounds = get_prediction_interval(args[0], args[1], np.array([0.9]), uct.recalibration.iso_recal(exp, obs))
    lower, upper = ours.interval(0.9)
    assert (np.abs(lower[:, 0].numpy() - bounds.lower) / args[1]).max() < 0.04
    assert (np.abs(upper[:, 0].numpy() - bounds.upper) / args[1]).max() < 0.04


# ------------------------------------------------------------------------------ auto
def test_auto_is_never_worse_than_none_on_a_calibrated_predictive() -> None:
    """30 random splits of a calibrated predictive (300 to fit, 2,000 to test): auto's held-out CRPS is within 1% of
    none's on every split, and on average within 0.1% (measured +0.03%: 1.7e-4 on a CRPS of ~0.56). The guarantee is on its folds: on new data a
    choice made on 300 points can lose a little (measured: split 11 picks isotonic, +0.74%)."""
    differences = []
    for seed in range(30):
        mean, std, y = _data(300, 100 + seed)
        test_mean, test_std, test_y = _data(2000, 200 + seed)
        auto = posthoc.calibrate(mean=mean, std=std, targets=y, method="auto", seed=seed)
        none = float(quantile_crps(as_prediction(test_mean, test_std), test_y).mean())
        chosen = float(quantile_crps(auto.predict(test_mean, test_std), test_y).mean())
        assert chosen <= none * 1.01, (seed, auto.chosen_name, auto.scores)
        differences.append(chosen - none)
    print(f"auto - none: mean {np.mean(differences):.2e}, max {max(differences):.2e}")
    assert np.mean(differences) <= 1e-3 * none


def test_auto_chooses_a_calibrator_when_it_helps() -> None:
    mean, std, y = _data(1000, 7, width=0.5)
    auto = posthoc.calibrate(mean=mean, std=std, targets=y, method="auto")
    assert auto.chosen_name == "variance-scaling"
    assert auto.scores["variance-scaling"]["crps"] < auto.scores["none"]["crps"]


# ------------------------------------------------------------------------------ files and numbers
@pytest.mark.parametrize("method", ["variance-scaling", "isotonic", "auto"])
def test_save_load_round_trip_is_bit_exact(method: str, tmp_path) -> None:
    mean, std, y = _data(500, 8, width=0.7, shift=0.2)
    calibrator = posthoc.calibrate(mean=mean, std=std, targets=y, method=method)
    calibrator.save(tmp_path / "c.pt")
    loaded = posthoc.calibrate.load(tmp_path / "c.pt")
    assert loaded.chosen_name == calibrator.chosen_name
    a, b = calibrator.predict(mean, std), loaded.predict(mean, std)
    for q in (0.05, 0.5, 0.95):
        assert torch.equal(a.quantile(q), b.quantile(q))
    assert torch.equal(a.cdf(y), b.cdf(y)) and torch.equal(a.std, b.std)


def test_means_alone_fit_the_homoscedastic_noise() -> None:
    mean, std, y = _data(4000, 9)
    calibrator = posthoc.calibrate(mean=mean, targets=y)
    assert calibrator.scale.item() == pytest.approx(float((y - mean).square().mean().sqrt()), rel=1e-9)
    with pytest.raises(InputError, match="fitted on means alone"):
        calibrator.predict(mean, std)


# ------------------------------------------------------------------------------ misuse
def test_misuse_is_refused_clearly() -> None:
    mean, std, y = _data(100, 10)
    with pytest.raises(InputError, match="every std must be > 0"):
        posthoc.calibrate(mean=mean, std=-std, targets=y)
    with pytest.raises(InputError, match="std has shape"):
        posthoc.calibrate(mean=mean, std=std[:50], targets=y)
    with pytest.raises(InputError, match="different lengths"):
        posthoc.calibrate(mean=mean, std=std, targets=y[:50])
    with pytest.raises(ConfigError, match="calibrates a classifier's logits"):
        posthoc.calibrate(mean=mean, std=std, targets=y, method="temperature")
    with pytest.raises(ConfigError, match="calibrates a regressor"):
        posthoc.calibrate(torch.randn(100, 3), torch.arange(100) % 3, method="variance-scaling")
    with pytest.raises(InputError, match="logits/labels and mean/std/targets"):
        posthoc.calibrate(torch.randn(100, 3), torch.arange(100) % 3, mean=mean, targets=y)
    calibrator = posthoc.calibrate(mean=mean, std=std, targets=y)
    with pytest.raises(InputError, match="fitted on 1 output"):
        calibrator.predict(torch.zeros(5, 2), torch.ones(5, 2))
    recalibrated = posthoc.calibrate(mean=mean, std=std, targets=y, method="isotonic").predict(mean, std)
    with pytest.raises(InputError, match="recalibrated"):
        components(recalibrated)


# ------------------------------------------------------------------------------ on a wrapped regressor


def test_wrap_refuses_a_stacked_calibrator_and_the_route_it_names_works() -> None:
    """``wrap`` does not stack a calibrator on a regressor: it refuses, naming ``posthoc.calibrate`` on the
    wrapped model's held-out predictions, and that route calibrates (variance scaling recovers a noise 3x too small)."""
    from torch import nn

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(600, 2, generator=generator)
    y = x[:, :1] + 0.3 * torch.randn(600, 1, generator=generator)
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 0.0]]))
        model.bias.zero_()
    for method, says in (
        (["laplace", "variance-scaling"], "'variance-scaling' calibrates a regressor's predictions"),
        (["laplace", "isotonic"], "'isotonic' calibrates a classifier's probabilities"),
        (["none", "temperature"], "'temperature' calibrates a classifier's probabilities"),
        (["laplace", "auto"], "'auto' calibrates a regressor's predictions"),
    ):
        with pytest.raises(ConfigError, match=re.escape(says) + ".*posthoc.calibrate\\(mean=pred.mean, std=pred.std"):
            posthoc.wrap(model, method=method, likelihood="regression")
    um = posthoc.wrap(model, method="none", likelihood=posthoc.Gaussian(noise_std=0.1))  # 3x too narrow
    um.fit()
    pred = um.predict(x[:300])
    cal = posthoc.calibrate(mean=pred.mean, std=pred.std, targets=y[:300], method="variance-scaling")
    calibrated = cal.calibrate(um.predict(x[300:]))
    assert float(calibrated.std.mean()) == pytest.approx(0.3, rel=0.1)  # 300 residuals: the std's sd is ~4 %
    lower, upper = calibrated.interval(0.9)
    assert float(((lower <= y[300:]) & (y[300:] <= upper)).double().mean()) == pytest.approx(0.9, abs=0.05)
