"""iBNN: node variables by forward pre-hooks, routing, KL, fine-tuning and bad input."""

import copy

import pytest
import torch
import torchvision
from torch import nn

import posthoc
import posthoc_apps.demo.data
import posthoc_apps.demo.zoo
from posthoc.errors import ConfigError, NumericalError
from posthoc.methods.ibnn.elbo import ElboOptions, expand
from posthoc.methods.ibnn.method import SCALES
from posthoc.methods.ibnn.nodes import NodeSet, count_nodes, select_layers
from posthoc.methods.ibnn.recipes import RECIPES


def _scaled_copy(model, names, factors):
    """A copy of ``model`` whose listed layers have their weights scaled per input channel/feature."""
    scaled = copy.deepcopy(model)
    with torch.no_grad():
        for name, c in zip(names, factors):
            layer = scaled.get_submodule(name)
            shape = (1, -1, 1, 1) if isinstance(layer, nn.Conv2d) else (1, -1)
            layer.weight.mul_(c.reshape(shape))
    return scaled


def _hooks_left(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_unit_means_and_zero_std_reproduce_the_checkpoint_exactly(digits_model, digits):
    x = digits.test.tensors[0][:16]
    um = posthoc.wrap(digits_model, method="ibnn", components=3, stem=True)
    nodes = um.method.nodes
    nodes.set_(mean=1.0, std=0.0)
    with torch.no_grad():
        plain = digits_model(x)
        with nodes.sampling(torch.arange(16) % 3):
            hooked = um.method.model(x)
    assert nodes.seen == ["features.0", "features.4", "classifier.1", "classifier.4"]
    assert torch.equal(hooked, plain)
    um.method.fitted.fill_(True)
    pred = um.predict(x, num_samples=2)
    assert pred.samples.shape == (6, 16, 8)
    torch.testing.assert_close(pred.samples, plain.softmax(-1).expand(6, -1, -1), rtol=0, atol=1e-6)
    assert float(pred.epistemic.max()) < 1e-5


def test_constant_nodes_equal_weights_scaled_per_input_channel(digits_model, digits):
    x = digits.test.tensors[0][:8]
    um = posthoc.wrap(digits_model, method="ibnn", components=2, stem=True)
    nodes = um.method.nodes
    generator = torch.Generator().manual_seed(1)
    factors = [1 + 0.3 * torch.randn(g.mean.shape[1], generator=generator) for g in nodes.groups]
    with torch.no_grad():
        for group, c in zip(nodes.groups, factors):
            group.mean.copy_(c.expand_as(group.mean))
        nodes.set_(std=0.0)
        with nodes.sampling(torch.arange(8) % 2):
            hooked = um.method.model(x)
        expected = _scaled_copy(digits_model, nodes.layer_names, factors)(x)
    torch.testing.assert_close(hooked, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(hooked, digits_model(x), atol=1e-2)


def test_expanded_example_i_uses_component_i_mod_k(digits_model, digits):
    k, s = 3, 2
    x = digits.test.tensors[0][:5]
    um = posthoc.wrap(digits_model, method="ibnn", components=k, num_samples=s)
    nodes = um.method.nodes
    generator = torch.Generator().manual_seed(2)
    per_component = [
        [1 + 0.3 * torch.randn(g.mean.shape[1], generator=generator) for g in nodes.groups] for _ in range(k)
    ]
    with torch.no_grad():
        for index, group in enumerate(nodes.groups):
            group.mean.copy_(torch.stack([per_component[c][index] for c in range(k)]))
    nodes.set_(std=0.0)
    um.method.fitted.fill_(True)
    samples = um.predict(x).samples  # (K * S, N, C)
    assert samples.shape == (k * s, 5, 8)
    with torch.no_grad():
        references = [_scaled_copy(digits_model, nodes.layer_names, per_component[c])(x).softmax(-1) for c in range(k)]
    for r in range(k * s):
        torch.testing.assert_close(samples[r], references[r % k], rtol=1e-4, atol=1e-5)
    # the same routing, row by row, on a hand-expanded batch
    with torch.no_grad(), nodes.sampling(torch.arange(5 * k) % k):
        rows = um.method.model(expand(x, k)).softmax(-1)
    for i in range(5 * k):
        torch.testing.assert_close(rows[i], references[i % k][i // k], rtol=1e-4, atol=1e-5)


def test_kl_matches_the_closed_form_and_vanishes_when_q_equals_p():
    net = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    s = 0.2
    nodes = NodeSet(net, components=4, prior_std=s, init_mean_std=0.3, init_std=0.1)
    with torch.no_grad():
        for group in nodes.groups:
            group.rho.add_(0.5 * torch.randn_like(group.rho))
    expected = 0.0
    for group in nodes.groups:
        mean = group.mean.mean(0)
        std = group.std.square().sum(0).sqrt() / 4
        q, p = torch.distributions.Normal(mean, std), torch.distributions.Normal(1.0, s)
        expected = expected + torch.distributions.kl_divergence(q, p).sum()
    torch.testing.assert_close(nodes.kl(), expected.float())
    assert float(nodes.kl().detach()) > 0

    single = NodeSet(net, components=1, prior_std=s)
    single.set_(mean=1.0, std=s)  # K = 1: q is exactly the prior
    assert abs(float(single.kl().detach())) < 1e-6
    nodes.set_(mean=1.0, std=2 * s)  # K = 4: the component-mean law N(1, 4 (2s)^2 / 16) is the prior
    assert abs(float(nodes.kl().detach())) < 1e-5


def test_hooks_work_on_every_architecture(architecture):
    name, model, x = architecture
    keys = list(model.state_dict())
    um = posthoc.wrap(model, method="ibnn", components=2, stem=True)
    nodes, copy_ = um.method.nodes, um.method.model
    assert list(copy_.state_dict()) == keys and _hooks_left(model) == 0
    route, x = torch.arange(2 * x.shape[0]) % 2, expand(x, 2)
    inputs = []
    with torch.no_grad():
        plain = model(x)
        nodes.set_(mean=1.0, std=0.0)
        with nodes.sampling(route):
            identity = copy_(x)
        assert torch.equal(identity, plain), f"{name}: unit nodes changed the output"
        assert nodes.seen, f"{name}: no hooked layer ran"
        first = copy_.get_submodule(nodes.seen[0])
        capture = first.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
        for group in nodes.groups:
            group.mean.normal_(1.0, 0.2)
        nodes.set_(std=0.1)
        with nodes.sampling(route):
            out = copy_(x)
        capture.remove()
    assert torch.isfinite(out).all()
    scale = 1 + plain.abs().max()
    assert not torch.equal(out, plain) or plain.abs().max() == 0, f"{name}: the nodes did not change the output"
    assert (out - plain).abs().max() < 100 * scale
    layer_in = inputs[0]
    assert layer_in.shape[0] % route.numel() == 0 and torch.isfinite(layer_in).all()


def test_token_inputs_get_one_node_per_last_dim_feature():
    net = nn.Sequential(nn.Linear(4, 3))
    nodes = NodeSet(net, components=2)
    nodes.set_(std=0.0)
    with torch.no_grad():
        nodes.groups[0].mean.copy_(torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 0.0, 1.0]]))
    x = torch.randn(4, 7, 4)  # (batch, tokens, features)
    with torch.no_grad(), nodes.sampling(torch.arange(4) % 2):
        out = net(x)
    scale = nodes.groups[0].mean[torch.arange(4) % 2][:, None, :]
    torch.testing.assert_close(out, net[0](x * scale))


def test_short_fit_keeps_the_users_model_and_round_trips(digits_model, digits, tmp_path):
    original = {k: v.clone() for k, v in digits_model.state_dict().items()}
    loader = posthoc_apps.demo.data.loader(torch.utils.data.Subset(digits.fit, range(256)), batch_size=64)
    torch.manual_seed(0)
    um = posthoc.wrap(digits_model, method="ibnn", components=2, num_samples=2)
    start = [g.mean.detach().clone() for g in um.method.nodes.groups]
    um.fit(loader, epochs=1, lr_nodes=0.5, progress=False)
    assert any(not torch.equal(a, g.mean) for a, g in zip(start, um.method.nodes.groups))
    assert all(torch.equal(v, digits_model.state_dict()[k]) for k, v in original.items())
    assert _hooks_left(digits_model) == 0 and not digits_model.training
    x, y = digits.test.tensors[0][:200], digits.test.tensors[1][:200]
    pred = um.predict(x, generator=torch.Generator().manual_seed(0))
    assert pred.samples.shape == (4, 200, 8) and float(pred.epistemic.mean()) > 0
    assert posthoc.evaluation.metrics.accuracy(pred.probs, y) > 0.95
    um.save(tmp_path / "ibnn.pt")
    again = posthoc.load(tmp_path / "ibnn.pt", digits_model)
    torch.testing.assert_close(again.predict(x, generator=torch.Generator().manual_seed(0)).probs, pred.probs)


def test_a_deep_copy_keeps_its_own_nodes(digits_model, digits):
    x = digits.test.tensors[0][:4]
    um = posthoc.wrap(digits_model, method="ibnn", components=2)
    um.method.nodes.set_(mean=0.2, std=0.0)
    um.method.fitted.fill_(True)
    twin = copy.deepcopy(um)
    twin.method.nodes.set_(mean=1.0)
    with torch.no_grad():
        plain = digits_model(x).softmax(-1)
    torch.testing.assert_close(twin.predict(x).probs, plain, rtol=0, atol=1e-6)
    assert not torch.allclose(um.predict(x).probs, plain, atol=1e-3)


def test_chunked_prediction_equals_one_pass(digits_model, digits):
    x = digits.test.tensors[0][:6]
    um = posthoc.wrap(digits_model, method="ibnn", components=3)
    um.method.nodes.set_(std=0.0)
    um.method.fitted.fill_(True)
    whole = um.predict(x).samples
    chunked = um.predict(x, max_memory=1).samples  # the runner's budget: one example per expanded forward
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)


def test_layers_that_never_run_are_left_out_of_the_kl():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x):
            return self.used(x) + nn.functional.linear(x, self.unused.weight)

    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 3, (32,)))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    with pytest.raises(ConfigError, match="ran in the forward pass"):
        posthoc.wrap(Functional(), method="ibnn", stem=False).fit(loader, progress=False)
    um = posthoc.wrap(Functional(), method="ibnn", components=2, stem=True)
    um.fit(loader, progress=False)
    assert um.method.nodes.called.tolist() == [True, False]
    unused = um.method.nodes.groups[1]
    assert unused.mean.grad is None or unused.mean.grad.abs().sum() == 0


@pytest.mark.parametrize(
    "options, match",
    [
        ({"components": 0}, "components"),
        ({"components": 2.5}, "components"),
        ({"prior_std": 0.0}, "prior_std"),
        ({"prior_std": -0.1}, "prior_std"),
        ({"layers": ["features.9"]}, "do not exist"),
        ({"layers": ["features.1"]}, "matches no"),  # a BatchNorm: no Conv/Linear inside
        ({"layers": ["classifier.4"], "head": False}, "matches no"),
        ({"num_samples": 0}, "num_samples"),
        ({"init_std_spread": -0.1}, "init_std_spread"),
        ({"recipe": "papers"}, "recipe"),
    ],
)
def test_bad_options_are_refused(digits_model, options, match):
    with pytest.raises(ConfigError, match=match):
        posthoc.wrap(digits_model, method="ibnn", **options)


def test_a_model_without_conv_or_linear_is_refused():
    with pytest.raises(ConfigError, match="no nn.Conv2d or nn.Linear"):
        posthoc.wrap(nn.Sequential(nn.Flatten(), nn.Softmax(-1)), method="ibnn")
    with pytest.raises(ConfigError, match="layers must be a list"):
        select_layers(nn.Linear(2, 2), "fc")


@pytest.mark.parametrize(
    "fit_options",
    [
        {"epochs": 0},
        {"lr_nodes": 0.0},
        {"lr_nodes_final": -1.0},
        {"lr_weights": -1.0},
        {"beta": float("nan")},
        {"batchnorm": "eval"},
        {"train_samples": 0},
    ],
)
def test_bad_fit_options_are_refused(digits_model, loaders, fit_options):
    um = posthoc.wrap(digits_model, method="ibnn")
    with pytest.raises(ConfigError):
        um.fit(loaders["fit"], progress=False, **fit_options)


def test_nan_elbo_stops_with_a_clear_error_and_restores_everything(digits_model, digits):
    original = {k: v.clone() for k, v in digits_model.state_dict().items()}
    x, y = digits.fit.tensors
    loader = posthoc_apps.demo.data.loader(torch.utils.data.TensorDataset(x[:128], y[:128]), batch_size=32)
    um = posthoc.wrap(digits_model, method="ibnn", components=2)
    before = {k: v.clone() for k, v in um.method.state_dict().items()}
    with pytest.raises(NumericalError, match="lower lr_nodes"):
        um.fit(loader, epochs=3, lr_nodes=1e30, lr_weights=1e30, progress=False)
    after = um.method.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    assert all(torch.equal(v, digits_model.state_dict()[k]) for k, v in original.items())
    assert not um.is_fitted


def test_batchnorm_train_re_estimates_the_statistics_with_the_nodes_on(digits_model, digits):
    x, y = digits.fit.tensors
    loader = posthoc_apps.demo.data.loader(torch.utils.data.TensorDataset(x[:128], y[:128]), batch_size=64)
    frozen = posthoc.wrap(digits_model, method="ibnn", components=2, init_mean_std=0.3)
    frozen.fit(loader, epochs=1, batchnorm="frozen", lr_weights=0.0, progress=False)
    assert torch.equal(frozen.method.model.features[1].running_mean, digits_model.features[1].running_mean)
    um = posthoc.wrap(digits_model, method="ibnn", components=2, init_mean_std=0.3)
    um.fit(loader, epochs=1, progress=False)  # batchnorm="train" by default
    norm, original = um.method.model.features[1], digits_model.features[1]
    assert not torch.allclose(norm.running_mean, original.running_mean) and norm.momentum == original.momentum
    # after the fit the statistics are exactly those of the training data with the fitted nodes sampling
    nodes = um.method.nodes
    with torch.no_grad(), nodes.sampling(torch.arange(2 * 128) % 2, generator=torch.Generator().manual_seed(0)):
        inputs = []
        hook = um.method.model.features[1].register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
        um.method.model.eval()(expand(x[:128], 2))
        hook.remove()
    torch.testing.assert_close(norm.running_mean, inputs[0].mean((0, 2, 3)), rtol=0.05, atol=0.02)
    assert not um.method.model.training and torch.isfinite(um.predict(x[:8]).probs).all()
    assert all(
        torch.equal(v, digits_model.state_dict()[k]) for k, v in posthoc_apps.demo.zoo.pretrained().state_dict().items()
    )


def test_the_paper_fit_trains_the_weights_slowly_and_the_nodes_fast(digits_model, digits):
    loader = posthoc_apps.demo.data.loader(torch.utils.data.Subset(digits.fit, range(128)), batch_size=64)
    um = posthoc.wrap(digits_model, method="ibnn", components=2)
    weight = um.method.model.classifier[4].weight.detach().clone()
    means = [g.mean.detach().clone() for g in um.method.nodes.groups]
    um.fit(loader, epochs=1, lr_weights=1e-4, lr_nodes=0.2, progress=False)
    weight_step = (um.method.model.classifier[4].weight - weight).abs().max()
    node_step = max(float((g.mean - m).abs().max()) for g, m in zip(um.method.nodes.groups, means))
    assert 0 < weight_step < 1e-2 < node_step
    frozen = posthoc.wrap(digits_model, method="ibnn", components=2)
    frozen.fit(loader, epochs=1, lr_weights=0.0, progress=False)
    assert torch.equal(frozen.method.model.classifier[4].weight, weight)


def test_node_learning_rate_is_annealed_and_kl_warms_up():
    options = ElboOptions(lr_nodes=0.2, lr_nodes_final=0.05, kl_warmup=0.5, beta=1.0)
    assert [options.node_lr(t) for t in (0.0, 0.5, 0.7, 0.9, 1.0)] == pytest.approx([0.2, 0.2, 0.125, 0.05, 0.05])
    assert [options.kl_weight(t) for t in (0.0, 0.25, 0.5, 1.0)] == pytest.approx([0.0, 0.5, 1.0, 1.0])


def test_training_samples_are_independent_of_the_components(digits_model, digits):
    loader = posthoc_apps.demo.data.loader(torch.utils.data.Subset(digits.fit, range(64)), batch_size=32)
    um = posthoc.wrap(digits_model, method="ibnn", components=4)
    rows = []
    hook = um.method.model.classifier[4].register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0]))
    um.fit(loader, epochs=1, train_samples=3, batchnorm="frozen", lr_weights=0.0, progress=False)
    hook.remove()
    assert rows == [32 * 3, 32 * 3]
    assert um.method.summary()["train_samples"] == 3


def test_initialisation_follows_the_paper(digits_model):
    um = posthoc.wrap(
        digits_model, method="ibnn", components=8, init_mean_std=0.5, init_std=0.05, init_std_spread=0.02, stem=True
    )
    means = torch.cat([g.mean.detach().flatten() for g in um.method.nodes.groups])
    stds = torch.cat([g.std.detach().flatten() for g in um.method.nodes.groups])
    assert abs(float(means.mean()) - 1) < 0.02 and abs(float(means.std()) - 0.5) < 0.02
    assert abs(float(stds.mean()) - 0.05) < 0.003 and abs(float(stds.std()) - 0.02) < 0.003 and float(stds.min()) > 0


@pytest.mark.parametrize("name, nodes", [("resnet50", 24579), ("alexnet", 18307), ("vgg16", 36995)])
def test_node_counts_match_the_papers_table_1(name, nodes):
    model = getattr(torchvision.models, name)(weights=None)
    assert count_nodes(model) == nodes
    summary = posthoc.wrap(model, method="ibnn", recipe="paper", components=2).method.summary()
    assert summary["random_variables"] == nodes and summary["components"] == 2
    assert posthoc.wrap(model, method="ibnn", stem=True).method.summary()["random_variables"] == nodes
    assert posthoc.wrap(model, method="ibnn").method.summary()["random_variables"] == count_nodes(model, stem=False)
    assert summary["layers"][0] in ("conv1", "features.0") and summary["variational_parameters"] == 2 * 2 * nodes
    assert count_nodes(model, stem=False, head=False) < nodes


def test_summary_reports_the_fit(digits_model, digits):
    loader = posthoc_apps.demo.data.loader(torch.utils.data.Subset(digits.fit, range(64)), batch_size=64)
    um = posthoc.wrap(digits_model, method="ibnn", components=3, num_samples=2, init_mean_std=0.4)
    before = um.method.summary()
    assert before["epochs"] is None and before["random_variables"] == 16 + 32 * 7 * 7 + 64  # no stem by default
    um.fit(loader, epochs=2, beta=0.5, progress=False)
    card = um.method.summary()
    assert card["epochs"] == 2 and card["beta"] == 0.5 and card["batchnorm"] == "train"
    assert card["init_mean_std"] == 0.4 and card["test_samples"] == 6 and card["components"] == 3
    assert card["layers"] == ["features.4", "classifier.1", "classifier.4"]


def test_recipes_set_the_defaults_and_named_options_override_them(digits_model, digits):
    default, paper = RECIPES["posthoc"], RECIPES["paper"]
    card = posthoc.wrap(digits_model, method="ibnn").method.summary()
    assert (card["recipe"], card["components"], card["init_mean_std"], card["prior_std"]) == (
        "posthoc",
        default.components,
        default.init_mean_std,
        default.prior_std,
    )
    um = posthoc.wrap(digits_model, method="ibnn", recipe="paper", init_mean_std=0.75)
    card = um.method.summary()
    assert (card["components"], card["init_mean_std"], card["prior_std"]) == (paper.components, 0.75, paper.prior_std)
    means = torch.cat([g.mean.detach().flatten() for g in um.method.nodes.groups])
    assert 0.6 < float(means.std()) < 0.9
    loader = posthoc_apps.demo.data.loader(torch.utils.data.Subset(digits.fit, range(64)), batch_size=64)
    um.fit(loader, epochs=1, progress=False)
    card = um.method.summary()
    assert (card["epochs"], card["lr_weights"], card["lr_nodes"], card["train_samples"]) == (
        1,
        paper.lr_weights,
        paper.lr_nodes,
        paper.train_samples,
    )


def test_the_node_noise_scale_is_chosen_on_held_out_data_saved_and_reported(digits_model, digits, tmp_path):
    x, y = digits.fit.tensors
    train = posthoc_apps.demo.data.loader(torch.utils.data.TensorDataset(x[:256], y[:256]), batch_size=64)
    vx, vy = digits.calibration.tensors
    val = posthoc_apps.demo.data.loader(torch.utils.data.TensorDataset(vx[:256], vy[:256]), batch_size=128)
    um = posthoc.wrap(digits_model, method="ibnn").fit(train, val, epochs=1, progress=False, shift=None)
    scale, plain, chosen = um.method.scale_fit.tolist()
    card = um.method.summary()
    assert scale in (0.0, *SCALES) and card["scale"] == scale and card["scale_fit"] == "val"
    record = um.summary()["selection"]
    picked = next(row for row in record["candidates"] if row["chosen"])
    assert picked["value"] == scale and picked["bound"] <= record["tolerance"]  # admissible on the same held-out set
    assert record["plain"]["clean_nll"] == pytest.approx(plain, abs=1e-6) and picked["clean_nll"] == pytest.approx(
        chosen, abs=1e-6
    )
    um.save(tmp_path / "ibnn.pt")
    loaded = posthoc.load(tmp_path / "ibnn.pt", digits_model)
    generator = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    assert loaded.method.scale == scale
    assert torch.equal(
        loaded.method.log_predictive(vx[:16], generator=generator())[0],
        um.method.log_predictive(vx[:16], generator=generator())[0],
    )  # the same code path, same draws
    um.method.scale_fit[0] = 0.0  # the scale widens the predictive: more epistemic spread at 4 than at 0
    narrow = um.predict(vx[:64]).epistemic.mean()
    um.method.scale_fit[0] = 4.0
    assert um.predict(vx[:64]).epistemic.mean() > narrow
    fixed = posthoc.wrap(digits_model, method="ibnn", scale=0.5).fit(train, val, epochs=1, progress=False)
    assert (
        fixed.method.scale == 0.5 and fixed.method.scale_fit is None and fixed.method.summary()["scale_fit"] == "fixed"
    )
    with pytest.raises(ConfigError, match="scale"):
        posthoc.wrap(digits_model, method="ibnn", scale=-1.0)
