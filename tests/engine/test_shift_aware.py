"""Shift-aware held-out choices: perturbed copies of the validation batches, graded per model, and the rule that uses them."""

from __future__ import annotations

import pytest
import torch
from conftest import rule_choice

import posthoc
import posthoc_apps.demo.zoo
from posthoc.engine import held_out, perturb
from posthoc.errors import ConfigError, InputError


def _records(model, small, shift):
    fit = lambda method: posthoc.wrap(model, method=method).fit(small["fit"], small["val"], progress=False, shift=shift)
    methods = ["laplace", "temperature", ["laplace", "temperature"]]
    if any(isinstance(m, torch.nn.Dropout) for m in model.modules()):
        methods.append("mc-dropout")
    return {"+".join([m] if isinstance(m, str) else m): fit(m).summary()["selection"] for m in methods}


@pytest.mark.parametrize("name", ["digits_cnn", "digits_bn_cnn"])
def test_shift_none_scores_clean_data_only_and_takes_the_last_admissible_near_the_best(name, small):
    """Without perturbed copies nothing is scored on them, and the rule takes the last admissible candidate (the widest
    spread of a walk, the clean fit of a calibrator)."""
    for method, record in _records(posthoc_apps.demo.zoo.pretrained(name), small, shift=None).items():
        assert record["perturbed"] == 0 and all(row["shifted_nll"] is None for row in record["candidates"]), method
        assert record["chosen"] == rule_choice(record), method


@pytest.mark.parametrize("name", ["digits_cnn", "digits_bn_cnn"])
def test_shift_aware_choices_take_the_admissible_candidate_of_lowest_perturbed_nll_ratio(name, small):
    for method, record in _records(posthoc_apps.demo.zoo.pretrained(name), small, shift="auto").items():
        assert record["perturbed"] == 3 * record["examples"], method
        admissible = [row for row in record["candidates"] if row["admissible"]]
        assert record["chosen"] == rule_choice(record), method
        assert all(row["bound"] <= record["tolerance"] for row in admissible), method


def test_laplace_shift_aware_prior_is_never_wider_than_the_clean_rule_allows(small):
    model = posthoc_apps.demo.zoo.pretrained("digits_bn_cnn")
    clean = posthoc.wrap(model, method="laplace").fit(small["fit"], small["val"], progress=False, shift=None)
    aware = posthoc.wrap(model, method="laplace").fit(small["fit"], small["val"], progress=False)
    assert aware.method.summary()["prior_precision"] >= clean.method.summary()["prior_precision"]
    assert aware.summary()["selection"]["perturbed"] > 0 and clean.summary()["selection"]["perturbed"] == 0


# ------------------------------------------------------------------ the engine


def test_grade_puts_each_strength_where_accuracy_falls_that_far():
    kind = perturb.Kind(lambda x, s, g: x, (0.1, 0.2, 0.4, 0.8, 1.6))
    accuracy = lambda k, s: max(0.1, 1.0 - s)  # noqa: E731
    graded = perturb.grade(accuracy, {"k": kind}, clean_accuracy=1.0, chance=0.1, fractions=(0.25, 0.5))
    for fraction, parameter in zip((0.25, 0.5), graded["k"]):
        target = 1.0 - fraction * 0.9
        assert parameter == pytest.approx(1 - target, rel=0.15)  # log-linear interpolation of a linear curve
    robust = perturb.grade(lambda k, s: 1.0, {"k": kind}, clean_accuracy=1.0, chance=0.1, fractions=(0.5,))
    assert robust["k"] == (1.6,)  # never reaches the target: the strongest rung


def test_graded_strengths_follow_the_model(small):
    """Each level lands near the accuracy it is graded for, on the examples it was graded on."""
    x, y = small["val"].dataset.tensors
    rows = [(x, y)]
    model = posthoc_apps.demo.zoo.pretrained("digits_cnn")
    shifted = held_out.shifted_held_out(rows, lambda x: model(x).log_softmax(-1), "auto", device="cpu")
    assert [len(level) for level in shifted.levels] == [3, 3, 3]
    with torch.no_grad():
        clean = float((model(x).argmax(-1) == y).float().mean())
        accuracies = [float((model(px).argmax(-1) == py).float().mean()) for px, py in shifted]
    chance = 1 / 8
    for fraction, accuracy in zip(held_out.STRENGTHS, accuracies):
        assert accuracy == pytest.approx(clean - fraction * (clean - chance), abs=0.15)
    assert accuracies[0] > accuracies[1] > accuracies[2]


def test_shifted_held_out_is_the_same_on_every_pass_and_keeps_labels(small):
    model = posthoc_apps.demo.zoo.pretrained("digits_bn_cnn")
    shifted = held_out.shifted_held_out(
        small["val"], lambda x: model(x).log_softmax(-1), ["noise", "impulse"], device="cpu"
    )
    first, second = list(shifted), list(shifted)
    assert len(first) == len(small["val"]) * len(held_out.STRENGTHS) == len(shifted)
    for (a, ya), (b, yb) in zip(first, second):
        assert torch.equal(a, b) and torch.equal(ya, yb)
    labels = torch.cat([y for _, y in small["val"]])
    assert torch.equal(torch.cat([y for _, y in first[::3]]), labels)
    assert held_out.shifted_held_out(small["val"], None, None, device="cpu") is None


def test_user_callables_are_used_as_given(small):
    seen = []

    def flip(x, generator):
        seen.append(x.shape)
        return x.flip(-1)

    shifted = held_out.shifted_held_out(small["val"], None, [flip], device="cpu")
    batches = list(shifted)
    x, _ = next(iter(small["val"]))
    assert len(batches) == len(small["val"]) and torch.equal(batches[0][0], x.flip(-1)) and seen


def test_each_input_gets_its_own_family():
    assert set(perturb.family_for(torch.randn(2, 3, 8, 8))) == {"noise", "blur", "impulse"}
    assert set(perturb.family_for(torch.randn(4, 5))) == {"feature-noise"}
    assert set(perturb.family_for(torch.ones(2, 6, dtype=torch.long))) == {"token-replace"}
    assert set(perturb.family_for({"input_ids": torch.ones(2, 6, dtype=torch.long)})) == {"token-replace"}
    assert set(perturb.family_for({"pixel_values": torch.randn(2, 3, 8, 8)})) == {"noise", "blur", "impulse"}
    with pytest.raises(InputError, match="shift=None"):
        perturb.family_for(torch.randn(2, 3, 4))
    # a dict batch of feature vectors (a tabular model's forward(x) fed {"x": ...}) takes feature-noise (issue 46)
    assert set(perturb.family_for({"x": torch.randn(2, 3), "ids": torch.ones(2, 4, dtype=torch.long)})) == {
        "feature-noise"
    }
    with pytest.raises(InputError, match="shift=None"):
        perturb.family_for({"input_features": torch.randn(2, 3, 4)})


def test_perturbations_keep_shape_and_touch_only_what_they_claim():
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(4, 3, 16, 16)
    for kind in perturb.IMAGE_KINDS.values():
        out = kind.perturb(images, kind.ladder[2], generator)
        assert out.shape == images.shape and out.dtype == images.dtype and not torch.equal(out, images)
    impulse = perturb.image_impulse(images, 0.2, generator)
    changed = (impulse != images).float().mean()
    assert 0.15 < float(changed) < 0.25
    ids = torch.arange(1, 41).view(2, 20)
    mask = torch.ones_like(ids)
    mask[:, 15:] = 0
    replaced = perturb.token_replace({"input_ids": ids, "attention_mask": mask}, 0.5, generator)
    assert torch.equal(replaced["input_ids"][:, 15:], ids[:, 15:])  # padding untouched
    assert set(replaced["input_ids"][:, :15].unique().tolist()) <= set(ids[:, :15].unique().tolist())
    assert not torch.equal(replaced["input_ids"], ids)
    features = torch.randn(64, 5) * torch.tensor([1.0, 10.0, 100.0, 0.1, 1.0])
    noisy = perturb.feature_noise(features, 0.5, generator)
    ratio = (noisy - features).std(0) / features.std(0)
    assert torch.allclose(ratio, torch.full((5,), 0.5), rtol=0.35)


def test_bad_shift_values_are_refused(small, digits_model):
    um = posthoc.wrap(digits_model, method="temperature")
    for bad in ("always", [], [3], {"noise": 1}, True):
        with pytest.raises(ConfigError, match="shift must be None"):
            um.fit(None, small["val"], progress=False, shift=bad)
    with pytest.raises(ConfigError, match="unknown fit-time perturbation"):
        um.fit(None, small["val"], progress=False, shift=["rotate"])


@pytest.mark.parametrize(
    ("inputs", "kind", "suited"),
    [
        (torch.randn(24, 3), "blur", "feature-noise"),
        (torch.randn(24, 3), "impulse", "feature-noise"),
        (torch.randint(0, 50, (24, 5)), "noise", "token-replace"),
        (torch.rand(24, 1, 8, 8), "token-replace", "noise, blur, impulse"),
    ],
)
def test_a_named_kind_that_does_not_suit_the_inputs_is_refused_naming_those_that_do(inputs, kind, suited):
    """Blur and impulse index image axes, noise image channels: on features or token ids they raised IndexError
    (or, for token-replace on images, silently shuffled pixel values). Each input keeps the kinds of its family."""
    model = (
        torch.nn.Sequential(torch.nn.Embedding(50, 4), torch.nn.Flatten(), torch.nn.Linear(20, 3))
        if not inputs.is_floating_point()
        else torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(inputs[0].numel(), 3))
    )
    loader = [(inputs[:12], torch.arange(12) % 3), (inputs[12:], torch.arange(12) % 3)]
    um = posthoc.wrap(model, method="temperature")
    with pytest.raises(ConfigError, match=f"the kinds that do: {suited}"):
        um.fit(None, loader, progress=False, shift=[kind])
    um.fit(None, loader, progress=False, shift=[suited.split(", ")[0]])  # the family's own kind fits


def test_a_shift_callable_that_changes_the_inputs_shape_is_named(small, digits_model):
    """Two callables of different output shapes met in torch.stack (a raw RuntimeError): the one that changes the
    shape is named by its place in the list."""
    keep, crop = (lambda x, generator: x), (lambda x, generator: x[..., :20, :20])
    um = posthoc.wrap(digits_model, method="temperature")
    with pytest.raises(InputError, match=r"shift\[1\] \(<lambda>\) returned inputs of shape \(128, 1, 20, 20\)"):
        um.fit(None, small["val"], progress=False, shift=[keep, crop])


def test_a_one_shot_iterator_is_read_once_and_its_perturbed_copies_are_made_from_what_was_read(small, digits_model):
    um = posthoc.wrap(digits_model, method="temperature").fit(None, iter(list(small["val"])), progress=False)
    record = um.summary()["selection"]
    assert record["examples"] == 256 and record["perturbed"] == 3 * 256
