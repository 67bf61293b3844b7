"""``method="auto"``: the selection step choosing the method, its record, files, fall-backs and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import linear_data_regressor, rule_choice
from torch import nn

import posthoc
from posthoc.errors import ConfigError, InputError
from posthoc_apps.demo import zoo


@pytest.fixture(scope="module")
def fitted(small) -> posthoc.UncertainModel:
    return posthoc.wrap(zoo.pretrained("digits_bn_cnn"), keep_candidates=True).fit(
        small["fit"], small["val"], progress=False
    )


def test_auto_is_the_default_and_keeps_the_admissible_candidate_the_rule_picks(fitted) -> None:
    assert fitted.methods == ["auto"]
    record = fitted.summary()["selection"]
    rows = {row["candidate"]: row for row in record["candidates"]}
    # the defaults for a model without dropout of its own, the plain model first
    assert list(rows) == ["none", "temperature", "vector", "laplace", "none+dac", "laplace+dac"]
    assert rows["none"]["excess"] == 0 and rows["none"]["admissible"]
    admissible = [row for row in rows.values() if row["admissible"]]
    chosen = next(row for row in rows.values() if row["chosen"])
    assert chosen["candidate"] == rule_choice(record)
    assert all(row["bound"] <= record["tolerance"] for row in admissible)
    assert fitted.method.chosen_label == chosen["candidate"] == record["chosen"]
    for row in rows.values():
        assert row["fit_seconds"] >= 0 and row["predict_cost"] > 0
    assert record["knob"] == "method" and record["perturbed"] == 3 * record["examples"]


def test_the_chosen_chain_predicts_as_auto_and_survives_a_file(fitted, small, tmp_path) -> None:
    x = small["x"][:64]
    chosen = fitted.method.fitted_candidates[fitted.method.chosen_label]
    with torch.no_grad():
        torch.testing.assert_close(fitted.method.log_predictive(x)[0], chosen.log_predictive(x)[0], rtol=0, atol=0)
    fitted.save(tmp_path / "auto.pt")
    loaded = posthoc.load(tmp_path / "auto.pt", zoo.pretrained("digits_bn_cnn"))
    torch.testing.assert_close(loaded.predict(x).probs, fitted.predict(x).probs, rtol=0, atol=0)
    assert loaded.summary()["selection"] == fitted.summary()["selection"]
    assert loaded.method.chosen_label == fitted.method.chosen_label


def test_every_candidate_can_be_kept_and_compared(fitted, small) -> None:
    kept = fitted.method.fitted_candidates
    assert set(kept) == {row["candidate"] for row in fitted.summary()["selection"]["candidates"]}
    for label, chain in kept.items():
        with torch.no_grad():
            log_probs, _ = chain.log_predictive(small["x"][:8])
        assert torch.allclose(log_probs.exp().sum(-1), torch.ones(8), atol=1e-5), label


def test_without_validation_data_auto_is_last_layer_laplace(small) -> None:
    um = posthoc.wrap(zoo.pretrained("digits_bn_cnn")).fit(small["fit"], progress=False)
    assert um.method.chosen_label == "laplace"
    assert um.summary()["selection"]["knob"] == "prior_precision"  # Laplace's own choice, on training rows
    with pytest.raises(InputError, match="falls back to 'laplace'"):
        posthoc.wrap(zoo.pretrained("digits_bn_cnn"), candidates=["temperature"]).fit(small["fit"], progress=False)


def test_own_candidates_with_options_and_a_new_choice(small) -> None:
    um = posthoc.wrap(
        zoo.pretrained(), method="auto", candidates=["temperature", {"method": ["laplace", "dac"], "anchor": 0.9}]
    )
    um.fit(small["fit"], small["val"], progress=False)
    labels = [row["candidate"] for row in um.summary()["selection"]["candidates"]]
    assert labels == ["none", "temperature", "laplace+dac (anchor=0.9)"]
    chosen = um.method.chosen_label
    um.choose(small["val"], shift=None)  # only the chosen chain is kept: its own choices are made again
    assert um.method.chosen_label == chosen


@pytest.mark.parametrize(
    "candidates, message",
    [
        ("laplace", "candidates must be None"),
        ([], "candidates must be None"),
        ([3], "an auto candidate is a method name"),
        (["auto"], "'auto' cannot be a candidate of itself"),
        (["nope"], "unknown method 'nope'"),
        ([{"method": "laplace", "hessian": "nope"}], "hessian must be one of"),
        ([{"method": "temperature", "bins": 3}], r"unknown option\(s\) \['bins'\]"),
    ],
)
def test_bad_candidates_are_refused_at_wrap(candidates, message) -> None:
    with pytest.raises(ConfigError, match=message):
        posthoc.wrap(zoo.pretrained(), method="auto", candidates=candidates)


def test_a_default_that_refuses_the_model_is_left_out_and_named(small) -> None:
    """A one-logit binary classifier: Laplace's softmax GGN needs two outputs, so laplace and laplace+dac are left out."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1), nn.Flatten(0))
    x = torch.randn(300, 4)
    y = (x[:, 0] > 0).long()
    loader = [(x[i : i + 100], y[i : i + 100]) for i in range(0, 200, 100)]
    with pytest.warns(RuntimeWarning) as caught:
        um = posthoc.wrap(net).fit(loader, [(x[200:], y[200:])], progress=False)
    card = um.summary()["posterior"][0]
    assert "laplace" in card["left_out"] and "needs a head with at least 2 outputs" in card["left_out"]["laplace"]
    assert "laplace" not in {row["candidate"] for row in um.summary()["selection"]["candidates"]}
    # issue 44: named in the selection record and in a warning, once per candidate left out
    assert um.summary()["selection"]["left_out"] == card["left_out"]
    said = [str(w.message) for w in caught if "leaves out the candidate" in str(w.message)]
    assert sorted(said) == sorted(
        f"'auto' leaves out the candidate '{label}': {why}" for label, why in card["left_out"].items()
    )


def test_a_default_that_refuses_the_held_out_data_is_left_out_and_a_named_one_is_refused() -> None:
    """Held-out data with 4 examples of one class: vector scaling needs 5 of every class. Among the defaults it is left
    out with its reason; named by the user it is refused, as a named candidate that refuses the model is at fit."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    x = torch.randn(64, 4)
    y = torch.cat([torch.zeros(30), torch.ones(30), torch.full((4,), 2.0)]).long()
    defaults = posthoc.wrap(net).fit([(x, y)], [(x, y)], progress=False)
    card = defaults.summary()["posterior"][0]
    assert "at least 5 held-out examples of every class (class 2: 4)" in card["left_out"]["vector"]
    assert "vector" not in {row["candidate"] for row in defaults.summary()["selection"]["candidates"]}
    with pytest.raises(InputError, match=r"class 2: 4"):
        posthoc.wrap(net, candidates=["vector"]).fit([(x, y)], [(x, y)], progress=False)


def test_a_regressor_chooses_on_held_out_gaussian_nll() -> None:
    net, x, y = linear_data_regressor(400, 250, 0.3)
    um = posthoc.wrap(net, method="auto", likelihood="regression").fit(
        [(x[:250], y[:250])], [(x[250:], y[250:])], progress=False
    )
    record = um.summary()["selection"]
    assert [row["candidate"] for row in record["candidates"]] == ["none", "laplace"]  # no dropout of its own
    assert all(math.isfinite(row["clean_nll"]) for row in record["candidates"])
    # shift-aware: feature-noise copies of the 150 held-out rows at three strengths graded by the rise in RMSE
    assert record["perturbed"] == 3 * 150 and record["shift"]["graded_by"] == "rmse"
    assert record["chosen"] == rule_choice(record)
    assert um.predict(x[:5]).mean.shape == (5, 1)
