"""SGLD: the Langevin update recovers a Gaussian posterior, the cyclical schedule's shape, the method's
samples, save/load, the user's model left alone, and clear errors for bad options."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import posthoc
from posthoc.engine.weight_samples import head_rows
from posthoc.errors import ConfigError
from posthoc.methods.sgld.langevin import Langevin, adds_noise, kept_steps, step_size


def _linear_gaussian(seed: int, n: int = 200, noise: float = 0.7) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=generator, dtype=torch.float64) * torch.tensor([1.0, 0.5], dtype=torch.float64)
    x[:, 1] += 0.6 * x[:, 0]  # correlated inputs: a posterior with off-diagonal covariance
    y = x @ torch.tensor([1.5, -2.0], dtype=torch.float64) + noise * torch.randn(
        n, generator=generator, dtype=torch.float64
    )
    return x, y


@pytest.mark.parametrize(("temperature", "seed"), [(1.0, 0), (0.5, 1), (1.0, 2)])
def test_sgld_recovers_the_posterior_of_bayesian_linear_regression(
    temperature: float, seed: int, one_thread: None
) -> None:
    """Bayesian linear regression, loss_i = (y_i - x_i theta)^2 / (2 sigma^2), prior N(0, 1/lambda):
    the posterior is N(A^-1 X^T y / sigma^2, A^-1) with A = X^T X / sigma^2 + lambda I, tempered by T.
    256 independent chains (each its own mini-batches of 50 of the 200 examples) per data set, lr 0.02,
    1,000 burn-in steps then every 20th of 1,500: the sample mean lies within 0.15 posterior sd of the
    exact one and every covariance entry within 12% of the largest variance (measured: at most 0.09 sd
    and 8% over 6 data sets; the step's O(lr) bias is ~3%)."""
    sigma, prior_precision, chains, batch, lr = 0.7, 2.0, 256, 50, 0.02
    x, y = _linear_gaussian(seed, noise=sigma)
    n = x.shape[0]
    precision = x.T @ x / sigma**2 + prior_precision * torch.eye(2, dtype=torch.float64)
    covariance = torch.linalg.inv(precision) * temperature
    mean = torch.linalg.solve(precision, x.T @ y / sigma**2)
    theta = mean.repeat(chains, 1)  # (chains, 2), started at the mode
    generator = torch.Generator().manual_seed(100 + seed)
    chain = Langevin([theta], size=n, prior_precision=prior_precision, temperature=temperature, generator=generator)
    kept = []
    for step in range(2500):
        rows = torch.randint(n, (chains, batch), generator=generator)
        xb, yb = x[rows], y[rows]  # (chains, batch, 2), (chains, batch)
        residual = torch.einsum("cbd,cd->cb", xb, theta) - yb
        theta.grad = torch.einsum("cbd,cb->cd", xb, residual) / (
            batch * sigma**2
        )  # the mean mini-batch loss's gradient
        chain.step(lr)
        if step >= 1000 and step % 20 == 0:
            kept.append(theta.clone())
    samples = torch.cat(kept)
    assert ((samples.mean(0) - mean).abs() / covariance.diagonal().sqrt()).max() < 0.15
    assert ((torch.cov(samples.T) - covariance).abs() / covariance.diagonal().max()).max() < 0.12


def test_sgld_without_noise_is_sgd_with_decay_towards_the_centre() -> None:
    theta = torch.tensor([1.0, 2.0])
    centre = torch.tensor([0.5, 0.5])
    chain = Langevin([theta], size=10, prior_precision=4.0, temperature=1.0, centre=[centre])
    theta.grad = torch.tensor([0.2, -0.2])
    chain.step(0.1, noise=False)
    torch.testing.assert_close(
        theta, torch.tensor([1.0, 2.0]) - 0.1 * (torch.tensor([0.2, -0.2]) + 0.4 * torch.tensor([0.5, 1.5]))
    )


def test_cyclical_schedule_shape() -> None:
    total, cycles, lr, exploration = 100, 4, 0.2, 0.8
    sizes = [step_size(k, total, lr, cycles=cycles) for k in range(total)]
    for cycle in range(cycles):
        part = sizes[cycle * 25 : (cycle + 1) * 25]
        assert part[0] == pytest.approx(lr)  # every cycle restarts at the full step
        assert all(a > b for a, b in zip(part, part[1:]))  # cosine decay within the cycle
        assert part[-1] < 0.01 * lr  # ends close to zero
        assert part[12] == pytest.approx(lr / 2 * (math.cos(math.pi * 12 / 25) + 1))
    kept = kept_steps(total, 8, cycles=cycles, burn_in=0.5, exploration=exploration)
    assert kept == [22, 24, 47, 49, 72, 74, 97, 99]  # two per cycle, ending each cycle, in its sampling phase
    assert all(adds_noise(k, total, cycles=cycles, exploration=exploration) for k in kept)
    assert not any(adds_noise(k, total, cycles=cycles, exploration=exploration) for k in range(20))
    assert all(sizes[k] < 0.1 * lr for k in kept)  # samples come from the low-step phase
    # plain SGLD: a constant step, noise throughout, samples after the burn-in only
    assert {step_size(k, total, lr, cycles=None) for k in range(total)} == {lr}
    assert kept_steps(total, 5, cycles=None, burn_in=0.5, exploration=exploration) == [59, 69, 79, 89, 99]


@pytest.mark.parametrize("layers", ["head", "all"])
def test_sgld_fit_predict_save_load(layers: str, digits_model: nn.Module, small: dict, tmp_path) -> None:
    before = {k: v.clone() for k, v in digits_model.state_dict().items()}
    # 4 steps per epoch: 2 cycles of 20 steps, each sampling in its last 4 (exploration 0.8), 2 samples per cycle
    um = posthoc.wrap(digits_model, method="sgld", layers=layers, cycles=2, num_samples=4).fit(
        small["fit"], progress=False, epochs=10
    )
    for key, value in digits_model.state_dict().items():
        assert torch.equal(value, before[key]), f"the user's model changed at {key}"
    prediction = um.predict(small["x"][:16])
    assert prediction.samples.shape == (4, 16, 8)
    assert torch.allclose(prediction.probs.sum(-1), torch.ones(16))
    assert prediction.epistemic.max() > 0  # the samples differ
    card = um.method.summary()
    assert card["kept"] == 4 and card["cycles"] == 2 and card["steps"] == 10 * len(small["fit"])
    expected_weights = sum(
        p.numel() for p in (digits_model.classifier[-1].parameters() if layers == "head" else digits_model.parameters())
    )
    assert card["random_variables"] == expected_weights
    um.save(tmp_path / "sgld.pt")
    loaded = posthoc.load(tmp_path / "sgld.pt", digits_model)
    again = loaded.predict(small["x"][:16])
    torch.testing.assert_close(again.samples, prediction.samples)
    assert loaded.method.summary() == card
    fewer = um.predict(small["x"][:16], num_samples=2)
    torch.testing.assert_close(fewer.samples, prediction.samples[[0, 3]])  # spread over the kept samples


def test_sgld_head_samples_move_around_the_checkpoint_and_are_reproducible(
    digits_model: nn.Module, small: dict
) -> None:
    first = posthoc.wrap(digits_model, method="sgld", num_samples=4, layers="head").fit(
        small["fit"], progress=False, epochs=2
    )
    second = posthoc.wrap(digits_model, method="sgld", num_samples=4, layers="head").fit(
        small["fit"], progress=False, epochs=2
    )
    torch.testing.assert_close(first.method.samples, second.method.samples)
    checkpoint = head_rows(digits_model.classifier[-1])
    moved = (first.method.samples - checkpoint).norm(dim=1) / checkpoint.norm()
    assert (moved > 0).all() and (moved < 0.5).all()
    cold = posthoc.wrap(digits_model, method="sgld", num_samples=4, layers="head", temperature=0.0).fit(
        small["fit"], progress=False, epochs=2
    )
    assert cold.method.samples.std(0).norm() < first.method.samples.std(0).norm()  # T = 0: SGD, no sampling noise


def test_sgld_keeps_the_all_weight_states_within_max_memory(digits_model: nn.Module, small: dict) -> None:
    row = 4 * (sum(p.numel() for p in digits_model.parameters()) + 2 * (16 + 32))
    with pytest.warns(RuntimeWarning, match="keeping 3"):
        um = posthoc.wrap(digits_model, method="sgld", layers="all", num_samples=10, max_memory=3 * row + 10)
        um.fit(small["fit"], progress=False, epochs=2)
    assert um.method.samples.shape == (3, row // 4)
    with pytest.raises(ConfigError, match="num_samples <= 3"):
        um.predict(small["x"][:4], num_samples=4)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cycles": 0}, "cycles must be a positive integer"),
        ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
        ({"prior": "flat"}, "prior must be one of"),
        ({"prior_precision": -2.0}, "prior_precision must be"),
        ({"layers": "body"}, "layers must be 'head'"),
        ({"num_samples": 0}, "num_samples must be a positive integer"),
    ],
)
def test_sgld_refuses_bad_options(options: dict, message: str, digits_model: nn.Module) -> None:
    with pytest.raises(ConfigError, match=message):
        posthoc.wrap(digits_model, method="sgld", **options)


@pytest.mark.parametrize(
    ("fit_options", "message"),
    [
        ({"lr": -0.1}, "lr must be a finite number > 0"),
        ({"epochs": 0}, "epochs must be a positive integer"),
        ({"burn_in": 1.0}, r"burn_in must be a fraction in \[0, 1\)"),
        ({"exploration": -0.1}, "exploration must be a fraction"),
    ],
)
def test_sgld_refuses_bad_fit_options(fit_options: dict, message: str, digits_model: nn.Module, small: dict) -> None:
    with pytest.raises(ConfigError, match=message):
        posthoc.wrap(digits_model, method="sgld").fit(small["fit"], progress=False, **fit_options)
