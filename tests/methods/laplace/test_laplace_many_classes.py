"""Heads with many classes: ``hessian="kron-diag"`` (KFAC with the output factor's exact diagonal) against the exact
KFAC statistics and the dense posterior, its grouped predictive against the exact one, the automatic switch above
``MANY_CLASSES``, the evidence over a sliced spectrum, saving, export and refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.methods.laplace import marglik
from posthoc.methods.laplace.curvature import augment
from posthoc.methods.laplace.kron import KronCurvature
from posthoc.methods.laplace.kron_diag import KronDiagCurvature
from posthoc.methods.laplace.structures import MANY_CLASSES

#: grouped vs exact variance: the largest relative error measured on these heads was 5.1 % (median 1.2 %)
GROUPED_MAX, GROUPED_MEDIAN = 0.08, 0.025


def _head(width: int, classes: int, rows: int, spectrum: str = "iso", seed: int = 0):
    """A linear head ``Sequential(Identity, Linear)``, its training loader and held-out features."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.ones(width) if spectrum == "iso" else torch.arange(1, width + 1.0) ** -0.5 * width**0.25
    teacher = torch.randn(classes, width, generator=generator) * 3 / width**0.5
    x = torch.randn(rows, width, generator=generator) * scale
    y = torch.distributions.Categorical(logits=x @ teacher.T).sample()
    head = nn.Linear(width, classes)
    with torch.no_grad():
        head.weight.copy_(teacher + 0.3 * torch.randn(classes, width, generator=generator) / width**0.5)
        head.bias.zero_()
    held_out = torch.randn(200, width, generator=generator) * scale
    return nn.Sequential(nn.Identity(), head).eval(), DataLoader(TensorDataset(x, y), batch_size=100), held_out


def test_kron_diag_holds_the_exact_diagonal_of_kfac_output_factor_and_the_same_input_factor() -> None:
    model, loader, _ = _head(16, 50, 400)
    kron = posthoc.wrap(model, method="laplace", hessian="kron", prior_precision=1.0).fit(loader, progress=False)
    diag = posthoc.wrap(model, method="laplace", hessian="kron-diag", prior_precision=1.0).fit(loader, progress=False)
    k, d = kron.method.curvature, diag.method.curvature
    assert isinstance(k, KronCurvature) and isinstance(d, KronDiagCurvature)
    out_factor = k.out_eigvecs @ torch.diag(k.out_eigvals) @ k.out_eigvecs.T
    torch.testing.assert_close(d.out_diagonal, out_factor.diagonal(), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(d.in_eigvals, k.in_eigvals, rtol=1e-9, atol=1e-9)
    # both are G ⊗ A in float64: the input factors agree to round-off
    in_k = k.in_eigvecs @ torch.diag(k.in_eigvals) @ k.in_eigvecs.T
    in_d = d.in_eigvecs @ torch.diag(d.in_eigvals) @ d.in_eigvecs.T
    torch.testing.assert_close(in_d, in_k, rtol=1e-9, atol=1e-9)


def test_exact_kron_diag_variance_is_the_dense_posterior_sandwich() -> None:
    model, loader, held_out = _head(6, 12, 300)
    um = posthoc.wrap(model, method="laplace", hessian="kron-diag", prior_precision=0.5).fit(loader, progress=False)
    block = um.method.curvature
    block.groups = None
    phi_aug = augment(held_out[:20].double(), True)
    dense = block.dense()
    sigma = torch.linalg.inv(dense + 0.5 * torch.eye(dense.shape[0], dtype=torch.float64))
    jacobian = torch.kron(torch.eye(12, dtype=torch.float64), phi_aug[:, None, :])
    expected = (jacobian @ sigma @ jacobian.transpose(1, 2)).diagonal(dim1=1, dim2=2)
    torch.testing.assert_close(block.head_variance(phi_aug, torch.zeros(20, 12), 0.5).variance(), expected)


@pytest.mark.parametrize("spectrum", ["iso", "power"])
@pytest.mark.parametrize("delta", [0.1, 1.0, 10.0])
def test_grouped_predictive_is_within_the_measured_error_of_the_exact_one(spectrum: str, delta: float) -> None:
    model, loader, held_out = _head(128, 300, 1500, spectrum)
    um = posthoc.wrap(model, method="laplace", hessian="kron-diag", prior_precision=delta).fit(loader, progress=False)
    block, phi_aug = um.method.curvature, augment(held_out, True)
    logits = model(held_out).detach()
    grouped = block.head_variance(phi_aug, logits, delta).variance()
    probs = um.predict(held_out).probs
    block.groups = None
    exact = block.head_variance(phi_aug, logits, delta).variance()
    relative = (grouped - exact).abs() / exact
    assert float(relative.max()) < GROUPED_MAX and float(relative.median()) < GROUPED_MEDIAN
    assert float((um.predict(held_out).probs - probs).abs().max()) < 0.01


def test_many_classes_switch_kron_to_kron_diag_and_fewer_keep_kron() -> None:
    small, small_loader, _ = _head(4, 10, 50)
    assert type(posthoc.wrap(small, method="laplace").method.curvature) is KronCurvature
    model, loader, held_out = _head(4, MANY_CLASSES + 1, 200)
    um = posthoc.wrap(model, method="laplace", prior_precision=1.0)
    assert um.method.hessian == "kron-diag"
    um.fit(loader, progress=False)
    assert isinstance(um.method.curvature, KronDiagCurvature)
    assert torch.allclose(um.predict(held_out[:5]).probs.sum(-1), torch.ones(5))


def test_evidence_over_a_sliced_spectrum_is_the_unsliced_one(monkeypatch: pytest.MonkeyPatch) -> None:
    model, loader, _ = _head(16, 200, 400)
    um = posthoc.wrap(model, method="laplace", hessian="kron-diag", prior_precision="marglik").fit(
        loader, progress=False
    )
    spectrum = um.method.spectrum()
    assert spectrum.numel() == 200 * 17
    whole = marglik.optimize_prior_precision(spectrum, um.method.train_loss, um.method.square_norm)
    assert whole == pytest.approx(float(um.method.prior_precision), rel=1e-12)
    monkeypatch.setattr(marglik, "SPECTRUM_CHUNK", 257)
    sliced = marglik.optimize_prior_precision(spectrum, um.method.train_loss, um.method.square_norm)
    assert sliced == pytest.approx(whole, rel=1e-9)


def test_mc_predictive_samples_the_same_gaussian_in_chunks() -> None:
    model, loader, held_out = _head(8, 60, 300)
    um = posthoc.wrap(model, method="laplace", hessian="kron-diag", prior_precision=1.0, link="mc").fit(
        loader, progress=False
    )
    x = held_out[:4]
    gaussian = um.method.logit_gaussian(augment(x, True), model(x).detach())
    samples = gaussian.sample(4000, torch.Generator().manual_seed(0))
    # the sample variance of 4,000 Gaussian draws is within 5 standard errors (sqrt(2 / 4000) relative)
    relative = (samples.var(0) / gaussian.variance() - 1).abs()
    assert float(relative.max()) < 5 * (2 / 4000) ** 0.5
    streamed = um.predict(x, num_samples=50, max_memory=60 * 4 * 50 * 3)  # a budget of about one row's samples
    assert streamed.probs.shape == (4, 60) and torch.allclose(streamed.probs.sum(-1), torch.ones(4))


def test_saved_kron_diag_posterior_loads_and_exports(tmp_path) -> None:
    model, loader, held_out = _head(8, 40, 200)
    um = posthoc.wrap(model, method="laplace", hessian="kron-diag", prior_precision="marglik").fit(
        loader, progress=False
    )
    path = tmp_path / "head.laplace.pt"
    um.save(path)
    loaded = posthoc.load(path, model)
    assert isinstance(loaded.method.curvature, KronDiagCurvature)
    torch.testing.assert_close(loaded.predict(held_out).probs, um.predict(held_out).probs)
    torch.testing.assert_close(um.to_module()(held_out), um.predict(held_out).probs, atol=1e-5, rtol=1e-5)


def test_kron_diag_refuses_what_it_is_not() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    with pytest.raises(posthoc.PosthocError, match="kron-diag"):
        posthoc.wrap(model, method="laplace", hessian="kron-diag", subset="all")
    with pytest.raises(posthoc.PosthocError, match="hessian"):
        posthoc.wrap(model, method="laplace", hessian="kron_diag")
    head, loader, _ = _head(4, 20, 40)
    um = posthoc.wrap(head, method="laplace", hessian="kron-diag")
    with pytest.raises(posthoc.PosthocError):  # labels outside the head's 20 classes
        um.fit([(torch.randn(8, 4), torch.full((8,), 25))], progress=False)
    with pytest.raises(posthoc.PosthocError):  # features of the wrong width
        um.fit([(torch.randn(8, 5), torch.zeros(8, dtype=torch.long))], progress=False)


def test_a_kron_diag_state_loads_into_a_kron_wrap() -> None:
    # a head found only at the first batch is "kron" until then; its saved "kron-diag" state still loads
    model, loader, held_out = _head(8, 30, 200)
    fitted = posthoc.wrap(model, method="laplace", hessian="kron-diag", prior_precision=1.0).fit(loader, progress=False)
    other = posthoc.wrap(model, method="laplace", hessian="kron", prior_precision=1.0)
    other.method.load_posterior_state(fitted.method.posterior_state())
    other.method.fitted.fill_(True)
    assert other.method.hessian == "kron-diag" and isinstance(other.method.curvature, KronDiagCurvature)
    torch.testing.assert_close(other.predict(held_out).probs, fitted.predict(held_out).probs)
