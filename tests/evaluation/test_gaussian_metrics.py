"""Regression predictives and their metrics against scipy, properscoring and uncertainty-toolbox.

The mixture maths is float64 throughout, so against scipy's closed forms the tolerance is a few ulps
of the values (1e-12 relative); against numerical integration it is quad's own error bound.
"""

from __future__ import annotations

import math

import numpy as np
import properscoring
import pytest
import torch
import uncertainty_toolbox as uct
from scipy import integrate, optimize, stats

from posthoc.core.mixture import GaussianMixture, sample_crps
from posthoc.errors import InputError
from posthoc.evaluation import gaussian_metrics as rm


def _mixture(k: int, n: int, d: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(k, n, d, generator=g, dtype=torch.float64) * 2
    stds = torch.rand(k, n, d, generator=g, dtype=torch.float64) + 0.2
    y = torch.randn(n, d, generator=g, dtype=torch.float64) * 2
    return means, stds, y


def _exact(means: torch.Tensor, stds: torch.Tensor) -> GaussianMixture:
    return GaussianMixture(means, stds.square())


def log_prob(means, stds, y):  # per output: one output at a time is a one-output mixture
    return torch.stack(
        [_exact(means[..., d : d + 1], stds[..., d : d + 1]).log_prob(y[:, d]) for d in range(y.shape[1])], -1
    )


def cdf(means, stds, y):
    return _exact(means, stds).cdf(y)


def quantile(means, stds, q):
    return _exact(means, stds).quantile(q)


def interval(means, stds, level):
    return _exact(means, stds).interval(level)


def crps(means, stds, y):
    return _exact(means, stds).crps(y)


def test_one_component_is_the_gaussian_of_scipy() -> None:
    means, stds, y = _mixture(1, 50)
    m, s, t = means[0].numpy(), stds[0].numpy(), y.numpy()
    np.testing.assert_allclose(log_prob(means, stds, y).numpy(), stats.norm.logpdf(t, m, s), rtol=1e-12)
    np.testing.assert_allclose(cdf(means, stds, y).numpy(), stats.norm.cdf(t, m, s), rtol=1e-12, atol=1e-300)
    for q in (0.025, 0.3, 0.5, 0.9):
        np.testing.assert_allclose(quantile(means, stds, q).numpy(), stats.norm.ppf(q, m, s), rtol=1e-12, atol=1e-12)


def test_mixture_density_and_cdf_are_the_mean_of_the_components() -> None:
    means, stds, y = _mixture(5, 40, 2)
    m, s, t = means.numpy(), stds.numpy(), y.numpy()
    np.testing.assert_allclose(log_prob(means, stds, y).numpy(), np.log(stats.norm.pdf(t, m, s).mean(0)), rtol=1e-12)
    np.testing.assert_allclose(cdf(means, stds, y).numpy(), stats.norm.cdf(t, m, s).mean(0), rtol=1e-12)


@pytest.mark.parametrize("q", [0.01, 0.25, 0.5, 0.8, 0.99])
def test_mixture_quantile_inverts_the_cdf_as_brentq_does(q: float) -> None:
    means, stds, _ = _mixture(4, 12)
    found = quantile(means, stds, q)
    m, s = means.numpy()[:, :, 0], stds.numpy()[:, :, 0]
    for n in range(12):
        root = optimize.brentq(lambda z: stats.norm.cdf(z, m[:, n], s[:, n]).mean() - q, -50, 50, xtol=1e-14)
        assert abs(float(found[n, 0]) - root) < 1e-9
    lower, upper = interval(means, stds, 0.9)
    np.testing.assert_allclose(cdf(means, stds, upper).numpy() - cdf(means, stds, lower).numpy(), 0.9, atol=1e-12)


def test_crps_of_a_gaussian_is_properscorings_and_uncertainty_toolboxs() -> None:
    means, stds, y = _mixture(1, 200)
    ours = crps(means, stds, y)[:, 0].numpy()
    m, s, t = means[0, :, 0].numpy(), stds[0, :, 0].numpy(), y[:, 0].numpy()
    np.testing.assert_allclose(ours, properscoring.crps_gaussian(t, m, s), rtol=1e-10)
    assert rm.crps(means, stds, y) == pytest.approx(float(uct.metrics_scoring_rule.crps_gaussian(m, s, t)), rel=1e-10)


def test_crps_of_a_mixture_is_the_integral_of_the_squared_cdf_gap() -> None:
    means, stds, y = _mixture(3, 6)
    ours = crps(means, stds, y)[:, 0]
    m, s = means.numpy()[:, :, 0], stds.numpy()[:, :, 0]
    for n in range(6):
        target = float(y[n, 0])
        below, err1 = integrate.quad(
            lambda z: stats.norm.cdf(z, m[:, n], s[:, n]).mean() ** 2, -60, target, epsabs=1e-12
        )
        above, err2 = integrate.quad(
            lambda z: (1 - stats.norm.cdf(z, m[:, n], s[:, n]).mean()) ** 2, target, 60, epsabs=1e-12
        )
        assert abs(float(ours[n]) - (below + above)) < 1e-8 + err1 + err2


def test_sample_crps_is_properscorings_ensemble_crps() -> None:
    g = torch.Generator().manual_seed(3)
    samples, y = (
        torch.randn(33, 20, 2, generator=g, dtype=torch.float64),
        torch.randn(20, 2, generator=g, dtype=torch.float64),
    )
    expected = properscoring.crps_ensemble(y.numpy(), np.moveaxis(samples.numpy(), 0, -1))
    np.testing.assert_allclose(sample_crps(samples, y).numpy(), expected, rtol=1e-10)


def test_interval_calibration_error_is_uncertainty_toolboxs_mace_and_rmsce() -> None:
    means, stds, y = _mixture(1, 500, seed=5)
    m, s, t = means[0, :, 0].numpy(), stds[0, :, 0].numpy(), y[:, 0].numpy()
    # a target exactly on an interval's edge could fall either way by float rounding: at most one point's weight
    tolerance = 1 / 500
    assert (
        abs(rm.calibration_error(means, stds, y) - uct.mean_absolute_calibration_error(m, s, t, vectorized=True))
        <= tolerance
    )
    assert (
        abs(
            rm.calibration_error(means, stds, y, squared=True)
            - uct.root_mean_squared_calibration_error(m, s, t, vectorized=True)
        )
        <= tolerance
    )


def test_quantile_curve_matches_uncertainty_toolbox_up_to_its_sign_convention() -> None:
    # uncertainty-toolbox counts (mean - y) / std <= z_p, i.e. F(y) >= 1 - p: the targets reflected about the mean
    means, stds, y = _mixture(1, 400, seed=6)
    m, s, t = means[0, :, 0].numpy(), stds[0, :, 0].numpy(), y[:, 0].numpy()
    expected, observed = rm.calibration_curve(means, stds, 2 * means[0] - y, kind="quantile")
    theirs_expected, theirs = uct.metrics_calibration.get_proportion_lists_vectorized(m, s, t, prop_type="quantile")
    np.testing.assert_allclose(expected.numpy(), theirs_expected, atol=1e-15)
    assert np.abs(observed.numpy() - theirs).max() <= 1 / 400


def _calibrated(n: int, seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Targets drawn from a heteroscedastic Gaussian predictive, whose stds are then multiplied by ``scale``."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(1, n, 1, generator=g, dtype=torch.float64)
    std = torch.rand(1, n, 1, generator=g, dtype=torch.float64) * 2 + 0.1
    y = mean[0] + std[0] * torch.randn(n, 1, generator=g, dtype=torch.float64)
    return mean, std * scale, y


def test_a_calibrated_predictive_covers_at_its_level_and_has_a_small_ence() -> None:
    n = 20000
    means, stds, y = _calibrated(n, seed=7)
    for level in rm.LEVELS:
        coverage, width = rm.interval_coverage(means, stds, y, level)
        assert abs(coverage - level) < 4 * math.sqrt(level * (1 - level) / n)  # binomial, 4 standard errors
        assert width == pytest.approx(float(2 * stats.norm.ppf(0.5 + level / 2) * stds.mean()), rel=1e-10)
    assert rm.ence(means, stds, y) < 0.05
    assert rm.calibration_error(means, stds, y) < 0.01


def test_ence_reads_a_std_twice_too_wide_as_one_half() -> None:
    # RMV doubles while RMSE stays: |2 s - s| / (2 s) = 0.5 in every bin, up to each bin's sampling error
    means, stds, y = _calibrated(20000, seed=8, scale=2.0)
    assert rm.ence(means, stds, y) == pytest.approx(0.5, abs=0.03)


def test_a_mixture_covers_targets_drawn_from_it() -> None:
    n, k = 20000, 3
    g = torch.Generator().manual_seed(9)
    means = torch.randn(k, n, 1, generator=g, dtype=torch.float64) * 3
    stds = torch.rand(k, n, 1, generator=g, dtype=torch.float64) + 0.1
    pick = torch.randint(k, (n,), generator=g)
    y = means[pick, torch.arange(n)] + stds[pick, torch.arange(n)] * torch.randn(n, 1, generator=g, dtype=torch.float64)
    coverage, _ = rm.interval_coverage(means, stds, y, 0.9)
    assert abs(coverage - 0.9) < 4 * math.sqrt(0.09 / n)
    mixture_std = rm.predictive_std(means, stds)
    assert float(mixture_std.pow(2).mean()) == pytest.approx(
        float((y - rm.predictive_mean(means)).pow(2).mean()), rel=0.05
    )


def test_accuracy_metrics_and_nll_on_a_hand_example() -> None:
    means, stds = torch.tensor([[[1.0], [2.0]]]), torch.tensor([[[1.0], [2.0]]])
    y = torch.tensor([2.0, 2.0])
    assert rm.rmse(means, y) == pytest.approx(math.sqrt(0.5))
    assert rm.mae(means, y) == pytest.approx(0.5)
    expected = -(stats.norm.logpdf(2.0, 1.0, 1.0) + stats.norm.logpdf(2.0, 2.0, 2.0)) / 2
    assert rm.nll(means, stds, y) == pytest.approx(expected, rel=1e-12)


def test_bad_shapes_and_stds_are_refused() -> None:
    means, stds, y = _mixture(2, 5)
    with pytest.raises(InputError, match="targets of shape"):
        rm.rmse(means, y[:4])
    with pytest.raises(InputError, match="one shape"):
        rm.crps(means, stds[:1], y)
    with pytest.raises(InputError, match="std must be > 0"):
        rm.nll(means, torch.zeros_like(stds), y)
    with pytest.raises(InputError, match=r"in \(0, 1\)"):
        quantile(means, stds, 1.0)


def test_plots_draw_what_the_metrics_say(tmp_path) -> None:
    from posthoc_apps.report import plots

    calibrated, too_wide = _calibrated(2000, seed=10), _calibrated(2000, seed=10, scale=2.0)
    fig = plots.calibration_curves({"calibrated": calibrated, "too wide": too_wide}, tmp_path / "cal.png")
    lines = fig.axes[0].get_lines()
    _, observed = rm.calibration_curve(*too_wide)
    np.testing.assert_allclose(lines[2].get_ydata(), observed.numpy())
    assert "MACE" in lines[2].get_label() and (tmp_path / "cal.png").stat().st_size > 0

    fig = plots.error_against_std({"too wide": too_wide}, tmp_path / "err.png", bins=5)
    rmv, rmse = fig.axes[0].get_lines()[0].get_data()
    assert len(rmv) == 5 and np.all(np.asarray(rmse) < 0.6 * np.asarray(rmv))  # a doubled std: RMSE ~ RMV / 2

    x = torch.linspace(-1, 1, 50)
    means, stds = x.view(1, -1, 1), (0.1 + x.abs()).view(1, -1, 1)
    fig = plots.predictive_band(x, {"a": (means, stds)}, (x[:5], x[:5]), tmp_path / "band.png")
    outer = fig.axes[0].collections[0].get_paths()[0].vertices[:, 1]
    assert outer.max() == pytest.approx(float(1 + stats.norm.ppf(0.975) * 1.1), rel=1e-5)
