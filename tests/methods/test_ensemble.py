"""Ensembles post hoc (issue 16): the mixture, the vmapped members, bad inputs, save/load, MultiSWAG."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.engine.ranks_spread import owner
from posthoc.errors import ConfigError, InputError, PosteriorFileError
from posthoc.methods.ensemble.data_order import reshuffled
from posthoc.methods.ensemble.method import Ensemble
from posthoc.methods.ensemble.mixture import mixture
from posthoc_apps.demo import zoo


def _perturbed(model: nn.Module, seed: int, size: float = 0.05) -> nn.Module:
    """A copy of ``model`` with its weights moved by seeded noise: another member of the same architecture."""
    member = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in member.parameters():
            parameter.add_(size * torch.randn(parameter.shape, generator=generator))
    return member.eval()


@pytest.fixture(scope="module")
def members() -> list[nn.Module]:
    base = zoo.pretrained("digits_cnn")
    return [base, _perturbed(base, 1), _perturbed(base, 2)]


def _mlp(seed: int, classes: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, classes)).eval()


def _toy_loader(seed: int = 0, n: int = 96) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
    return DataLoader(TensorDataset(x, y), batch_size=32)


# ---------------------------------------------------------------- the mixture


def test_mixture_is_the_equal_weight_average_and_keeps_one_sample_per_plain_member():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(4, 5, 3), -1)  # 4 members, 5 examples, 3 classes
    log_probs, samples = mixture([(p.log(), None) for p in probs])
    torch.testing.assert_close(log_probs.exp(), probs.mean(0))
    torch.testing.assert_close(samples.exp(), probs)
    pred = posthoc.Prediction.from_probs(log_probs.exp(), samples.exp())
    # the epistemic part is the members' disagreement: entropy of the mean minus the mean entropy
    h = lambda p: -(p * p.log()).sum(-1)  # noqa: E731
    torch.testing.assert_close(pred.epistemic, h(probs.mean(0)) - h(probs).mean(0))
    assert (pred.epistemic > 0).all()


def test_sampled_members_are_concatenated_and_each_member_weighs_the_same():
    torch.manual_seed(1)
    a = torch.softmax(torch.randn(6, 2, 3), -1)  # member a: 6 samples
    b = torch.softmax(torch.randn(6, 2, 3), -1)
    log_probs, samples = mixture([(a.mean(0).log(), a.log()), (b.mean(0).log(), b.log())])
    assert samples.shape == (12, 2, 3)
    torch.testing.assert_close(log_probs.exp(), (a.mean(0) + b.mean(0)) / 2)
    torch.testing.assert_close(samples.exp().mean(0), log_probs.exp())


def test_members_with_different_class_counts_are_refused_when_they_predict():
    class Net(nn.Module):  # no head to find at wrap: checked on the outputs
        def __init__(self, classes):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, classes))

        def forward(self, x):
            return x @ self.weight

    um = posthoc.wrap([Net(3), Net(4)])
    with pytest.raises(InputError, match="different shapes"):
        um.predict(torch.randn(2, 4))


# ---------------------------------------------------------------- batched members


@pytest.mark.parametrize("name", ["digits_cnn", "digits_bn_cnn"])
def test_vmapped_members_equal_the_loop_and_each_members_own_softmax(name, digits):
    base = zoo.pretrained(name)
    models = [base, _perturbed(base, 1), _perturbed(base, 2)]
    x = digits.test.tensors[0][:40]
    batched = posthoc.wrap(models, batched=True)
    loop = posthoc.wrap(models, batched=False)
    assert batched.method.vmapped and not loop.method.vmapped
    assert not posthoc.wrap(models).method.vmapped  # the default on the CPU: the loop
    fast, slow = batched.predict(x), loop.predict(x)
    with torch.no_grad():
        expected = torch.stack([torch.softmax(m(x), -1) for m in models])
    torch.testing.assert_close(fast.samples, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(slow.samples, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(fast.probs, expected.mean(0), atol=1e-5, rtol=0)
    assert (fast.epistemic > 0).all()


def test_batched_weights_follow_a_member_changed_in_place(members, digits):
    models = [copy.deepcopy(m) for m in members]
    um = posthoc.wrap(models, batched=True)
    x = digits.test.tensors[0][:8]
    before = um.predict(x).samples
    with torch.no_grad():
        models[1].classifier[4].bias.add_(3.0)
        expected = torch.softmax(models[1](x), -1)
    after = um.predict(x).samples
    torch.testing.assert_close(after[1], expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(after[0], before[0])


def test_identical_members_have_no_disagreement_and_mixed_architectures_loop(digits):
    x = digits.test.tensors[0][:16]
    same = zoo.pretrained("digits_cnn")
    pred = posthoc.wrap([same, copy.deepcopy(same)]).predict(x)
    assert pred.epistemic.max() < 1e-5
    mixed = posthoc.wrap([zoo.pretrained("digits_cnn"), zoo.pretrained("digits_bn_cnn")])
    assert not mixed.method.vmapped and mixed.predict(x).samples.shape == (2, 16, 8)
    with pytest.raises(ConfigError, match="batched=True needs plain members"):
        posthoc.wrap([zoo.pretrained("digits_cnn"), zoo.pretrained("digits_bn_cnn")], batched=True)


# ---------------------------------------------------------------- bad inputs


def test_bad_lists_are_refused_with_what_to_do():
    with pytest.raises(ConfigError, match="empty list"):
        posthoc.wrap([])
    with pytest.raises(ConfigError, match="member 1 must be a torch.nn.Module"):
        posthoc.wrap([_mlp(0), 123])
    with pytest.raises(ConfigError, match="same classes.*member 0: 3, member 1: 5"):
        posthoc.wrap([_mlp(0), _mlp(1, classes=5)])
    with pytest.raises(ConfigError, match="one device.*member 1: meta"):
        posthoc.wrap([_mlp(0), _mlp(1).to("meta")])
    with pytest.raises(ConfigError, match="unknown option"):
        posthoc.wrap([_mlp(0), _mlp(1)], method="laplace", hesian="kron")


def test_one_member_warns_and_gives_the_single_model_method():
    with pytest.warns(UserWarning, match="one model"):
        um = posthoc.wrap([_mlp(0)], method="laplace")
    assert not isinstance(um.method, Ensemble) and um.methods == ["laplace"]


def test_the_users_models_are_not_changed(members, digits):
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in members]
    um = posthoc.wrap(members, method="laplace").fit(
        DataLoader(TensorDataset(*[t[:256] for t in digits.fit.tensors]), batch_size=128), progress=False
    )
    um.predict(digits.test.tensors[0][:8])
    for model, state in zip(members, before):
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


# ---------------------------------------------------------------- fitted members, composition, card


def test_mixture_of_laplace_with_temperature_on_top(digits):
    models = [_mlp(0), _mlp(1), _mlp(2)]
    loader = _toy_loader()
    # shift=None: the perturbed copies would be graded once, on the plain ensemble, and a single model grades its own
    um = posthoc.wrap(models, method=["laplace", "temperature"], hessian="diag").fit(
        loader, _toy_loader(1), progress=False, shift=None
    )
    assert um.methods == ["laplace", "temperature"]
    ensemble = um.method.inner
    assert isinstance(ensemble, Ensemble) and all(bool(m.fitted) for m in ensemble.members)
    # every member is the single-model Laplace fitted on its own checkpoint
    x = torch.randn(5, 4)
    single = posthoc.wrap(models[1], method="laplace", hessian="diag").fit(
        loader, _toy_loader(1), progress=False, shift=None
    )
    torch.testing.assert_close(ensemble.members[1].log_predictive(x)[0], single.method.log_predictive(x)[0])
    card = um.summary()
    laplace_card = card["posterior"][0]
    assert laplace_card["members"] == 3
    assert laplace_card["random_variables"] == 3 * single.method.summary()["random_variables"]
    assert float(um.method.temperature) > 0


def test_temperature_alone_tempers_the_plain_ensemble():
    um = posthoc.wrap([_mlp(0), _mlp(1)], method="temperature").fit(val_loader=_toy_loader(2), progress=False)
    assert um.methods == ["none", "temperature"]
    assert um.predict(torch.randn(3, 4)).samples.shape == (2, 3, 3)


# ---------------------------------------------------------------- save and load


@pytest.fixture()
def saved(tmp_path):
    models = [_mlp(0), _mlp(1), _mlp(2)]
    um = posthoc.wrap(models, method="laplace", hessian="diag").fit(_toy_loader(), progress=False)
    path = tmp_path / "three.pt"
    um.save(str(path))
    return path, models, um


def test_saved_ensemble_loads_onto_its_members_and_predicts_the_same(saved):
    path, models, um = saved
    loaded = posthoc.load(path, [copy.deepcopy(m) for m in models])
    x = torch.randn(7, 4)
    torch.testing.assert_close(loaded.predict(x).probs, um.predict(x).probs)
    assert loaded.summary()["posterior"][0]["members"] == 3


def test_load_refuses_wrong_order_missing_and_changed_members(saved):
    path, models, _ = saved
    with pytest.raises(PosteriorFileError, match="member 0 given is saved member 1"):
        posthoc.load(path, [models[1], models[0], models[2]])
    with pytest.raises(PosteriorFileError, match=r"3 members but 2 models.*\[2\] are missing"):
        posthoc.load(path, models[:2])
    changed = copy.deepcopy(models[2])
    with torch.no_grad():
        changed[0].weight.mul_(1.01)  # the user trains a member further after fit
    with pytest.raises(PosteriorFileError, match="member 2 .* is not the checkpoint"):
        posthoc.load(path, [models[0], models[1], changed])
    with pytest.raises(PosteriorFileError, match="ensemble of 3 members; load it onto the list"):
        posthoc.load(path, models[0])


def test_a_single_model_file_is_refused_for_a_list(tmp_path):
    model = _mlp(0)
    path = tmp_path / "one.pt"
    posthoc.wrap(model, method="temperature").fit(val_loader=_toy_loader(), progress=False).save(str(path))
    with pytest.raises(PosteriorFileError, match="one model .* not of an ensemble"):
        posthoc.load(path, [model, _mlp(1)])


# ---------------------------------------------------------------- MultiSWAG


def test_multiswag_runs_differ_by_data_order_and_mix_their_samples(tmp_path):
    model = _mlp(0)
    fit = DataLoader(_toy_loader().dataset, batch_size=16, shuffle=True)
    um = posthoc.wrap(model, method="multiswag", members=3, subset="last_layer", num_samples=4, seed=5)
    um.fit(fit, progress=False, epochs=2, collect_per_epoch=2)
    runs = um.method.members
    assert [run.seed for run in runs] == [5, 6, 7]
    means = [run.collector.mean for run in runs]
    assert not torch.equal(means[0], means[1]) and not torch.equal(means[1], means[2])
    x = torch.randn(6, 4)
    pred = um.predict(x, generator=torch.Generator().manual_seed(0))
    assert pred.samples.shape == (12, 6, 3)
    assert um.summary()["posterior"][0]["members"] == 3
    path = tmp_path / "multiswag.pt"
    um.save(str(path))
    loaded = posthoc.load(path, model)
    again = loaded.predict(x, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(again.probs, pred.probs)


def test_multiswag_options_are_swags_plus_members():
    assert posthoc.available_methods()["multiswag"] == {"members": 4, **posthoc.available_methods()["swag"]}
    with pytest.raises(ConfigError, match="members >= 2"):
        posthoc.wrap(_mlp(0), method="multiswag", members=1)
    with pytest.raises(ConfigError, match="unknown option"):
        posthoc.wrap(_mlp(0), method="multiswag", rank_of_swag=3)


def test_a_member_reshuffles_a_dataloader_with_its_seed_and_keeps_other_iterables():
    loader = DataLoader(TensorDataset(torch.arange(50)), batch_size=10)
    orders = [torch.cat([b[0] for b in reshuffled(loader, seed)]) for seed in (1, 1, 2)]
    assert torch.equal(orders[0], orders[1]) and not torch.equal(orders[0], orders[2])
    assert sorted(orders[2].tolist()) == list(range(50))
    batches = [(torch.zeros(2), torch.zeros(2))]
    assert reshuffled(batches, 3) is batches


def test_members_go_round_robin_over_ranks():
    assert [owner(i, 3) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_retrained_seeds_are_cached_as_files(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(
        zoo,
        "train",
        lambda seed, progress=False, name="digits_cnn": calls.append(seed) or zoo.ARCHITECTURES[name][0]().eval(),
    )
    first = zoo.retrained([3, 4], name="digits_bn_cnn", cache=tmp_path)
    second = zoo.retrained([3, 4], name="digits_bn_cnn", cache=tmp_path)
    assert calls == [3, 4] and sorted(p.name for p in tmp_path.iterdir()) == [
        "digits_bn_cnn-seed3.pt",
        "digits_bn_cnn-seed4.pt",
    ]
    for a, b in zip(first, second):
        assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())


def test_members_given_as_checkpoint_paths_with_a_builder(tmp_path):
    models = [_mlp(0), _mlp(1)]
    paths = []
    for index, model in enumerate(models):
        paths.append(tmp_path / f"member{index}.pt")
        torch.save(model.state_dict(), paths[-1])
    um = posthoc.wrap([str(paths[0]), paths[1]], builder=lambda: _mlp(9))
    x = torch.randn(4, 3 + 1)
    with torch.no_grad():
        expected = torch.stack([torch.softmax(m(x), -1) for m in models]).mean(0)
    torch.testing.assert_close(um.predict(x).probs, expected)
    with pytest.raises(ConfigError, match="need builder="):
        posthoc.wrap([str(paths[0]), str(paths[1])])
