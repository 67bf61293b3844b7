"""Regression: the likelihood seam, the Gaussian (mixture) predictive, and the methods that do it so far.

The oracles: laplace-torch's last-layer Laplace ``"regression"`` (same model, prior and noise), scipy's
normal distribution, a brute-force numeric mixture on a fine grid, and a known noise on synthetic data.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import scipy.stats
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.core.likelihood import Gaussian
from posthoc.core.mixture import GaussianMixture
from posthoc.core.prediction import RegressionPrediction
from posthoc.errors import ConfigError, NotFittedError, PosteriorFileError


def _trained_mlp(outputs: int = 1, seed: int = 0) -> tuple[nn.Module, DataLoader, torch.Tensor]:
    """A small MLP fitted to a noisy linear map of 3 features, its training loader and test inputs."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(200, 3, generator=generator)
    y = torch.stack([2 * x[:, 0], x[:, 1] - x[:, 2]], 1)[:, :outputs] + 0.4 * torch.randn(
        200, outputs, generator=generator
    )
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, outputs))
    optimiser = torch.optim.Adam(net.parameters(), 1e-2)
    for _ in range(200):
        optimiser.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        optimiser.step()
    return net.eval(), DataLoader(TensorDataset(x, y), batch_size=50), 2 * torch.randn(30, 3, generator=generator)


# ------------------------------------------------------------------------------ laplace-torch
@pytest.mark.parametrize("outputs", [1, 2])
@pytest.mark.parametrize("hessian", ["full", "kron", "diag"])
def test_last_layer_laplace_equals_laplace_torch(hessian: str, outputs: int) -> None:
    """Same model, prior 2.0 and noise 0.4: the GLM predictive mean and variance agree to 1e-4 (measured: mean
    exactly, variance <= 3e-6; laplace-torch works in float32, so 1e-4 is float32 rounding over a 16-wide head
    with a margin), and the evidence to 1e-5 relative. The Kronecker factors are the same on both sides
    (``G = Σ_n I``, ``A = Σ_n phi phiᵀ / N``, the bias its own block), so kron is compared like the others."""
    from laplace import Laplace

    net, loader, x = _trained_mlp(outputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = Laplace(
            net,
            "regression",
            subset_of_weights="last_layer",
            hessian_structure=hessian,
            sigma_noise=0.4,
            prior_precision=2.0,
        )
        reference.fit(loader)
        mean, variance = reference(x, pred_type="glm")
        evidence = float(reference.log_marginal_likelihood())
    um = posthoc.wrap(net, method="laplace", likelihood=Gaussian(noise_std=0.4), prior_precision=2.0, hessian=hessian)
    pred = um.fit(loader, progress=False).predict(x)
    torch.testing.assert_close(pred.mean, mean, atol=1e-4, rtol=0)
    torch.testing.assert_close(pred.epistemic, variance.diagonal(dim1=1, dim2=2), atol=1e-4, rtol=0)
    torch.testing.assert_close(pred.aleatoric, torch.full_like(pred.mean, 0.16), atol=1e-6, rtol=0)
    assert um.method.log_marginal_likelihood() == pytest.approx(evidence, rel=1e-5)


@pytest.mark.parametrize("hessian", ["full", "kron", "diag"])
def test_marglik_noise_and_prior_maximise_the_evidence(hessian: str) -> None:
    net, loader, _ = _trained_mlp()
    um = posthoc.wrap(net, method="laplace", likelihood="regression", hessian=hessian).fit(loader, progress=False)
    card = um.summary()["posterior"][0]
    assert card["prior_fit"] == "marglik" and card["noise_fit"] == "marglik"
    delta, std, method = card["prior_precision"], card["noise_std"], um.method
    best = method.log_marginal_likelihood()
    for factor in (0.9, 1.1):
        assert method.log_marginal_likelihood(delta * factor) < best
        method.likelihood.set_noise(std * factor, "marglik")
        assert method.log_marginal_likelihood() < best
    method.likelihood.set_noise(std, "marglik")
    assert 0.3 < std < 0.5  # the data's noise is 0.4


# ------------------------------------------------------------------------------ the predictive's distribution
def test_gaussian_interval_quantile_log_prob_cdf_equal_scipy() -> None:
    generator = torch.Generator().manual_seed(0)
    mean, var = (
        torch.randn(5, 2, generator=generator, dtype=torch.float64),
        torch.rand(5, 2, generator=generator, dtype=torch.float64) + 0.1,
    )
    pred = RegressionPrediction.from_components(mean[None], var[None] / 2, var[None] / 2)
    y = torch.randn(5, 2, generator=generator, dtype=torch.float64)
    normal = scipy.stats.norm(mean.numpy(), np.sqrt(var.numpy()))
    np.testing.assert_allclose(pred.cdf(y).numpy(), normal.cdf(y.numpy()), rtol=0, atol=1e-12)
    np.testing.assert_allclose(pred.log_prob(y).numpy(), normal.logpdf(y.numpy()).sum(1), rtol=1e-12)
    np.testing.assert_allclose(pred.quantile(0.3).numpy(), normal.ppf(0.3), rtol=0, atol=1e-12)
    lower, upper = pred.interval(0.9)
    np.testing.assert_allclose(lower.numpy(), normal.ppf(0.05), atol=1e-12)
    np.testing.assert_allclose(upper.numpy(), normal.ppf(0.95), atol=1e-12)
    assert pred.samples is None and torch.allclose(pred.variance, var)


def test_mixture_interval_quantile_log_prob_cdf_equal_a_numeric_mixture() -> None:
    means = torch.tensor([[-1.0, 0.0, 2.5], [0.0, 0.1, 0.2]], dtype=torch.float64).T[:, :, None]  # (K=3, N=2, D=1)
    noise = torch.tensor([[0.3], [0.5], [1.0]], dtype=torch.float64)[:, :, None].expand(3, 2, 1)
    pred = RegressionPrediction.from_components(means, torch.full_like(means, 0.2), noise)
    grid = np.linspace(-12, 14, 400_001)
    for n in range(2):
        mu, sd = means[:, n, 0].numpy(), np.sqrt(0.2 + noise[:, n, 0].numpy())
        density = np.mean([scipy.stats.norm.pdf(grid, m, s) for m, s in zip(mu, sd)], axis=0)
        cdf = np.concatenate([[0.0], np.cumsum((density[1:] + density[:-1]) / 2 * np.diff(grid))])
        for q in (0.05, 0.3, 0.5, 0.95):
            assert pred.quantile(q)[n, 0].item() == pytest.approx(np.interp(q, cdf, grid), abs=1e-4)
        for value in (-1.5, 0.2, 3.0):
            y = torch.full((2, 1), value, dtype=torch.float64)
            assert pred.cdf(y)[n, 0].item() == pytest.approx(np.interp(value, grid, cdf), abs=1e-6)
            assert pred.log_prob(y)[n].item() == pytest.approx(math.log(np.interp(value, grid, density)), abs=1e-6)
        lower, upper = pred.interval(0.8)
        assert np.interp(upper[n, 0].item(), grid, cdf) - np.interp(lower[n, 0].item(), grid, cdf) == pytest.approx(
            0.8, abs=1e-6
        )
    # the split: noise averages into the aleatoric part, the means' spread and the model variance into the epistemic
    torch.testing.assert_close(pred.aleatoric, noise.mean(0))
    torch.testing.assert_close(pred.epistemic, 0.2 + means.var(0, unbiased=False))
    torch.testing.assert_close(pred.variance, GaussianMixture(means, 0.2 + noise).variance())


# ------------------------------------------------------------------------------ the noise
def test_the_noise_fit_recovers_a_known_noise() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 2, generator=generator)
    y = x @ torch.tensor([1.5, -0.5]) + 0.3 * torch.randn(4000, generator=generator)
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.5, -0.5]]))
        model.bias.zero_()
    um = posthoc.wrap(model, method="none", likelihood="regression").fit(
        None, DataLoader(TensorDataset(x, y), batch_size=500), progress=False
    )
    std = um.summary()["posterior"][0]["noise_std"]
    assert abs(std - 0.3) < 3 * 0.3 / math.sqrt(2 * 4000)  # three standard errors of a fitted std
    # the search used for mixtures finds the same optimum as the closed form for points
    gaussian = Gaussian()
    outputs, targets = model(x).detach()[None].double(), y[:, None].double()
    gaussian.fit_noise(outputs, torch.zeros_like(outputs), targets)
    assert float(gaussian.noise_std) == pytest.approx(std, rel=1e-6)


def test_predict_before_the_noise_is_fitted_is_refused() -> None:
    with pytest.raises(NotFittedError, match="observation noise"):
        posthoc.wrap(nn.Linear(2, 1), method="none", likelihood="regression").predict(torch.randn(3, 2))


# ------------------------------------------------------------------------------ the seed 004 sinusoid
def _sinusoid() -> tuple[nn.Module, DataLoader, dict[str, torch.Tensor]]:
    """Seed 004: ``y = 2 + 0.3 sin(2π(x+ε)) + 0.3 sin(4π(x+ε)) + ε``, ε ~ N(0, 0.02²), 40 training points of 500
    in two clusters (x < 0.3, x > 0.7), an MLP with dropout trained here (about a second)."""
    generator = torch.Generator().manual_seed(4)
    x = torch.rand(500, generator=generator)
    eps = 0.02 * torch.randn(500, generator=generator)
    y = 2 + 0.3 * torch.sin(2 * torch.pi * (x + eps)) + 0.3 * torch.sin(4 * torch.pi * (x + eps)) + eps
    pool = torch.nonzero((x < 0.3) | (x > 0.7)).squeeze(1)
    train = pool[torch.randperm(len(pool), generator=generator)[:40]]
    scale = lambda v: (v[:, None] - 0.5) * 4  # noqa: E731  (inputs centred for training)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Dropout(0.1), nn.Linear(64, 1))
    optimiser = torch.optim.Adam(net.parameters(), 1e-2)
    for _ in range(1000):
        optimiser.zero_grad()
        ((net(scale(x[train])) - y[train, None]) ** 2).mean().backward()
        optimiser.step()
    regions = {
        "train": scale(x[train]),
        "gap": scale(x[(x > 0.4) & (x < 0.6)]),
        "beyond": scale(torch.linspace(1.1, 1.3, 20)),
    }
    return net.eval(), DataLoader(TensorDataset(scale(x[train]), y[train]), batch_size=40), regions


@pytest.mark.parametrize(
    "method, options",
    [("laplace", {"hessian": "full"}), ("laplace", {"hessian": "kron"}), ("mc-dropout", {"num_samples": 100})],
)
def test_the_sinusoid_predictive_is_wider_in_the_gap_and_beyond_the_data(method: str, options: dict) -> None:
    net, loader, regions = _sinusoid()
    um = posthoc.wrap(net, method=method, likelihood="regression", **options).fit(loader, progress=False)
    std = {
        name: um.predict(x, generator=torch.Generator().manual_seed(0)).std.mean().item() for name, x in regions.items()
    }
    assert std["gap"] > 1.05 * std["train"] and std["beyond"] > 1.05 * std["train"], std


# ------------------------------------------------------------------------------ methods and the API
def test_ensemble_of_plain_regressors_is_the_mixture_of_their_gaussians() -> None:
    nets = [_trained_mlp(seed=seed)[0] for seed in (0, 1, 2)]
    _, loader, x = _trained_mlp()
    um = posthoc.wrap(nets, likelihood="regression").fit(loader, progress=False)
    pred = um.predict(x)
    singles = [
        posthoc.wrap(net, method="none", likelihood="regression").fit(loader, progress=False).predict(x) for net in nets
    ]
    means = torch.stack([p.mean for p in singles])
    torch.testing.assert_close(pred.mean, means.mean(0))
    torch.testing.assert_close(pred.epistemic, means.var(0, unbiased=False))
    torch.testing.assert_close(pred.aleatoric, torch.stack([p.aleatoric for p in singles]).mean(0))
    assert pred.samples.shape == (3, 30, 1)
    assert set(um.summary()["posterior"][0]["per_member"]["0"]) >= {"noise_std"}


def test_targets_may_be_flat_or_two_dimensional_and_the_prediction_is_n_by_d() -> None:
    net, loader, x = _trained_mlp(outputs=1)
    flat = DataLoader(TensorDataset(loader.dataset.tensors[0], loader.dataset.tensors[1][:, 0]), batch_size=50)
    a = posthoc.wrap(net, method="laplace", likelihood="regression").fit(loader, progress=False).predict(x)
    b = posthoc.wrap(net, method="laplace", likelihood="regression").fit(flat, progress=False).predict(x)
    assert a.mean.shape == (30, 1)
    torch.testing.assert_close(a.variance, b.variance)
    two, loader2, _ = _trained_mlp(outputs=2)
    pred = (
        posthoc.wrap(two, method="mc-dropout", p=0.1, likelihood="regression").fit(loader2, progress=False).predict(x)
    )
    assert (
        pred.mean.shape == (30, 2)
        and pred.samples.shape == (50, 30, 2)
        and pred.log_prob(torch.zeros(30, 2)).shape == (30,)
    )


def test_save_and_load_keep_the_likelihood_and_its_noise(tmp_path) -> None:
    net, loader, x = _trained_mlp()
    um = posthoc.wrap(net, method="laplace", likelihood="regression", hessian="kron").fit(loader, progress=False)
    um.save(tmp_path / "r.pt")
    loaded = posthoc.load(tmp_path / "r.pt", net)
    assert loaded.likelihood.name == "regression" and float(loaded.likelihood.noise_std) == float(
        um.likelihood.noise_std
    )
    torch.testing.assert_close(loaded.predict(x).variance, um.predict(x).variance, rtol=0, atol=0)
    with pytest.raises(PosteriorFileError, match="likelihood='regression'"):
        posthoc.load(tmp_path / "r.pt", net, likelihood="classification")
    classifier = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).eval()
    labels = DataLoader(
        TensorDataset(loader.dataset.tensors[0], (loader.dataset.tensors[1][:, 0] > 0).long()), batch_size=50
    )
    posthoc.wrap(classifier, method="none").fit(labels, progress=False).save(tmp_path / "c.pt")
    with pytest.raises(PosteriorFileError, match="likelihood='classification'"):
        posthoc.load(tmp_path / "c.pt", classifier, likelihood="regression")


def test_wrap_refuses_what_does_not_do_regression_and_names_what_does() -> None:
    net, loader, _ = _trained_mlp()
    with pytest.raises(ConfigError, match="pass|likelihood='regression'") as refused:
        posthoc.wrap(net, method="laplace").fit(loader, progress=False)
    assert "needs a head with at least 2 outputs; this head has 1" in str(refused.value)
    assert "likelihood='regression'" in str(refused.value)
    for method, options in (("temperature", {}), (["laplace", "temperature"], {})):
        with pytest.raises(ConfigError, match="does not do likelihood='regression' yet") as refused:
            posthoc.wrap(net, method=method, likelihood="regression", **options)
        for able in ("ibnn", "ivon", "laplace", "mc-dropout", "multiswag", "none", "sgld", "sparse-vd", "swag", "vi"):
            assert able in str(refused.value)
    with pytest.raises(ConfigError, match="likelihood must be one of"):
        posthoc.wrap(net, method="none", likelihood="poisson")
    with pytest.raises(ConfigError, match="pred='glm'"):
        posthoc.wrap(net, method="laplace", likelihood="regression", subset="all", pred="nn", prior_precision="val")


def test_heteroscedastic_plain_model_reads_its_own_variance() -> None:
    model = nn.Linear(2, 2)
    x = torch.randn(5, 2)
    pred = posthoc.wrap(model, method="none", likelihood="heteroscedastic").predict(x)
    with torch.no_grad():
        out = model(x)
    torch.testing.assert_close(pred.mean, out[:, :1])
    torch.testing.assert_close(pred.aleatoric, out[:, 1:].exp())
    assert torch.equal(pred.epistemic, torch.zeros_like(pred.mean))
    with pytest.raises(ConfigError, match="does not do likelihood='heteroscedastic'"):
        posthoc.wrap(model, method="laplace", likelihood="heteroscedastic", subset="all")


def test_with_held_out_data_laplace_takes_the_noise_of_lowest_held_out_nll() -> None:
    """An over-fitted network: the evidence reads only the training residuals and under-states the noise; with
    ``val_loader`` the noise is re-chosen on held-out NLL (and the prior re-fitted at it), which must not be worse
    there than the evidence's noise, nor than the plain model with its held-out noise by more than 1 %."""
    from posthoc_apps.demo.data import auto_mpg, train_mlp

    data = auto_mpg(0)
    net = train_mlp(data.train, epochs=300)
    evidence_only = posthoc.wrap(net, method="laplace", likelihood="regression").fit(
        data.train_loader(), progress=False
    )
    held_out = posthoc.wrap(net, method="laplace", likelihood="regression").fit(
        data.train_loader(), data.val_loader(), progress=False
    )
    plain = posthoc.wrap(net, method="none", likelihood="regression").fit(
        data.train_loader(), data.val_loader(), progress=False
    )
    card = held_out.summary()["posterior"][0]
    assert card["noise_fit"] == "held-out" and card["prior_fit"] == "marglik"
    assert card["noise_std"] > evidence_only.summary()["posterior"][0]["noise_std"]
    x, y = data.val
    nll = {
        name: -float(um.predict(x).log_prob(y).mean())
        for name, um in (("evidence", evidence_only), ("held-out", held_out), ("plain", plain))
    }
    assert nll["held-out"] <= nll["evidence"] and nll["held-out"] <= nll["plain"] + 0.01 * abs(nll["plain"]), nll


@pytest.mark.parametrize("method", ["vi", "sparse-vd"])
def test_variational_methods_predict_a_mixture_around_sampled_outputs_with_a_held_out_noise(
    method: str, tmp_path
) -> None:
    """The ELBO under a Gaussian likelihood: the posterior's draws spread the outputs (epistemic > 0), the noise is
    re-fitted to them on held-out data, and a saved posterior predicts the same mixture."""
    net, loader, x = _trained_mlp()
    val = DataLoader(TensorDataset(*[t[:100] for t in loader.dataset.tensors]), batch_size=50)
    um = posthoc.wrap(net, method=method, likelihood="regression").fit(loader, val, progress=False)
    pred = um.predict(x)
    assert isinstance(pred, RegressionPrediction) and pred.samples.shape == (20, 30, 1)
    assert float(pred.epistemic.min()) > 0 and um.summary()["posterior"][0]["noise_fit"] == "held-out"
    with torch.no_grad():
        plain = net(x)
    assert float((pred.mean - plain).abs().max()) < 0.5  # the draws sit around the checkpoint's outputs
    um.save(tmp_path / "posterior.pt")
    loaded = posthoc.load(tmp_path / "posterior.pt", net, likelihood="regression").predict(x)
    torch.testing.assert_close(loaded.variance, pred.variance, rtol=0, atol=0)


# ------------------------------------------------------------ the (N,) outputs that docs/regression.md promises
class _Squeezed(nn.Module):
    """A regressor whose forward ends in ``.squeeze(-1)``: outputs ``(N,)``, its body's ``(N, 1)`` with the axis dropped."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).squeeze(-1)


#: every method that does regression, with options that keep its fit small (fit options after the ``|``)
SQUEEZED_CASES = [
    ("none", {}, {}),
    ("laplace", {}, {}),
    ("laplace", {"subset": "all"}, {}),
    ("laplace", {"subset": "all", "pred": "nn"}, {}),
    ("laplace", {"subset": ["body.0"]}, {}),
    ("mc-dropout", {"p": 0.1, "where": "blocks"}, {}),
    ("vi", {}, {"epochs": 1}),
    ("sparse-vd", {}, {"epochs": 1}),
    ("swag", {}, {"epochs": 1}),
    ("multiswag", {}, {"epochs": 1}),
    ("ivon", {}, {}),
    ("sgld", {}, {}),
    ("ibnn", {}, {"epochs": 1}),
]


@pytest.mark.parametrize(
    ("method", "options", "fit_options"),
    SQUEEZED_CASES,
    ids=[f"{m}-{'-'.join(map(str, o.values())) or 'default'}" for m, o, _ in SQUEEZED_CASES],
)
def test_a_regressor_of_shape_n_predicts_as_its_n_by_1_body(method: str, options: dict, fit_options: dict) -> None:
    """docs/regression.md promises ``(N,)`` outputs: a model ending in ``.squeeze(-1)`` gets the same predictive, to the
    bit, as the same network returning ``(N, 1)`` (was: subset Laplace raised MSELoss's ValueError, last-layer Laplace,
    VI and others HeadNotFoundError whatever head was named)."""
    body, loader, x = _trained_mlp()
    flat = DataLoader(TensorDataset(loader.dataset.tensors[0], loader.dataset.tensors[1][:, 0]), batch_size=50)
    unprefixed = {
        key: [name.removeprefix("body.") for name in value] if isinstance(value, list) else value
        for key, value in options.items()
    }
    predictions = []
    for model, data, opts in ((_Squeezed(body), flat, options), (body, loader, unprefixed)):
        torch.manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            um = posthoc.wrap(model, method=method, likelihood="regression", **opts).fit(
                data, data, progress=False, **fit_options
            )
        predictions.append(um.predict(x, generator=torch.Generator().manual_seed(0)))
    squeezed, plain = predictions
    assert squeezed.mean.shape == (30, 1)
    torch.testing.assert_close(squeezed.mean, plain.mean, rtol=0, atol=0)
    torch.testing.assert_close(squeezed.variance, plain.variance, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["laplace", "vi", "sparse-vd", "swag"])
def test_a_model_that_is_its_own_head_is_a_linear_regression(method: str) -> None:
    """A bare ``nn.Linear`` (linear regression): its head is the model itself, named ``""`` (was: last-layer Laplace
    raised ``KeyError: '.weight'``, VI and sparse VD ``KeyError`` on the empty module name). Full last-layer Laplace on
    it is the exact Bayesian linear regression: predictive variance ``σ² + x̃ᵀ (X̃ᵀX̃ / σ² + δ I)⁻¹ x̃``."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(100, 3, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3 * torch.randn(100, 1, generator=generator)
    model = nn.Linear(3, 1)
    with torch.no_grad():
        solution = torch.linalg.lstsq(torch.cat([x, torch.ones(100, 1)], 1), y).solution
        model.weight.copy_(solution[:3].T)
        model.bias.copy_(solution[3])
    loader = DataLoader(TensorDataset(x, y), batch_size=50)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        um = posthoc.wrap(
            model, method=method, likelihood="regression", **({"hessian": "full"} if method == "laplace" else {})
        ).fit(loader, loader, progress=False, **({} if method == "laplace" else {"epochs": 1}))
    pred = um.predict(x[:5])
    assert pred.mean.shape == (5, 1) and torch.isfinite(pred.std).all()
    if method != "laplace":
        return
    noise, delta = float(um.likelihood.noise_std) ** 2, float(um.method.prior_precision)
    features = torch.cat([x, torch.ones(100, 1)], 1).double()
    covariance = torch.linalg.inv(features.T @ features / noise + delta * torch.eye(4, dtype=torch.float64))
    expected = noise + (features[:5] @ covariance * features[:5]).sum(-1)
    torch.testing.assert_close(pred.variance[:, 0].double(), expected, rtol=1e-4, atol=0)


# ------------------------------------------------------------------------------ units of the targets
def _in_units(net: nn.Module, loader: DataLoader, factor: float) -> tuple[nn.Module, DataLoader]:
    """The same regressor and data with targets ``factor`` times larger: the last layer scaled, as training would."""
    scaled = nn.Sequential(*[nn.Linear(m.in_features, m.out_features) if isinstance(m, nn.Linear) else m for m in net])
    scaled.load_state_dict(net.state_dict())
    with torch.no_grad():
        scaled[-1].weight.mul_(factor)
        scaled[-1].bias.mul_(factor)
    x, y = loader.dataset.tensors
    return scaled.eval(), DataLoader(TensorDataset(x, y * factor), batch_size=50)


@pytest.mark.parametrize("factor", [1e8, 1e-8])
@pytest.mark.parametrize("prior", ["auto-train", "auto-val", "grid"])
def test_laplace_is_invariant_to_the_targets_units(prior: str, factor: float) -> None:
    """The prior is searched in standardised units (a decade of the training residuals' scale), so targets in other
    units give the same predictive in those units: the NLL in units of the scale, ``NLL - log(factor)``, agrees to 1e-4
    nats (measured: 2e-6, the float32 network's rounding), with no warning. Before, the range [1e-8, 1e8] put the
    evidence's prior on a bound at both factors (a warning) and the NLL drifted by up to 0.2 nats."""
    net, loader, x = _trained_mlp()
    generator = torch.Generator().manual_seed(5)
    x_val = torch.randn(100, 3, generator=generator)
    val = DataLoader(
        TensorDataset(x_val, torch.stack([2 * x_val[:, 0]], 1) + 0.4 * torch.randn(100, 1, generator=generator)),
        batch_size=50,
    )
    x_test = torch.randn(200, 3, generator=generator)
    y_test = 2 * x_test[:, :1] + 0.4 * torch.randn(200, 1, generator=generator)
    options = {"prior_precision": "grid"} if prior == "grid" else {}
    nlls = []
    for scale in (1.0, factor):
        model, train = _in_units(net, loader, scale)
        _, held_out = _in_units(net, val, scale)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            um = posthoc.wrap(model, method="laplace", likelihood="regression", **options).fit(
                train, None if prior == "auto-train" else held_out, progress=False
            )
        nlls.append(float(-um.predict(x_test).log_prob(y_test * scale).mean()) - math.log(scale))
    assert nlls[1] == pytest.approx(nlls[0], abs=1e-4)


def test_laplace_refuses_a_model_that_predicts_every_training_target_exactly() -> None:
    """As the plain model's noise fit does (was: the prior at its bound with a warning, then a noise of 1e-13)."""
    model = nn.Linear(3, 1)
    x = torch.randn(40, 3)
    with torch.no_grad():
        exact = DataLoader(TensorDataset(x, model(x)), batch_size=20)
    for method in ("none", "laplace"):
        with pytest.raises(
            posthoc.InputError, match="predicts every (training )?target exactly, so the observation noise is 0"
        ):
            posthoc.wrap(model, method=method, likelihood="regression").fit(exact, progress=False)
    fixed = posthoc.wrap(model, method="laplace", likelihood=posthoc.Gaussian(noise_std=0.1)).fit(exact, progress=False)
    assert float(fixed.predict(x).aleatoric[0, 0]) == pytest.approx(0.01)  # a fixed noise needs no residuals
