"""Multi-output regression with one observation noise per output (issue 38).

The data: ``y = W x + ε`` with ``ε_d ~ N(0, σ_d²)`` of very different scales per output and a regressor holding the
true ``W``, so each output's residuals are its noise and the maximum-likelihood ``σ_d`` is their RMS, whose relative
standard error is ``1 / sqrt(2 n)``: the tolerances below are a few of those.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.core.likelihood import Gaussian
from posthoc.core.prediction import RegressionPrediction
from posthoc.errors import ConfigError, InputError

TRUE_STD = torch.tensor([0.05, 0.5, 3.0], dtype=torch.float64)
INPUTS, OUTPUTS = 4, 3


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, nn.Module]:
    """``n`` rows of ``y = W x + ε`` and the linear regressor ``x -> W x`` (a hidden layer, then the true head)."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(OUTPUTS, INPUTS, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, INPUTS, generator=generator)
    y = x @ weights.T + torch.randn(n, OUTPUTS, generator=generator) * TRUE_STD.float()
    model = nn.Sequential(nn.Linear(INPUTS, INPUTS), nn.Linear(INPUTS, OUTPUTS))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(INPUTS))
        model[0].bias.zero_()
        model[1].weight.copy_(weights)
        model[1].bias.zero_()
    return x, y, model


def _loader(x: torch.Tensor, y: torch.Tensor) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=500)


def _within(fitted: torch.Tensor, rows: int, sigmas: float = 4.0) -> None:
    """Each fitted ``σ_d`` within ``sigmas`` standard errors (``σ_d / sqrt(2 n)``) of the true one."""
    error = (fitted.double() / TRUE_STD - 1).abs()
    assert bool((error < sigmas / math.sqrt(2 * rows)).all()), (fitted, TRUE_STD)


@pytest.mark.parametrize("method", ["none", "laplace"])
def test_the_noise_of_each_output_is_recovered(method: str) -> None:
    x, y, model = _data(3000, 1)
    um = posthoc.wrap(model, method=method, likelihood="regression").fit(
        _loader(x[:1000], y[:1000]), _loader(x[1000:], y[1000:])
    )
    fitted = um.likelihood.noise_std
    assert fitted.shape == (OUTPUTS,)
    _within(fitted, 2000)
    pred = um.predict(x[:50])
    torch.testing.assert_close(pred.aleatoric, fitted.square().float().expand(50, OUTPUTS))
    assert um.likelihood.summary()["noise_std"] == fitted.tolist()


def test_laplace_without_held_out_data_fits_each_noise_on_the_training_rows() -> None:
    x, y, model = _data(2000, 2)
    um = posthoc.wrap(model, method="laplace", likelihood="regression").fit(_loader(x, y))
    assert um.likelihood.summary()["noise_fit"] == "training"
    _within(um.likelihood.noise_std, 2000)


def test_mc_dropout_and_an_ensemble_fit_a_noise_per_output() -> None:
    x, y, model = _data(1500, 3)
    train, val = _loader(x[:500], y[:500]), _loader(x[500:1000], y[500:1000])
    dropout = posthoc.wrap(model, method="mc-dropout", p=0.01, likelihood="regression", num_samples=10).fit(train, val)
    noise = dropout.likelihood.noise_std
    assert noise.shape == (OUTPUTS,) and bool((noise.diff() > 0).all())  # the outputs' noise scales, in order
    pred = dropout.predict(x[1000:], generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(pred.aleatoric, noise.square().float().expand(500, OUTPUTS))
    # one shared noise, even fitted on the test rows themselves, predicts them far worse than a noise per output
    shared = Gaussian()
    shared.fit_noise(pred.component_means, None, y[1000:].double())
    one = RegressionPrediction.from_components(
        pred.component_means, None, shared.variances(OUTPUTS, torch.float32, torch.device("cpu"))
    )
    assert float(pred.log_prob(y[1000:]).mean()) > float(one.log_prob(y[1000:]).mean()) + 1.0
    members = [_data(10, 0)[2] for _ in range(3)]
    with torch.no_grad():
        for shift, member in enumerate(members):
            member[1].bias.fill_(0.001 * shift)
    ensemble = posthoc.wrap(members, method="none", likelihood="regression").fit(train, val)
    for member in ensemble.method.members:
        _within(member.likelihood.noise_std, 500)
    pred = ensemble.predict(x[:20])
    noises = torch.stack([m.likelihood.noise_std for m in ensemble.method.members]).square().mean(0)
    torch.testing.assert_close(pred.aleatoric, noises.float().expand(20, OUTPUTS))


def _perturbed(seed: int) -> tuple[torch.Tensor, torch.Tensor, nn.Module]:
    x, y, model = _data(300, seed)
    with torch.no_grad():
        model[0].weight.add_(0.3 * torch.randn(INPUTS, INPUTS, generator=torch.Generator().manual_seed(5)))
    return x, y, model


@pytest.mark.parametrize("hessian", ["kron", "diag"])
def test_each_outputs_laplace_variance_is_that_of_a_shared_noise_of_its_own_size(hessian: str) -> None:
    """Output ``d``'s column under a noise per output is the column of a posterior fitted with the one noise ``σ_d``."""
    x, y, model = _perturbed(4)
    options = {"method": "laplace", "hessian": hessian, "prior_precision": 2.0}
    per_output = posthoc.wrap(model, likelihood=Gaussian(noise_std=TRUE_STD.tolist()), **options).fit(
        _loader(x[:200], y[:200])
    )
    epistemic = per_output.predict(x[200:]).epistemic
    for d in range(OUTPUTS):
        shared = posthoc.wrap(model, likelihood=Gaussian(noise_std=float(TRUE_STD[d])), **options).fit(
            _loader(x[:200], y[:200])
        )
        torch.testing.assert_close(epistemic[:, d], shared.predict(x[200:]).epistemic[:, d], rtol=1e-5, atol=1e-9)


def test_last_layer_laplace_variance_per_output_equals_the_brute_force_posterior() -> None:
    """The head's posterior under ``Λ = diag(1/σ_d²)``: precision ``Σ_n J_nᵀ Λ J_n + δ I``, built densely."""
    x, y, model = _perturbed(4)
    um = posthoc.wrap(
        model, method="laplace", hessian="full", prior_precision=2.0, likelihood=Gaussian(noise_std=[0.05, 0.5, 3.0])
    ).fit(_loader(x[:200], y[:200]))
    phi = model[0](x).detach().double()
    phi_aug = torch.cat([phi, torch.ones(len(phi), 1, dtype=torch.float64)], 1)  # [W | b] row by row
    jacobians = torch.stack([torch.kron(torch.eye(OUTPUTS, dtype=torch.float64), row[None]) for row in phi_aug])
    precision = 2.0 * torch.eye(OUTPUTS * (INPUTS + 1), dtype=torch.float64)
    noise = torch.diag(TRUE_STD.square().reciprocal())
    for jacobian in jacobians[:200]:
        precision += jacobian.T @ noise @ jacobian
    covariance = torch.linalg.inv(precision)
    expected = torch.einsum("ndp,pq,ndq->nd", jacobians[200:], covariance, jacobians[200:])
    torch.testing.assert_close(um.predict(x[200:]).epistemic.double(), expected, rtol=2e-4, atol=1e-9)


def test_one_output_is_the_shared_fit_bit_for_bit() -> None:
    x, y, model = _data(500, 6)
    one = nn.Sequential(model, nn.Linear(OUTPUTS, 1))
    outputs = one(x).detach()[None]
    per_output, shared = Gaussian(), Gaussian()
    per_output.fit_noise(outputs, None, y[:, :1].double(), per_output=True)
    shared.fit_noise(outputs, None, y[:, :1].double())
    assert per_output.noise_std.shape == () and torch.equal(per_output.noise_std, shared.noise_std)
    samples = outputs + 0.1 * torch.randn(3, 500, 1, generator=torch.Generator().manual_seed(0))
    per_output.fit_noise(samples, None, y[:, :1].double(), per_output=True)
    shared.fit_noise(samples, None, y[:, :1].double())
    assert torch.equal(per_output.noise_std, shared.noise_std)
    for method in ("none", "laplace"):
        um = posthoc.wrap(one, method=method, likelihood="regression").fit(
            _loader(x[:250], y[:250, :1]), _loader(x[250:], y[250:, :1])
        )
        assert um.likelihood.noise_std.shape == ()  # a one-output model keeps its one σ, as before


@pytest.mark.parametrize("method", ["none", "laplace"])
def test_save_and_load_keep_the_noise_per_output(method: str, tmp_path) -> None:
    x, y, model = _data(1000, 7)
    um = posthoc.wrap(model, method=method, likelihood="regression").fit(
        _loader(x[:500], y[:500]), _loader(x[500:], y[500:])
    )
    um.save(tmp_path / "multi.pt")
    loaded = posthoc.load(tmp_path / "multi.pt", model)
    assert torch.equal(loaded.likelihood.noise_std, um.likelihood.noise_std)
    assert torch.equal(loaded.predict(x[:30]).variance, um.predict(x[:30]).variance)
    fixed = posthoc.wrap(model, method=method, likelihood=Gaussian(noise_std=[0.1, 0.2, 0.3])).fit(
        _loader(x[:500], y[:500])
    )
    fixed.save(tmp_path / "fixed.pt")
    assert posthoc.load(tmp_path / "fixed.pt", model).likelihood.config() == {
        "name": "regression",
        "noise_std": [0.1, 0.2, 0.3],
    }


def test_a_shared_noise_still_loads_into_a_multi_output_model(tmp_path) -> None:
    """A posterior saved with one ``σ`` (as every file before the noise per output) keeps its one ``σ``."""
    x, y, model = _data(200, 8)
    um = posthoc.wrap(model, method="vi", likelihood="regression", num_samples=2).fit(
        _loader(x[:100], y[:100]), _loader(x[100:], y[100:]), epochs=1
    )
    assert um.likelihood.noise_std.shape == ()  # a method with one shared noise
    um.save(tmp_path / "shared.pt")
    loaded = posthoc.load(tmp_path / "shared.pt", model)
    assert loaded.likelihood.noise_std.shape == () and torch.equal(loaded.likelihood.noise_std, um.likelihood.noise_std)


def test_mismatched_widths_are_refused_naming_both_counts() -> None:
    _, _, model = _data(10, 0)
    with pytest.raises(ConfigError, match=r"2 value\(s\).*3 output\(s\)"):
        posthoc.wrap(model, method="none", likelihood=Gaussian(noise_std=[0.1, 0.2]))
    with pytest.raises(ConfigError, match="noise_std must be"):
        Gaussian(noise_std=[0.1, -1.0])
    with pytest.raises(ConfigError, match="one per output"):
        posthoc.wrap(model, method="vi", likelihood=Gaussian(noise_std=[0.1, 0.2, 0.3]))
    fitted = Gaussian()
    fitted.set_noise(torch.tensor([0.1, 0.2]), "held-out")
    with pytest.raises(InputError, match=r"2 value\(s\).*3 output\(s\)"):
        fitted.predictive(torch.zeros(1, 4, 3))
    with pytest.raises(ConfigError, match="one observation noise for all outputs"):
        fitted.dispersion  # noqa: B018


def test_conformal_intervals_refuse_another_output_count() -> None:
    x, y, model = _data(400, 9)
    um = posthoc.wrap(model, method="none", likelihood="regression").fit(_loader(x[:200], y[:200]))
    cp = posthoc.conformal(um.predict(x[200:300]), y[200:300], alpha=0.1)
    assert cp.threshold.shape == (OUTPUTS,)
    two = RegressionPrediction.from_components(torch.zeros(1, 5, 2), None, torch.ones(1, 1, 2))
    with pytest.raises(InputError, match=r"calibrated on 3 output\(s\) but mean has 2"):
        cp.intervals(two)
    with pytest.raises(InputError, match=r"shape \(5, 3\) but the model predicts 2 output"):
        posthoc.conformal(two, torch.zeros(5, 3), alpha=0.1)


def test_each_outputs_conformal_threshold_equals_mapies() -> None:
    from mapie.regression import SplitConformalRegressor
    from sklearn.base import BaseEstimator, RegressorMixin

    class GivenMean(RegressorMixin, BaseEstimator):
        """A prefit 'regressor' whose input is its prediction."""

        def fit(self, x, y):
            self.fitted_ = True
            return self

        def predict(self, x):
            return np.asarray(x, dtype=np.float64)[:, 0]

    x, y, model = _data(700, 10)
    um = posthoc.wrap(model, method="none", likelihood="regression").fit(_loader(x[:200], y[:200]))
    mean_cal, mean_test = um.predict(x[200:500]).mean.double(), um.predict(x[500:]).mean.double()
    cp = posthoc.conformal(um.predict(x[200:500]), y[200:500], alpha=0.1, score="absolute")
    lower, upper = cp.intervals(um.predict(x[500:]))
    for d in range(OUTPUTS):
        reference = SplitConformalRegressor(
            GivenMean().fit(None, None), confidence_level=0.9, conformity_score="absolute", prefit=True
        )
        reference.conformalize(mean_cal[:, d : d + 1].numpy(), y[200:500, d].double().numpy())
        _, bounds = reference.predict_interval(mean_test[:, d : d + 1].numpy())
        np.testing.assert_allclose(lower[:, d].numpy(), bounds[:, 0, 0], rtol=0, atol=1e-6)
        np.testing.assert_allclose(upper[:, d].numpy(), bounds[:, 1, 0], rtol=0, atol=1e-6)


def test_each_outputs_90_percent_conformal_interval_covers_88_to_92_percent_over_many_splits() -> None:
    """The guarantee, per output, over ``SPLITS`` random calibration/test splits of one pool.

    The scores ``|y - mean| / std`` are a fixed function of each pooled row, so over uniformly random splits the
    number of test rows an interval covers is exactly Beta-binomial(n_test, k, n_cal + 1 - k), ``k =
    ceil((n_cal + 1)(1 - α))`` (continuous scores): its mean is ``k / (n_cal + 1)`` and the splits are independent
    given the pool. The mean coverage over the splits must lie within 4 of its standard errors of that (well inside
    0.88-0.92), and the per-split coverages must follow that law (a chi-square test on its deciles, p > 0.001).
    """
    splits, n_cal, n_test, alpha = 200, 400, 400, 0.1
    x, y, model = _data(1000 + n_cal + n_test, 11)
    um = posthoc.wrap(model, method="none", likelihood="regression").fit(
        _loader(x[:500], y[:500]), _loader(x[500:1000], y[500:1000])
    )
    pool, targets = um.predict(x[1000:]), y[1000:]
    generator = torch.Generator().manual_seed(12)
    coverage = torch.empty(splits, OUTPUTS, dtype=torch.float64)
    for split in range(splits):
        order = torch.randperm(n_cal + n_test, generator=generator)
        cal, test = order[:n_cal], order[n_cal:]
        part = lambda rows: RegressionPrediction.from_components(pool.mean[rows][None], None, pool.variance[rows][None])
        cp = posthoc.conformal(part(cal), targets[cal], alpha=alpha)
        lower, upper = cp.intervals(part(test))
        coverage[split] = ((lower <= targets[test]) & (targets[test] <= upper)).double().mean(0)
    k = math.ceil((n_cal + 1) * (1 - alpha))
    law = stats.betabinom(n_test, k, n_cal + 1 - k)
    mean, std = law.mean() / n_test, law.std() / n_test
    for d in range(OUTPUTS):
        assert abs(float(coverage[:, d].mean()) - mean) < 4 * std / math.sqrt(splits), (d, coverage[:, d].mean())
        assert 0.88 <= float(coverage[:, d].mean()) <= 0.92
        assert _chi_square_p((coverage[:, d] * n_test).round().numpy(), law) > 0.001


def _chi_square_p(counts: np.ndarray, law: stats.rv_discrete) -> float:
    """The chi-square test's p-value of the covered ``counts`` against the discrete ``law``, binned at its deciles."""
    edges = np.unique(law.ppf(np.linspace(0.1, 0.9, 9)))
    observed = np.bincount(np.searchsorted(edges, counts, side="left"), minlength=len(edges) + 1)
    expected = np.diff(np.concatenate([[0.0], law.cdf(edges), [1.0]])) * len(counts)
    return float(stats.chisquare(observed, expected).pvalue)


def test_an_exported_plain_regressor_keeps_the_noise_per_output_and_laplace_refuses_it() -> None:
    x, y, model = _data(600, 13)
    plain = posthoc.wrap(model, method="none", likelihood="regression").fit(_loader(x[:300], y[:300]))
    _, variance = plain.to_module()(x[300:310])
    torch.testing.assert_close(variance.reshape(10, OUTPUTS), plain.predict(x[300:310]).variance)
    laplace = posthoc.wrap(model, method="laplace", likelihood="regression").fit(_loader(x[:300], y[:300]))
    with pytest.raises(posthoc.ExportError, match=r"noise per output \(3 values\)"):
        laplace.to_module()
