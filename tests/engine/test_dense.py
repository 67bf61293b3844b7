"""Dense outputs (posthoc.engine.dense): a segmentation FCN on digit canvases and a tiny GPT-2 through posthoc.wrap(dense=True)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.engine.dense import GROUP_COPIES
from posthoc.errors import PosthocError
from posthoc_apps.demo.segmentation import IGNORE, NUM_CLASSES, loaders, segmentation_data, trained_fcn


@pytest.fixture(scope="module")
def segmentation():
    data = segmentation_data(train=192, val=96, test=48)
    return data, trained_fcn(data.train, epochs=3)


def _per_position_nll(probs, masks):
    valid = masks != IGNORE
    return float(-probs.movedim(1, -1)[valid].gather(-1, masks[valid][:, None]).clamp_min(1e-12).log().mean())


def test_prediction_fields_are_shaped_per_position(segmentation):
    data, model = segmentation
    um = posthoc.wrap(model, method="none", dense=True).fit(None, loaders(data)[1], progress=False)
    images, _ = data.test.tensors
    pred = um.predict(images[:5])
    assert pred.probs.shape == (5, NUM_CLASSES, 32, 32)
    for name in ("entropy", "aleatoric", "epistemic", "confidence", "label"):
        assert getattr(pred, name).shape == (5, 32, 32), name
    assert torch.allclose(pred.probs.sum(1), torch.ones(5, 32, 32), atol=1e-5)


def test_none_is_the_softmax_at_every_position(segmentation):
    data, model = segmentation
    um = posthoc.wrap(model, method="none", dense=True).fit(None, loaders(data)[1], progress=False)
    images, _ = data.test.tensors
    with torch.no_grad():
        expected = torch.softmax(model(images), dim=1)
    # a small max_memory streams the inputs in several chunks
    assert torch.allclose(um.predict(images, max_memory=2**20).probs, expected, atol=1e-6)


def test_ignored_positions_change_nothing(segmentation):
    data, model = segmentation
    images, masks = data.val.tensors
    other = masks.clone()
    other[masks == IGNORE] = -100  # the other default ignore index, at the same positions
    temperatures = []
    for labels in (masks, other):
        val = DataLoader(TensorDataset(images, labels), batch_size=32)
        um = posthoc.wrap(model, method="temperature", dense=True).fit(None, val, progress=False)
        temperatures.append(float(um.inner.method.temperature))
    assert temperatures[0] == temperatures[1]
    assert temperatures[0] != 1.0  # it did fit something on the valid positions


def test_temperature_keeps_per_pixel_nll_in_distribution(segmentation):
    data, model = segmentation
    _, val, _ = loaders(data)
    images, masks = data.test.tensors
    plain = _per_position_nll(
        posthoc.wrap(model, method="none", dense=True).fit(None, val, progress=False).predict(images).probs, masks
    )
    um = posthoc.wrap(model, method="temperature", dense=True).fit(None, val, progress=False)
    calibrated = _per_position_nll(um.predict(images).probs, masks)
    assert calibrated <= plain + max(0.02 * plain, 0.005)


def test_auto_chooses_by_the_per_image_bound(segmentation):
    data, model = segmentation
    train, val, _ = loaders(data)
    um = posthoc.wrap(model, method="auto", dense=True).fit(train, val, progress=False)
    selection = um.summary()["posterior"][0]["selection"]
    assert {row["candidate"] for row in selection["candidates"]} == {"none", "temperature"}
    assert selection["chosen"] in {"none", "temperature"}


def test_held_out_positions_carry_their_image(segmentation):
    from posthoc.core.likelihood import Categorical
    from posthoc.engine.held_out import HeldOut

    data, model = segmentation
    um = posthoc.wrap(model, method="none", dense=True).fit(None, loaders(data)[1], progress=False)
    held = HeldOut.read(
        um._rows(loaders(data)[1]), model=um.inner.method.model, likelihood=Categorical(), shift=None, device="cpu"
    )
    masks = data.val.tensors[1]
    assert held.plain.units.shape == held.plain.clean.shape == (int((masks != IGNORE).sum()),)
    assert torch.equal(held.plain.units.bincount(), (masks != IGNORE).flatten(1).sum(1))


def test_perturbed_copies_are_graded_and_grouped_per_position(segmentation):
    """shift="auto" on dense batches: every perturbed copy keeps its image's labels, one group per kept position."""
    from posthoc.core.likelihood import Categorical
    from posthoc.engine.held_out import HeldOut

    data, model = segmentation
    val = loaders(data)[1]
    um = posthoc.wrap(model, method="none", dense=True).fit(None, val, progress=False)
    held = HeldOut.read(
        um._rows(val), model=um.inner.method.model, likelihood=Categorical(), shift="auto", device="cpu"
    )
    levels = len(held.shifted.levels)
    positions = int((data.val.tensors[1] != IGNORE).sum())
    assert held.plain.clean.shape == (positions,) and held.plain.shifted.shape == (levels * positions,)
    assert held.plain.groups.shape == (levels * positions,) and held.plain.groups.unique().numel() > levels
    copies = torch.cat([y for _, y in held.perturbed()])
    # each clean batch at every level, its labels unmoved
    assert torch.equal(copies, torch.cat([y.repeat(levels) for _, y in held.clean()]))
    # the copies are harder for the plain model than the clean positions
    assert float(held.plain.shifted.mean()) > float(held.plain.clean.mean())


def test_a_shift_aware_dense_fit_records_its_perturbed_copies(segmentation):
    data, model = segmentation
    val = DataLoader(TensorDataset(*(t[:32] for t in data.val.tensors)), batch_size=16)
    train = DataLoader(TensorDataset(*(t[:32] for t in data.train.tensors)), batch_size=16)
    um = posthoc.wrap(model, method="auto", dense=True).fit(train, val, shift="auto", progress=False)
    selection = um.summary()["posterior"][0]["selection"]
    assert selection["perturbed"] > 0 and selection["chosen"] in {"none", "temperature"}
    clean = posthoc.wrap(model, method="auto", dense=True).fit(train, val, progress=False)
    assert clean.summary()["posterior"][0]["selection"]["perturbed"] == 0  # shift=None is the dense default


def test_ensemble_of_fcns_has_epistemic_uncertainty(segmentation):
    data, model = segmentation
    other = trained_fcn(data.train, epochs=3, seed=1)
    um = posthoc.wrap([model, other], dense=True).fit(None, loaders(data)[1], progress=False)
    pred = um.predict(data.test.tensors[0][:4])
    assert pred.probs.shape == (4, NUM_CLASSES, 32, 32)
    assert float(pred.epistemic.mean()) > 0


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=32)).eval()


@pytest.mark.parametrize("method", ["none", "temperature"])
def test_tokens_through_a_tiny_gpt2(method):
    model = _tiny_gpt2()
    ids = torch.randint(0, 50, (24, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100  # no next token at the end
    val = DataLoader(TensorDataset(ids, labels), batch_size=8)
    um = posthoc.wrap(model, method=method, dense=True).fit(None, val, progress=False)
    pred = um.predict(ids[:3])
    assert pred.probs.shape == (3, 12, 50)
    assert pred.entropy.shape == (3, 12)
    if method == "none":
        with torch.no_grad():
            assert torch.allclose(pred.probs, torch.softmax(model(ids[:3]).logits, -1), atol=1e-6)


def test_labels_of_the_wrong_shape_are_refused(segmentation):
    data, model = segmentation
    images, masks = data.val.tensors
    val = [(images[:8], masks[:8, :16])]
    with pytest.raises(PosthocError, match="do not match"):
        posthoc.wrap(model, method="temperature", dense=True).fit(None, val, progress=False)


def test_an_ambiguous_class_dim_is_refused_unless_given():
    model = torch.nn.Linear(5, 5)  # (N, 5, 5) logits: positions and classes both 5
    x, y = torch.randn(8, 5, 5), torch.randint(0, 5, (8, 5))
    with pytest.raises(PosthocError, match="ambiguous"):
        posthoc.wrap(model, method="none", dense=True).fit(None, [(x, y)], progress=False)
    um = posthoc.wrap(model, method="none", dense=True, class_dim=-1).fit(None, [(x, y)], progress=False)
    assert um.predict(x).probs.shape == (8, 5, 5)


def test_unsupported_methods_name_the_supported_ones(segmentation):
    _, model = segmentation
    with pytest.raises(PosthocError, match="'none', 'temperature', 'vector', 'auto', 'laplace', 'mc-dropout'"):
        posthoc.wrap(model, method="swag", dense=True)
    with pytest.raises(PosthocError, match="last-layer only"):
        posthoc.wrap(model, method="laplace", subset="all", dense=True)


def test_last_layer_laplace_per_position_is_the_row_laplace_of_the_head_features(segmentation):
    """KFAC over positions: the dense fit is the last-layer Laplace of a Linear head on the features of every valid
    position as rows, the same posterior and predictive (float32 sums in another order: 1e-4)."""
    from posthoc.engine.dense_head import position_head

    data, model = segmentation
    train, val, _ = loaders(data)
    options = {"prior_precision": 3.0, "hessian": "kron"}
    um = posthoc.wrap(model, method="laplace", dense=True, **options).fit(train, val, progress=False)
    valid = int((data.train.tensors[1] != IGNORE).sum())
    assert um.summary()["posterior"][0]["fit_examples"] == valid
    head = position_head(model)
    assert head.conv and head.name == "head"
    with torch.no_grad():
        features, labels = [], []
        for images, masks in train:
            keep = (masks != IGNORE).reshape(-1)
            features.append(head.feature_rows(model, images)[keep])
            labels.append(masks.reshape(-1)[keep])
        test_images, test_masks = data.test.tensors[:8]
        test_features = head.feature_rows(model, test_images)
    rows_model = head.as_linear()
    rows = posthoc.wrap(rows_model, method="laplace", **options).fit(
        DataLoader(TensorDataset(torch.cat(features), torch.cat(labels)), batch_size=4096), progress=False
    )
    expected = rows.predict(test_features).probs
    dense = um.predict(test_images).probs.movedim(1, -1).reshape(-1, NUM_CLASSES)
    assert torch.allclose(dense, expected, atol=1e-4)
    assert not torch.allclose(
        dense, torch.softmax(model(test_images), 1).movedim(1, -1).reshape(-1, NUM_CLASSES), atol=1e-3
    )


def test_mc_dropout_samples_every_position_through_the_suffix_runner(segmentation):
    """The FCN's own dropout before its 1x1 head, expanded S times inside the network: S rows per kept position."""
    data, model = segmentation
    val = DataLoader(TensorDataset(*(t[:32] for t in data.val.tensors)), batch_size=16)
    images = data.test.tensors[0][:4]
    um = posthoc.wrap(model, method="mc-dropout", dense=True, p=0.3, num_samples=16).fit(None, val, progress=False)
    assert um.summary()["posterior"][0]["sites"] == ["model.dropout (output)"]
    pred = um.predict(images, generator=torch.Generator().manual_seed(0), keep_samples=True)
    assert pred.probs.shape == (4, NUM_CLASSES, 32, 32) and pred.samples.shape == (16, 4, NUM_CLASSES, 32, 32)
    assert torch.allclose(pred.samples.mean(0), pred.probs, atol=1e-5)
    assert float(pred.epistemic.mean()) > 1e-4  # the masks differ between samples and positions
    with torch.no_grad():
        plain = torch.softmax(model(images), 1)
    assert float((pred.probs - plain).abs().max()) > 1e-3
    zero = posthoc.wrap(model, method="mc-dropout", dense=True, p=0.0, num_samples=4).fit(None, val, progress=False)
    assert torch.allclose(zero.predict(images).probs, plain, atol=1e-5)  # no dropout: the plain network


def test_samples_of_a_map_that_do_not_fit_the_budget_are_drawn_in_groups(segmentation):
    """One canvas's 16 samples (11 x 32 x 32 each) under a budget that holds 4: no call draws more than 4, and the
    prediction is that of all the groups' samples together (to float32 round-off)."""
    data, model = segmentation
    val = DataLoader(TensorDataset(*(t[:32] for t in data.val.tensors)), batch_size=16)
    images = data.test.tensors[0][:3]
    um = posthoc.wrap(model, method="mc-dropout", dense=True, p=0.3, num_samples=16).fit(None, val, progress=False)
    method, calls = um.inner.method, []
    original = method.log_predictive

    def recorded(x, **options):
        log_probs, samples = original(x, **options)
        calls.append(samples.exp())
        return log_probs, samples

    method.log_predictive = recorded
    one_sample = 4 * NUM_CLASSES * 32 * 32
    pred = um.predict(images, max_memory=4 * GROUP_COPIES * one_sample, generator=torch.Generator().manual_seed(0))
    del method.log_predictive
    assert len(calls) == 3 * 4 and all(c.shape[0] == 4 for c in calls)
    for index in range(3):
        samples = torch.cat(calls[4 * index : 4 * index + 4])  # (16, 1024 positions, 11)
        expected = posthoc.Prediction.from_probs(samples.mean(0), samples)
        probs = pred.probs[index].movedim(0, -1).reshape(-1, NUM_CLASSES)
        torch.testing.assert_close(probs, expected.probs, atol=1e-5, rtol=1e-4)
        for name in ("entropy", "aleatoric", "epistemic"):
            torch.testing.assert_close(
                getattr(pred, name)[index].reshape(-1), getattr(expected, name), atol=1e-4, rtol=1e-4
            )
    assert pred.samples is None and float(pred.epistemic.mean()) > 1e-4
    whole = um.predict(images, generator=torch.Generator().manual_seed(0))  # all 16 at once: other draws, same law
    assert float((whole.probs - pred.probs).abs().mean()) < 0.02


def test_laplace_on_a_network_that_resizes_its_logits_is_refused(segmentation):
    data, model = segmentation

    class Upsampled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x):
            small = torch.nn.functional.avg_pool2d(x, 2)
            return torch.nn.functional.interpolate(self.net(small), size=x.shape[-2:], mode="bilinear")

    with pytest.raises(PosthocError, match="not the model's logits"):
        posthoc.wrap(Upsampled(), method="laplace", dense=True).fit(*loaders(data)[:2], progress=False)


def test_laplace_per_token_on_a_tiny_gpt2():
    model = _tiny_gpt2()
    ids = torch.randint(0, 50, (24, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    loader = DataLoader(TensorDataset(ids, labels), batch_size=8)
    um = posthoc.wrap(model, method="laplace", dense=True, prior_precision=1.0).fit(loader, loader, progress=False)
    assert um.summary()["posterior"][0]["fit_examples"] == 24 * 11  # every token but the last of each sequence
    pred = um.predict(ids[:3])
    assert pred.probs.shape == (3, 12, 50) and torch.allclose(pred.probs.sum(-1), torch.ones(3, 12), atol=1e-5)
    with torch.no_grad():
        plain = torch.softmax(model(ids[:3]).logits, -1)
    assert float((pred.entropy - (-(plain * plain.log()).sum(-1))).mean()) > 0  # the posterior widens the predictive


@pytest.mark.parametrize("method", ["none", "temperature", "vector", "laplace"])
def test_the_exported_module_gives_the_per_position_probabilities_through_torch_export(segmentation, method):
    """module(x) and torch.export's program give um.predict(x).probs (N, C, H, W) to 1e-5 (float32, the same
    operations in another order), for any batch size (a dynamic batch dimension)."""
    data, model = segmentation
    images, masks = data.val.tensors
    small = [(images[:32], masks[:32])]
    um = posthoc.wrap(model, method=method, dense=True).fit(
        small if method == "laplace" else None, small, progress=False
    )
    module = um.to_module()
    x = data.test.tensors[0][:6]
    expected = um.predict(x).probs
    assert module(x).shape == (6, NUM_CLASSES, 32, 32)
    assert torch.allclose(module(x), expected, atol=1e-5)
    batch = torch.export.Dim("batch", min=2)
    program = torch.export.export(module, (x,), dynamic_shapes=({0: batch},)).module()
    assert torch.allclose(program(x), expected, atol=1e-5)
    assert torch.allclose(program(x[:3]), expected[:3], atol=1e-5)
    if method != "none":  # the method changed the probabilities, and the module follows it
        with torch.no_grad():
            assert not torch.allclose(torch.softmax(model(x), 1), expected, atol=1e-4)


def test_the_exported_module_of_a_token_model_with_laplace_keeps_its_layout():
    model = _tiny_gpt2()
    ids = torch.randint(0, 50, (16, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    loader = DataLoader(TensorDataset(ids, labels), batch_size=8)
    um = posthoc.wrap(model, method="laplace", dense=True, prior_precision=1.0).fit(loader, loader, progress=False)
    module = um.to_module()
    assert module(ids[:3]).shape == (3, 12, 50)
    assert torch.allclose(module(ids[:3]), um.predict(ids[:3]).probs, atol=1e-5)


def test_to_module_refuses_what_it_does_not_export(segmentation):
    data, model = segmentation
    images, masks = data.val.tensors
    small = [(images[:16], masks[:16])]
    um = posthoc.wrap(model, method="temperature", dense=True).fit(None, small, progress=False)
    assert torch.equal(um(images[:2]), um.predict(images[:2]).probs)
    auto = posthoc.wrap(model, method="auto", dense=True).fit(small, small, progress=False)  # exports what it chose
    assert torch.allclose(auto.to_module()(images[:2]), auto.predict(images[:2]).probs, atol=1e-5)
    dropout = posthoc.wrap(model, method="mc-dropout", dense=True, p=0.1, num_samples=2).fit(
        None, small, progress=False
    )
    with pytest.raises(posthoc.ExportError, match="does not export 'mc-dropout' yet; it exports dense classifiers"):
        dropout.to_module()
    ensemble = posthoc.wrap([model, model], dense=True).fit(None, small, progress=False)
    with pytest.raises(posthoc.ExportError, match="does not export an ensemble"):
        ensemble.to_module()
    with pytest.raises(posthoc.NotFittedError):
        posthoc.wrap(model, method="temperature", dense=True).to_module()


def test_evaluate_shift_gives_the_per_position_metrics_of_the_corrupted_images_against_the_same_masks(segmentation):
    """Every cell is dense_metrics of the model's prediction on the corrupted images (posthoc.shift.corrupt_images,
    seeded as evaluate_shift seeds it) against the unchanged masks; the default kinds move no pixel."""
    from posthoc.evaluation.dense import dense_metrics
    from posthoc.evaluation.shift import DENSE_METRICS, DENSE_NAMES
    from posthoc.shift.kinds import DENSE_EVALUATION_KINDS
    from posthoc.shift.loader import corrupt

    data, model = segmentation
    val = [tuple(t[:32] for t in data.val.tensors)]
    test = DataLoader(TensorDataset(*(t[:16] for t in data.test.tensors)), batch_size=8)
    models = {
        m: posthoc.wrap(model, method=m, dense=True).fit(None, val, progress=False) for m in ("none", "temperature")
    }
    normalization = ((0.1,), (0.3,))  # the canvases' (segmentation.canvases)
    table = posthoc.evaluate_shift(models, test, severities=[3], normalization=normalization, progress=False)
    assert table.kinds == DENSE_EVALUATION_KINDS and table.metrics == DENSE_METRICS
    masks = data.test.tensors[1][:16]
    for name, um in models.items():
        clean = posthoc.evaluate(um, test).rows[name]
        assert table.values[name]["clean"][0] == {key: clean[label] for key, label in DENSE_NAMES.items()}
        shifted = torch.cat([x for x, _ in corrupt(test, "contrast", 3, 0, normalization=normalization)])
        expected = dense_metrics(um.predict(shifted), masks)
        assert table.value(name, "contrast", 3, "nll") == pytest.approx(expected["NLL"], rel=1e-6)
        assert table.value(name, "contrast", 3, "miou") == pytest.approx(expected["mIoU"], rel=1e-6)
        assert table.value(name, "contrast", 3, "nll") != pytest.approx(clean["NLL"], rel=1e-3)  # it did corrupt
    assert "mIoU" in table.to_markdown() and table.best_method() in models
    with pytest.raises(PosthocError, match="rotate move pixels"):
        posthoc.evaluate_shift(models, test, kinds=["rotate"], severities=[1], normalization=normalization)
    with pytest.raises(PosthocError, match="ci= is not available for dense"):
        posthoc.evaluate_shift(models, test, ci=0.95)
    with pytest.raises(PosthocError, match="mix dense"):
        posthoc.evaluate_shift([models["none"], posthoc.wrap(torch.nn.Linear(2, 2), method="none")], test)
    with pytest.raises(PosthocError, match="per-position metrics"):
        table.confidence("none", "contrast", 3)


@pytest.mark.parametrize("method", ["temperature", "laplace"])
def test_a_saved_dense_posterior_loads_onto_its_checkpoint_only(segmentation, tmp_path, method):
    data, model = segmentation
    train, val, _ = loaders(data)
    um = posthoc.wrap(model, method=method, dense=True).fit(train, val, progress=False)
    path = tmp_path / f"fcn.{method}.pt"
    um.save(str(path))
    loaded = posthoc.load(str(path), model)
    images = data.test.tensors[0][:4]
    assert type(loaded) is type(um) and loaded.ignore_index == um.ignore_index
    assert torch.equal(loaded.predict(images).probs, um.predict(images).probs)  # the same code path and state
    other = trained_fcn(data.train, epochs=1, seed=3)
    with pytest.raises(PosthocError, match="different model"):
        posthoc.load(str(path), other)
    with pytest.raises(PosthocError, match="dense outputs; pass that model"):
        posthoc.load(str(path), [model, other])


@pytest.mark.parametrize("method", ["none", "temperature"])
def test_a_saved_dense_ensemble_loads_onto_its_members_only(segmentation, tmp_path, method):
    data, model = segmentation
    other = trained_fcn(data.train, epochs=1, seed=1)
    um = posthoc.wrap([model, other], method=method, dense=True).fit(None, loaders(data)[1], progress=False)
    path = tmp_path / f"two.{method}.pt"
    um.save(str(path))
    loaded = posthoc.load(str(path), [model, other])
    images = data.test.tensors[0][:4]
    assert type(loaded) is type(um) and len(loaded.position_rows) == 2
    before, after = um.predict(images, keep_samples=True), loaded.predict(images, keep_samples=True)
    assert torch.equal(after.probs, before.probs) and torch.equal(after.samples, before.samples)
    third = trained_fcn(data.train, epochs=1, seed=3)
    with pytest.raises(PosthocError, match="member 1 .* is not the checkpoint"):
        posthoc.load(str(path), [model, third])
    with pytest.raises(PosthocError, match="member 0 given is saved member 1"):
        posthoc.load(str(path), [other, model])
    with pytest.raises(PosthocError, match="ensemble with dense outputs; pass the list of its members"):
        posthoc.load(str(path), model)
