"""``"sparse-vd"``: Molchanov et al.'s KL approximation, pruning (principled, random, sparse storage),
``um.sparsity`` / ``um.prune`` on the UncertainModel, persistence, and bad options."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from scipy import integrate
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.methods.sparse_vd import log_alpha
from posthoc.methods.sparse_vd.log_alpha import kl_approximation


def _negative_kl_exact(log_a: float) -> float:
    """``-KL`` up to its constant (the prior is improper): ``0.5 log alpha - E log|e|``, ``e ~ N(1, alpha)``."""
    alpha = math.exp(log_a)
    sd = math.sqrt(alpha)

    def integrand(e: float) -> float:
        return math.log(abs(e)) * math.exp(-((e - 1) ** 2) / (2 * alpha)) / math.sqrt(2 * math.pi * alpha)

    low, high = 1 - 12 * sd, 1 + 12 * sd
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the log singularity at 0 is integrable
        expected_log = integrate.quad(integrand, low, high, points=[0.0] if low < 0 < high else None, limit=500)[0]
    return 0.5 * log_a - expected_log


def test_kl_approximation_has_the_published_constants_and_tracks_the_exact_kl():
    assert (log_alpha.K1, log_alpha.K2, log_alpha.K3) == (0.63576, 1.87320, 1.48695)
    grid = np.linspace(-8, 8, 33)
    approx = -kl_approximation(torch.tensor(grid, dtype=torch.float64)).numpy()
    offsets = np.array([_negative_kl_exact(a) for a in grid]) - approx
    # the approximation is the exact -KL up to one constant, to about 0.01 nats (the paper's claim)
    assert np.ptp(offsets) < 0.02
    # and goes to 0 for a weight that is pure noise (alpha -> inf), to 0.5 / alpha for large alpha
    assert float(kl_approximation(torch.tensor(10.0))) == pytest.approx(0.5 * math.exp(-10.0), abs=1e-4)
    assert (kl_approximation(torch.linspace(-10, 10, 50)).diff() < 0).all()


@pytest.fixture()
def toy():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(256, 4)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return model, DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True), x


@pytest.fixture()
def fitted(toy):
    model, loader, x = toy
    torch.manual_seed(0)
    um = posthoc.wrap(model, method="sparse-vd").fit(loader, progress=False, epochs=15, lr_scale=0.1)
    return um, model, x


def test_prune_zeroes_exactly_the_weights_over_the_threshold(fitted):
    um, model, x = fitted
    layers = um.method.layers
    assert 0.2 < um.sparsity()["total"] < 1.0, "the toy fit must prune some weights, not all"
    for threshold in (3.0, 0.0):
        pruned = um.prune(threshold=threshold)
        assert type(pruned) is type(model) and pruned is not model
        replaced = {}
        for name in layers.names:
            posterior, weight = layers[name], pruned.get_submodule(name).weight
            over = posterior.log_alpha() > threshold
            assert torch.equal(weight == 0, over | (posterior.theta == 0))
            assert torch.equal(weight[~over], posterior.theta.detach()[~over])
            replaced[f"{name}.weight"] = posterior.theta.detach().masked_fill(over, 0.0)
            replaced[f"{name}.bias"] = posterior.bias.detach()
        # the pruned model computes the variational mean with those weights at zero
        expected = torch.func.functional_call(model, replaced, (x,))
        assert torch.allclose(pruned(x), expected, atol=1e-6)
        card = um.sparsity(threshold=threshold)
        assert card["removed"] == sum(int((layers[n].log_alpha() > threshold).sum()) for n in layers.names)
        assert card["layers"]["0"] == pytest.approx(float((layers["0"].log_alpha() > threshold).float().mean()))


def test_random_pruning_removes_as_many_weights_per_layer_elsewhere(fitted):
    um, _, x = fitted
    principled, random = um.prune(), um.prune(random=True, seed=1)
    for name in um.method.layers.names:
        kept, shuffled = principled.get_submodule(name).weight, random.get_submodule(name).weight
        assert int((kept == 0).sum()) == int((shuffled == 0).sum())
    assert not torch.equal(principled[0].weight == 0, random[0].weight == 0)
    assert torch.equal(um.prune(random=True, seed=1)[0].weight, random[0].weight)
    assert not torch.equal(um.prune(random=True, seed=2)[0].weight, random[0].weight)


def test_sparse_storage_gives_the_same_outputs(fitted):
    um, _, x = fitted
    dense, sparse = um.prune(), um.prune(sparse=True)
    assert sparse[0].weight.layout == torch.sparse_csr
    assert torch.allclose(sparse(x), dense(x), atol=1e-5)


def test_pruned_posterior_and_save_load(fitted, tmp_path):
    um, model, x = fitted
    generator = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    full = um.predict(x[:8], generator=generator())
    with um.method.pruned():
        restricted = um.predict(x[:8], generator=generator())
        theta, variance, _, _ = um.method.layers["0"].moments()
        removed = um.method.layers["0"].log_alpha() > 3.0
        assert (theta[removed] == 0).all() and (variance[removed] == 0).all()
    assert um.method.layers["0"].removed is None
    assert not torch.equal(full.probs, restricted.probs)
    um.save(tmp_path / "svd.pt")
    loaded = posthoc.load(tmp_path / "svd.pt", model)
    assert loaded.sparsity() == um.sparsity()
    assert torch.equal(loaded.predict(x[:8], generator=generator()).probs, full.probs)
    assert loaded.summary()["posterior"][0]["sparsity"] == um.sparsity()["total"]


def test_tools_reach_through_a_stacked_calibrator_and_unknown_names_still_fail(toy):
    model, loader, _ = toy
    um = posthoc.wrap(model, method=["sparse-vd", "temperature"])
    for tool in ("sparsity", "prune"):  # before fit they would report the initial log alpha as if fitted
        with pytest.raises(
            posthoc.NotFittedError, match=rf"um\.{tool}\(\) reads the fitted posterior of 'sparse-vd'.*um\.fit"
        ):
            getattr(um, tool)()
    with pytest.raises(posthoc.NotFittedError, match="not fitted yet"):
        um.method.inner.sparsity()
    um.fit(loader, loader, progress=False, epochs=1)
    assert um.sparsity()["weights"] == 4 * 32 + 32 * 16 + 16 * 3
    with pytest.raises(AttributeError):
        um.not_a_tool  # noqa: B018
    with pytest.raises(AttributeError):
        posthoc.wrap(model, method="vi").prune  # noqa: B018


@pytest.mark.parametrize("threshold", [math.inf, math.nan, "3", True])
def test_threshold_must_be_finite(toy, threshold):
    model, _, _ = toy
    with pytest.raises(posthoc.ConfigError, match="threshold must be a finite number"):
        posthoc.wrap(model, method="sparse-vd", threshold=threshold)
    um = posthoc.wrap(model, method="sparse-vd")
    um.method.fitted.fill_(True)  # the threshold is checked whatever the fit
    with pytest.raises(posthoc.ConfigError, match="threshold must be a finite number"):
        um.sparsity(threshold=threshold)
    with pytest.raises(posthoc.ConfigError, match="threshold must be a finite number"):
        um.prune(threshold=threshold)


def test_bad_options(toy):
    model, loader, _ = toy
    with pytest.raises(posthoc.ConfigError, match="init_log_alpha must be a finite number"):
        posthoc.wrap(model, method="sparse-vd", init_log_alpha=math.nan)
    with pytest.raises(posthoc.ConfigError, match="kl_weight must be a finite number >= 0"):
        posthoc.wrap(model, method="sparse-vd").fit(loader, progress=False, kl_weight=-0.5)
    um = posthoc.wrap(model, method="sparse-vd")
    um.method.fitted.fill_(True)  # the options are checked whatever the fit
    with pytest.raises(posthoc.ConfigError, match="seed must be an integer"):
        um.prune(random=True, seed=1.5)
