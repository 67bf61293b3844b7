"""Held-out choices under likelihood="regression": MC dropout's rate and Laplace's prior precision by the Gaussian NLL.

The oracles: a hand Gaussian NLL (``N(f(x), σ²)`` with ``σ`` the root mean square residual, its maximum-likelihood
value), models on which dropout clearly costs or clearly costs nothing on held-out data, and a brute-force loop
over fixed prior precisions through the public ``predict``.
"""

from __future__ import annotations

import math
import statistics
import warnings

import pytest
import torch
from conftest import linear_data_regressor, rule_choice
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.core.likelihood import Gaussian, best_noise_nll
from posthoc.engine.selection import CONFIDENCE, Tolerance
from posthoc.methods.mc_dropout.method import P_GRID

#: the Laplace models here have more head weights than training rows on purpose (the prior matters)
pytestmark = pytest.mark.filterwarnings("ignore:.*training examples determine:RuntimeWarning")


def _dropout_net(head_scale: float, seed: int = 0) -> nn.Module:
    """A random tanh MLP with dropout before a Linear head whose weights are scaled by ``head_scale``."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    with torch.no_grad():
        net[3].weight.mul_(head_scale)
    return net.eval()


def _loaders(net: nn.Module, noise: float, seed: int = 1) -> tuple[DataLoader, DataLoader]:
    """Training and held-out loaders whose targets are ``net``'s own outputs plus Gaussian noise of std ``noise``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(400, 2, generator=generator)
    with torch.no_grad():
        y = net(x) + noise * torch.randn(400, 1, generator=generator)
    return (
        DataLoader(TensorDataset(x[:200], y[:200]), batch_size=50),
        DataLoader(TensorDataset(x[200:], y[200:]), batch_size=64),
    )


def _held_out(loader: DataLoader) -> tuple[torch.Tensor, torch.Tensor]:
    return loader.dataset.tensors


# ------------------------------------------------------------------------------ MC dropout's rate
@pytest.mark.parametrize("p", ["auto", None])
def test_mc_dropout_rate_is_chosen_on_held_out_gaussian_nll_and_recorded(p: str | None) -> None:
    """The plain NLL recorded is the hand ``N(f(x), σ_plain²)`` one (σ_plain = RMS residual; to 1e-6), and the chosen
    rate's held-out NLL is within the tolerance of it."""
    net = _dropout_net(1.0)
    train, val = _loaders(net, noise=0.3)
    um = posthoc.wrap(net, method="mc-dropout", likelihood="regression", p=p).fit(train, val, progress=False)
    card = um.summary()["posterior"][0]
    x, y = _held_out(val)
    with torch.no_grad():
        residual = net(x).double() - y.double()
    sigma = residual.square().mean().sqrt()
    hand = float(0.5 * math.log(2 * math.pi) + sigma.log() + 0.5)
    assert card["validation_nll_plain"] == pytest.approx(hand, abs=1e-6)
    (rate,) = card["dropout_rate"]
    assert rate in (0.0, *P_GRID) and "Gaussian NLL" in card["rate_from"]
    chosen = next(row for row in card["selection"]["candidates"] if row["chosen"])
    assert chosen["value"] == rate and chosen["bound"] <= card["selection"]["tolerance"]
    assert card["selection"]["plain"]["clean_nll"] == pytest.approx(card["validation_nll_plain"], abs=1e-6)  # rounded
    assert card["noise_fit"] == "held-out"


def test_mc_dropout_rate_follows_what_dropout_costs_on_held_out_data() -> None:
    """Large head weights and nearly exact targets: dropout's spread dwarfs the noise, every rate costs, no dropout (rate
    0, the plain model) is kept. Tiny head weights and noisy targets: the spread is negligible, every rate is within, the
    widest is taken."""
    costly = _dropout_net(5.0)
    train, val = _loaders(costly, noise=0.01)
    card = (
        posthoc.wrap(costly, method="mc-dropout", likelihood="regression", p="auto")
        .fit(train, val, progress=False)
        .summary()["posterior"][0]
    )
    assert card["dropout_rate"] == [0.0]
    refused = card["selection"]["candidates"][1]
    assert (
        refused["value"] == P_GRID[0]
        and not refused["admissible"]
        and refused["bound"] > card["selection"]["tolerance"]
    )
    free = _dropout_net(1e-3)
    train, val = _loaders(free, noise=1.0)
    card = (
        posthoc.wrap(free, method="mc-dropout", likelihood="regression", p="auto")
        .fit(train, val, progress=False)
        .summary()["posterior"][0]
    )
    assert card["dropout_rate"] == [P_GRID[-1]]


@pytest.mark.parametrize("components", [1, 40])
def test_the_per_rate_noise_fit_is_the_likelihoods_maximum_likelihood_mixture_fit(components: int) -> None:
    """The fast held-out score of a rate equals the NLL of ``Gaussian.fit_noise``'s mixture, joint over 2 outputs
    (both golden-section searches; agreement to 1e-9)."""
    generator = torch.Generator().manual_seed(0)
    outputs = torch.randn(components, 30, 2, generator=generator, dtype=torch.float64)
    targets = torch.randn(30, 2, generator=generator, dtype=torch.float64)
    gaussian = Gaussian()
    gaussian.fit_noise(outputs, None, targets)
    expected = float(-gaussian.predictive(outputs).log_prob(targets).mean())
    assert best_noise_nll(Gaussian(), outputs, targets) == pytest.approx(expected, abs=1e-9)
    fixed = Gaussian(noise_std=0.5)
    assert best_noise_nll(fixed, outputs, targets) == pytest.approx(
        float(-fixed.predictive(outputs).log_prob(targets).mean()), abs=1e-12
    )


def test_mc_dropout_auto_rate_survives_save_and_load(tmp_path) -> None:
    net = _dropout_net(1.0)
    train, val = _loaders(net, noise=0.3)
    um = posthoc.wrap(net, method="mc-dropout", likelihood="regression", p="auto").fit(train, val, progress=False)
    um.save(tmp_path / "p.pt")
    loaded = posthoc.load(tmp_path / "p.pt", net, likelihood="regression")
    assert loaded.summary()["posterior"][0]["dropout_rate"] == um.summary()["posterior"][0]["dropout_rate"]
    x, _ = _held_out(val)
    first = um.predict(x, generator=torch.Generator().manual_seed(0))
    second = loaded.predict(x, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(second.variance, first.variance, rtol=0, atol=0)


def test_mc_dropout_auto_without_held_out_data_is_refused() -> None:
    net = _dropout_net(1.0)
    train, _ = _loaders(net, noise=0.3)
    with pytest.raises(Exception, match="val_loader"):
        posthoc.wrap(net, method="mc-dropout", likelihood="regression", p="auto").fit(train, progress=False)


# ------------------------------------------------------------------------------ Laplace's prior precision
def _ridge_head_net(seed: int = 0, train_rows: int = 30, width: int = 100) -> tuple[nn.Module, DataLoader, DataLoader]:
    """A random tanh layer of ``width`` units whose Linear head is fitted by ridge least squares to ``train_rows``
    noisy points of ``sin(3 x₁) + x₂²`` (more head weights than points: the held-out residuals exceed the training
    ones and the posterior's spread matters), its training loader and 300 held-out rows."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(train_rows + 300, 2, generator=generator)
    y = torch.sin(3 * x[:, :1]) + x[:, 1:2] ** 2 + 0.1 * torch.randn(len(x), 1, generator=generator)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, 1))
    with torch.no_grad():
        net[0].weight.mul_(2.0)
        phi = torch.cat([torch.tanh(net[0](x[:train_rows])), torch.ones(train_rows, 1)], 1).double()
        head = torch.linalg.solve(
            phi.T @ phi + 1e-2 * torch.eye(width + 1, dtype=torch.float64), phi.T @ y[:train_rows].double()
        )
        net[2].weight.copy_(head[:-1].T)
        net[2].bias.copy_(head[-1])
    return (
        net.eval(),
        DataLoader(TensorDataset(x[:train_rows], y[:train_rows]), batch_size=16),
        DataLoader(TensorDataset(x[train_rows:], y[train_rows:]), batch_size=100),
    )


def _fixed_prior_nll(net: nn.Module, train: DataLoader, val: DataLoader, prior: float, hessian: str) -> torch.Tensor:
    """Per-example held-out NLL through the public API at a fixed prior (whose noise is then fitted on ``val``)."""
    um = posthoc.wrap(net, method="laplace", likelihood="regression", hessian=hessian, prior_precision=prior)
    um.fit(train, val, progress=False)
    x, y = _held_out(val)
    return -um.predict(x).log_prob(y).double()


def test_laplace_grid_prior_is_the_brute_force_minimiser_of_held_out_gaussian_nll() -> None:
    """``prior_precision="grid"`` under regression: the grid point whose predictive, with its held-out noise, has the
    lowest held-out NLL, as a loop over the 41 fixed priors through ``predict`` finds (NLLs agree to 1e-5)."""
    from posthoc.methods.laplace.prior_search import default_grid

    net, train, val = _ridge_head_net()
    um = posthoc.wrap(net, method="laplace", likelihood="regression", hessian="kron", prior_precision="grid").fit(
        train, val, progress=False
    )
    card = um.summary()["posterior"][0]
    assert card["prior_fit"] == "grid" and card["noise_fit"] == "held-out"
    brute = {
        float(delta): float(_fixed_prior_nll(net, train, val, float(delta), "kron").mean()) for delta in default_grid()
    }
    best = min(brute, key=brute.get)
    x, y = _held_out(val)
    chosen = -float(um.predict(x).log_prob(y).mean())
    assert chosen == pytest.approx(brute[best], abs=1e-5)
    assert (
        card["prior_precision"] == pytest.approx(best, rel=1e-9) or brute[card["prior_precision"]] <= brute[best] + 1e-5
    )
    assert 1e-4 < best < 1e4  # an interior minimum: the test would catch a search stuck at either end


@pytest.mark.parametrize("hessian", ["kron", "full"])
def test_laplace_val_prior_is_the_widest_within_tolerance_of_the_plain_gaussian_nll(hessian: str) -> None:
    """``prior_precision="val"`` under regression: at the chosen δ the mean per-example NLL increase over the plain
    ``N(f(x), σ_plain²)`` (those below their 2.5 % quantile raised to it), plus ``z_0.95`` standard errors times
    ``sqrt(2)`` (the excess on new data of the held-out size), is within the default tolerance ``max(2 % |plain NLL|, 0.005)``;
    at the first wider δ the walk refused it is not, and the choice among the admissible ones is the rule's. NLLs
    through the public ``predict`` at fixed priors (each at its own held-out noise, as the choice scores them, to
    1e-5)."""
    net, train, val = _ridge_head_net()
    um = posthoc.wrap(net, method="laplace", likelihood="regression", hessian=hessian, prior_precision="val").fit(
        train, val, progress=False
    )
    card = um.summary()["posterior"][0]
    assert card["prior_fit"] == "val" and card["noise_fit"] == "held-out"
    delta = card["prior_precision"]
    x, y = _held_out(val)
    with torch.no_grad():
        residual = net(x).double() - y.double()
    sigma = float(residual.square().mean().sqrt())
    plain = 0.5 * math.log(2 * math.pi * sigma**2) + residual.square()[:, 0] / (2 * sigma**2)
    threshold = Tolerance().nats(float(plain.mean()))
    z = statistics.NormalDist().inv_cdf(CONFIDENCE)

    def excess(prior: float) -> float:
        difference = (_fixed_prior_nll(net, train, val, prior, hessian) - plain).detach().double()
        capped = difference.clamp_min(float(torch.quantile(difference, 0.025)))
        return float(capped.mean() + z * capped.std() / math.sqrt(len(capped)) * math.sqrt(2))

    rows = card["selection"]["candidates"]
    assert 1e-4 < delta < 1e4
    assert excess(delta) <= threshold + 1e-5
    # the walk stopped at the first wider prior it refused, and the rule picked among the admissible ones
    refused = [row for row in rows if not row["admissible"] and row["value"] < delta]
    assert refused and excess(max(row["value"] for row in refused)) > threshold
    assert card["selection"]["chosen"] == rule_choice(card["selection"])


def test_laplace_held_out_prior_survives_save_and_load(tmp_path) -> None:
    net, train, val = _ridge_head_net()
    um = posthoc.wrap(net, method="laplace", likelihood="regression", hessian="diag", prior_precision="grid").fit(
        train, val, progress=False
    )
    um.save(tmp_path / "l.pt")
    loaded = posthoc.load(tmp_path / "l.pt", net, likelihood="regression")
    for key in ("prior_precision", "prior_fit", "noise_std", "noise_fit"):
        assert loaded.summary()["posterior"][0][key] == um.summary()["posterior"][0][key]
    x, _ = _held_out(val)
    torch.testing.assert_close(loaded.predict(x).variance, um.predict(x).variance, rtol=0, atol=0)


# ------------------------------------------------------------------------------ iBNN's scale
def _linear_data_mlp() -> tuple[nn.Module, DataLoader, DataLoader]:
    """A small tanh MLP fitted to ``2 x₁`` plus noise of std 0.4, its training loader and 150 held-out rows."""
    net, x, y = linear_data_regressor(350, 200, 0.4)
    return (
        net,
        DataLoader(TensorDataset(x[:200], y[:200]), batch_size=50),
        DataLoader(TensorDataset(x[200:], y[200:]), batch_size=50),
    )


def test_ibnn_regression_chooses_its_scale_on_held_out_gaussian_nll_and_refits_the_noise(tmp_path) -> None:
    """The ELBO under a Gaussian likelihood, then the scale: the checkpoint's recorded NLL is the hand
    ``N(f(x), σ_plain²)`` one (to 1e-6), the chosen scale admissible (its excess bound within the tolerance); the
    predictive is the mixture around the ``K x S`` sampled outputs (epistemic > 0) with a held-out noise, and a
    saved posterior predicts the same mixture."""
    from posthoc.methods.ibnn.method import SCALES

    net, train, val = _linear_data_mlp()
    um = posthoc.wrap(net, method="ibnn", likelihood="regression").fit(train, val, progress=False)
    card = um.summary()["posterior"][0]
    scale, plain, chosen = um.method.scale_fit.tolist()
    x, y = _held_out(val)
    with torch.no_grad():
        residual = net(x).double() - y.double()
    assert plain == pytest.approx(
        float(0.5 * math.log(2 * math.pi) + residual.square().mean().sqrt().log() + 0.5), abs=1e-6
    )
    assert card["scale_fit"] == "val" and scale in (0.0, *SCALES) and card["noise_fit"] == "held-out"
    picked = next(row for row in card["selection"]["candidates"] if row["chosen"]) if card["selection"] else None
    assert picked is not None and picked["bound"] <= card["selection"]["tolerance"]
    assert picked["clean_nll"] == pytest.approx(chosen, abs=1e-6)  # the record rounds to 6 decimals
    pred = um.predict(x, generator=torch.Generator().manual_seed(0))
    assert pred.samples.shape == (card["test_samples"], 150, 1) and float(pred.epistemic.min()) > 0
    um.save(tmp_path / "i.pt")
    loaded = posthoc.load(tmp_path / "i.pt", net, likelihood="regression")
    again = loaded.predict(x, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(again.variance, pred.variance, rtol=0, atol=0)


def test_gaussian_mean_nll_is_the_elbos_gaussian_data_term() -> None:
    """``Gaussian.mean_nll``: the mean over rows of the summed per-output normal NLL at the fitted σ (to 1e-6)."""
    outputs, targets = torch.tensor([[0.0, 1.0], [2.0, -1.0]]), torch.tensor([[0.5, 1.0], [1.0, 0.0]])
    expected = (
        sum(
            -float(torch.distributions.Normal(o, 0.5).log_prob(t)) for o, t in zip(outputs.flatten(), targets.flatten())
        )
        / 2
    )
    assert float(Gaussian(noise_std=0.5).mean_nll(outputs, targets)) == pytest.approx(expected, abs=1e-6)


def test_ibnn_default_steps_keep_the_sinusoid_checkpoints_fit() -> None:
    """The recipe's learning rates are set for class labels; under a Gaussian of σ ≈ 0.15 the NLL's gradients are
    ~1/σ² larger, and unscaled steps moved the sinusoid MLP's nodes so far that its test NLL rose from -0.57 to
    +0.83 (noise 0.57). Scaled by σ²/2 the default stays within 0.05 nats of the plain model (measured: -0.572
    against -0.569)."""
    from posthoc_apps.demo.data import sinusoid, train_mlp

    data = sinusoid()
    net = train_mlp(data.train, epochs=1000)
    x, y = data.test

    def test_nll(method: str) -> float:
        um = posthoc.wrap(net, method=method, likelihood="regression")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            um.fit(data.train_loader(), data.val_loader(), progress=False)
        return float(-um.predict(x, generator=torch.Generator().manual_seed(0)).log_prob(y).mean())

    assert test_nll("ibnn") <= test_nll("none") + 0.05
