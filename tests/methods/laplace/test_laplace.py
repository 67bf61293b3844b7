"""Laplace: the maths of the last-layer GGN, the marginal likelihood, the logit-space predictive, and behaviour."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.errors import ConfigError, HeadNotFoundError, InputError
from posthoc.methods.laplace import subset_glm
from posthoc.methods.laplace.curvature import LastLayerGGN, augment
from posthoc.methods.laplace.marglik import log_marginal_likelihood, optimize_prior_precision

D, C = 5, 3


def tiny_model(bias: bool = True, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, D), nn.Tanh(), nn.Linear(D, C, bias=bias)).double().eval()


def tiny_data(n: int = 40, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=generator, dtype=torch.float64), torch.randint(0, C, (n,), generator=generator)


def curvature(structure: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    phi = model[:2](x)
    head = model[2]
    ggn = LastLayerGGN(structure, D, C, head.bias is not None)
    for rows in (slice(0, len(x) // 2), slice(len(x) // 2, None)):  # two batches: accumulation is exact
        ggn.update(phi[rows], model(x[rows]), y[rows])
    return ggn.finalize(), phi, ggn.loss


def brute_force_hessian(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.func Hessian of the summed NLL in the head parameters, class-major over [phi, 1]."""
    phi, head = model[:2](x).detach(), model[2]
    bias = head.bias is not None
    theta = torch.cat([head.weight, head.bias[:, None]], 1) if bias else head.weight

    def nll(flat: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(augment(phi, bias) @ flat.reshape(C, -1).T, y, reduction="sum")

    flat = theta.detach().reshape(-1)
    return torch.func.hessian(nll)(flat), nll(flat)


# ------------------------------------------------------------------------------- curvature
def test_full_ggn_equals_brute_force_hessian_of_the_nll() -> None:
    model, (x, y) = tiny_model(), tiny_data()
    curv, _, fitted_loss = curvature("full", model, x, y)
    hessian, loss = brute_force_hessian(model, x, y)
    torch.testing.assert_close(curv.dense(), hessian, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(fitted_loss, loss.detach())


def test_diag_ggn_is_the_hessian_diagonal() -> None:
    model, (x, y) = tiny_model(), tiny_data()
    curv, _, _ = curvature("diag", model, x, y)
    hessian, _ = brute_force_hessian(model, x, y)
    torch.testing.assert_close(curv.diagonal.reshape(-1), hessian.diagonal(), rtol=1e-9, atol=1e-12)


def test_kfac_equals_exact_ggn_for_one_example_without_bias() -> None:
    model, (x, y) = tiny_model(bias=False), tiny_data(n=1)
    ggn = LastLayerGGN("kron", D, C, bias=False)
    ggn.update(model[:2](x), model(x), y)
    hessian, _ = brute_force_hessian(model, x, y)
    torch.testing.assert_close(ggn.finalize().dense(), hessian, rtol=1e-8, atol=1e-10)


def test_kfac_blocks_equal_exact_ggn_blocks_for_one_example_with_bias() -> None:
    """With a bias KFAC keeps weight and bias as two Kronecker blocks (laplace-torch's layout): both are exact."""
    model, (x, y) = tiny_model(), tiny_data(n=1)
    ggn = LastLayerGGN("kron", D, C, bias=True)
    ggn.update(model[:2](x), model(x), y)
    kfac = ggn.finalize().dense().reshape(C, D + 1, C, D + 1)
    exact = brute_force_hessian(model, x, y)[0].reshape(C, D + 1, C, D + 1)
    torch.testing.assert_close(kfac[:, :D, :, :D], exact[:, :D, :, :D], rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(kfac[:, D, :, D], exact[:, D, :, D], rtol=1e-8, atol=1e-10)
    assert kfac[:, :D, :, D].abs().max() == 0  # the weight-bias coupling is dropped, not approximated


def test_kfac_factors_are_sum_of_output_hessians_and_mean_input_covariance() -> None:
    model, (x, y) = tiny_model(bias=False), tiny_data()
    curv, phi, _ = curvature("kron", model, x, y)
    probs = torch.softmax(model(x), -1)
    expected = torch.kron(torch.diag(probs.sum(0)) - probs.T @ probs, phi.T @ phi / len(x))
    torch.testing.assert_close(curv.dense(), expected.detach(), rtol=1e-9, atol=1e-10)


# ------------------------------------------------------------------------------ marglik
@pytest.mark.parametrize("structure", ["kron", "full", "diag"])
def test_marglik_prior_is_the_maximiser_and_log_det_matches_dense(structure: str) -> None:
    model, (x, y) = tiny_model(), tiny_data()
    curv, _, loss = curvature(structure, model, x, y)
    head = model[2]
    norm = float(head.weight.detach().square().sum() + head.bias.detach().square().sum())
    delta = optimize_prior_precision(curv.spectrum(), loss, norm)
    best = log_marginal_likelihood(curv.spectrum(), loss, norm, delta)
    for factor in (0.9, 0.99, 1.01, 1.1):
        assert log_marginal_likelihood(curv.spectrum(), loss, norm, delta * factor) < best
    dense = curv.dense() + delta * torch.eye(C * (D + 1), dtype=torch.float64)
    expected = -loss - 0.5 * (torch.logdet(dense) - C * (D + 1) * math.log(delta) + delta * norm)
    torch.testing.assert_close(best, expected.detach())


# ----------------------------------------------------------------------- logit predictive
@pytest.mark.parametrize("structure", ["kron", "full", "diag"])
def test_logit_covariance_equals_jacobian_sandwich(structure: str) -> None:
    """J Σ Jᵀ with the explicit Jacobian I ⊗ phĩᵀ and Σ = (GGN + δI)⁻¹, against the Jacobian-free formulas."""
    model, (x, y) = tiny_model(), tiny_data()
    um = posthoc.wrap(model, method="laplace", hessian=structure, prior_precision=0.7)
    um.fit(DataLoader(TensorDataset(x, y), batch_size=16), progress=False)
    curv, phi, _ = curvature(structure, model, x, y)
    sigma = torch.linalg.inv(curv.dense() + 0.7 * torch.eye(C * (D + 1), dtype=torch.float64))
    phi_aug = augment(phi[:6].detach(), True)
    jacobian = torch.kron(torch.eye(C, dtype=torch.float64), phi_aug[:, None, :])  # (N, C, P)
    expected = jacobian @ sigma @ jacobian.transpose(1, 2)
    gaussian = um.method.logit_gaussian(phi_aug, model(x[:6]).detach())
    torch.testing.assert_close(gaussian.covariance(), expected, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(gaussian.variance(), expected.diagonal(dim1=1, dim2=2), rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(gaussian.row_sums(), expected.sum(-1), rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("structure", ["kron", "full", "diag"])
def test_logit_samples_have_the_analytic_covariance(structure: str) -> None:
    model, (x, y) = tiny_model(), tiny_data()
    um = posthoc.wrap(model, method="laplace", hessian=structure, prior_precision=0.5)
    um.fit(DataLoader(TensorDataset(x, y), batch_size=16), progress=False)
    phi_aug = augment(model[:2](x[:4]).detach(), True)
    gaussian = um.method.logit_gaussian(phi_aug, model(x[:4]).detach())
    draws = gaussian.sample(40_000, torch.Generator().manual_seed(0))
    centred = draws - draws.mean(0)
    empirical = torch.einsum("snc,snk->nck", centred, centred) / (draws.shape[0] - 1)
    true = gaussian.covariance()
    var = true.diagonal(dim1=1, dim2=2)
    stderr = ((var[:, :, None] * var[:, None, :] + true.square()) / draws.shape[0]).sqrt()
    assert ((empirical - true).abs() / stderr).max() < 5  # ~5 standard errors at most
    assert ((empirical - 1.15 * true).abs() / stderr).max() > 5  # a 15% wrong covariance is caught
    assert ((draws.mean(0) - gaussian.mean).abs() / var.sqrt() * math.sqrt(draws.shape[0])).max() < 5


@pytest.fixture(scope="module")
def fitted(digits) -> dict[str, posthoc.UncertainModel]:
    """The bundled CNN with a (wide, marglik) Laplace posterior of each structure, fitted once for this module."""
    from posthoc_apps.demo import data, zoo

    model = zoo.pretrained()
    loader = data.loader(digits.fit, batch_size=256)
    return {
        structure: posthoc.wrap(model, method="laplace", hessian=structure, prior_precision="marglik").fit(
            loader, progress=False
        )
        for structure in ("kron", "full", "diag")
    }


@pytest.fixture(scope="module")
def small_loader(digits) -> DataLoader:
    x, y = digits.fit.tensors
    return DataLoader(TensorDataset(x[:512], y[:512]), batch_size=128)


def test_probit_and_bridge_are_normalised_and_mc_has_samples(fitted, digits, monkeypatch) -> None:
    x = digits.test.tensors[0][:64]
    method = fitted["kron"].method
    for link in ("probit", "bridge"):
        monkeypatch.setattr(method, "link", link)
        pred = fitted["kron"].predict(x)
        assert pred.samples is None
        torch.testing.assert_close(pred.probs.sum(-1), torch.ones(64))
    monkeypatch.setattr(method, "link", "mc")
    pred = fitted["kron"].predict(x, num_samples=30, generator=torch.Generator().manual_seed(0))
    assert pred.samples.shape == (30, 64, 8)
    assert (pred.epistemic > 0).all()
    torch.testing.assert_close(pred.probs, pred.samples.mean(0))


def test_probit_moves_towards_uniform_and_keeps_the_map_label(fitted, digits) -> None:
    x = digits.test.tensors[0][:200]
    um = fitted["kron"]
    map_probs = torch.softmax(um.method.model(x), -1).detach()
    probs = um.predict(x).probs
    assert torch.equal(probs.argmax(-1), map_probs.argmax(-1))
    assert (probs.max(-1).values <= map_probs.max(-1).values + 1e-6).all()


@pytest.mark.parametrize("structure, budget", [("kron", 1e-5), ("full", 1e-2), ("diag", 1e-6)])
def test_chunking_does_not_change_the_predictive(fitted, digits, structure: str, budget: float) -> None:
    x = digits.test.tensors[0][:100]
    um = fitted[structure]
    whole = um.predict(x).probs
    chunked = um.predict(x, max_memory=max(1, int(budget * 2**30)))  # chunks of a few rows
    torch.testing.assert_close(chunked.probs, whole)


def test_grid_prior_precision_uses_validation_data(digits_model, small_loader, loaders) -> None:
    um = posthoc.wrap(digits_model, method="laplace", prior_precision="grid")
    with pytest.raises(InputError, match="val_loader"):
        um.fit(small_loader, progress=False)
    um.fit(small_loader, loaders["calibration"], progress=False)
    grid = torch.logspace(-4, 4, 41, dtype=torch.float64)
    assert torch.isclose(grid, um.method.prior_precision).any()


# ------------------------------------------------------------------------------ behaviour
def test_user_model_is_not_mutated(digits_model, small_loader, digits) -> None:
    digits_model.train()
    before = {k: v.clone() for k, v in digits_model.state_dict().items()}
    um = posthoc.wrap(digits_model, method="laplace").fit(small_loader, progress=False)
    um.predict(digits.test.tensors[0][:8])
    assert all(torch.equal(before[k], v) for k, v in digits_model.state_dict().items())
    assert all(m.training for m in digits_model.modules())
    assert not any(m._forward_hooks for m in digits_model.modules())


@pytest.mark.parametrize("structure", ["kron", "full", "diag"])
def test_save_load_round_trip(tmp_path, fitted, digits, structure: str) -> None:
    x = digits.test.tensors[0][:32]
    um = fitted[structure]
    um.save(tmp_path / "posterior.pt")
    loaded = posthoc.load(tmp_path / "posterior.pt", um.method.model)
    torch.testing.assert_close(loaded.predict(x).probs, um.predict(x).probs)
    assert float(loaded.method.prior_precision) == float(um.method.prior_precision)


def test_composes_with_temperature(digits_model, small_loader, loaders, digits) -> None:
    um = posthoc.wrap(digits_model, method=["laplace", "temperature"], hessian="diag")
    um.fit(small_loader, loaders["calibration"], progress=False)
    assert um.predict(digits.test.tensors[0][:8]).probs.shape == (8, 8)


# ------------------------------------------------------------------------------ bad input
def test_regression_targets_are_refused() -> None:
    model, (x, _) = tiny_model(), tiny_data()
    um = posthoc.wrap(model, method="laplace")
    with pytest.raises(InputError, match="regression"):
        um.fit(DataLoader(TensorDataset(x, torch.randn(len(x), dtype=torch.float64)), batch_size=8), progress=False)
    with pytest.raises(InputError, match="regression"):
        um.fit(DataLoader(TensorDataset(x, torch.randn(len(x), 2)), batch_size=8), progress=False)


@pytest.mark.parametrize("structure", ["kron", "full", "diag"])
def test_too_few_examples_warn_and_stay_finite(structure: str) -> None:
    model, (x, y) = tiny_model(), tiny_data(n=2)
    um = posthoc.wrap(model, method="laplace", hessian=structure, link="mc")
    with pytest.warns(RuntimeWarning, match="singular"):
        um.fit(DataLoader(TensorDataset(x, y), batch_size=2), progress=False)
    pred = um.predict(tiny_data(n=10, seed=3)[0])
    assert torch.isfinite(pred.probs).all() and torch.isfinite(pred.samples).all()
    assert float(um.method.prior_precision) > 0


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), "evidence"])
def test_bad_prior_precision_is_refused(value) -> None:
    with pytest.raises(ConfigError, match="prior_precision"):
        posthoc.wrap(tiny_model(), method="laplace", prior_precision=value)


def test_bad_options_are_refused() -> None:
    for options in ({"hessian": "lowrank"}, {"link": "sigmoid"}, {"num_samples": 0}, {"max_memory": 0}):
        with pytest.raises(ConfigError):
            posthoc.wrap(tiny_model(), method="laplace", **options)


def test_conv_head_gets_a_clear_error() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 5, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    with pytest.raises(HeadNotFoundError, match="Linear"):
        posthoc.wrap(model, method="laplace", head="2")


def test_full_hessian_over_the_memory_budget_is_refused_before_allocating() -> None:
    model = nn.Sequential(nn.Linear(8, 2048), nn.ReLU(), nn.Linear(2048, 1000))
    with pytest.raises(ConfigError, match="kron"):
        posthoc.wrap(model, method="laplace", hessian="full")
    posthoc.wrap(model, method="laplace", hessian="kron")  # fine


def test_full_hessian_is_checked_against_the_wraps_memory_budget() -> None:
    model = nn.Sequential(nn.Linear(8, 60), nn.ReLU(), nn.Linear(60, 100))  # 6,100 parameters: 595 MB for 'full'
    with posthoc.settings.override(max_memory=2**29), pytest.raises(ConfigError, match="kron"):
        posthoc.wrap(model, method="laplace", hessian="full")
    with posthoc.settings.override(max_memory=2**29):
        posthoc.wrap(model, method="laplace", hessian="full", max_memory=2**30)  # the wrap's budget holds it


def test_predict_before_fit_is_refused(digits_model, digits) -> None:
    with pytest.raises(posthoc.NotFittedError):
        posthoc.wrap(digits_model, method="laplace").predict(digits.test.tensors[0][:2])


# ------------------------------------------------------------------- deeper subsets (BackPACK)
def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, C)).double().eval()


def brute_force_kfac_blocks(model: nn.Module, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example output-side GGN ``J_zᵀ H J_z`` (z: the layer's output) summed, and the mean input covariance."""
    inputs = model[:layer](x).detach()
    rest = model[layer + 1 :]
    outputs = model[layer](inputs).detach()
    g_sum = 0
    for z in outputs:
        jacobian = torch.func.jacrev(rest)(z)  # (C, out)
        p = torch.softmax(rest(z), -1).detach()
        g_sum = g_sum + jacobian.T @ (torch.diag(p) - torch.outer(p, p)) @ jacobian
    return g_sum, inputs.T @ inputs / len(x)


def kron_of(block) -> torch.Tensor:
    out = block.out_eigvecs @ torch.diag(block.out_eigvals) @ block.out_eigvecs.T
    if block.in_eigvals is None:
        return out
    return torch.kron(out, block.in_eigvecs @ torch.diag(block.in_eigvals) @ block.in_eigvecs.T)


def test_backpack_kflr_over_two_layers_equals_brute_force_blocks() -> None:
    from posthoc.methods.laplace.curvature import backpack_ggn

    model, (x, y) = mlp(), tiny_data(n=30)
    names = ["2.weight", "2.bias", "4.weight", "4.bias"]
    blocks, loss = backpack_ggn(model, names, "kron", [(x[:10], y[:10]), (x[10:], y[10:])])
    for layer, (weight, bias) in ((2, blocks[:2]), (4, blocks[2:])):
        g_sum, a_mean = brute_force_kfac_blocks(model, x, layer)
        torch.testing.assert_close(kron_of(weight), torch.kron(g_sum, a_mean), rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(kron_of(bias), g_sum, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(loss, nn.functional.cross_entropy(model(x), y, reduction="sum").detach())


def test_backpack_kflr_is_the_exact_ggn_block_for_one_example() -> None:
    from posthoc.methods.laplace.curvature import backpack_ggn

    model, (x, y) = mlp(), tiny_data(n=1)
    blocks, _ = backpack_ggn(model, ["2.weight"], "kron", [(x, y)])
    params = {"2.weight": model[2].weight.detach()}
    jacobian = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (x,))[0])(params)["2.weight"].reshape(
        C, -1
    )
    p = torch.softmax(model(x)[0], -1).detach()
    exact = jacobian.T @ (torch.diag(p) - torch.outer(p, p)) @ jacobian
    torch.testing.assert_close(kron_of(blocks[0]), exact, rtol=1e-8, atol=1e-10)


def test_weight_samples_have_the_posterior_covariance() -> None:
    from posthoc.methods.laplace.curvature import backpack_ggn

    model, (x, y) = mlp(), tiny_data(n=30)
    (block,), _ = backpack_ggn(model, ["4.weight"], "kron", [(x, y)])
    value = model[4].weight.detach()
    draws = block.sample(value, 0.5, 40_000, torch.Generator().manual_seed(0)).reshape(40_000, -1)
    true = torch.linalg.inv(kron_of(block) + 0.5 * torch.eye(value.numel(), dtype=torch.float64))
    centred = draws - value.reshape(1, -1)
    empirical = centred.T @ centred / draws.shape[0]
    stderr = ((true.diagonal()[:, None] * true.diagonal()[None] + true.square()) / draws.shape[0]).sqrt()
    assert ((empirical - true).abs() / stderr).max() < 5.5
    assert ((empirical - 1.15 * true).abs() / stderr).max() > 5.5


@pytest.mark.parametrize("hessian", ["kron", "diag"])
def test_subset_glm_covariance_is_the_jacobian_sandwich(hessian: str) -> None:
    """Two Linear layers: the logit covariance equals J Σ Jᵀ with dense J (torch.func) and dense Σ."""
    from posthoc.methods.laplace.curvature import backpack_ggn
    from posthoc.methods.laplace.subset_glm import covered_linear_layers, logit_gaussian

    model, (x, y) = mlp(), tiny_data(n=30)
    names = ["2.weight", "2.bias", "4.weight", "4.bias"]
    blocks, _ = backpack_ggn(model, names, hessian, [(x, y)])
    delta, test_x = 0.7, x[:6]
    got = logit_gaussian(model, covered_linear_layers(model, names), blocks, test_x, delta).covariance()
    params = {n: p.detach() for n, p in model.named_parameters()}
    jacobians = torch.func.jacrev(lambda sub: torch.func.functional_call(model, {**params, **sub}, (test_x,)))(
        {n: params[n] for n in names}
    )
    jacobian = torch.cat([jacobians[n].reshape(6, C, -1) for n in names], -1)  # (n, C, P)
    curvature = torch.block_diag(
        *[torch.diag(b.diagonal.reshape(-1)) if hessian == "diag" else kron_of(b) for b in blocks]
    )
    sigma = torch.linalg.inv(curvature + delta * torch.eye(curvature.shape[0], dtype=torch.float64))
    torch.testing.assert_close(got, jacobian @ sigma @ jacobian.transpose(1, 2), rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("hessian", ["kron", "diag"])
def test_subset_glm_over_the_head_equals_the_last_layer_laplace(
    digits_model, small_loader, digits, hessian: str
) -> None:
    x = digits.test.tensors[0][:50]
    options = dict(method="laplace", hessian=hessian, prior_precision=2.0)
    last = posthoc.wrap(digits_model, **options).fit(small_loader, progress=False).predict(x).probs
    subset = posthoc.wrap(digits_model, subset=["classifier.4"], **options).fit(small_loader, progress=False)
    assert subset.method.pred == "glm"
    torch.testing.assert_close(subset.predict(x).probs, last, atol=1e-5, rtol=0)


def test_subset_glm_chunks_under_a_small_memory_budget_without_changing_the_predictive(
    digits_model, small_loader, digits
) -> None:
    x = digits.test.tensors[0][:40]
    um = posthoc.wrap(digits_model, method="laplace", subset=["classifier.1", "classifier.4"]).fit(
        small_loader, progress=False
    )
    calls = []
    original = posthoc.methods.laplace.subset_glm.logit_gaussian
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            posthoc.methods.laplace.subset_glm,
            "logit_gaussian",
            lambda *args: calls.append(args[3].shape[0]) or original(*args),
        )
        small = um.predict(x, max_memory=200_000).probs
    assert max(calls) < 8 and sum(calls) == 40, calls
    torch.testing.assert_close(small, um.predict(x).probs, atol=1e-6, rtol=0)


def test_subset_glm_keeps_the_checkpoint_accurate_where_weight_samples_do_not(
    digits_model, small_loader, digits
) -> None:
    x, y = digits.test.tensors[0][:200], digits.test.tensors[1][:200]
    accuracy = {}
    for pred in ("glm", "nn"):
        um = posthoc.wrap(
            digits_model,
            method="laplace",
            subset=["classifier.1", "classifier.4"],
            pred=pred,
            num_samples=20,
            prior_precision="marglik",
        )
        pred_labels = um.fit(small_loader, progress=False).predict(x, generator=torch.Generator().manual_seed(0)).label
        accuracy[pred] = (pred_labels == y).float().mean().item()
    map_accuracy = (digits_model(x).argmax(-1) == y).float().mean().item()
    assert accuracy["glm"] >= map_accuracy - 0.01, accuracy
    assert accuracy["nn"] < map_accuracy - 0.3, accuracy  # marglik's prior spread through the weights


@pytest.mark.parametrize("hessian", ["kron", "kron-mc", "diag"])
def test_subset_laplace_fits_predicts_and_round_trips(tmp_path, hessian: str) -> None:
    model, (x, y) = mlp(), tiny_data(n=60)
    model.train()
    flags = [p.requires_grad for p in model.parameters()]
    um = posthoc.wrap(model, method="laplace", subset=["2", "4"], hessian=hessian, pred="nn", num_samples=16)
    um.fit(DataLoader(TensorDataset(x, y), batch_size=20), progress=False)
    assert um.method.pred == "nn" and float(um.method.prior_precision) > 0
    pred = um.predict(x[:7], generator=torch.Generator().manual_seed(0))
    assert pred.samples.shape == (16, 7, C) and torch.isfinite(pred.probs).all()
    assert [p.requires_grad for p in model.parameters()] == flags and all(m.training for m in model.modules())
    assert not any(m._forward_hooks or m._backward_hooks for m in model.modules())
    um.save(tmp_path / "subset.pt")
    loaded = posthoc.load(tmp_path / "subset.pt", model)
    again = loaded.predict(x[:7], generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(again.probs, pred.probs)


def test_subset_errors_are_clear(digits_model) -> None:
    with pytest.raises(ConfigError, match="BatchNorm2d"):
        posthoc.wrap(digits_model, method="laplace", subset="all")
    with pytest.raises(ConfigError, match="ReLU"):
        posthoc.wrap(digits_model, method="laplace", subset=["classifier.2"])
    with pytest.raises(ConfigError, match="does not have"):
        posthoc.wrap(digits_model, method="laplace", subset=["nope"])
    with pytest.raises(ConfigError, match="kron"):
        posthoc.wrap(digits_model, method="laplace", subset=["classifier.4"], hessian="full")
    with pytest.raises(ConfigError, match="pred='nn'"):
        posthoc.wrap(digits_model, method="laplace", subset=["features.0", "classifier.4"], pred="glm")
    assert posthoc.wrap(digits_model, method="laplace", subset=["features.4", "classifier.4"]).method.pred == "nn"


def test_subset_glm_over_linear_layers_applied_over_positions_is_the_exact_linearisation() -> None:
    """A Linear applied at several positions (tokens) has the Jacobian sum_t g_t a_t^T: the GLM covariance
    equals J (diag GGN + delta)^-1 J^T with J and the GGN diagonal by brute force (torch.func)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Unflatten(1, (2, 2)), nn.Linear(2, 3), nn.Flatten(), nn.Linear(6, 3)).double().eval()
    x, y = torch.randn(20, 4, dtype=torch.float64), torch.randint(0, 3, (20,))
    um = posthoc.wrap(model, method="laplace", subset=["1", "3"], hessian="diag", prior_precision=1.0).fit(
        [(x, y)], progress=False
    )
    params = dict(model.named_parameters())
    names = ["1.weight", "1.bias", "3.weight", "3.bias"]
    jacobian = torch.func.vmap(
        lambda row: torch.cat(
            [
                j.flatten(1)
                for j in torch.func.jacrev(
                    lambda values: torch.func.functional_call(model, {**params, **values}, (row[None],))[0]
                )({n: params[n].detach() for n in names}).values()
            ],
            1,
        )
    )(x)  # (n, C, P)
    probs = torch.softmax(model(x), -1).detach()
    hessian = torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]
    ggn = torch.einsum("ncp,ncd,ndp->p", jacobian, hessian, jacobian)
    expected = torch.einsum("ncp,p,ndp->ncd", jacobian[:3], 1 / (ggn + 1.0), jacobian[:3])
    gaussian = subset_glm.logit_gaussian(model, um.method.glm_layers, list(um.method.blocks), x[:3], 1.0)
    torch.testing.assert_close(gaussian.covariance().double(), expected)
    model.float()
    nn_um = posthoc.wrap(model, method="laplace", subset=["1", "3"], hessian="diag", pred="nn", num_samples=4)
    assert torch.isfinite(nn_um.fit([(x.float(), y)], progress=False).predict(x[:3].float()).probs).all()


# ------------------------------------------------------------------- prior precision on held-out NLL
def test_the_prior_ladder_runs_from_nearly_the_checkpoint_to_the_grids_widest() -> None:
    from posthoc.methods.laplace.prior_search import default_grid, ladder

    found = ladder()
    assert found[:5] == [1e8, 1e7, 1e6, 1e5, 1e4] and found[-1] == pytest.approx(1e-4)
    assert found[4:] == pytest.approx(default_grid().flip(0).tolist()) and found == sorted(found, reverse=True)


def test_val_prior_is_the_widest_posterior_confidently_within_the_tolerance(
    digits_model, small_loader, loaders, digits
) -> None:
    """With clean held-out data only (``shift=None``) the prior is the widest of the ladder whose excess over the
    checkpoint, computed here independently with numpy, is within the default tolerance; the next wider one is not (the
    walk stops there). The bound: the per-example NLL increases with those below their 2.5 % quantile raised to it,
    their mean plus ``z_0.95`` standard errors times ``sqrt(2)`` (the excess on new data of the held-out size)."""
    um = posthoc.wrap(digits_model, method="laplace").fit(
        small_loader, loaders["calibration"], progress=False, shift=None
    )
    method = um.method
    assert method.summary()["prior_fit"] == "val"
    x, y = digits.calibration.tensors
    with torch.no_grad():
        map_nll = nn.functional.cross_entropy(digits_model(x).double(), y, reduction="none")
    z = statistics.NormalDist().inv_cdf(0.95)

    def excess(delta: float) -> float:
        method.prior_precision.fill_(delta)
        log_probs, _ = method.log_predictive(x)
        difference = (nn.functional.nll_loss(log_probs.double(), y, reduction="none") - map_nll).detach().numpy()
        capped = np.maximum(difference, np.quantile(difference, 0.025))
        return float(capped.mean() + z * capped.std(ddof=1) / math.sqrt(len(y)) * math.sqrt(2))

    chosen, allowed = float(method.prior_precision), max(0.02 * float(map_nll.mean()), 0.005)
    rows = um.summary()["selection"]["candidates"]
    index = [row["chosen"] for row in rows].index(True)
    assert rows[index]["value"] == pytest.approx(chosen, rel=1e-6)
    assert excess(chosen) <= allowed * (1 + 1e-6)
    assert excess(rows[index + 1]["value"]) > allowed  # the next wider one costs more: the widest one


def test_auto_prior_falls_back_to_the_training_data_and_val_needs_a_val_loader(digits_model, small_loader) -> None:
    um = posthoc.wrap(digits_model, method="laplace").fit(small_loader, progress=False)
    card = um.method.summary()
    assert card["prior_fit"] == "train" and card["fit_examples"] == 512
    for mode in ("val", "grid"):
        with pytest.raises(InputError, match="val_loader"):
            posthoc.wrap(digits_model, method="laplace", prior_precision=mode).fit(small_loader, progress=False)


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf"), True, "1%"])
def test_bad_val_tolerance_is_refused(value) -> None:
    with pytest.raises(ConfigError, match="val_tolerance"):
        posthoc.wrap(tiny_model(), method="laplace", val_tolerance=value)


def test_summary_names_the_posterior(digits_model, small_loader, loaders, tmp_path) -> None:
    um = posthoc.wrap(digits_model, method="laplace", prior_precision="marglik").fit(small_loader, progress=False)
    card = um.method.summary()
    assert card == {
        "random_variables": 8 * (64 + 1),
        "layers": ["classifier.4"],
        "hessian": "kron",
        "predictive": "glm",
        "link": "probit",
        "prior_precision": pytest.approx(float(um.method.prior_precision)),
        "prior_fit": "marglik",
        "fit_examples": 512,
    }
    um.save(tmp_path / "posterior.pt")
    assert posthoc.load(tmp_path / "posterior.pt", digits_model).method.summary() == card
    fixed = posthoc.wrap(digits_model, method="laplace", subset=["classifier.4"], hessian="diag", prior_precision=2.0)
    card = fixed.fit(small_loader, progress=False).method.summary()
    assert card["random_variables"] == 8 * 64 + 8 and card["predictive"] == "glm"
    assert card["layers"] == ["classifier.4"] and card["prior_fit"] == "fixed" and card["fit_examples"] == 512


@pytest.mark.parametrize("method", ["laplace", "dac"])
def test_a_model_that_is_its_own_head_is_a_logistic_regression(method: str) -> None:
    """A bare ``nn.Linear`` classifier: its head is the model itself, named ``""`` (was ``KeyError: '.weight'`` in
    last-layer Laplace; dac found no head call, its trace skipping the root). Laplace's GGN is then the logistic
    regression's Hessian: the full structure equals the brute-force Hessian of the summed NLL."""
    x, y = tiny_data(60)
    model = nn.Linear(4, C).double().eval()
    loader = DataLoader(TensorDataset(x, y), batch_size=20)
    um = posthoc.wrap(
        model, method=method, **({"hessian": "full", "prior_precision": 1.0} if method == "laplace" else {})
    )
    um.fit(loader, loader, progress=False)
    pred = um.predict(x)
    assert pred.probs.shape == (60, C) and torch.isfinite(pred.entropy).all()
    if method == "dac":
        return
    flat = torch.cat([model.weight, model.bias[:, None]], 1).detach().reshape(-1)  # class-major over [x, 1]

    def nll(theta: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(augment(x, True) @ theta.reshape(C, -1).T, y, reduction="sum")

    hessian = torch.func.hessian(nll)(flat)
    assert um.method.posterior_parameters() == ["weight", "bias"]
    torch.testing.assert_close(um.method.curvature.dense(), hessian, rtol=1e-8, atol=1e-8)
