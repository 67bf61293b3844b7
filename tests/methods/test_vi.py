"""``"vi"``: the Gaussian KL, local reparameterisation against weight sampling, the KL schedules,
the head path against the general path, persistence, and bad options."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Normal, kl_divergence

import posthoc
import posthoc_apps.demo.zoo
from posthoc.engine.kl_schedule import KLSchedule
from posthoc.engine.variational_layers import sample_output
from posthoc.methods.vi.gaussian import GaussianLayer, gaussian_kl

#: weight draws of the Monte Carlo comparisons; with 20,000 draws the sample mean is within 5
#: standard errors and the sample variance within 5 % (its relative sd is sqrt(2 / n) = 1 %)
DRAWS = 20_000


def _randomised(layer: nn.Module, seed: int) -> GaussianLayer:
    generator = torch.Generator().manual_seed(seed)
    posterior = GaussianLayer(layer, init_std=0.2, prior_std=0.7, prior_mean="checkpoint")
    with torch.no_grad():
        for p in posterior.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return posterior


@pytest.mark.parametrize("prior_mean", ["zero", "checkpoint"])
def test_kl_equals_torch_distributions(prior_mean):
    torch.manual_seed(0)
    layer = nn.Linear(5, 3)
    posterior = _randomised(layer, 1)
    posterior.prior_mean = prior_mean
    expected = 0.0
    for mean, log_std, checkpoint in (
        (posterior.weight_mean, posterior.weight_log_std, layer.weight),
        (posterior.bias_mean, posterior.bias_log_std, layer.bias),
    ):
        centre = checkpoint.detach() if prior_mean == "checkpoint" else torch.zeros_like(mean)
        expected += kl_divergence(Normal(mean, log_std.exp()), Normal(centre, 0.7)).sum()
    assert torch.allclose(posterior.kl(), expected, rtol=1e-5)
    assert float(gaussian_kl(torch.zeros(4), torch.zeros(4), 0.0, 1.0)) == 0.0


def _check_moments(draws: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> None:
    """``draws (n, ...)`` have ``mean`` within 5 standard errors and ``var`` within 5 %."""
    n = draws.shape[0]
    assert ((draws.mean(0) - mean).abs() <= 5 * (var / n).sqrt()).all()
    assert torch.allclose(draws.var(0), var, rtol=0.05)


def test_local_reparameterisation_matches_weight_sampling_linear():
    torch.manual_seed(0)
    posterior = _randomised(nn.Linear(6, 4), 2)
    x = torch.randn(3, 6)
    mean, var = posterior.output_moments(x)
    w_mean, w_var, b_mean, b_var = (t.detach() for t in posterior.moments())
    weights = w_mean + w_var.sqrt() * torch.randn(DRAWS, *w_mean.shape)
    biases = b_mean + b_var.sqrt() * torch.randn(DRAWS, *b_mean.shape)
    by_weights = torch.einsum("ni,soi->sno", x, weights) + biases[:, None]
    _check_moments(by_weights, mean.detach(), var.detach())
    by_lrt = sample_output(mean.detach().expand(DRAWS, -1, -1), var.detach().expand(DRAWS, -1, -1))
    _check_moments(by_lrt, mean.detach(), var.detach())


def test_local_reparameterisation_matches_weight_sampling_conv2d():
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1, stride=2)
    posterior = _randomised(conv, 3)
    x = torch.randn(1, 2, 6, 6)
    mean, var = (t.detach() for t in posterior.output_moments(x))
    w_mean, w_var, b_mean, b_var = (t.detach() for t in posterior.moments())
    weights = (w_mean + w_var.sqrt() * torch.randn(DRAWS, *w_mean.shape)).flatten(0, 1)
    biases = (b_mean + b_var.sqrt() * torch.randn(DRAWS, *b_mean.shape)).flatten()
    by_weights = F.conv2d(x, weights, biases, stride=2, padding=1).reshape(DRAWS, 1, 3, *mean.shape[-2:])
    _check_moments(by_weights, mean, var)


def test_kl_schedules():
    assert [KLSchedule("linear", weight=2.0, warmup=0.5)(t) for t in (0.0, 0.25, 0.5, 0.9)] == [0.0, 1.0, 2.0, 2.0]
    cosine = KLSchedule("cosine", warmup=0.5)
    assert cosine(0.0) == 0.0 and cosine(0.5) == 1.0 and cosine(0.125) < 0.25 < cosine(0.25) == pytest.approx(0.5)
    cyclical = KLSchedule("cyclical", warmup=0.5, cycles=4)
    assert [cyclical(t) for t in (0.0, 0.0625, 0.2, 0.25, 0.3125)] == [0.0, 0.5, 1.0, 0.0, 0.5]
    assert KLSchedule("constant", weight=0.3)(0.0) == 0.3
    assert KLSchedule("linear", warmup=0.0)(0.0) == 1.0


def test_fit_predict_leaves_the_model_untouched_and_the_head_path_matches_the_hook_path(digits_model, small):
    before = {k: v.clone() for k, v in digits_model.state_dict().items()}
    torch.manual_seed(0)
    um = posthoc.wrap(digits_model, method="vi").fit(small["fit"], progress=False, epochs=1)
    assert all(torch.equal(before[k], v) for k, v in digits_model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in digits_model.modules())
    assert all(p.requires_grad for p in digits_model.parameters())
    card = um.method.summary()
    assert card["layers"] == ["classifier.4"] and card["random_variables"] == 64 * 8 + 8
    # the same posterior, predicted through the hooks of the general path: the same predictive up to Monte Carlo error
    hooked = posthoc.wrap(digits_model, method="vi", layers=["classifier.4"])
    hooked.method.layers.load_state_dict(um.method.layers.state_dict())
    hooked.method.expansion.fill_(0)
    hooked.method.fitted.fill_(True)
    x = small["x"][:20]
    fast = um.predict(x, num_samples=4000, generator=torch.Generator().manual_seed(1))
    slow = hooked.predict(x, num_samples=4000, generator=torch.Generator().manual_seed(2))
    assert fast.samples.shape == (4000, 20, 8)
    assert (fast.probs - slow.probs).abs().max() < 0.02
    assert fast.epistemic.mean() > 0


def test_all_layers_expand_at_the_first_layer_and_save_load_round_trip(digits_model, small, tmp_path):
    torch.manual_seed(0)
    um = posthoc.wrap(digits_model, method="vi", layers="all", num_samples=3).fit(
        small["fit"], progress=False, epochs=1, kl_schedule="cyclical", kl_cycles=2
    )
    assert um.method.layers.names == ["features.0", "features.4", "classifier.1", "classifier.4"]
    assert int(um.method.expansion) == 0
    x = small["x"][:10]
    pred = um.predict(x, generator=torch.Generator().manual_seed(0))
    assert pred.samples.shape == (3, 10, 8) and (pred.epistemic > 0).all()
    um.save(tmp_path / "vi.pt")
    loaded = posthoc.load(tmp_path / "vi.pt", digits_model)
    again = loaded.predict(x, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pred.probs, again.probs)
    assert loaded.summary()["posterior"][0]["kl_schedule"] == "cyclical"
    other = posthoc_apps.demo.zoo.train(seed=3, epochs=1, progress=False)
    with pytest.raises(posthoc.PosteriorFileError, match="different model"):
        posthoc.load(tmp_path / "vi.pt", other)


@pytest.mark.parametrize(
    "options, says",
    [
        ({"prior_std": 0.0}, "prior_std must be a finite number > 0"),
        ({"init_std": float("nan")}, "init_std must be a finite number > 0"),
        ({"prior_mean": "pretrained"}, "prior_mean must be one of"),
        ({"layers": "heads"}, "layers must be 'head', 'all' or a list"),
        ({"layers": ["nope"]}, "layers names a module the model does not have: 'nope'"),
        ({"layers": ["features.1"]}, "selects no Linear or Conv2d"),
        ({"num_samples": 0}, "num_samples must be a positive integer"),
    ],
)
def test_bad_options_fail_at_wrap(digits_model, options, says):
    with pytest.raises(posthoc.ConfigError, match=says):
        posthoc.wrap(digits_model, method="vi", **options)


@pytest.mark.parametrize(
    "options, says",
    [
        ({"kl_weight": -1.0}, "kl_weight must be a finite number >= 0"),
        ({"kl_weight": math.inf}, "kl_weight must be a finite number >= 0"),
        ({"kl_schedule": "exponential"}, "kl_schedule must be one of"),
        ({"kl_warmup": 1.5}, "kl_warmup must be a fraction"),
        ({"kl_cycles": 0}, "kl_cycles must be a positive integer"),
        ({"epochs": 0}, "epochs must be a positive integer"),
        ({"lr": -1e-3}, "lr must be a finite number >= 0"),
    ],
)
def test_bad_fit_options_fail_before_anything_changes(digits_model, small, options, says):
    um = posthoc.wrap(digits_model, method="vi")
    before = {k: v.clone() for k, v in um.method.layers.state_dict().items()}
    with pytest.raises(posthoc.ConfigError, match=says):
        um.fit(small["fit"], progress=False, **options)
    assert all(torch.equal(before[k], v) for k, v in um.method.layers.state_dict().items())
    assert not um.is_fitted
