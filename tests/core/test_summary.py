"""The model card (``um.summary()``): keys and values per method and composition, fit data and cost,
save/load, unfitted models, files written before cards existed, and the Markdown rendering."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import posthoc
from posthoc.core import persistence
from posthoc.core.fit_record import CountingLoader, FitRecord, counting, examples
from posthoc.core.model_card import SHOWN_ITEMS, ModelCard
from posthoc.methods.mc_dropout.method import P_GRID
from posthoc_apps.demo import zoo

FORMAT1 = Path(__file__).parent / "data" / "format1"
MODEL_KEYS = {
    "methods",
    "fitted",
    "random_variables",
    "posterior",
    "train_examples",
    "val_examples",
    "fit_wall_seconds",
    "fit_cpu_seconds",
    "model_class",
    "fingerprint",
    "posthoc_version",
    "selection",
}


def _batches(dataset: torch.utils.data.TensorDataset, size: int = 100) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = dataset.tensors
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(y), size)]


def test_the_plain_model_card_says_zero_random_variables_and_what_fit_saw(digits_model: nn.Module, loaders) -> None:
    um = posthoc.wrap(digits_model, method="none")
    card = um.summary()
    assert set(card) == MODEL_KEYS and isinstance(card, ModelCard) and isinstance(card, dict)
    assert card["methods"] == ["none"] and card["fitted"] is True and card["random_variables"] == 0
    assert card["posterior"] == [
        {"method": "none", "options": {}, "fitted": True, "random_variables": 0, "layers": [], "selection": None}
    ]
    assert card["selection"] is None  # the plain model chooses nothing on held-out data
    assert card["model_class"] == "DigitsCNN" and card["posthoc_version"] == posthoc.__version__
    assert card["fingerprint"] == persistence.fingerprint(digits_model)
    assert [card[key] for key in ("train_examples", "val_examples", "fit_wall_seconds", "fit_cpu_seconds")] == [
        None
    ] * 4
    card = um.fit(loaders["fit"], loaders["calibration"], progress=False).summary()
    assert (card["train_examples"], card["val_examples"]) == (2400, 600)
    assert card["fit_wall_seconds"] >= 0 and card["fit_cpu_seconds"] >= 0
    json.dumps(card)  # plain values only


def test_mc_dropout_counts_the_units_its_sites_drop(digits_model: nn.Module, digits, loaders) -> None:
    um = posthoc.wrap(digits_model, method="mc-dropout").fit(loaders["fit"], progress=False)  # no val_loader: own rate
    before = um.summary()["posterior"][0]
    assert before["random_variables"] is None and before["dropout_rate"] == [
        0.25
    ]  # units known once a batch is sampled
    assert before["rate_from"] == "the model's own dropout" and before["layers"] == ["classifier.3"]
    um.predict(digits.test.tensors[0][:4])
    entry = um.summary()["posterior"][0]
    assert entry["random_variables"] == 64 and entry["dropout_units"] == [64]  # the 64 hidden units of the MLP head
    assert entry["masks"] == "per_example" and entry["num_samples"] == 50 and entry["validation_nll"] is None
    inserted = posthoc.wrap(zoo.pretrained("digits_bn_cnn"), method="mc-dropout", num_samples=10, masks="shared")
    card = inserted.fit(loaders["fit"], loaders["calibration"], progress=False).summary()
    entry = card["posterior"][0]
    assert card["random_variables"] == entry["random_variables"] == 64 and entry["layers"] == ["fc"]  # fc's 64 inputs
    assert len(entry["dropout_rate"]) == 1 and entry["dropout_rate"][0] in (0.0, *P_GRID)
    assert entry["rate_from"].startswith("held-out NLL")
    chosen = next(row for row in entry["selection"]["candidates"] if row["chosen"])
    assert chosen["value"] == entry["dropout_rate"][0] and chosen["bound"] <= entry["selection"]["tolerance"]
    assert chosen["clean_nll"] == pytest.approx(entry["validation_nll"], abs=1e-6)
    fixed = posthoc.wrap(zoo.pretrained("digits_bn_cnn"), method="mc-dropout", p=0.1)
    assert fixed.summary()["posterior"][0]["rate_from"] == "option p"


def test_mc_dropout_units_are_per_example_and_whole_channels_for_channel_dropout() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 6, 3, padding=1),
        nn.Dropout2d(0.2),
        nn.Flatten(),
        nn.Linear(6 * 5 * 5, 7),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Linear(7, 3),
    ).eval()
    um = posthoc.wrap(net, method="mc-dropout", num_samples=3)
    um.predict(torch.randn(4, 1, 5, 5))
    entry = um.summary()["posterior"][0]
    assert entry["dropout_units"] == [6, 7] and entry["random_variables"] == 13
    assert entry["sites"] == ["1 (output, whole channels)", "5 (output)"]
    assert posthoc.wrap(net, method="mc-dropout", p=0.0).summary()["random_variables"] == 0  # no dropout, no variables


def test_temperature_and_a_composition_sum_their_methods(digits_model: nn.Module, loaders) -> None:
    alone = posthoc.wrap(digits_model, method="temperature").fit(None, loaders["calibration"], progress=False).summary()
    assert alone["methods"] == ["temperature"] and len(alone["posterior"]) == 1  # not the plain model inside it
    assert alone["random_variables"] == alone["posterior"][0]["random_variables"]
    assert alone["train_examples"] is None and alone["val_examples"] == 600
    um = posthoc.wrap(digits_model, method=["mc-dropout", "temperature"], num_samples=8)
    card = um.fit(loaders["fit"], loaders["calibration"], progress=False).summary()  # temperature samples the dropout
    assert card["methods"] == ["mc-dropout", "temperature"]
    assert [entry["method"] for entry in card["posterior"]] == card["methods"]
    assert card["posterior"][0]["options"] == {"num_samples": 8} and card["posterior"][0]["random_variables"] == 64
    assert card["random_variables"] == sum(entry["random_variables"] for entry in card["posterior"])


def test_an_unfitted_model_gets_a_card_that_says_so(digits_model: nn.Module) -> None:
    card = posthoc.wrap(digits_model, method=["mc-dropout", "temperature"]).summary()
    assert card["fitted"] is False and card["random_variables"] is None
    assert [entry["fitted"] for entry in card["posterior"]] == [True, False]
    assert card["posterior"][1] == {
        "method": "temperature",
        "options": {},
        "fitted": False,
        "random_variables": None,
        "selection": None,
    }
    assert "| fitted | False |" in card.to_markdown()


def test_the_card_survives_save_and_load(tmp_path, digits_model: nn.Module, loaders) -> None:
    um = posthoc.wrap(digits_model, method=["mc-dropout", "temperature"], num_samples=8)
    um.fit(loaders["fit"], loaders["calibration"], progress=False)
    um.save(tmp_path / "card.pt")
    assert persistence.read(tmp_path / "card.pt")["fit"] == um.fit_record.to_dict()
    loaded = posthoc.load(tmp_path / "card.pt", zoo.pretrained())
    assert loaded.summary() == um.summary()
    assert loaded.summary()["fit_cpu_seconds"] == um.fit_record.cpu_seconds


def test_a_file_written_before_cards_loads_with_an_unrecorded_fit() -> None:
    maker_spec = importlib.util.spec_from_file_location("make_fixtures", FORMAT1 / "make_fixtures.py")
    maker = importlib.util.module_from_spec(maker_spec)
    maker_spec.loader.exec_module(maker)
    assert "fit" not in persistence.read(FORMAT1 / "temperature.pt")
    card = posthoc.load(FORMAT1 / "temperature.pt", maker.model()).summary()
    assert card["fitted"] is True and card["methods"] == ["temperature"]
    assert card["train_examples"] is None and card["fit_wall_seconds"] is None


def test_loaders_without_a_dataset_are_counted_in_the_one_pass_fit_makes(digits_model: nn.Module, digits) -> None:
    val = _batches(digits.calibration)
    um = posthoc.wrap(digits_model, method="mc-dropout", p="auto", num_samples=4)
    um.fit(None, iter(val), progress=False)  # a one-shot iterator: a second pass would see nothing
    card = um.summary()
    assert card["val_examples"] == 600 and card["train_examples"] is None
    assert card["posterior"][0]["dropout_rate"][0] in (0.0, *P_GRID)
    # a loader the fit never reads is not counted (the plain model reads none)
    card = posthoc.wrap(digits_model, method="none").fit(_batches(digits.fit), progress=False).summary()
    assert card["train_examples"] is None


def test_counting_loader_passes_batches_through_and_counts_the_first_full_pass() -> None:
    batches = [(torch.zeros(3, 2), torch.zeros(3)), ({"a": torch.zeros(2, 1)}, torch.zeros(2))]
    counted = counting(batches)
    assert isinstance(counted, CountingLoader) and len(counted) == 2
    for got, expected in zip(counted, batches):
        assert got is expected
    assert examples(counted) == 5
    next(iter(counted))  # a later, partial pass changes nothing
    assert examples(counted) == 5
    partial = counting(batches)
    next(iter(partial))
    assert examples(partial) is None  # never run through
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(7, 2)), batch_size=3)
    assert counting(loader) is loader and examples(loader) == 7
    assert counting(None) is None and examples(None) is None
    assert FitRecord.from_dict(None) is None and FitRecord.from_dict(
        FitRecord(1, None, 0.5, 0.25).to_dict()
    ) == FitRecord(1, None, 0.5, 0.25)


def test_markdown_renders_every_key(digits_model: nn.Module, loaders) -> None:
    um = posthoc.wrap(digits_model, method=["mc-dropout", "temperature"], num_samples=8)
    card = um.fit(loaders["fit"], loaders["calibration"], progress=False).summary()
    text = card.to_markdown()
    assert text.startswith("# Model card: mc-dropout + temperature\n")
    for key in set(card) - {"posterior", "selection"}:
        assert f"| {key} |" in text, key
    assert card["selection"]["knob"] == "calibration" and "Held-out choice of the calibration" in text
    sections = text.split("\n## ")[1:]
    assert [section.splitlines()[0] for section in sections] == ["1. mc-dropout", "2. temperature"]
    for section, entry in zip(sections, card["posterior"]):
        for key in entry["options"]:
            assert f"| options.{key} |" in section, key
        for key in set(entry) - {"method", "options", "selection"}:
            assert f"| {key} |" in section, key
        if entry["selection"]:
            assert f"Held-out choice of the {entry['selection']['knob']}" in section
    assert f"| fingerprint | {card['fingerprint']} |" in text and "| train_examples | 2400 |" in text


def test_markdown_cuts_long_lists_and_escapes_table_characters() -> None:
    entry = {
        "method": "x",
        "options": {"where": "a|b"},
        "fitted": True,
        "random_variables": 3,
        "layers": [f"block{i}" for i in range(SHOWN_ITEMS + 5)],
    }
    text = ModelCard.of([entry], None, model_class="Net", fingerprint=None, version="0").to_markdown()
    assert f"block{SHOWN_ITEMS - 1}, ... ({SHOWN_ITEMS + 5} in all) |" in text and f"block{SHOWN_ITEMS}," not in text
    assert "| options.where | a\\|b |" in text and "| fingerprint | - |" in text


@pytest.mark.parametrize("method", ["none", "mc-dropout"])
def test_a_method_that_needs_no_fit_has_a_card_before_fit(digits_model: nn.Module, method: str) -> None:
    card = posthoc.wrap(digits_model, method=method).summary()
    assert card["fitted"] is True and card["fingerprint"] == persistence.fingerprint(digits_model)
