"""IVON: the fine-tune and the samples agree with ivon-opt's own, the spread chosen on held-out data,
save/load without the package, the user's model left alone, and clear errors."""

from __future__ import annotations

import subprocess
import sys

import ivon
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.engine.head import FeatureSplit
from posthoc.errors import ConfigError
from posthoc.methods.ivon import optimiser
from posthoc.methods.ivon.scale import SCALES


@pytest.fixture()
def one_batch(small: dict) -> DataLoader:
    """256 digits in one batch: the fine-tune's data order is then the same for posthoc and a hand-written loop."""
    x, y = next(iter(small["fit"]))[0].repeat(2, 1, 1, 1), next(iter(small["fit"]))[1].repeat(2)
    return DataLoader(TensorDataset(x, y), batch_size=256)


def test_ivon_matches_ivon_opt_fine_tune_and_sampled_params(
    digits_model: nn.Module, one_batch: DataLoader, small: dict
) -> None:
    """Same seed, same data: posthoc's mean and std are IVON's weights and ``1 / sqrt(ess (h + wd))``, and the
    first predictive sample equals the logits under ``IVON.sampled_params`` drawn after ``torch.manual_seed``."""
    options = {"lr": 0.01, "hess_init": 5.0, "weight_decay": 1e-3, "beta2": 0.99, "epochs": 3}
    um = posthoc.wrap(digits_model, method="ivon", layers="head", scale=1.0, seed=7).fit(
        one_batch, progress=False, **options
    )
    split = FeatureSplit(digits_model)
    x, y = next(iter(one_batch))
    with torch.no_grad():
        phi, _ = split(x)
    head = digits_model.classifier[-1]
    weight, bias = head.weight.detach().clone().requires_grad_(True), head.bias.detach().clone().requires_grad_(True)
    torch.manual_seed(7)
    opt = ivon.IVON([weight, bias], lr=0.01, ess=256.0, hess_init=5.0, weight_decay=1e-3, beta2=0.99)
    for _ in range(3):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            F.cross_entropy(F.linear(phi, weight, bias), y).backward()
        opt.step()
    torch.testing.assert_close(um.method.mean, torch.cat([weight.detach().reshape(-1), bias.detach()]))
    hess = opt.param_groups[0]["hess"]
    torch.testing.assert_close(um.method.std, (256.0 * (hess + 1e-3)).rsqrt())
    assert not torch.allclose(hess, torch.full_like(hess, 5.0))  # the Hessian estimate moved from its start
    test = small["x"][:32]
    with torch.no_grad():
        test_phi, _ = split(test)
        torch.manual_seed(123)
        with opt.sampled_params():
            expected = torch.softmax(F.linear(test_phi, weight, bias), -1)
    ours = um.predict(test, num_samples=3, generator=torch.Generator().manual_seed(123)).samples[0]
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_ivon_all_weights_fit_predict_save_load(digits_model: nn.Module, small: dict, tmp_path) -> None:
    before = {k: v.clone() for k, v in digits_model.state_dict().items()}
    um = posthoc.wrap(digits_model, method="ivon", num_samples=4).fit(
        small["fit"], small["val"], progress=False, epochs=1
    )
    for key, value in digits_model.state_dict().items():
        assert torch.equal(value, before[key]), f"the user's model changed at {key}"
    card = um.method.summary()
    assert card["random_variables"] == sum(p.numel() for p in digits_model.parameters())
    assert card["scale"] in SCALES + (0.0,) and card["steps"] == len(small["fit"])
    assert um.method.scale_fit[1] == pytest.approx(
        posthoc.evaluate(posthoc.wrap(digits_model, method="none"), small["val"], progress=False).nll, rel=1e-5
    )
    prediction = um.predict(small["x"][:16], generator=torch.Generator().manual_seed(1))
    assert prediction.samples.shape == (4, 16, 8) or card["scale"] == 0
    um.save(tmp_path / "ivon.pt")
    loaded = posthoc.load(tmp_path / "ivon.pt", digits_model)
    again = loaded.predict(small["x"][:16], generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(again.probs, prediction.probs)
    assert loaded.method.summary() == card


def test_ivon_head_samples_are_batched_on_one_backbone_pass(digits_model: nn.Module, small: dict) -> None:
    um = posthoc.wrap(digits_model, method="ivon", layers="head", num_samples=6).fit(
        small["fit"], progress=False, epochs=1
    )
    calls = []
    handle = digits_model.features.register_forward_hook(lambda *args: calls.append(1))
    try:
        prediction = um.predict(small["x"][:8])  # one chunk (predict probes with 8 examples first)
    finally:
        handle.remove()
    assert len(calls) == 1 and prediction.samples.shape == (6, 8, 8)
    assert prediction.epistemic.min() > 0


def test_ivon_without_the_extra_names_it(digits_model: nn.Module, small: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(optimiser, "_ivon", None)
    um = posthoc.wrap(digits_model, method="ivon")  # wrapping needs nothing
    with pytest.raises(ConfigError, match=r"pip install posthoc\[ivon\]"):
        um.fit(small["fit"], progress=False)


def test_posthoc_imports_and_loads_an_ivon_posterior_without_the_package(
    digits_model: nn.Module, small: dict, tmp_path
) -> None:
    um = posthoc.wrap(digits_model, method="ivon", layers="head", scale=1.0, num_samples=3).fit(
        small["fit"], progress=False, epochs=1
    )
    um.save(tmp_path / "ivon.pt")
    torch.save(digits_model.state_dict(), tmp_path / "model.pt")
    expected = um.predict(small["x"][:4], generator=torch.Generator().manual_seed(0)).probs
    torch.save(small["x"][:4], tmp_path / "x.pt")
    script = f"""
import sys
sys.modules["ivon"] = None  # importing ivon now fails, as without the extra
import torch, posthoc
from posthoc_apps.demo import zoo
model = zoo.pretrained("digits_cnn")
model.load_state_dict(torch.load({str(tmp_path / "model.pt")!r}))
um = posthoc.load({str(tmp_path / "ivon.pt")!r}, model)
probs = um.predict(torch.load({str(tmp_path / "x.pt")!r}), generator=torch.Generator().manual_seed(0)).probs
torch.save(probs, {str(tmp_path / "probs.pt")!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
    torch.testing.assert_close(torch.load(tmp_path / "probs.pt"), expected)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"layers": "body"}, "layers must be 'head'"),
        ({"num_samples": 0}, "num_samples must be a positive integer"),
        ({"scale": -1.0}, "scale must be a finite number >= 0"),
    ],
)
def test_ivon_refuses_bad_options(options: dict, message: str, digits_model: nn.Module) -> None:
    with pytest.raises(ConfigError, match=message):
        posthoc.wrap(digits_model, method="ivon", **options)


@pytest.mark.parametrize(
    ("fit_options", "message"),
    [
        ({"lr": -0.1}, "lr must be a finite number > 0"),
        ({"beta2": 1.0}, r"beta2 must be a fraction in \[0, 1\)"),
        ({"hess_init": 0.0}, "hess_init must be a finite number > 0"),
        ({"mc_samples": 0}, "mc_samples must be a positive integer"),
        ({"ess": -5.0}, "ess must be a finite number > 0"),
    ],
)
def test_ivon_refuses_bad_fit_options(fit_options: dict, message: str, digits_model: nn.Module, small: dict) -> None:
    with pytest.raises(ConfigError, match=message):
        posthoc.wrap(digits_model, method="ivon").fit(small["fit"], progress=False, **fit_options)
