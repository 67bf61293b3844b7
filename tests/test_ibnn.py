"""iBNN: node variables by forward pre-hooks, routing, KL, fine-tuning and bad input."""

import copy

import pytest
import torch
from torch import nn

import posthoc
from posthoc.core.errors import ConfigError, NumericalError
from posthoc.methods.ibnn.elbo import expand
from posthoc.methods.ibnn.nodes import NodeSet, select_layers


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
    per_component = [[1 + 0.3 * torch.randn(g.mean.shape[1], generator=generator) for g in nodes.groups] for _ in range(k)]
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
    loader = posthoc.demo.data.loader(torch.utils.data.Subset(digits.fit, range(256)), batch_size=64)
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
    um.method.max_memory = 1  # one example per expanded forward
    torch.testing.assert_close(um.predict(x).samples, whole, rtol=1e-5, atol=1e-6)


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


@pytest.mark.parametrize("fit_options", [{"epochs": 0}, {"lr_nodes": 0.0}, {"lr_weights": -1.0}, {"beta": float("nan")}])
def test_bad_fit_options_are_refused(digits_model, loaders, fit_options):
    um = posthoc.wrap(digits_model, method="ibnn")
    with pytest.raises(ConfigError):
        um.fit(loaders["fit"], progress=False, **fit_options)


def test_nan_elbo_stops_with_a_clear_error_and_restores_everything(digits_model, digits):
    original = {k: v.clone() for k, v in digits_model.state_dict().items()}
    x, y = digits.fit.tensors
    loader = posthoc.demo.data.loader(torch.utils.data.TensorDataset(x[:128], y[:128]), batch_size=32)
    um = posthoc.wrap(digits_model, method="ibnn", components=2)
    before = {k: v.clone() for k, v in um.method.state_dict().items()}
    with pytest.raises(NumericalError, match="lower lr_nodes"):
        um.fit(loader, epochs=3, lr_nodes=1e30, lr_weights=1e30, progress=False)
    after = um.method.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    assert all(torch.equal(v, digits_model.state_dict()[k]) for k, v in original.items())
    assert not um.is_fitted


def test_refresh_bn_re_estimates_the_statistics_with_the_nodes_on(digits_model, digits):
    x, y = digits.fit.tensors
    loader = posthoc.demo.data.loader(torch.utils.data.TensorDataset(x[:128], y[:128]), batch_size=64)
    um = posthoc.wrap(digits_model, method="ibnn", components=2, init_mean_std=0.3)
    um.fit(loader, epochs=1, lr_nodes=0.1, refresh_bn=True, progress=False)
    norm, original = um.method.model.features[1], digits_model.features[1]
    assert not torch.allclose(norm.running_mean, original.running_mean) and norm.momentum == original.momentum
    assert not um.method.model.training and torch.isfinite(um.predict(x[:8]).probs).all()
