"""Last-layer Laplace under ``likelihood="heteroscedastic"``: a head of means and log-variances.

- the GGN is the Fisher of the Gaussian NLL in both outputs: equal, in float64, to the brute-force Hessian of the
  summed NLL in the head's weights (``torch.func.hessian``) averaged over targets drawn from the model itself,
  which is exact with the two points ``y = m ± e^{s/2}`` (the Hessian is a quadratic in ``y - m``);
- the moment-matched predictive has the mean and variance of the predictive sampled from the weight posterior;
- the prior is chosen by the selection step (and the evidence), and the fitted posterior saves and loads.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.core.likelihood import HeteroscedasticGaussian, HeteroscedasticHessian
from posthoc.errors import ConfigError
from posthoc.methods.laplace.marglik import effective_parameters

FEATURES, HIDDEN, TARGETS, EXAMPLES = 3, 5, 2, 9
pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(dtype: torch.dtype = torch.float64) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """An untrained float64 network with a head of ``2 * TARGETS`` outputs, inputs and targets."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 2 * TARGETS)).to(dtype).eval()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(EXAMPLES, FEATURES, generator=generator, dtype=dtype)
    return net, x, torch.randn(EXAMPLES, TARGETS, generator=generator, dtype=dtype)


def _brute_force_fisher(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``E_y ∇²_θ Σ_n -log N(y_n; m_n, e^{s_n})`` over ``θ = [W, b]`` (class-major, bias last in each row), ``y``
    from the model at the checkpoint: the mean of the Hessians at ``y = m + e^{s/2}`` and ``y = m - e^{s/2}``."""
    head = net[-1]
    with torch.no_grad():
        features = net[:-1](x)
        out = net(x)
    means, log_variances = out[:, :TARGETS], out[:, TARGETS:]
    theta = torch.cat([head.weight, head.bias[:, None]], 1).detach().reshape(-1)

    def nll(flat: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        matrix = flat.reshape(2 * TARGETS, HIDDEN + 1)
        outputs = features @ matrix[:, :-1].T + matrix[:, -1]
        m, s = outputs[:, :TARGETS], outputs[:, TARGETS:]
        return 0.5 * (s + (targets - m).square() * (-s).exp() + math.log(2 * math.pi)).sum()

    spread = (log_variances / 2).exp()
    return sum(torch.func.hessian(nll)(theta, means + sign * spread) for sign in (1, -1)) / 2


@pytest.mark.parametrize("hessian", ["full", "diag"])
def test_the_ggn_is_the_expected_hessian_of_the_nll_in_the_head(hessian: str) -> None:
    """Full: the whole matrix to 1e-10 relative; diag: its diagonal; kron: its output factor is the Hessian in the
    bias (whose Jacobian is the identity), so ``Σ_n diag(e^{-s_n}, ½)`` exactly."""
    net, x, y = _tiny()
    expected = _brute_force_fisher(net, x)
    um = posthoc.wrap(net, method="laplace", likelihood="heteroscedastic", hessian=hessian, prior_precision=1.0)
    um.fit(DataLoader(TensorDataset(x, y), batch_size=4), progress=False)
    dense = um.method.curvature.dense()
    scale = float(expected.abs().max())
    if hessian == "full":
        assert float((dense - expected).abs().max()) < 1e-10 * scale
    else:
        assert float((dense.diagonal() - expected.diagonal()).abs().max()) < 1e-10 * scale
    kron = posthoc.wrap(net, method="laplace", likelihood="heteroscedastic", hessian="kron", prior_precision=1.0)
    kron.fit(DataLoader(TensorDataset(x, y), batch_size=4), progress=False)
    block = kron.method.curvature
    out_factor = block.out_eigvecs @ torch.diag(block.out_eigvals) @ block.out_eigvecs.T
    bias = torch.arange(2 * TARGETS) * (HIDDEN + 1) + HIDDEN
    assert float((out_factor - expected[bias][:, bias]).abs().max()) < 1e-10 * scale


def test_the_exact_hessian_in_the_outputs_is_indefinite_and_the_fisher_is_not() -> None:
    """Why the Fisher: the NLL's Hessian in ``(m, s)`` has determinant ``-½ r² e^{-2s}`` at a residual ``r ≠ 0``."""
    m, s, y = 0.3, -0.2, 1.0
    exact = torch.func.hessian(lambda v: 0.5 * (v[1] + (y - v[0]) ** 2 * (-v[1]).exp()))(
        torch.tensor([m, s], dtype=torch.float64)
    )
    assert float(torch.linalg.det(exact)) == pytest.approx(-0.5 * (y - m) ** 2 * math.exp(-2 * s), rel=1e-12)
    fisher = HeteroscedasticHessian(torch.tensor([[m, s]], dtype=torch.float64)).diagonal()
    assert torch.allclose(fisher, torch.tensor([[math.exp(-s), 0.5]], dtype=torch.float64), rtol=1e-15, atol=0)


def _growing_noise(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(rows, 1, generator=generator) * 4 - 2
    return x, torch.sin(2 * x) + (0.05 + 0.15 * (x + 2)) * torch.randn(rows, 1, generator=generator)


@functools.cache
def _trained() -> tuple[nn.Module, DataLoader, DataLoader, torch.Tensor]:
    """A small MLP of mean and log-variance trained (200 Adam steps) on noise that grows with ``x`` (made once)."""
    x, y = _growing_noise(0, 240)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 2))
    optimiser = torch.optim.Adam(net.parameters(), 2e-2)
    for _ in range(200):
        optimiser.zero_grad()
        out = net(x[:160])
        (0.5 * (out[:, 1:] + (y[:160] - out[:, :1]).square() * (-out[:, 1:]).exp())).mean().backward()
        optimiser.step()
    loader = lambda rows: DataLoader(TensorDataset(x[rows], y[rows]), batch_size=64)  # noqa: E731
    return net.eval(), loader(slice(0, 160)), loader(slice(160, 240)), torch.linspace(-3, 3, 7)[:, None]


@pytest.mark.parametrize("hessian", ["full", "kron", "diag"])
def test_the_moment_matched_predictive_has_the_moments_of_the_sampled_posterior(hessian: str) -> None:
    """Mean and variance of ``y`` under 20,000 head weights drawn from the posterior (then ``y ~ N(m, e^s)``, whose
    conditional moments are exact) within 5 Monte Carlo standard errors of the closed form; ``link="mc"`` (the
    mixture over draws of ``(m, s)``) within 5 standard errors too."""
    net, train, _, x = _trained()
    um = posthoc.wrap(net, method="laplace", likelihood="heteroscedastic", hessian=hessian, prior_precision=0.5)
    um.fit(train, progress=False)
    pred = um.predict(x)
    draws = 20_000
    head = net[-1]
    theta = torch.cat([head.weight, head.bias[:, None]], 1).detach().double()
    weights = um.method.curvature.sample(theta, 0.5, draws, torch.Generator().manual_seed(0))  # (S, 2, 17)
    with torch.no_grad():
        features = torch.cat([net[:-1](x), torch.ones(len(x), 1)], 1).double()
    outputs = torch.einsum("nd,scd->snc", features, weights)
    m, noise = outputs[..., 0], outputs[..., 1].exp()
    mean, second = m.mean(0), (m.square() + noise).mean(0)  # E y, E y²
    variance = second - mean.square()
    mean_error = (m.var(0) + noise.mean(0)).div(draws).sqrt()
    variance_error = (m.square() + noise).var(0).div(draws).sqrt() + 2 * mean.abs() * mean_error
    assert ((pred.mean[:, 0].double() - mean).abs() <= 5 * mean_error).all()
    assert ((pred.variance[:, 0].double() - variance).abs() <= 5 * variance_error).all(), (pred.variance, variance)
    sampled = posthoc.wrap(
        net,
        method="laplace",
        likelihood="heteroscedastic",
        hessian=hessian,
        prior_precision=0.5,
        link="mc",
        num_samples=draws,
    ).fit(train, progress=False)
    mixture = sampled.predict(x, generator=torch.Generator().manual_seed(1))
    assert mixture.samples.shape == (draws, len(x), 1)
    assert ((mixture.mean[:, 0].double() - pred.mean[:, 0].double()).abs() <= 5 * mean_error).all()
    assert ((mixture.variance[:, 0].double() - pred.variance[:, 0].double()).abs() <= 5 * variance_error).all()


def test_the_prior_is_chosen_on_held_out_nll_and_by_the_evidence() -> None:
    """``"val"``: the selection step over the ladder, the chosen δ's held-out NLL not above the plain network's by more
    than the tolerance; ``"auto"`` (= ``"marglik"``): the evidence's fixed point ``γ(δ) = δ ‖θ‖²``."""
    net, train, val, _ = _trained()
    um = posthoc.wrap(net, method="laplace", likelihood="heteroscedastic", prior_precision="val")
    um.fit(train, val, progress=False)
    selection = um.method.last_selection
    assert um.method.summary()["prior_fit"] == "val" and selection.knob == "prior_precision"
    assert float(um.method.prior_precision) == selection.value
    plain = posthoc.wrap(net, method="none", likelihood="heteroscedastic")
    x, y = val.dataset.tensors
    chosen, reference = float(-um.predict(x).log_prob(y).mean()), float(-plain.predict(x).log_prob(y).mean())
    assert selection.plain_nll == pytest.approx(reference, rel=1e-5)
    assert selection.records[selection.index].clean_nll == pytest.approx(chosen, rel=1e-5)
    assert chosen <= reference + selection.tolerance
    method = posthoc.wrap(net, method="laplace", likelihood="heteroscedastic").fit(train, val, progress=False).method
    delta = float(method.prior_precision)
    assert method.summary()["prior_fit"] == "marglik" and method.last_selection is None
    assert method.summary()["link"] == "moment-matched"
    assert float(effective_parameters(method.spectrum(), delta)) == pytest.approx(
        delta * float(method.square_norm), rel=1e-6
    )


@pytest.mark.parametrize("hessian", ["full", "kron", "diag"])
def test_save_and_load_predict_the_same(tmp_path, hessian: str) -> None:
    net, train, val, x = _trained()
    um = posthoc.wrap(net, method="laplace", likelihood="heteroscedastic", hessian=hessian)
    um.fit(train, val, progress=False)
    um.save(tmp_path / "h.pt")
    loaded = posthoc.load(tmp_path / "h.pt", net)
    assert isinstance(loaded.likelihood, HeteroscedasticGaussian)
    assert float(loaded.method.prior_precision) == float(um.method.prior_precision)
    for field in ("mean", "variance", "aleatoric", "epistemic"):
        assert torch.equal(getattr(loaded.predict(x), field), getattr(um.predict(x), field))


def test_refusals_name_what_to_use() -> None:
    net = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="link='probit'"):
        posthoc.wrap(net, method="laplace", likelihood="heteroscedastic", link="bridge")
    with pytest.raises(ConfigError, match="subset='last_layer' only"):
        posthoc.wrap(net, method="laplace", likelihood="heteroscedastic", subset="all")
    with pytest.raises(ConfigError, match="D means then D log-variances"):
        posthoc.wrap(nn.Linear(1, 3), method="laplace", likelihood="heteroscedastic")
