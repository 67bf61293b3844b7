"""Regression under the sampling methods that fine-tune from the checkpoint: SWAG, MultiSWAG, IVON and SGLD.

The data: ``y = sin(2x) + ε``, ``ε ~ N(0, 0.1²)``, ``x ~ U(-2, 2)``; 400 training, 400 held-out and 400 test
points, an MLP fitted to the training points. The oracle: the plain model (``method="none"``) with its noise
fitted on the same held-out data, and the known noise 0.1.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.core.likelihood import Categorical, Gaussian
from posthoc.core.prediction import RegressionPrediction
from posthoc.engine.held_out import HeldOut
from posthoc.engine.objective import training_loss
from posthoc.engine.selection import Tolerance
from posthoc_apps.demo.data import RegressionData, sinusoid, train_mlp

NOISE = 0.1
#: the test NLL a method may cost over the plain model, in nats per example (its scale is chosen on 400 held-out
#: points within 0.02 nats of the best; on the 400 test points that choice costs up to 0.037, SWAG over every weight)
NLL_MARGIN = 0.05
#: three standard errors of a noise std fitted on 400 points (``σ / sqrt(2n)``), and the fine-tune's drift
NOISE_TOLERANCE = 0.015


@functools.lru_cache(maxsize=1)
def _problem() -> tuple[nn.Module, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(0)

    def split(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.rand(n, 1, generator=generator) * 4 - 2
        return x, torch.sin(2 * x) + NOISE * torch.randn(n, 1, generator=generator)

    data = {"train": split(400), "val": split(400), "test": split(400)}
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    optimiser = torch.optim.Adam(net.parameters(), 1e-2)
    x, y = data["train"]
    for _ in range(500):
        optimiser.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        optimiser.step()
    return net.eval(), data


def _loader(pair: tuple[torch.Tensor, torch.Tensor], shuffle: bool = False) -> DataLoader:
    return DataLoader(TensorDataset(*pair), batch_size=50, shuffle=shuffle)


def _test_nll(um: posthoc.UncertainModel) -> float:
    x, y = _problem()[1]["test"]
    return float(um.likelihood.nll(um.predict(x), y).mean())


def _plain() -> posthoc.UncertainModel:
    net, data = _problem()
    return posthoc.wrap(net, method="none", likelihood="regression").fit(
        _loader(data["train"]), _loader(data["val"]), progress=False
    )


def _fitted(method: str, options: dict, fit_options: dict | None = None) -> posthoc.UncertainModel:
    net, data = _problem()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a scale choice that accepts nothing warns
        return posthoc.wrap(net, method=method, likelihood="regression", **options).fit(
            _loader(data["train"], shuffle=True), _loader(data["val"]), progress=False, **(fit_options or {})
        )


# ------------------------------------------------------------------------------ the shared objective
def test_the_training_loss_is_the_class_nll_or_the_gaussian_nll_per_example_at_the_noise() -> None:
    logits, labels = torch.randn(6, 3), torch.tensor([0, 2, 1, 0, 1, 2])
    assert torch.equal(training_loss(Categorical(), logits, labels), F.cross_entropy(logits, labels))
    single = torch.randn(6, 1)
    for shape in ((6, 1), (6,)):  # a binary classifier's one logit, (N, 1) or squeezed: the classes [0, z] (SWAG too)
        assert torch.equal(
            training_loss(Categorical(), single.reshape(shape), labels % 2),
            F.cross_entropy(torch.cat([torch.zeros_like(single), single], 1), labels % 2),
        )
    outputs, targets = torch.randn(6, 2), torch.randn(6, 2)
    expected = 0.5 * (outputs - targets).square().sum() / 0.25 / 6
    torch.testing.assert_close(training_loss(Gaussian(noise_std=0.5), outputs, targets), expected, rtol=1e-6, atol=0)


def test_a_gaussian_tolerance_is_in_nats_and_real_targets_take_a_shift_graded_by_rmse() -> None:
    assert Tolerance().nats(0.5) == pytest.approx(0.01) and Tolerance().nats(0.1) == pytest.approx(0.005)
    assert Tolerance().nats(-1.0) == pytest.approx(0.02)  # a Gaussian NLL may be negative: 2 % of its size
    x, y = _problem()[1]["val"]
    held = HeldOut.read([(x, y)], model=_problem()[0], likelihood=Gaussian(), shift="auto", device="cpu")
    assert held.description["graded_by"] == "rmse" and list(held.description["kinds"]) == ["feature-noise"]
    assert held.plain.shifted is not None and held.plain.shifted.shape == (3 * len(y),)  # three graded strengths
    assert held.plain.shifted_nll > held.plain.nll  # the copies are harder for the model
    assert HeldOut.read([(x, y)], model=_problem()[0], likelihood=Gaussian(), shift=None, device="cpu").shifted is None


def _check_mixture_near_the_plain_model(um: posthoc.UncertainModel, tmp_path, *, samples: int) -> dict:
    """What every method here must give: a mixture of ``samples`` components ``(N, 1)`` with a model spread, the
    known noise fitted on held-out data, a test NLL within :data:`NLL_MARGIN` of the plain model's, and a saved
    posterior that predicts the same. Returns the model card's entry of the method."""
    x = _problem()[1]["test"][0]
    pred = um.predict(x)
    assert isinstance(pred, RegressionPrediction) and pred.mean.shape == (400, 1)
    assert pred.samples.shape == (samples, 400, 1) and float(pred.epistemic.min()) > 0
    card = um.summary()["posterior"][0]
    assert card["noise_fit"] == "held-out" and abs(card["noise_std"] - NOISE) < NOISE_TOLERANCE, card
    assert _test_nll(um) <= _test_nll(_plain()) + NLL_MARGIN
    um.save(tmp_path / "posterior.pt")
    again = posthoc.load(tmp_path / "posterior.pt", _problem()[0], likelihood="regression").predict(x)
    torch.testing.assert_close(again.mean, pred.mean, rtol=0, atol=0)
    torch.testing.assert_close(again.variance, pred.variance, rtol=0, atol=0)
    return card


# ------------------------------------------------------------------------------ SWAG
@pytest.mark.parametrize("subset", ["last_layer", "all"])
def test_swag_predicts_a_mixture_near_the_plain_model_with_the_known_noise(subset: str, tmp_path) -> None:
    um = _fitted("swag", {"subset": subset})
    card = _check_mixture_near_the_plain_model(um, tmp_path, samples=20)
    assert card["scale"] > 0  # a scale was accepted: negative Gaussian NLLs take a tolerance relative to their size
    chosen = next(row for row in card["selection"]["candidates"] if row["chosen"])
    assert chosen["value"] == card["scale"] and chosen["bound"] <= card["selection"]["tolerance"]


def test_swag_scores_the_checkpoint_by_its_gaussian_held_out_nll() -> None:
    um = _fitted("swag", {"subset": "last_layer"})
    x, y = _problem()[1]["val"]
    plain = _plain()  # its noise is the maximum-likelihood one on these held-out points
    expected = float(plain.likelihood.nll(plain.predict(x), y).mean())
    assert float(um.method.scale_fit[1]) == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------------------------------------ IVON
@pytest.mark.parametrize("layers", ["head", "all"])
def test_ivon_predicts_a_mixture_near_the_plain_model_with_the_known_noise(layers: str, tmp_path) -> None:
    # lr 1e-4: at the default 1e-3 the 1,153 weights of this MLP drift in 16 steps (the fine-tuned mean alone costs
    # 0.045 nats of test NLL, and no scale is within tolerance)
    um = _fitted("ivon", {"layers": layers}, {"lr": 1e-4})
    card = _check_mixture_near_the_plain_model(um, tmp_path, samples=20)
    assert card["scale"] > 0  # IVON starts from hess_init / σ²: at hess_init its steps would be 1 / σ² = 100x larger


# ------------------------------------------------------------------------------ MultiSWAG
def test_multiswag_is_the_mixture_of_its_runs_samples_with_one_held_out_noise(tmp_path) -> None:
    um = _fitted("multiswag", {"members": 2, "subset": "last_layer"})
    card = _check_mixture_near_the_plain_model(um, tmp_path, samples=40)
    assert [run["noise_std"] for run in card["per_member"].values()] == [card["noise_std"]] * 2
    x = _problem()[1]["test"][0]
    pred, outputs = um.predict(x), torch.cat([run.sampled_outputs(x) for run in um.method.members])
    whole = um.likelihood.predictive(outputs)  # one mixture over both runs' samples
    torch.testing.assert_close(pred.mean, whole.mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pred.variance, whole.variance, rtol=1e-6, atol=1e-6)
    assert not torch.equal(outputs[:20], outputs[20:])  # the runs drifted apart


# ------------------------------------------------------------------------------ SGLD
@pytest.mark.parametrize("layers", ["head", "all"])
def test_sgld_predicts_a_mixture_of_its_kept_samples_with_the_known_noise(layers: str, tmp_path) -> None:
    um = _fitted("sgld", {"layers": layers}, {"epochs": 10})  # 80 steps: 40 after burn-in, 20 kept
    _check_mixture_near_the_plain_model(um, tmp_path, samples=20)
    net, data = _problem()
    with torch.no_grad():
        features = net[:-1](data["train"][0])
    unit = 1 / float((features.square().sum(-1) + 1).mean()) if layers == "head" else 1e-3  # the class labels' step
    plain_variance = _plain().summary()["posterior"][0]["noise_std"] ** 2  # the noise the chain's loss divides by
    assert um.summary()["posterior"][0]["lr"] == pytest.approx(unit * plain_variance / 2, rel=1e-5)


@functools.lru_cache(maxsize=1)
def _sinusoid_mlp() -> tuple[RegressionData, nn.Module]:
    """The demo's sinusoid and its MLP (1,000 full-batch Adam steps: a few seconds, made once)."""
    data = sinusoid()
    return data, train_mlp(data.train, epochs=1000)


@pytest.mark.parametrize("layers, wider", [("head", ("gap", "beyond")), ("all", ("gap",))])
def test_sgld_spreads_its_outputs_more_off_the_sinusoid_data_than_on_it(layers: str, wider: tuple[str, ...]) -> None:
    """The model variance, not the total (the noise dominates it): on the sinusoid of seed 004 (40 points in two
    clusters) SGLD's kept samples disagree more in the gap between the clusters than on the training inputs, for
    MLPs trained from seeds 0, 1 and 2 (head: 1.8x, 1.9x, 1.2x in the gap, 2.2x, 2.1x, 3.7x beyond the data; every
    weight: 2.7x, 1.5x, 1.5x in the gap, but 0.7x-1.5x beyond, not asserted). SWAG and IVON do not show it on every
    one of those seeds (0.3x-2.3x), so it is not asserted for them."""
    data, net = _sinusoid_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # too few steps for 20 samples is not what is tested here
        um = posthoc.wrap(net, method="sgld", layers=layers, likelihood="regression").fit(
            data.train_loader(8), data.val_loader(), progress=False, epochs=40
        )
    spread = {name: float(um.predict(x).epistemic.mean()) for name, x in data.regions.items()}
    assert all(spread[name] > 1.1 * spread["train"] for name in wider), spread


# ------------------------------------------------------------------------------ the noise without held-out data
FAST = [
    ("swag", {"subset": "last_layer"}),
    ("multiswag", {"members": 2, "subset": "last_layer"}),
    ("ivon", {"layers": "head"}),
    ("sgld", {"layers": "head"}),
]


@pytest.mark.parametrize("method, options", FAST)
def test_without_held_out_data_the_noise_is_fitted_on_the_training_data_and_a_fixed_noise_stays(
    method: str, options: dict
) -> None:
    net, data = _problem()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # SGLD keeps fewer than 20 samples of 16 steps
        fitted = posthoc.wrap(net, method=method, likelihood="regression", **options).fit(
            _loader(data["train"]), progress=False
        )
        fixed = posthoc.wrap(net, method=method, likelihood=Gaussian(noise_std=0.3), **options).fit(
            _loader(data["train"]), _loader(data["val"]), progress=False
        )
    card = fitted.summary()["posterior"][0]
    assert card["noise_fit"] == "training" and abs(card["noise_std"] - NOISE) < NOISE_TOLERANCE, card
    card = fixed.summary()["posterior"][0]
    assert card["noise_fit"] == "fixed" and card["noise_std"] == 0.3
    assert float(fixed.predict(data["test"][0]).aleatoric.mean()) == pytest.approx(0.09, rel=1e-5)


@pytest.mark.parametrize("method", ["swag", "multiswag", "ivon", "sgld"])
def test_a_heteroscedastic_model_is_refused_naming_the_methods_that_take_it(method: str) -> None:
    with pytest.raises(
        posthoc.ConfigError, match="does not do likelihood='heteroscedastic' yet; the methods that do: "
    ):
        posthoc.wrap(nn.Linear(1, 2), method=method, likelihood="heteroscedastic")
