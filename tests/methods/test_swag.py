"""SWAG: collector maths, sampling covariance, SWA limit, exact BatchNorm refresh, last layer, bad input."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.engine import bn_refresh
from posthoc.errors import ConfigError, InputError, NumericalError
from posthoc.methods.swag import schedule, subset
from posthoc.methods.swag.collector import SWAGCollector
from posthoc.methods.swag.last_layer import LastLayerSWAG
from posthoc.methods.swag.schedule import FLAT_LOSS_LR, relative_lr
from posthoc.methods.swag.subset import Placement, SubsetSWAG
from posthoc_apps.demo import data, zoo


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def _perturb(model: nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))


@pytest.fixture(scope="module")
def small_fit(digits) -> DataLoader:
    x, y = digits.fit.tensors
    return DataLoader(TensorDataset(x[:512], y[:512]), batch_size=128)


def test_collector_moments_and_ring_buffer_match_definitions() -> None:
    model, generator = _mlp(), torch.Generator().manual_seed(1)
    collector = SWAGCollector(model, rank=3)
    averaged = AveragedModel(copy.deepcopy(model))
    snapshots, expected_deviations = [], []
    for _ in range(7):
        _perturb(model, generator)
        collector.update(model)
        averaged.update_parameters(model)
        snapshots.append(collector.flatten(model))
        running_mean = torch.stack(snapshots).mean(0)
        expected_deviations.append(snapshots[-1] - running_mean)
    mean = collector.unflatten(collector.mean.float())
    for name, p in averaged.module.named_parameters():
        torch.testing.assert_close(mean[name], p.detach(), rtol=0, atol=1e-6)
    stacked = torch.stack(snapshots)
    torch.testing.assert_close(collector.variance, stacked.var(0, unbiased=False), rtol=1e-9, atol=1e-12)
    assert collector.num_deviations == 3
    torch.testing.assert_close(collector.deviations.double(), torch.stack(expected_deviations[-3:]), rtol=0, atol=1e-6)


def _covariance_z_scores(samples: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """|empirical - target| in units of the sampling standard error of a Gaussian covariance entry."""
    centred = samples - samples.mean(0)
    empirical = centred.T @ centred / (samples.shape[0] - 1)
    diag = target.diagonal()
    stderr = ((diag[:, None] * diag[None, :] + target**2) / samples.shape[0]).sqrt()
    return (empirical - target).abs() / stderr


def test_public_collector_in_a_user_loop_holds_the_moments_of_the_built_in_fit() -> None:
    """``posthoc.SWAGCollector`` updated after each step of the user's own SGD loop holds the moments (and gives the
    samples) that ``wrap(method="swag")`` collects with the same schedule; and they are the snapshots' mean and
    population variance."""
    model = _mlp()
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 4, generator=generator), torch.randint(0, 3, (48,), generator=generator)
    batches = [(x[k : k + 12], y[k : k + 12]) for k in range(0, 48, 12)]
    before = copy.deepcopy(model.state_dict())
    um = posthoc.wrap(model, method="swag", scale=0.5).fit(
        batches, epochs=2, lr=0.05, collect_per_epoch=4, rank=5, progress=False
    )
    mine = copy.deepcopy(model)
    optimizer = torch.optim.SGD(mine.parameters(), lr=0.05, momentum=0.9)
    collector = posthoc.SWAGCollector(mine, rank=5)
    snapshots = []
    for _ in range(2):
        for xb, yb in batches:
            optimizer.zero_grad()
            nn.functional.cross_entropy(mine(xb), yb).backward()
            optimizer.step()
            collector.update(mine)
            snapshots.append(collector.flatten(mine))
    built = um.method.collector
    assert collector.num_snapshots == built.num_snapshots == 8
    for name in ("mean", "sum_sq", "deviation_rows"):  # the same steps in the same order: the same bits
        assert torch.equal(getattr(collector, name), getattr(built, name)), name
    stacked = torch.stack(snapshots)
    torch.testing.assert_close(collector.mean, stacked.mean(0), rtol=0, atol=1e-12)
    torch.testing.assert_close(collector.variance, stacked.var(0, unbiased=False), rtol=1e-9, atol=1e-12)
    draw = lambda c: c.sample(scale=0.5, generator=torch.Generator().manual_seed(3))  # noqa: E731
    assert torch.equal(draw(collector), draw(built))
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())  # fine-tuned a copy


@pytest.mark.parametrize("low_rank, scale", [(True, 0.5), (False, 1.0)])
def test_sample_covariance_is_scaled_diag_plus_low_rank(low_rank: bool, scale: float) -> None:
    generator = torch.Generator().manual_seed(0)
    direction = torch.tensor([1.0, -2.0, 0.5, 1.5, 0.0])
    weights = torch.zeros(5)
    collector = SWAGCollector({"w": weights}, names=["w"], rank=3, low_rank=low_rank)
    for step in range(6):  # strong low-rank structure plus small isotropic jitter
        collector.update({"w": direction * (step % 3 - 1.0) * 2 + 0.3 * torch.randn(5, generator=generator)})
    held = collector.num_deviations
    diag = torch.diag(collector.variance.float())
    low = collector.deviations.T @ collector.deviations / (held - 1) if low_rank else torch.zeros(5, 5)
    target = scale * (diag + low)
    samples = torch.stack([collector.sample(scale=scale, generator=generator) for _ in range(10000)])
    torch.testing.assert_close(
        samples.mean(0), collector.mean.float(), rtol=0, atol=5 * target.diagonal().max().sqrt().item() / 10000**0.5
    )
    assert _covariance_z_scores(samples, target).max() < 5
    if low_rank:  # the test can tell K from K - 1 and a missing scale
        wrong = scale * (diag + collector.deviations.T @ collector.deviations / held)
        assert _covariance_z_scores(samples, wrong).max() > 8
        assert _covariance_z_scores(samples, target / scale).max() > 8


def test_batchnorm_refresh_equals_full_data_statistics() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3)).eval()
    x = torch.randn(300, 2, 8, 8) * 3 + 1
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = bn_refresh.batchnorm_statistics(model, list(x.split([128, 100, 72])))
    for key, value in model.state_dict().items():  # nothing of the model changed
        assert torch.equal(value, before[key]), key
    assert not model.training
    reference = copy.deepcopy(model).train()
    reference[1].momentum = None
    with torch.no_grad():
        reference(x)  # one batch holding all the data: the exact statistics
    torch.testing.assert_close(stats["1.running_mean"], reference[1].running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats["1.running_var"], reference[1].running_var, rtol=1e-5, atol=1e-6)
    bn_refresh.refresh_batchnorm(model, list(x.split([128, 100, 72])))
    torch.testing.assert_close(model[1].running_var, reference[1].running_var, rtol=1e-5, atol=1e-6)
    assert bn_refresh.batchnorm_statistics(_mlp(), [torch.randn(4, 4)]) == {}


def test_scale_zero_reproduces_swa_with_refreshed_batchnorm(digits_model, small_fit, monkeypatch) -> None:
    snapshots = []
    original = SWAGCollector.update

    def spy(self, source):
        snapshots.append({n: p.detach().clone() for n, p in source.named_parameters()})
        original(self, source)

    monkeypatch.setattr(SWAGCollector, "update", spy)
    um = posthoc.wrap(digits_model, method="swag", scale=0.0).fit(small_fit, progress=False, epochs=1, lr=0.05)
    assert len(snapshots) == 4
    averaged = AveragedModel(copy.deepcopy(digits_model))
    snapshot_model = copy.deepcopy(digits_model)
    for snapshot in snapshots:
        snapshot_model.load_state_dict(snapshot, strict=False)
        averaged.update_parameters(snapshot_model)
    swa = bn_refresh.refresh_batchnorm(averaged.module, [x for x, _ in small_fit]).eval()
    x = small_fit.dataset.tensors[0][:200]
    pred = um.predict(x)
    assert pred.samples is None
    torch.testing.assert_close(pred.probs, torch.softmax(swa(x), -1), rtol=0, atol=1e-5)


def test_full_swag_lazy_samples_cached_batchnorm_and_save_load(
    digits, digits_model, small_fit, monkeypatch, tmp_path
) -> None:
    user_state = {k: v.clone() for k, v in digits_model.state_dict().items()}
    calls = []
    original = bn_refresh.batchnorm_statistics
    monkeypatch.setattr(
        "posthoc.methods.swag.subset.batchnorm_statistics", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    um = posthoc.wrap(digits_model, method="swag", num_samples=3).fit(
        small_fit, progress=False, epochs=1, lr=0.05, include_pretrained=True
    )
    assert um.method.collector.num_snapshots == 5 and len(calls) == 3
    x = digits.test.tensors[0][:100]
    first, second = um.predict(x), um.predict(x)
    assert len(calls) == 3  # BatchNorm statistics are not recomputed per call
    torch.testing.assert_close(first.samples, second.samples, rtol=0, atol=0)
    assert first.samples.shape == (3, 100, 8) and not torch.allclose(first.samples[0], first.samples[1])
    assert um.predict(x, num_samples=4).samples.shape[0] == 4 and len(calls) == 4
    assert not torch.equal(um.method.bn_cache[0], um.method.bn_cache[1])  # each sample has its own
    for key, value in digits_model.state_dict().items():  # the user's model is untouched
        assert torch.equal(value, user_state[key]), key
    assert not digits_model.training
    path = tmp_path / "swag.pt"
    um.save(path)
    loaded = posthoc.load(path, digits_model)
    torch.testing.assert_close(loaded.predict(x).samples, um.predict(x, num_samples=4).samples[:3], rtol=0, atol=1e-6)
    with pytest.raises(ConfigError, match="num_samples <= 4"):
        loaded.predict(x, num_samples=9)


def test_last_layer_logits_follow_the_weight_space_gaussian(digits, digits_model, small_fit) -> None:
    um = posthoc.wrap(digits_model, method="swag", subset="last_layer").fit(
        small_fit, progress=False, epochs=2, lr=0.05
    )
    method, collector = um.method, um.method.collector
    assert collector.names == ["classifier.4.weight", "classifier.4.bias"]
    x = digits.test.tensors[0][:2]
    samples = um.predict(x, num_samples=20000, generator=torch.Generator().manual_seed(0)).samples.log()
    phi, _ = method.split(x)
    phi = torch.cat([phi, torch.ones(2, 1)], 1)

    def as_matrix(flat: torch.Tensor) -> torch.Tensor:  # [W.flatten(), b] -> [W | b], acting on [phi, 1]
        return torch.cat([flat[..., : 8 * 64].unflatten(-1, (8, 64)), flat[..., 8 * 64 :, None]], -1)

    mean = as_matrix(collector.mean.float()) @ phi.T  # (C, N)
    variance = as_matrix(collector.variance.float())
    deviations = as_matrix(collector.deviations.float()) @ phi.T  # (K, C, N)
    contrast = torch.cat([-torch.ones(7, 1), torch.eye(7)], 1)  # softmax-invariant logit differences
    for n in range(2):
        covariance = 0.5 * (
            torch.diag(variance @ phi[n] ** 2)
            + deviations[..., n].T @ deviations[..., n] / (collector.num_deviations - 1)
        )
        target = contrast @ covariance @ contrast.T
        differences = samples[:, n] @ contrast.T
        assert _covariance_z_scores(differences, target).max() < 5
        torch.testing.assert_close(
            differences.mean(0),
            contrast @ mean[:, n],
            rtol=0,
            atol=5 * target.diagonal().max().sqrt().item() / 20000**0.5,
        )


def test_user_frozen_parameters_stay_fixed_and_frozen(digits_model, small_fit) -> None:
    for p in digits_model.features.parameters():
        p.requires_grad_(False)
    um = posthoc.wrap(digits_model, method="swag", num_samples=2).fit(small_fit, progress=False, epochs=1, lr=0.05)
    assert um.method.collector.names and all(n.startswith("classifier.") for n in um.method.collector.names)
    assert not any(p.requires_grad for p in digits_model.features.parameters())
    assert um.method.bn_cache is None  # no BatchNorm lies after the sampled weights
    assert um.predict(small_fit.dataset.tensors[0][:10]).samples.shape == (2, 10, 8)


def test_more_snapshots_than_steps_collects_every_step() -> None:
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(48, 4), torch.randint(0, 3, (48,))), batch_size=16)
    um = posthoc.wrap(_mlp(), method="swag")
    with pytest.warns(RuntimeWarning, match="collecting after every step"):
        um.fit(loader, progress=False, epochs=2, lr=0.01, collect_per_epoch=4)
    assert um.method.collector.num_snapshots == 6


def test_nan_loss_stops_and_keeps_the_good_statistics() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    x[48:] = 3e38  # finite inputs whose last batch overflows the loss (non-finite inputs are refused before)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    um = posthoc.wrap(_mlp(), method="swag")
    with pytest.raises(NumericalError, match="step 4"):
        um.fit(loader, progress=False, epochs=1, lr=0.01, collect_per_epoch=4)
    collector = um.method.collector
    assert (
        collector.num_snapshots == 3
        and torch.isfinite(collector.mean).all()
        and torch.isfinite(collector.variance).all()
    )
    assert not um.is_fitted


@pytest.mark.parametrize(
    "wrap_options, fit_options, error, match",
    [
        ({}, {"rank": 1}, ConfigError, "rank must be"),
        ({}, {"lr": 0.0}, ConfigError, "lr must be"),
        ({}, {"lr": -1e-3}, ConfigError, "lr must be"),
        ({}, {"collect_per_epoch": 1, "epochs": 1}, ConfigError, "at least 2"),
        ({"subset": "nope"}, {}, ConfigError, "no module 'nope'"),
        ({"scale": -1.0}, {}, ConfigError, "scale must be"),
    ],
)
def test_bad_options(wrap_options, fit_options, error, match) -> None:
    loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 3, (32,))), batch_size=8)
    with pytest.raises(error, match=match):
        posthoc.wrap(_mlp(), method="swag", **wrap_options).fit(loader, progress=False, **fit_options)


def test_loader_without_labels_is_refused() -> None:
    with pytest.raises(InputError, match="without labels"):
        posthoc.wrap(_mlp(), method="swag").fit([torch.randn(8, 4)] * 4, progress=False)


def test_linear_subset_runs_the_prefix_once_and_equals_one_pass_per_sample(
    digits_model, small_fit, digits, monkeypatch
) -> None:
    um = posthoc.wrap(digits_model, method="swag", subset=["classifier.1", "classifier.4"], num_samples=6)
    um.fit(small_fit, progress=False, epochs=1)
    x = digits.test.tensors[0][:30]
    calls = []
    digits_model.features.register_forward_hook(lambda *args: calls.append(1))
    um.predict(x[:2])  # traces the call order and probes the suffix once
    calls.clear()
    batched = um.predict(x, generator=torch.Generator().manual_seed(0))
    prefix_batched = len(calls)
    monkeypatch.setattr(um.method, "placement", dataclasses.replace(um.method.placement, runner=None))
    calls.clear()
    looped = um.predict(x, generator=torch.Generator().manual_seed(0))
    assert prefix_batched == 2 and len(calls) == 2 * 6  # two chunks (8 + 22 examples)
    torch.testing.assert_close(batched.samples, looped.samples, atol=1e-6, rtol=0)


def test_batched_suffix_only_where_exact_and_in_sample_groups_under_the_budget(monkeypatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3)).eval()
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    before_bn = posthoc.wrap(model, method="swag", subset=["0"]).fit(loader, progress=False, epochs=2)
    after_bn = posthoc.wrap(model, method="swag", subset=["3"], num_samples=4).fit(loader, progress=False, epochs=2)
    assert before_bn.method.placement == Placement(["1"], None)  # its BatchNorm needs statistics per sample
    assert after_bn.method.placement.refreshed == [] and after_bn.method.placement.runner.start == "3"
    for um in (before_bn, after_bn):
        assert torch.isfinite(um.predict(x[:5]).probs).all()
    groups = []
    original = subset.sampled_linears
    monkeypatch.setattr(
        subset, "sampled_linears", lambda model, weights, runner: groups.append(1) or original(model, weights, runner)
    )
    _, whole = after_bn.method.log_predictive(x[:5])
    with posthoc.settings.override(max_memory=2 * 2 * 21 * 4):  # two samples of 21 float32 weights, each alive twice
        _, grouped = after_bn.method.log_predictive(x[:5])
    assert len(groups) == 1 + 2
    torch.testing.assert_close(grouped, whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "subset_option, algorithm", [("last_layer", LastLayerSWAG), ("all", SubsetSWAG), (["classifier.4"], SubsetSWAG)]
)
def test_one_registered_name_picks_the_algorithm_and_both_round_trip(
    digits, digits_model, small_fit, tmp_path, subset_option, algorithm
) -> None:
    assert posthoc.available_methods()["swag"]["subset"] == "all"
    um = posthoc.wrap(digits_model, method="swag", subset=subset_option, num_samples=3)
    assert type(um.method) is algorithm and um.methods == ["swag"]
    um.fit(small_fit, progress=False, epochs=1, lr=0.05)
    assert not um.method.works_on_copy  # the fine-tuned copy lives only inside fit
    um.save(tmp_path / "swag.pt")
    assert not any(key.startswith("model.") for key in posthoc.core.persistence.read(tmp_path / "swag.pt")["state"])
    loaded = posthoc.load(tmp_path / "swag.pt", digits_model)
    assert type(loaded.method) is algorithm
    x = digits.test.tensors[0][:20]
    torch.testing.assert_close(
        loaded.predict(x, generator=torch.Generator().manual_seed(0)).samples,
        um.predict(x, generator=torch.Generator().manual_seed(0)).samples,
        rtol=0,
        atol=1e-6,
    )


def test_default_lr_moves_the_weights_by_the_relative_step_whatever_their_scale() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    model = _mlp()
    lr = schedule.relative_lr(model, list(model.parameters()), loader, device=torch.device("cpu"))
    norms = []
    for xb, yb in loader:
        model.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        norms.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm())
    weight_norm = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).norm()
    assert lr * torch.stack(norms).mean().item() == pytest.approx(schedule.RELATIVE_STEP * weight_norm.item(), rel=1e-5)
    um = posthoc.wrap(model, method="swag", scale=0.0).fit(loader, progress=False)
    assert um.method.summary()["lr"] == pytest.approx(lr, rel=1e-5)


def test_scale_chosen_on_validation_is_used_saved_and_reported(digits, digits_model, small_fit, tmp_path) -> None:
    x, y = digits.calibration.tensors
    val = DataLoader(TensorDataset(x[:256], y[:256]), batch_size=128)
    um = posthoc.wrap(digits_model, method="swag", subset="last_layer").fit(small_fit, val, progress=False)
    card = um.method.summary()
    plain_nll, chosen_nll = um.method.scale_fit[1:].tolist()
    assert card["scale"] == um.method.scale == float(um.method.scale_fit[0]) > 0
    assert chosen_nll <= 1.02 * plain_nll
    assert card["random_variables"] == 64 * 8 + 8 and card["layers"] == ["classifier.4"]
    assert card["rank"] == card["snapshots"] == 8 and card["epochs"] == 2 and card["collect_per_epoch"] == 4
    um.save(tmp_path / "swag.pt")
    loaded = posthoc.load(tmp_path / "swag.pt", digits_model)
    assert loaded.method.scale == um.method.scale and loaded.method.summary() == card
    fixed = posthoc.wrap(digits_model, method="swag", subset="last_layer", scale=0.5).fit(
        small_fit, val, progress=False
    )
    assert fixed.method.scale == 0.5  # a scale the user gave is never searched


@pytest.mark.parametrize("name", ["digits_cnn", "digits_bn_cnn"])
def test_swa_mean_of_the_default_schedule_is_not_worse_than_the_checkpoint_in_distribution(digits, name) -> None:
    """Issue 15: the default fine-tuning must not drift (lr 0.01 for 10 epochs did: NLL 0.080 vs 0.081 at 0 deg
    but 7.18 vs 6.59 at 90), on both bundled models over three data orders.

    One fine-tuning is one sample: two epochs of SGD amplify the last-bit differences of another CPU's
    kernels, so a single data order may land on either side of the checkpoint (on this machine seed 3 of
    digits_cnn gives 1.003x, on a CI machine seed 2 gave 1.013x). Each order must keep the project's
    standard (at most 1.02x the checkpoint's NLL) and their mean must not be worse than the checkpoint."""
    model = zoo.pretrained(name)
    test = data.loader(digits.test, 500)
    plain = posthoc.evaluate(posthoc.wrap(model, method="none"), test, progress=False).nll
    ratios = []
    for seed in range(3):
        fit = data.loader(digits.fit, 64, shuffle=True, seed=seed)
        swa = posthoc.wrap(model, method="swag", scale=0.0).fit(fit, progress=False)
        ratios.append(posthoc.evaluate(swa, test, progress=False).nll / plain)
    assert max(ratios) <= 1.02, ratios
    assert sum(ratios) / len(ratios) <= 1.0, ratios


def test_a_flat_loss_falls_back_to_a_fixed_learning_rate_with_a_warning():
    net = torch.nn.Linear(4, 2)  # class 0 certain for every input: the loss is at its minimum, its gradient exactly 0
    with torch.no_grad():
        net.weight.zero_()
        net.bias.copy_(torch.tensor([200.0, -200.0]))
    batch = [(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))]
    with pytest.warns(RuntimeWarning, match="gradient at the checkpoint is 0"):
        assert relative_lr(net, list(net.parameters()), batch, device=torch.device("cpu")) == FLAT_LOSS_LR
