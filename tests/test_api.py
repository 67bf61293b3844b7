import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.errors import ConfigError, InputError, NotFittedError


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_unknown_method_lists_valid_ones(digits_model):
    with pytest.raises(ConfigError, match="unknown method 'bayes'.*valid methods:.*temperature"):
        posthoc.wrap(digits_model, method="bayes")


def test_unknown_option_lists_valid_ones(digits_model):
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['temprature'\].*max_iter=100"):
        posthoc.wrap(digits_model, method="temperature", temprature=2)


def test_unknown_fit_option_is_refused(digits_model, loaders):
    um = posthoc.wrap(digits_model, method="temperature")
    with pytest.raises(ConfigError, match=r"unknown fit option\(s\) \['epochs'\]"):
        um.fit(loaders["fit"], loaders["calibration"], epochs=3)


def test_temperature_cannot_be_inner(digits_model):
    with pytest.raises(ConfigError, match="cannot stack"):
        posthoc.wrap(digits_model, method=["temperature", "none"])


def test_map_baseline_equals_softmax(digits_model, digits):
    x = digits.test.tensors[0][:16]
    um = posthoc.wrap(digits_model, method="none")
    assert isinstance(um, nn.Module)
    with torch.no_grad():
        expected = digits_model(x).softmax(-1)
    assert torch.allclose(um(x), expected, atol=1e-6)


def test_wrap_and_fit_never_mutate_the_model(digits_model, loaders, digits):
    digits_model.train()  # the user's own mode must survive too
    before, modes = _state(digits_model), [m.training for m in digits_model.modules()]
    um = posthoc.wrap(digits_model, method="temperature").fit(loaders["fit"], loaders["calibration"], progress=False)
    um.predict(digits.test.tensors[0][:8])
    after = digits_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [m.training for m in digits_model.modules()] == modes
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in digits_model.modules())


def test_predict_before_fit(digits_model, digits):
    um = posthoc.wrap(digits_model, method="temperature")
    with pytest.raises(NotFittedError, match="must be fitted"):
        um.predict(digits.test.tensors[0][:4])


def test_temperature_without_held_out_loader(digits_model, loaders):
    with pytest.raises(InputError, match="held-out data"):
        posthoc.wrap(digits_model, method="temperature").fit(loaders["fit"])


def test_wrong_input_shape_and_dtype(digits_model):
    um = posthoc.wrap(digits_model, method="none")
    with pytest.raises(InputError, match=r"shape \(4, 3, 28, 28\).*shaped and typed like"):
        um.predict(torch.randn(4, 3, 28, 28))
    with pytest.raises(InputError, match="dtype torch.int64"):
        um.predict(torch.zeros(4, 1, 28, 28, dtype=torch.long))
    with pytest.raises(InputError, match="empty batch"):
        um.predict(torch.zeros(0, 1, 28, 28))


def test_nan_inputs_are_refused(digits_model):
    x = torch.zeros(2, 1, 28, 28)
    x[1, 0, 3, 3] = float("nan")
    with pytest.raises(InputError, match="NaN or inf"):
        posthoc.wrap(digits_model, method="none").predict(x)


def test_labels_outside_range(digits_model, digits):
    x = digits.calibration.tensors[0][:32]
    bad = DataLoader(TensorDataset(x, torch.full((32,), 9)), batch_size=16)
    with pytest.raises(InputError, match=r"labels must lie in \[0, 8\)"):
        posthoc.wrap(digits_model, method="temperature").fit(val_loader=bad, progress=False)


def test_empty_loader(digits_model):
    empty = DataLoader(TensorDataset(torch.zeros(0, 1, 28, 28), torch.zeros(0, dtype=torch.long)), batch_size=4)
    with pytest.raises(InputError, match="yielded no batches"):
        posthoc.wrap(digits_model, method="temperature").fit(val_loader=empty, progress=False)


def test_loader_without_labels(digits_model, digits):
    unlabelled = DataLoader(digits.calibration.tensors[0][:8], batch_size=4)
    with pytest.raises(InputError, match="without labels"):
        posthoc.wrap(digits_model, method="temperature").fit(val_loader=unlabelled, progress=False)


def test_dict_inputs_reach_the_model_as_keywords():
    class KeywordNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 4)

        def forward(self, pixels, scale):
            return self.fc(pixels * scale)

    model = KeywordNet()
    x = {"pixels": torch.randn(5, 3), "scale": torch.full((5, 1), 2.0)}
    um = posthoc.wrap(model, method="none")
    assert torch.allclose(um(x), model(**x).softmax(-1), atol=1e-6)


def test_head_option_takes_a_module_and_stores_its_name():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    assert "head" in posthoc.available_methods()["laplace"], "laplace must take a head option"
    um = posthoc.wrap(model, method="laplace", head=model[2])
    assert um.spec[0]["options"]["head"] == "2"
    with pytest.raises(ConfigError, match="not part of the model"):
        posthoc.wrap(model, method="laplace", head=nn.Linear(8, 3))


def test_binary_single_logit_classifier():
    model = nn.Sequential(nn.Linear(3, 1))
    x = torch.randn(6, 3)
    probs = posthoc.wrap(model, method="none")(x)
    assert probs.shape == (6, 2)
    assert torch.allclose(probs[:, 1], torch.sigmoid(model(x)).squeeze(1), atol=1e-6)


class _SqueezedLogit(nn.Module):
    """A binary classifier whose forward ends in ``.squeeze(-1)``: one logit per example, shape ``(N,)``."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        norm = [nn.BatchNorm1d(8)] if batchnorm else []  # for mc-batchnorm and abnn, which need BatchNorm
        self.body = nn.Sequential(nn.Linear(3, 8), *norm, nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).squeeze(-1)


@pytest.mark.parametrize("method", sorted(set(posthoc.available_methods()) - {"ensemble"}))
def test_a_binary_classifier_of_one_squeezed_logit_predicts_two_classes_or_is_refused_by_name(method):
    """``(N,)`` logits are a binary classifier's ``[0, z]`` everywhere (was: SWAG and MultiSWAG raised cross-entropy's
    RuntimeError, VI HeadNotFoundError). Laplace's softmax GGN needs two outputs and says so; platt is binary-only and
    fits; the rest predict two classes."""
    x = torch.randn(80, 3, generator=torch.Generator().manual_seed(1))
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    loader = [(x[:40], y[:40]), (x[40:], y[40:])]
    net = _SqueezedLogit(batchnorm=method in ("mc-batchnorm", "abnn"))
    fit_options = {"epochs": 1} if "epochs" in posthoc.wrap(net, method=method).method.fit_option_defaults() else {}
    um = posthoc.wrap(net, method=method)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if method == "laplace":
            with pytest.raises(ConfigError, match="needs a head with at least 2 outputs; this head has 1"):
                um.fit(loader, loader, progress=False)
            return
        um.fit(loader, loader, progress=False, **fit_options)
    probs = um.predict(x).probs
    assert probs.shape == (80, 2) and torch.allclose(probs.sum(-1), torch.ones(80), atol=1e-5)


def test_composition_spec_and_help_lists_methods(digits_model):
    um = posthoc.wrap(digits_model, method=["none", "temperature"], max_iter=20)
    assert um.methods == ["none", "temperature"]
    assert um.spec[1]["options"] == {"max_iter": 20}
    listed = posthoc.available_methods()
    assert {"laplace", "temperature", "auto", "mc-dropout"} <= set(listed)
    assert listed["temperature"]["max_iter"] == 100 and "available_methods()" in posthoc.wrap.__doc__
