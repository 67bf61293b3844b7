"""Laplace over deeper layers (BackPACK) under likelihood="regression": the GGN of the squared error at noise σ.

The oracles: the dense GGN ``Σ_n J_nᵀ J_n`` of a tiny float64 MLP by ``torch.func`` (BackPACK's squared error
has the loss Hessian ``2 I``; a missed factor 2 would show as a factor 2 here), laplace-torch's ``"regression"``
Laplace over all weights with the diagonal GGN (same model, prior and noise), and for weight samples through the
network the closed form they must reproduce where the network is linear in the covered weights.
"""

from __future__ import annotations

import peft
import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.errors import ConfigError


def _tiny(outputs: int = 2) -> tuple[nn.Module, DataLoader, DataLoader, torch.Tensor]:
    """A float64 tanh MLP 2 → 5 → ``outputs``, 40 training rows, 60 held-out rows and 7 test inputs."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, outputs)).double().eval()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(100, 2, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        y = net(x) + 0.3 * torch.randn(100, outputs, generator=generator, dtype=torch.float64)
    test = torch.randn(7, 2, generator=generator, dtype=torch.float64)
    return (
        net,
        DataLoader(TensorDataset(x[:40], y[:40]), batch_size=16),
        DataLoader(TensorDataset(x[40:], y[40:]), batch_size=32),
        test,
    )


def _jacobian(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``(N, D, P)``: the outputs' Jacobian in every parameter, in ``named_parameters`` order."""
    params = {name: value.detach() for name, value in net.named_parameters()}
    found = jacrev(lambda p: functional_call(net, p, (x,)))(params)
    return torch.cat([found[name].reshape(x.shape[0], -1, value.numel()) for name, value in params.items()], -1)


def _ranges(net: nn.Module) -> dict[str, slice]:
    ranges, start = {}, 0
    for name, value in net.named_parameters():
        ranges[name] = slice(start, start + value.numel())
        start += value.numel()
    return ranges


@pytest.mark.parametrize("hessian, subset", [("diag", "all"), ("kron", ["2"])])
def test_subset_variance_equals_the_dense_ggn_posterior_by_hand(hessian: str, subset) -> None:
    """The GLM predictive variance equals ``J Σ Jᵀ + σ²`` with ``Σ`` the block-diagonal (one block per parameter)
    inverse of ``G / σ² + δ I``, ``G = Σ_n J_nᵀ J_n`` (the diagonal of it for ``"diag"``; KFAC is exact for the
    squared error of a last layer), at the fitted σ and δ: to 1e-10 relative (measured 2e-16)."""
    net, train, _, test = _tiny()
    um = posthoc.wrap(net, method="laplace", likelihood="regression", hessian=hessian, subset=subset).fit(
        train, progress=False
    )
    card = um.summary()["posterior"][0]
    sigma, delta = card["noise_std"], card["prior_precision"]
    assert card["noise_fit"] == "marglik" and card["prior_fit"] == "marglik"
    x = train.dataset.tensors[0]
    jacobian, ggn = _jacobian(net, test), torch.einsum("ndp,ndq->pq", _jacobian(net, x), _jacobian(net, x))
    names = um.method.posterior_parameters()
    covariance = torch.zeros_like(ggn)
    for name in names:
        part = _ranges(net)[name]
        block = ggn[part, part] / sigma**2
        if hessian == "diag":
            block = torch.diag(torch.diagonal(block))
        covariance[part, part] = torch.linalg.inv(block + delta * torch.eye(block.shape[0], dtype=torch.float64))
    expected = torch.einsum("ndp,pq,ndq->nd", jacobian, covariance, jacobian) + sigma**2
    predicted = um.predict(test).variance
    assert float((predicted - expected).abs().max() / expected.abs().max()) < 1e-10


def test_backpack_squared_error_curvature_is_halved_to_the_unit_noise_ggn() -> None:
    """BackPACK's ``MSELoss(reduction="sum")`` is ``Σ (f - y)²``, loss Hessian ``2 I``: the fitted diagonal must be
    ``diag Σ_n J_nᵀ J_n`` itself (to 1e-10), not twice it."""
    net, train, _, _ = _tiny()
    um = posthoc.wrap(net, method="laplace", likelihood="regression", hessian="diag", subset="all").fit(
        train, progress=False
    )
    x = train.dataset.tensors[0]
    jacobian = _jacobian(net, x)
    expected = jacobian.square().sum((0, 1))
    fitted = torch.cat([block.spectrum() for block in um.method.blocks])
    torch.testing.assert_close(fitted, expected, rtol=1e-10, atol=1e-12)
    # the fit sums float64 squared residuals batch by batch (16 rows) from forward passes of other shapes than this
    # one sum over 40 rows: the order of the additions and the matmuls' blocking (threads) move the last bits, and a
    # residual f - y cancels up to log10 |f| / |f - y| digits; 1e-9 is far above that and far below a missed factor 2
    assert float(um.method.train_loss) == pytest.approx(
        0.5 * float((net(x) - train.dataset.tensors[1]).square().sum()), rel=1e-9
    )


def test_subset_diag_equals_laplace_torch() -> None:
    """laplace-torch's ``Laplace(net, "regression", subset_of_weights="all", hessian_structure="diag")`` at σ = 0.7,
    δ = 2: the GLM predictive mean and variance (its ``f_var`` plus σ²) agree to 1e-10 relative, the log marginal
    likelihood to 1e-9 relative (measured: 2e-16 and equal)."""
    from laplace import Laplace as PeerLaplace

    net, train, _, test = _tiny()
    um = posthoc.wrap(
        net,
        method="laplace",
        likelihood=posthoc.Gaussian(noise_std=0.7),
        hessian="diag",
        subset="all",
        prior_precision=2.0,
    ).fit(train, progress=False)
    peer = PeerLaplace(
        net, "regression", subset_of_weights="all", hessian_structure="diag", sigma_noise=0.7, prior_precision=2.0
    )
    peer.fit(train)
    mean, variance = peer(test, pred_type="glm")
    pred = um.predict(test)
    expected = variance.diagonal(dim1=1, dim2=2) + 0.49
    torch.testing.assert_close(pred.mean, mean.detach(), rtol=1e-10, atol=1e-12)
    assert float((pred.variance - expected).abs().max() / expected.abs().max()) < 1e-10
    assert um.method.log_marginal_likelihood() == pytest.approx(float(peer.log_marginal_likelihood()), rel=1e-9)


def test_subset_noise_is_rechosen_on_held_out_data_and_survives_save_and_load(tmp_path) -> None:
    """With a ``val_loader`` σ is re-chosen on held-out NLL, which is then no worse there than the evidence's σ."""
    net, train, val, test = _tiny()
    evidence = posthoc.wrap(net, method="laplace", likelihood="regression", hessian="kron", subset="all").fit(
        train, progress=False
    )
    held_out = posthoc.wrap(net, method="laplace", likelihood="regression", hessian="kron", subset="all").fit(
        train, val, progress=False
    )
    assert held_out.summary()["posterior"][0]["noise_fit"] == "held-out"
    x, y = val.dataset.tensors
    nll = {
        name: -float(um.predict(x).log_prob(y).mean()) for name, um in (("evidence", evidence), ("held-out", held_out))
    }
    assert nll["held-out"] <= nll["evidence"] + 1e-9, nll
    held_out.save(tmp_path / "s.pt")
    loaded = posthoc.load(tmp_path / "s.pt", net, likelihood="regression")
    torch.testing.assert_close(loaded.predict(test).variance, held_out.predict(test).variance, rtol=0, atol=0)


def test_weight_samples_through_a_network_linear_in_them_reproduce_the_glm_variance() -> None:
    """``pred="nn"`` over the last layer only: the outputs are linear in the sampled weights, so the epistemic
    variance of 4000 draws (σ times a unit-noise draw at prior δσ²) matches the GLM one within 10% (Monte Carlo
    error about 2%); a draw missing the σ would miss by the factor σ² (here far from 1)."""
    net, train, _, test = _tiny()
    options = {
        "method": "laplace",
        "likelihood": posthoc.Gaussian(noise_std=3.0),
        "hessian": "kron",
        "subset": ["2"],
        "prior_precision": 0.5,
    }
    glm = posthoc.wrap(net, pred="glm", **options).fit(train, progress=False).predict(test)
    sampled = (
        posthoc.wrap(net, pred="nn", num_samples=4000, **options)
        .fit(train, progress=False)
        .predict(test, generator=torch.Generator().manual_seed(0))
    )
    ratio = sampled.epistemic / glm.epistemic
    assert float((ratio - 1).abs().max()) < 0.1, ratio
    torch.testing.assert_close(sampled.aleatoric, glm.aleatoric)


def test_what_subset_laplace_still_refuses_under_regression() -> None:
    net, _, _, _ = _tiny()
    lora = peft.get_peft_model(
        nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 2)), peft.LoraConfig(r=2, target_modules=["0"])
    )
    with pytest.raises(ConfigError, match="subset='lora' .* does not do likelihood='regression'"):
        posthoc.wrap(lora, method="laplace", likelihood="regression", subset="lora")


@pytest.mark.parametrize("prior", ["grid", "val"])
def test_held_out_prior_over_the_head_equals_the_last_layers(prior: str) -> None:
    """The diagonal GGN of the head's weight and bias blocks is the last layer's diagonal GGN, so the held-out
    choices must agree: the same δ (to 1e-6 relative), held-out σ and predictive variance (to 1e-5 relative;
    BackPACK's float64 sums against the closed form's). One output: with several, the last layer fits a noise per
    output and a layer subset one shared noise."""
    net, train, val, test = _tiny(outputs=1)
    options = {"method": "laplace", "likelihood": "regression", "hessian": "diag", "prior_precision": prior}
    subset = posthoc.wrap(net, subset=["2"], **options).fit(train, val, progress=False)
    last = posthoc.wrap(net, **options).fit(train, val, progress=False)
    cards = [um.summary()["posterior"][0] for um in (subset, last)]
    assert cards[0]["prior_fit"] == prior and cards[0]["noise_fit"] == "held-out"
    assert cards[0]["prior_precision"] == pytest.approx(cards[1]["prior_precision"], rel=1e-6)
    assert cards[0]["noise_std"] == pytest.approx(cards[1]["noise_std"], rel=1e-5)
    torch.testing.assert_close(subset.predict(test).variance, last.predict(test).variance, rtol=1e-5, atol=0)


def test_weight_samples_refuse_the_held_out_prior_under_regression() -> None:
    net, _, _, _ = _tiny()
    with pytest.raises(ConfigError, match="pred='nn' does not have under likelihood='regression'"):
        posthoc.wrap(net, method="laplace", likelihood="regression", subset="all", pred="nn", prior_precision="val")
