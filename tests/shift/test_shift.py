"""posthoc.shift: corruptions on the fly (kinds, severities, seeding, shapes, normalisation, errors)."""

import argparse
import json
import re

import pytest
import torch
from test_recipes import _digits_factory, _write_images
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc import shift
from posthoc_apps.cli.evaluate import add_evaluate_arguments, run_evaluate
from posthoc_apps.demo import data

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.fixture(scope="module")
def images() -> dict[str, torch.Tensor]:
    """Real digits in [0, 1] and smooth random colour images of an odd size."""
    digits = data.load_digits().test.tensors[0][:32] * data.STD + data.MEAN
    smooth = F.interpolate(
        torch.rand(8, 3, 6, 5, generator=torch.Generator().manual_seed(0)), size=(41, 33), mode="bilinear"
    )
    return {"digits": digits.clamp(0, 1), "colour": smooth}


def _change(x: torch.Tensor, kind: str, severity: int, seed: int = 0) -> float:
    return float((shift.corrupt_images(x, kind, severity, torch.Generator().manual_seed(seed)) - x).abs().mean())


@pytest.mark.parametrize("kind", shift.KINDS)
@pytest.mark.parametrize("which", ["digits", "colour"])
def test_each_kind_changes_the_images_more_at_higher_severity(images, kind, which):
    x = images[which]
    changes = [_change(x, kind, severity) for severity in (1, 3, 5)]
    assert 0 < changes[0] < changes[1] < changes[2], changes


@pytest.mark.parametrize("kind", shift.KINDS)
def test_shapes_dtypes_and_range_are_kept(images, kind):
    for x in (images["colour"], images["digits"], images["colour"].double(), (images["digits"] * 255).round().byte()):
        out = shift.corrupt_images(x, kind, 4, torch.Generator().manual_seed(0))
        assert out.shape == x.shape and out.dtype == x.dtype
        top = 255 if x.dtype == torch.uint8 else 1
        assert float(out.min()) >= 0 and float(out.max()) <= top


def test_noise_parameters_follow_imagenet_c(images):
    x = torch.full((64, 3, 32, 32), 0.5)
    noisy = shift.corrupt_images(x, "gaussian-noise", 3, torch.Generator().manual_seed(0))
    assert float((noisy - x).std()) == pytest.approx(0.18, rel=0.03)
    dots = shift.corrupt_images(x, "salt-pepper", 5, torch.Generator().manual_seed(0))
    assert float(((dots == 0) | (dots == 1)).double().mean()) == pytest.approx(0.27, abs=0.01)
    assert float(shift.corrupt_images(x, "brightness", 2, torch.Generator()).mean()) == pytest.approx(0.7)
    assert shift.SEVERITIES["jpeg"] == (25, 18, 15, 10, 7) and shift.SEVERITIES["contrast"][0] == 0.4


def test_rotation_matches_the_demo_rotation(images):
    digits = data.load_digits().test
    normalised = TensorDataset(digits.tensors[0][:8], digits.tensors[1][:8])
    turned = shift.corrupt(DataLoader(normalised, batch_size=8), "rotate", 4, normalization=(data.MEAN, data.STD))
    expected = data.rotated(normalised, shift.SEVERITIES["rotate"][3]).tensors[0]
    assert torch.allclose(next(iter(turned))[0], expected, atol=1e-5)


@pytest.mark.parametrize("kind", ["gaussian-noise", "shot-noise", "salt-pepper"])
def test_corruptions_are_seeded_and_reproducible(images, kind):
    dataset = TensorDataset(images["colour"], torch.arange(8))
    loader = DataLoader(dataset, batch_size=3)
    first = [x for x, _ in shift.corrupt(loader, kind, 3, seed=1)]
    again = [x for x, _ in shift.corrupt(loader, kind, 3, seed=1)]
    other = [x for x, _ in shift.corrupt(loader, kind, 3, seed=2)]
    wrapped = shift.corrupt(loader, kind, 3, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert all(torch.equal(a, b) for a, b in zip(first, list(x for x, _ in wrapped)))
    assert not torch.equal(first[0], other[0])
    assert not torch.equal(first[0], first[1][:3])  # batches get fresh draws
    assert len(wrapped) == 3 and [y.tolist() for _, y in wrapped] == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_normalised_inputs_are_corrupted_in_pixel_space(images):
    x = images["colour"]
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    normalised = (x - mean) / std
    for kind in ("contrast", "gaussian-noise", "jpeg"):
        expected = shift.corrupt_images(x, kind, 3, torch.Generator().manual_seed(0))
        got = shift.corrupt_images(normalised, kind, 3, torch.Generator().manual_seed(0), normalization=(MEAN, STD))
        assert torch.allclose(got * std + mean, expected, atol=1e-5), kind
    # a scalar normalisation works for one-channel digits, and the round trip of a no-op keeps the inputs
    digits = (images["digits"] - data.MEAN) / data.STD
    kept = shift.corrupt_images(digits, "brightness", 1, torch.Generator(), normalization=(data.MEAN, data.STD))
    assert torch.allclose(
        kept * data.STD + data.MEAN,
        shift.corrupt_images(images["digits"], "brightness", 1, torch.Generator()),
        atol=1e-5,
    )


def test_normalised_inputs_without_normalization_are_refused(images):
    normalised = (images["colour"] - 0.45) / 0.225
    with pytest.raises(posthoc.InputError, match=r"normalization=\(mean, std\)"):
        shift.corrupt_images(normalised, "contrast", 1, torch.Generator())
    with pytest.raises(posthoc.ConfigError, match="3 channels"):
        shift.corrupt_images(images["colour"], "contrast", 1, torch.Generator(), normalization=((0.1, 0.2), (1, 1)))


def test_bad_kind_severity_and_inputs_give_clear_errors(images):
    loader = [(images["colour"], torch.zeros(8))]
    with pytest.raises(posthoc.ConfigError, match="gaussian-noise, shot-noise"):
        shift.corrupt(loader, "fog", 1)
    for severity in (0, 6, 2.5, True):
        with pytest.raises(posthoc.ConfigError, match="1 to 5"):
            shift.corrupt(loader, "contrast", severity)
    with pytest.raises(posthoc.InputError, match=r"\(N, C, H, W\)"):
        next(iter(shift.corrupt([(torch.rand(4, 10), torch.zeros(4))], "contrast", 1)))
    with pytest.raises(posthoc.InputError, match="1 or 3 channels"):
        shift.corrupt_images(torch.rand(2, 4, 8, 8), "jpeg", 1, torch.Generator())


def test_dict_inputs_corrupt_their_pixel_values(images):
    batch = ({"pixel_values": images["colour"], "mask": torch.ones(8)}, torch.zeros(8))
    x, y = next(iter(shift.corrupt([batch], "gaussian-blur", 5)))
    assert set(x) == {"pixel_values", "mask"} and torch.equal(x["mask"], torch.ones(8))
    assert not torch.equal(x["pixel_values"], images["colour"]) and x["pixel_values"].shape == images["colour"].shape
    with pytest.raises(posthoc.InputError, match="pixel_values"):
        next(iter(shift.corrupt([({"input_ids": torch.ones(2, 3)}, torch.zeros(2))], "contrast", 1)))


# ------------------------------------------------------------------------------ evaluate_shift and the CLI


def test_evaluate_shift_table_on_the_digits(digits, digits_model):
    um = posthoc.wrap(digits_model, method="none")
    test = data.loader(data.subset(digits.test, 200), batch_size=100)
    table = posthoc.evaluate_shift(
        [um, um],
        test,
        kinds=["rotate", "contrast"],
        severities=[1, 5],
        normalization=(data.MEAN, data.STD),
        ci=0.9,
        bootstraps=100,
        progress=False,
    )
    assert table.methods == ["none", "none (2)"]
    clean = posthoc.evaluate(um, test, progress=False)
    assert table.value("none", "clean", 0, "nll") == pytest.approx(clean.nll)
    rotated = posthoc.evaluate(
        um, shift.corrupt(test, "rotate", 5, normalization=(data.MEAN, data.STD)), progress=False
    )
    assert table.value("none", "rotate", 5, "ece") == pytest.approx(rotated.ece)
    mean = (table.value("none", "rotate", 5, "nll") + table.value("none", "contrast", 5, "nll")) / 2
    assert table.value("none", "mean", 5, "nll") == pytest.approx(mean)
    assert table.value("none", "mean", 5, "nll") > table.value("none", "mean", 1, "nll") > clean.nll
    low, high = table.intervals["none"]["mean"][5]["nll"]
    assert low < table.value("none", "mean", 5, "nll") < high
    assert set(table.reports["none"]) == {("clean", 0), ("rotate", 1), ("rotate", 5), ("contrast", 1), ("contrast", 5)}
    with pytest.raises(posthoc.ConfigError, match="valid kinds"):
        posthoc.evaluate_shift(um, test, kinds=["snow"], progress=False)


def test_evaluate_cli_corrupts_the_test_set_and_reports_intervals(tmp_path, digits):
    _write_images(digits.test, tmp_path / "val", 6)
    parser = argparse.ArgumentParser()
    add_evaluate_arguments(parser)
    out = tmp_path / "report"
    args = parser.parse_args(
        [
            "--model",
            f"{_digits_factory(tmp_path)}:digits",
            "--val",
            str(tmp_path / "val"),
            "--method",
            "temperature",
            "--option",
            "max_iter=20",
            "--shift",
            "gaussian-noise,contrast",
            "--severities",
            "1,5",
            "--ci",
            "0.9",
            "--bootstraps",
            "100",
            "--workers",
            "0",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert args.corruptions == ["gaussian-noise", "contrast"] and args.shift == []
    run_evaluate(args)
    report = (out / "report.md").read_text()
    assert "## Corruptions of the test set" in report and "| none | contrast | 5 |" in report
    # temperature's own rows, or the note that it kept T = 1 (all 24 calibration digits right) and was merged
    merged = "`temperature` into `none` (its temperature kept T = 1)" in report
    assert merged is ("| temperature | contrast | 5 |" not in report)
    assert re.search(r"\| none \| (\*\*)?\d\.\d{4}(\*\*)? \[\d\.\d{4}, \d\.\d{4}\] \|", report)
    rows = json.loads((out / "metrics.json").read_text())["rows"]
    corrupted = rows[0]["corruptions"]["values"]["none"]
    assert corrupted["contrast"]["5"]["nll"] > corrupted["clean"]["0"]["nll"]
    assert rows[0]["test"]["intervals"]["nll"][0] <= rows[0]["test"]["nll"]
    assert (out / "shift.png").stat().st_size > 10_000
    assert (out / "confidence.png").stat().st_size > 10_000  # no flag asked for it
    compared = "none" if merged else "none against temperature"
    assert f"Mean confidence (solid) against accuracy (dashed), {compared}:" in report
    assert (out / "report.html").read_text().count("data:image/png;base64,") == 5  # with the verdict's frontier
    assert not merged or "**Keep the plain model**" in report  # every method predicts as the plain model
    verdict = report.split("## Verdict\n\n")[1].split("\n## ")[0]
    assert "![frontier" in verdict and (out / "frontier.png").stat().st_size > 10_000
    if not verdict.startswith("**Keep the plain model**"):  # the shifts are the severities, each over the kinds
        assert re.search(
            r"at severity 1, .* at severity 5 \(severities: each the mean over gaussian-noise, contrast\)", verdict
        )
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "x", "--val", "v", "--out", "o", "--severities", "0,7"])
