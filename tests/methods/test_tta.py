"""``method="tta"``: the mixture over augmented views, stacked on any method (issue 38)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.errors import ConfigError, InputError
from posthoc.methods.tta.augment import FAMILY_NAMES, image_zoom
from posthoc.shift import EVALUATION_KINDS, KINDS

#: float32 rounding of a log-mean-exp over identical views, and of a softmax computed in two ways
ATOL = 1e-6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3)).eval()


def _data() -> tuple[DataLoader, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(240, 4, generator=generator)
    y = torch.arange(240) % 3
    x[:, 0] += y
    return DataLoader(TensorDataset(x, y), batch_size=60), x[:16]


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)
    ).eval()


def _images() -> tuple[DataLoader, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, 12, 12, generator=generator)
    y = torch.arange(64) % 3
    return DataLoader(TensorDataset(x, y), batch_size=32), x[:8]


def _plain_probs(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.softmax(model(x), -1)


def test_the_samples_are_the_views_and_the_predictive_their_mean():
    loader, x = _data()
    model = _model()
    um = posthoc.wrap(model, method="tta", views=4, strength=1.0).fit(loader, progress=False)
    pred = um.predict(x)
    assert pred.samples.shape == (4, 16, 3)
    torch.testing.assert_close(pred.probs, pred.samples.mean(0), atol=ATOL, rtol=0)
    torch.testing.assert_close(pred.samples[0], _plain_probs(model, x), atol=ATOL, rtol=0)  # view 1: the identity
    assert not torch.allclose(pred.samples[1], pred.samples[0], atol=1e-4)  # the others are augmented
    assert (pred.epistemic >= -1e-6).all() and pred.epistemic.max() > 0  # the views' disagreement
    assert torch.allclose(pred.aleatoric + pred.epistemic, pred.entropy, atol=1e-5)


def test_identity_only_views_give_the_inner_predictive():
    """Every view the identity: the mixture of V equal predictives is the inner one (to float32 rounding of the
    log-mean-exp, 1e-6), on the plain model and on last-layer Laplace (whose probit predictive has no samples)."""
    loader, x = _data()
    model = _model()
    same = posthoc.wrap(model, method="tta", augmentations=[lambda v: v], views=5).fit(loader, progress=False)
    torch.testing.assert_close(same.predict(x).probs, _plain_probs(model, x), atol=ATOL, rtol=0)
    laplace = posthoc.wrap(model, method="laplace", prior_precision=1.0).fit(loader, progress=False)
    stacked = posthoc.wrap(model, method=["laplace", "tta"], augmentations=[lambda v: v], views=3, prior_precision=1.0)
    stacked.fit(loader, progress=False)
    torch.testing.assert_close(stacked.predict(x).probs, laplace.predict(x).probs, atol=ATOL, rtol=0)
    one = posthoc.wrap(model, method="tta", views=1).fit(loader, progress=False)  # the identity alone
    assert torch.equal(one.predict(x).probs, posthoc.wrap(model, method="none").predict(x).probs)


def test_a_users_callables_make_the_views():
    loader, x = _data()
    model = _model()
    calls = []

    def shifted(v: torch.Tensor) -> torch.Tensor:
        calls.append(v.shape[0])
        return v + 0.5

    um = posthoc.wrap(model, method="tta", augmentations=[shifted], views=2)
    assert not um.method.requires_fit  # no family that needs the training std
    probs = um.predict(x).probs
    expected = (_plain_probs(model, x) + _plain_probs(model, x + 0.5)) / 2
    torch.testing.assert_close(probs, expected, atol=ATOL, rtol=0)
    assert sum(calls) == 16  # once per example (the runner predicts in chunks)
    mixed = posthoc.wrap(model, method="tta", augmentations=["feature-noise", shifted], views=5, strength=1.0)
    mixed.fit(loader, progress=False)
    assert mixed.predict(x).samples.shape == (5, 16, 3)
    assert mixed.summary()["posterior"][-1]["families"] == ["feature-noise", "augmentations[1]"]


def test_stacks_on_laplace_and_mc_dropout():
    loader, x = _data()
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dropout = posthoc.wrap(model, method=["mc-dropout", "tta"], p=0.2, num_samples=5, views=3, strength=1.0)
        dropout.fit(loader, loader, progress=False)
        laplace = posthoc.wrap(model, method=["laplace", "tta"], link="mc", num_samples=7, views=3, strength=1.0)
        laplace.fit(loader, loader, progress=False)
    assert dropout.methods == ["mc-dropout", "tta"] and laplace.methods == ["laplace", "tta"]
    for um, samples in ((dropout, 15), (laplace, 21)):
        pred = um.predict(x, generator=torch.Generator().manual_seed(0))
        assert pred.samples.shape == (samples, 16, 3)
        torch.testing.assert_close(pred.probs, pred.samples.mean(0), atol=ATOL, rtol=0)
    assert laplace.summary()["posterior"][0]["prior_precision"] > 0


def test_the_strength_is_chosen_within_the_tolerance():
    loader, x = _data()
    um = posthoc.wrap(_model(), method="tta", views=4).fit(loader, loader, progress=False)
    selection = um.summary()["selection"]
    assert selection["knob"] == "augmentation strength"
    assert selection["candidates"][0]["candidate"] == "no augmentation"
    chosen = next(c for c in selection["candidates"] if c["chosen"])
    assert chosen["bound"] <= selection["tolerance"]
    assert um.summary()["posterior"][-1]["strength"] == chosen["value"]
    # without val_loader: the documented default
    default = posthoc.wrap(_model(), method="tta").fit(loader, progress=False)
    assert default.summary()["posterior"][-1]["strength"] == 0.25


def test_images_get_noise_blur_and_zoom_never_an_evaluation_kind():
    loader, x = _images()
    model = _cnn()
    um = posthoc.wrap(model, method="tta", views=7, strength=2.0).fit(loader, progress=False)
    pred = um.predict(x)
    assert pred.samples.shape == (7, 8, 3)
    assert um.summary()["posterior"][-1]["families"] == ["noise", "blur", "zoom"]
    assert um.method.scale.shape == (1,)  # one channel's training std
    assert not set(FAMILY_NAMES) & set(KINDS)  # no family is a shift of the harness, let alone an evaluation kind
    assert set(EVALUATION_KINDS) <= set(KINDS)
    # a zoom of strength 0 is the identity (bilinear sampling at the pixel centres)
    torch.testing.assert_close(image_zoom(x, 0.0, torch.Generator(), torch.ones(1)), x, atol=1e-5, rtol=0)


def test_regression_mixes_the_views_gaussian_mixtures(tmp_path):
    generator = torch.Generator().manual_seed(0)
    inputs = torch.rand(80, 1, generator=generator) * 4 - 2
    targets = torch.sin(2 * inputs) + 0.1 * torch.randn(80, 1, generator=generator)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=40)
    torch.manual_seed(0)
    regressor = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1)).eval()
    inner = posthoc.wrap(regressor, method="laplace", likelihood="regression").fit(loader, loader, progress=False)
    um = posthoc.wrap(regressor, method=["laplace", "tta"], likelihood="regression", views=4, strength=1.0)
    um.fit(loader, loader, progress=False)
    pred = um.predict(inputs[:8])
    assert isinstance(pred, posthoc.RegressionPrediction) and pred.component_means.shape == (4, 8, 1)
    torch.testing.assert_close(pred.component_means[0], inner.predict(inputs[:8]).mean, atol=ATOL, rtol=0)
    same = posthoc.wrap(
        regressor, method=["laplace", "tta"], likelihood="regression", augmentations=[lambda v: v], views=3
    ).fit(loader, loader, progress=False)
    torch.testing.assert_close(same.predict(inputs[:8]).variance, inner.predict(inputs[:8]).variance, atol=ATOL, rtol=0)
    chosen = posthoc.wrap(regressor, method=["none", "tta"], likelihood="regression", views=3).fit(
        loader, loader, progress=False
    )
    assert chosen.summary()["selection"]["knob"] == "augmentation strength"
    chosen.save(str(tmp_path / "regression.pt"))
    loaded = posthoc.load(str(tmp_path / "regression.pt"), regressor)
    assert torch.equal(loaded.predict(inputs[:8]).variance, chosen.predict(inputs[:8]).variance)
    with pytest.raises(ConfigError, match="'mc-batchnorm' does not do likelihood='regression'"):  # the inner refuses
        posthoc.wrap(regressor, method=["mc-batchnorm", "tta"], likelihood="regression")


def test_bad_options_and_inputs_are_refused_by_name():
    loader, x = _data()
    model = _model()
    with pytest.raises(ConfigError, match=r"augmentations\[1\]: unknown family 'rotate'.*evaluation reports"):
        posthoc.wrap(model, method="tta", augmentations=["noise", "rotate"])
    with pytest.raises(ConfigError, match=r"augmentations\[0\] must be a family name or a callable"):
        posthoc.wrap(model, method="tta", augmentations=[3])
    with pytest.raises(ConfigError, match="views must be a positive integer"):
        posthoc.wrap(model, method="tta", views=0)
    with pytest.raises(ConfigError, match="strength must be a number >= 0"):
        posthoc.wrap(model, method="tta", strength=-1.0)
    with pytest.raises(ConfigError, match=r"family 'blur' does not suit the inputs \(feature vectors.*feature-noise"):
        posthoc.wrap(model, method="tta", augmentations=["blur"]).fit(loader, progress=False)
    tokens = posthoc.wrap(nn.Sequential(nn.Embedding(10, 3), nn.Flatten(), nn.Linear(15, 3)), method="tta")
    with pytest.raises(ConfigError, match="no built-in augmentation for token ids"):
        tokens.fit([(torch.randint(0, 10, (4, 5)), torch.zeros(4, dtype=torch.long))], progress=False)
    cropped = posthoc.wrap(model, method="tta", augmentations=[lambda v: v[:, :2]], views=2)
    with pytest.raises(
        InputError,
        match=r"augmentations\[0\] \(<lambda>\) returned inputs of shape \(8, 2\) for inputs of shape \(8, 4\)",
    ):
        cropped.predict(x)
    fitted = posthoc.wrap(model, method="tta", strength=1.0).fit(loader, progress=False)
    with pytest.raises(InputError, match="std of 4 channels or features at fit, but these inputs have 5"):
        fitted.method.log_predictive(torch.randn(3, 5))


def test_saves_family_names_bit_for_bit_and_refuses_callables(tmp_path):
    loader, x = _data()
    model = _model()
    um = posthoc.wrap(model, method="tta", augmentations=["feature-noise"], views=3).fit(loader, loader, progress=False)
    um.save(str(tmp_path / "tta.pt"))
    loaded = posthoc.load(str(tmp_path / "tta.pt"), model)
    assert torch.equal(loaded.method.strength, um.method.strength) and torch.equal(loaded.method.scale, um.method.scale)
    assert torch.equal(loaded.predict(x).probs, um.predict(x).probs)
    own = posthoc.wrap(model, method="tta", augmentations=[torch.neg], views=2)
    with pytest.raises(ConfigError, match="cannot save: option augmentations=.* of 'tta' holds what a posterior file"):
        own.save(str(tmp_path / "own.pt"))


def test_the_same_seed_gives_the_same_views():
    loader, x = _data()
    model = _model()
    um = posthoc.wrap(model, method="tta", views=4, strength=1.0).fit(loader, progress=False)
    assert torch.equal(um.predict(x).probs, um.predict(x).probs)  # seeded by seed=0 on every call
    first = um.predict(x, generator=torch.Generator().manual_seed(3)).probs
    assert torch.equal(first, um.predict(x, generator=torch.Generator().manual_seed(3)).probs)
    assert not torch.equal(first, um.predict(x, generator=torch.Generator().manual_seed(4)).probs)
    other = posthoc.wrap(model, method="tta", views=4, strength=1.0, seed=1).fit(loader, progress=False)
    assert not torch.equal(other.predict(x).probs, um.predict(x).probs)
