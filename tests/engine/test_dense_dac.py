"""DAC per position on dense outputs: every kept position is a row whose feature is the per-position head's input."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.engine.dense_head import position_head
from posthoc.errors import PosthocError
from posthoc_apps.demo.segmentation import IGNORE, NUM_CLASSES, segmentation_data, trained_fcn

#: a small bank keeps the distances (every position a query) cheap
OPTIONS = {"bank_positions": 1024, "max_iter": 30}


@pytest.fixture(scope="module")
def segmentation():
    data = segmentation_data(train=32, val=16, test=8)
    model = trained_fcn(data.train, epochs=2)
    images, masks = data.val.tensors
    masks = masks.clone()
    masks[:, :8] = IGNORE  # the top rows of every validation canvas are left out
    train = DataLoader(data.train, batch_size=16)
    val = DataLoader(TensorDataset(images, masks), batch_size=8)
    return data, model, train, val


@pytest.fixture(scope="module")
def fitted(segmentation):
    data, model, train, val = segmentation
    return posthoc.wrap(model, method="dac", dense=True, **OPTIONS).fit(train, val, progress=False)


def _temperatures(um, images):
    """The fitted DAC's temperature at every position of ``images`` (rows in the order of the positions)."""
    dac = um.inner.method
    rows = um.position_rows[0]
    with torch.no_grad():
        features = rows.position_head.feature_rows(rows.model, images)
    return dac.temperatures_of([features])


def test_dac_per_position_predicts_per_position_fields(segmentation, fitted):
    data, model, *_ = segmentation
    card = fitted.summary()["posterior"][-1]
    assert card["layers"] == ["head:input"]  # the per-position head's input, no pooled intermediate map
    valid = int((data.train.tensors[1] != IGNORE).sum())
    assert card["training_examples_seen"] == valid and card["bank_rows"] == OPTIONS["bank_positions"] < valid
    images = data.test.tensors[0][:5]
    pred = fitted.predict(images)
    assert pred.probs.shape == (5, NUM_CLASSES, 32, 32)
    for name in ("entropy", "confidence", "label"):
        assert getattr(pred, name).shape == (5, 32, 32), name
    assert torch.allclose(pred.probs.sum(1), torch.ones(5, 32, 32), atol=1e-5)
    t = _temperatures(fitted, images)
    assert t.shape == (5 * 32 * 32,) and bool((t > 0).all())
    with torch.no_grad():  # the predictive is the softmax of the logits over each position's own temperature
        logits = model(images).movedim(1, -1).reshape(-1, NUM_CLASSES)
    expected = torch.softmax(logits / t[:, None], -1)
    assert torch.allclose(pred.probs.movedim(1, -1).reshape(-1, NUM_CLASSES), expected, atol=1e-5)


def test_per_position_temperature_is_the_row_dac_of_the_head_features(segmentation, fitted):
    """The dense fit is the row DAC of a Linear head on the features of every kept position, batch by batch: the same
    bank, choice and fitted map, so the same temperature per position (float32 reductions in another order: 1e-5)."""
    data, model, train, val = segmentation
    head = position_head(model)

    def rows(loader):
        out = []
        with torch.no_grad():
            for images, masks in loader:
                keep = (masks != IGNORE).reshape(-1)
                out.append((head.feature_rows(model, images)[keep], masks.reshape(-1)[keep]))
        return out

    row_model = nn.Sequential(head.as_linear())
    bank_bytes = OPTIONS["bank_positions"] * head.module.in_channels * 4  # the same rows on a row model
    row = posthoc.wrap(row_model, method="dac", layers=[], bank_bytes=bank_bytes, max_iter=OPTIONS["max_iter"])
    row.fit(rows(train), rows(val), shift=None, progress=False)  # the dense default: clean held-out choices
    dense_card, row_card = fitted.summary()["posterior"][-1], row.summary()["posterior"][-1]
    assert dense_card["bank_rows"] == row_card["bank_rows"]
    assert torch.allclose(fitted.inner.method.bank, row.method.bank)
    # the per-image selection bound and the per-row one agree here on the configuration
    assert dense_card["selection"]["chosen"] == row_card["selection"]["chosen"]
    images = data.test.tensors[0][:4]
    with torch.no_grad():
        features = head.feature_rows(model, images)
    expected = row.method.temperatures_of([features])
    assert torch.allclose(_temperatures(fitted, images), expected, rtol=1e-5, atol=1e-6)
    dense = fitted.predict(images).probs.movedim(1, -1).reshape(-1, NUM_CLASSES)
    assert torch.allclose(dense, row.predict(features).probs, atol=1e-5)


def test_ignored_positions_are_left_out_of_the_fit(segmentation, fitted):
    data, model, train, val = segmentation
    selection = fitted.summary()["posterior"][-1]["selection"]
    assert selection["examples"] == int((val.dataset.tensors[1] != IGNORE).sum())  # held-out rows: kept positions
    images, masks = val.dataset.tensors
    other = masks.clone()
    other[masks == IGNORE] = -100  # the other ignore index at the same positions: the same fit
    again = posthoc.wrap(model, method="dac", dense=True, **OPTIONS).fit(
        train, DataLoader(TensorDataset(images, other), batch_size=8), progress=False
    )
    assert torch.equal(_temperatures(again, images[:2]), _temperatures(fitted, images[:2]))
    labelled = masks.clone()
    labelled[masks == IGNORE] = 0  # the same positions labelled background: another held-out set, another fit
    changed = posthoc.wrap(model, method="dac", dense=True, **OPTIONS).fit(
        train, DataLoader(TensorDataset(images, labelled), batch_size=8), progress=False
    )
    assert changed.summary()["posterior"][-1]["selection"]["examples"] > selection["examples"]
    assert not torch.equal(_temperatures(changed, images[:2]), _temperatures(fitted, images[:2]))


def test_a_saved_dense_dac_loads_onto_its_checkpoint(segmentation, fitted, tmp_path):
    data, model, *_ = segmentation
    path = tmp_path / "fcn.dac.pt"
    fitted.save(str(path))
    loaded = posthoc.load(str(path), model)
    images = data.test.tensors[0][:3]
    assert torch.equal(loaded.predict(images).probs, fitted.predict(images).probs)
    assert loaded.summary()["posterior"][-1]["layers"] == ["head:input"]


def test_dac_without_a_per_position_feature_is_refused(segmentation):
    data, model, train, val = segmentation

    class Upsampled(nn.Module):  # the head's output is resized: no feature per output position
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x):
            small = nn.functional.avg_pool2d(x, 2)
            return nn.functional.interpolate(self.net(small), size=x.shape[-2:], mode="bilinear")

    with pytest.raises(PosthocError, match="not the model's logits"):
        posthoc.wrap(Upsampled(), method="dac", dense=True, **OPTIONS).fit(train, val, progress=False)
    no_head = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, NUM_CLASSES, 3, padding=1))
    with pytest.raises(PosthocError, match="need a per-position head"):
        posthoc.wrap(no_head, method="dac", dense=True)
    with pytest.raises(PosthocError, match="per-position head's input only"):
        posthoc.wrap(model, method="dac", dense=True, layers=["model.refine"], **OPTIONS).fit(
            train, val, progress=False
        )


def test_dac_per_token_on_a_tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=32)).eval()
    ids = torch.randint(0, 50, (24, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    loader = DataLoader(TensorDataset(ids, labels), batch_size=8)
    um = posthoc.wrap(model, method="dac", dense=True).fit(loader, loader, progress=False)
    card = um.summary()["posterior"][-1]
    assert card["layers"] == ["head:input"] and card["training_examples_seen"] == 24 * 11  # every kept token
    pred = um.predict(ids[:3])
    assert pred.probs.shape == (3, 12, 50) and torch.allclose(pred.probs.sum(-1), torch.ones(3, 12), atol=1e-5)
