"""The recipes and ``posthoc evaluate``, run end to end on a tiny ImageFolder built from the bundled digits."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import posthoc
from posthoc.core.registry import REGISTRY
from posthoc_apps.cli.evaluate import add_evaluate_arguments, route_options, run_evaluate
from posthoc_apps.demo import data, zoo
from posthoc_apps.loading import folders
from posthoc_apps.loading.models import build_model, load_checkpoint, parse_model_spec

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
METRICS_IN_UNIT_INTERVAL = ("accuracy", "ece", "aurc")

FACTORY_SOURCE = '''
from torch import nn
from posthoc_apps.demo import data, zoo


class RGBDigits(nn.Module):
    """The bundled digits CNN fed with 3-channel images (the channel mean is the grey image)."""

    def __init__(self, pretrained=True):
        super().__init__()
        self.net = zoo.pretrained() if pretrained else zoo.DigitsCNN()
        # read by timm.data.resolve_data_config: how this model wants its images preprocessed
        self.pretrained_cfg = {"input_size": (3, 28, 28), "mean": (data.MEAN,) * 3, "std": (data.STD,) * 3,
                               "crop_pct": 1.0, "interpolation": "bilinear"}

    def forward(self, x):
        return self.net(x.mean(1, keepdim=True))


def digits(pretrained=True):
    return RGBDigits(pretrained)
'''


def _write_images(
    dataset: torch.utils.data.TensorDataset,
    root: Path,
    per_class: int,
    *,
    flat: bool = False,
    rotate: float = 0.0,
    classes: tuple[int, ...] | None = None,
) -> None:
    """Save ``per_class`` digits of each class as 3-channel PNGs, ``root/<class>/*.png`` (or flat)."""
    x, y = dataset.tensors
    pixels = ((x * data.STD + data.MEAN).clamp(0, 1) * 255).round().byte().squeeze(1).numpy()
    counts: dict[int, int] = {}
    for image, label in zip(pixels, y.tolist()):
        if counts.get(label, 0) >= per_class or (classes is not None and label not in classes):
            continue
        counts[label] = counts.get(label, 0) + 1
        folder = root if flat else root / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).convert("RGB").rotate(rotate).save(folder / f"{label}_{counts[label]}.png")


@pytest.fixture(scope="module")
def image_folders(tmp_path_factory: pytest.TempPathFactory, digits: data.DigitsSplits) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("digits_folders")
    _write_images(digits.fit, root / "train", 4)
    _write_images(digits.test, root / "val", 4)
    _write_images(digits.calibration, root / "calibration", 3)
    _write_images(digits.ood, root / "ood", 8, flat=True)
    _write_images(digits.test, root / "shift", 2, rotate=90)
    _write_images(digits.fit, root / "six_classes", 2, classes=tuple(range(6)))
    return {name: root / name for name in ("train", "val", "calibration", "ood", "shift", "six_classes")}


def _recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _png_size(path: Path) -> tuple[int, int]:
    assert path.stat().st_size > 1000, f"{path} is (nearly) empty"
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.load()
        return image.size


def _check_report(out: Path, rows: list[str], *, ood: bool, shifts: int = 0) -> dict:
    """The report files exist and hold one sane row per method; return metrics.json."""
    report = (out / "report.md").read_text().replace("**", "")  # the best entry of each column is in bold
    metrics = json.loads((out / "metrics.json").read_text())
    assert [row["method"] for row in metrics["rows"]] == rows
    merged = {m["label"]: m["into"] for m in metrics["merged"]}  # rows that predict as another are merged into it
    for row in metrics["rows"]:
        line = f"| {row['method']} | {row['test']['accuracy']:.4f} | {row['test']['nll']:.4f} |"
        assert (
            line in report
            if row["method"] not in merged
            else f"`{row['method']}` into `{merged[row['method']]}`" in report
        )
        for result in [row["test"], *row["shifts"].values()]:
            for key in METRICS_IN_UNIT_INTERVAL:
                assert 0.0 <= result[key] <= 1.0, (key, result[key])
            assert 0.0 <= result["brier"] <= 2.0 and math.isfinite(result["nll"]) and result["nll"] >= 0
        assert (row["test"]["ood_auroc"] is not None) == ood
        if ood:
            assert 0.0 <= row["test"]["ood_auroc"] <= 1.0
        assert len(row["shifts"]) == shifts
    assert report.count("## Shift:") == shifts
    cards = (out / "summary.md").read_text()
    for row in metrics["rows"]:  # the model card of every row, next to the report
        assert row["summary"]["fitted"] and row["summary"]["methods"] == row["method"].split("+")
        assert f"# {row['method']}" in cards
    # one reliability panel per row drawn (every row left after merging, up to the plain one and four more)
    width, height = _png_size(out / "reliability.png")
    assert width > 280 * min(len(rows) - len(merged), 5) and height > 200
    _png_size(out / "risk_coverage.png")
    return metrics


def _common(folders_: dict[str, Path], out: Path) -> list[str]:
    return [
        "--pretrained",
        "false",
        "--num-classes",
        "8",
        "--image-size",
        "32",
        "--train",
        str(folders_["train"]),
        "--val",
        str(folders_["val"]),
        "--workers",
        "0",
        "--batch-size",
        "16",
        "--out",
        str(out),
        "--no-progress",
    ]


RANDOM_WEIGHTS = pytest.mark.filterwarnings("ignore:the fitted temperature hit its bound:RuntimeWarning")


@RANDOM_WEIGHTS
def test_timm_recipe_end_to_end(image_folders: dict[str, Path], tmp_path: Path) -> None:
    recipe = _recipe("imagenet_timm")
    argv = [
        "--model",
        "resnet18",
        *_common(image_folders, tmp_path),
        "--ood",
        str(image_folders["ood"]),
        "--shift",
        str(image_folders["shift"]),
        "--method",
        "temperature",
        "--val-subset",
        "30",
    ]
    assert recipe.main(argv) == 0
    metrics = _check_report(tmp_path, ["none", "temperature"], ood=True, shifts=1)
    assert metrics["sizes"] == {
        "train": 32,
        "calibration": 15,
        "test": 15,
        "ood": 16,
        f"shift {image_folders['shift']}": 16,
    }
    plain, tempered = metrics["rows"]
    assert tempered["test"]["accuracy"] == plain["test"]["accuracy"]  # a temperature never changes the argmax
    assert tempered["fitted"]["calibrator.temperature"] > 0


@RANDOM_WEIGHTS
def test_torchvision_recipe_end_to_end_with_calibration_folder(image_folders: dict[str, Path], tmp_path: Path) -> None:
    recipe = _recipe("imagenet_torchvision")
    argv = [
        "--model",
        "resnet18",
        *_common(image_folders, tmp_path),
        "--calibration",
        str(image_folders["calibration"]),
        "--method",
        "temperature",
        "--train-subset",
        "10",
    ]
    assert recipe.main(argv) == 0
    metrics = _check_report(tmp_path, ["none", "temperature"], ood=False)
    assert metrics["sizes"]["test"] == 32 and metrics["sizes"]["calibration"] == 24 and metrics["sizes"]["train"] == 10


def test_recipes_document_themselves(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "imagenet_timm",
        "imagenet_torchvision",
        "calibrate_from_logits",
        "segmentation_torchvision",
        "causal_lm_lora",
    ):
        recipe = _recipe(name)
        assert len(recipe.__doc__) > 500 and f"recipes/{name}.py" in recipe.__doc__
        with pytest.raises(SystemExit) as exit_info:
            recipe.main(["--help"])
        assert exit_info.value.code == 0
        assert "--out" in capsys.readouterr().out
    # and as a script, the way users run it (`python recipes/calibrate_from_logits.py --help`)
    monkeypatch.setattr(sys, "argv", ["calibrate_from_logits.py", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(RECIPES / "calibrate_from_logits.py"), run_name="__main__")
    assert exit_info.value.code == 0 and "--test-logits" in capsys.readouterr().out


def _digits_factory(tmp_path: Path) -> Path:
    path = tmp_path / "my_models.py"
    path.write_text(FACTORY_SOURCE)
    return path


def test_evaluate_cli_with_file_model_and_checkpoint(image_folders: dict[str, Path], tmp_path: Path) -> None:
    """A trained model (the bundled CNN, saved as a checkpoint) must score well: the folder labels, the class
    order and the model's declared preprocessing all line up."""
    factory = _digits_factory(tmp_path)
    spec = f"{factory}:digits"
    trained = build_model(spec, pretrained=True)
    torch.save({"state_dict": {f"module.{k}": v for k, v in trained.state_dict().items()}}, tmp_path / "ckpt.pth")
    parser = argparse.ArgumentParser()
    add_evaluate_arguments(parser)
    out = tmp_path / "report"
    args = parser.parse_args(
        [
            "--model",
            spec,
            "--pretrained",
            "false",
            "--checkpoint",
            str(tmp_path / "ckpt.pth"),
            "--train",
            str(image_folders["train"]),
            "--val",
            str(image_folders["val"]),
            "--ood",
            str(image_folders["ood"]),
            "--method",
            "temperature",
            "--option",
            "max_iter=50",
            "--workers",
            "0",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert run_evaluate(args) == out / "report.md"
    metrics = _check_report(out, ["none", "temperature"], ood=True)
    plain = metrics["rows"][0]["test"]
    assert plain["accuracy"] >= 0.8, "a trained digits model should classify the digits folder"
    assert plain["ood_auroc"] > 0.6, "unseen digits 8/9 should get a higher entropy than digits 0-7"
    assert metrics["settings"]["option"] == [["max_iter", 50]]


GREY_FACTORY_SOURCE = """
from posthoc_apps.demo import zoo


def grey_digits(pretrained=True):
    return zoo.pretrained() if pretrained else zoo.DigitsCNN()  # 1 x 28 x 28 inputs, MNIST mean and std; no pretrained_cfg
"""


def test_evaluate_cli_preprocessing_flags_fit_a_model_of_its_own(
    image_folders: dict[str, Path], tmp_path: Path
) -> None:
    """A model file whose preprocessing is not ImageNet's (grey 28-px digits, MNIST's mean and std) and that declares
    none: with the documented flags it scores as it should, the report prints the transform it used, and the title
    names the loaded checkpoint (not "random weights")."""
    factory = tmp_path / "grey_models.py"
    factory.write_text(GREY_FACTORY_SOURCE)
    spec = f"{factory}:grey_digits"
    trained = build_model(spec, pretrained=True)
    torch.save({"state_dict": trained.state_dict(), "accuracy": 0.97}, tmp_path / "grey.pth")
    parser = argparse.ArgumentParser()
    add_evaluate_arguments(parser)
    out = tmp_path / "report"
    flags = ["--channels", "1", "--resize", "28", "--crop", "28", "--mean", str(data.MEAN), "--std", str(data.STD)]
    args = parser.parse_args(
        [
            "--model", spec, "--pretrained", "false", "--checkpoint", str(tmp_path / "grey.pth"),
            "--val", str(image_folders["val"]), "--method", "temperature", "--option", "max_iter=20",
            "--workers", "0", "--out", str(out), "--no-progress", *flags,
        ]
    )  # fmt: skip
    assert run_evaluate(args) == out / "report.md"
    report = (out / "report.md").read_text()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["rows"][0]["test"]["accuracy"] >= 0.8, "the model's own preprocessing should classify the digits"
    assert "- preprocessing: `Grayscale(num_output_channels=1) -> Resize(size=28" in report
    assert f"Normalize(mean=({data.MEAN},), std=({data.STD},))" in report
    title = report.splitlines()[0]
    assert f"checkpoint {tmp_path / 'grey.pth'}" in title and "random weights" not in title, title
    assert "Possible preprocessing mismatch" not in report  # 0.97 recorded in the checkpoint, and met


def test_calibrate_from_logits_recovers_the_temperature(tmp_path: Path) -> None:
    """Logits that are 4x overconfident: the fitted T is close to 4 and calibration improves on a test set."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 5, generator=generator) * 4
    labels = torch.distributions.Categorical(logits=logits / 4).sample()
    np.save(tmp_path / "val_logits.npy", logits[:2000].numpy())
    np.save(tmp_path / "val_labels.npy", labels[:2000].numpy())
    torch.save(logits[2000:], tmp_path / "test_logits.pt")
    torch.save(labels[2000:], tmp_path / "test_labels.pt")
    out = tmp_path / "out"
    recipe = _recipe("calibrate_from_logits")
    assert (
        recipe.main(
            [
                "--logits",
                str(tmp_path / "val_logits.npy"),
                "--labels",
                str(tmp_path / "val_labels.npy"),
                "--test-logits",
                str(tmp_path / "test_logits.pt"),
                "--test-labels",
                str(tmp_path / "test_labels.pt"),
                "--out",
                str(out),
                "--save-probs",
                "--calibrator",
                "temperature",
            ]
        )
        == 0
    )
    fitted = json.loads((out / "calibration.json").read_text())
    assert fitted["method"] == "temperature" and fitted["scores"] == {}
    assert abs(fitted["temperature"] - 4.0) < 0.4 and not fitted["in_sample"]
    assert fitted["after"]["ece"] < fitted["before"]["ece"] and fitted["after"]["nll"] < fitted["before"]["nll"]
    assert fitted["after"]["accuracy"] == fitted["before"]["accuracy"]
    probs = np.load(out / "calibrated_probs.npy")
    assert probs.shape == (2000, 5) and np.allclose(probs.sum(-1), 1, atol=1e-5) and (probs >= 0).all()
    report = (out / "report.md").read_text()
    assert f"T = {fitted['temperature']:.4f}" in report and "| before (softmax) |" in report
    width, _ = _png_size(out / "reliability.png")
    assert width > 500  # two panels: before | after (one is about 300 px)


def test_calibrate_from_logits_in_sample_binary(tmp_path: Path) -> None:
    """The default, --calibrator auto: the cross-validated table is in the report, the choice is no worse than
    the identity on the folds, and the saved calibrator gives the same probabilities."""
    z = torch.linspace(-6, 6, 400)
    labels = (torch.rand(400, generator=torch.Generator().manual_seed(1)) < torch.sigmoid(z / 3)).long()
    np.save(tmp_path / "z.npy", z.numpy())
    np.save(tmp_path / "y.npy", labels.numpy())
    recipe = _recipe("calibrate_from_logits")
    assert (
        recipe.main(
            [
                "--logits",
                str(tmp_path / "z.npy"),
                "--labels",
                str(tmp_path / "y.npy"),
                "--out",
                str(tmp_path / "out"),
                "--save-probs",
            ]
        )
        == 0
    )
    fitted = json.loads((tmp_path / "out" / "calibration.json").read_text())
    assert fitted["in_sample"] and fitted["num_classes"] == 2 and fitted["requested"] == "auto"
    scores = fitted["scores"]
    assert {"none", "temperature", "platt"} <= set(scores) and fitted["method"] != "none"
    assert scores[fitted["method"]]["nll"] <= scores["none"]["nll"]
    assert fitted["after"]["nll"] < fitted["before"]["nll"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "in-sample" in report and "cross-validated" in report and f"| {fitted['method']} |" in report
    loaded = posthoc.calibrate.load(tmp_path / "out" / "calibrator.pt")
    assert loaded.chosen_name == fitted["method"]
    assert np.allclose(loaded(z).numpy(), np.load(tmp_path / "out" / "calibrated_probs.npy"), atol=1e-6)


# ----------------------------------------------------------------------------------------- bad input


def test_folder_classes_must_match_the_head(
    image_folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recipe = _recipe("imagenet_timm")
    argv = ["--model", "resnet18", *_common(image_folders, tmp_path)]
    argv[argv.index("--num-classes") + 1] = "5"
    assert recipe.main(argv) == 2
    message = capsys.readouterr().err
    assert "8 class folders (0, 1, 2" in message and "outputs 5 classes" in message and "--num-classes 8" in message


def test_train_and_val_folders_must_share_classes(image_folders: dict[str, Path]) -> None:
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 8))
    transform = folders.model_transform(model, "x.py:f", image_size=8)
    val = folders.image_folder(image_folders["val"], transform)
    six = folders.image_folder(image_folders["six_classes"], transform)
    folders.check_classes(val, folders.head_size(model, val))
    with pytest.raises(posthoc.InputError, match="6 class folders"):
        folders.check_classes(six, 8)
    with pytest.raises(posthoc.InputError, match="different class folders"):
        folders.check_classes(val, 8, reference=["0", "1", "2", "3", "4", "5", "6", "9"])
    with pytest.raises(posthoc.InputError, match="not an image folder"):
        folders.image_folder(image_folders["ood"], transform)  # flat folder where classes are needed
    assert len(folders.image_folder(image_folders["ood"], transform, allow_flat=True)) == 16


def test_logits_and_labels_of_different_length(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    np.save(tmp_path / "logits.npy", np.zeros((10, 3), dtype=np.float32))
    np.save(tmp_path / "labels.npy", np.zeros(9, dtype=np.int64))
    recipe = _recipe("calibrate_from_logits")
    assert (
        recipe.main(
            [
                "--logits",
                str(tmp_path / "logits.npy"),
                "--labels",
                str(tmp_path / "labels.npy"),
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    assert "10 rows of logits" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_checkpoint_of_another_architecture_lists_the_keys(tmp_path: Path) -> None:
    torch.save(zoo.pretrained().state_dict(), tmp_path / "digits.pth")
    with pytest.raises(posthoc.InputError) as error:
        build_model("timm:resnet18", pretrained=False, checkpoint=tmp_path / "digits.pth")
    message = str(error.value)
    assert "does not fit timm:resnet18" in message
    assert "missing keys (" in message and "conv1.weight" in message
    assert "unexpected keys (" in message and "features.0.weight" in message


def test_checkpoint_with_another_head_size_shows_the_shapes(tmp_path: Path) -> None:
    import torchvision

    torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), tmp_path / "r18.pth")
    with pytest.raises(posthoc.InputError, match=r"fc.weight \(10, 512\) vs \(8, 512\)"):
        build_model("torchvision:resnet18", pretrained=False, num_classes=8, checkpoint=tmp_path / "r18.pth")
    model = load_checkpoint(torchvision.models.resnet18(num_classes=10), tmp_path / "r18.pth")
    assert torch.equal(model.fc.weight, torch.load(tmp_path / "r18.pth")["fc.weight"])


def test_bad_model_specs_and_options() -> None:
    assert parse_model_spec("tv:resnet50").source == "torchvision"
    with pytest.raises(posthoc.ConfigError, match="timm:NAME"):
        parse_model_spec("resnet50")
    with pytest.raises(posthoc.ConfigError, match="timm has no model"):
        build_model("timm:resnet_does_not_exist", pretrained=False)
    with pytest.raises(posthoc.ConfigError, match="does not exist"):
        build_model("missing_file.py:factory")
    with pytest.raises(posthoc.ConfigError, match="accepted by none of the methods"):
        route_options([["none"], ["temperature"]], {"max_itr": 3})
    assert route_options([["none"], ["temperature"]], {"max_iter": 3}) == [({}, {}), ({"max_iter": 3}, {})]


def test_methods_that_fit_on_training_images_need_train(image_folders: dict[str, Path], tmp_path: Path) -> None:
    needs_train = sorted(name for name, cls in REGISTRY.items() if cls.requires_fit and not cls.needs_val)
    assert {"ibnn", "laplace", "swag"} <= set(needs_train), needs_train
    parser = argparse.ArgumentParser()
    add_evaluate_arguments(parser)
    for method in needs_train:
        args = parser.parse_args(
            [
                "--model",
                f"{_digits_factory(tmp_path)}:digits",
                "--val",
                str(image_folders["val"]),
                "--method",
                method,
                "--workers",
                "0",
                "--out",
                str(tmp_path),
                "--no-progress",
            ]
        )
        with pytest.raises(
            posthoc.ConfigError, match=f"method '{method}' is fitted on training images: pass --train DIR"
        ):
            run_evaluate(args)


def test_offline_pretrained_weights_give_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, image_folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import urllib.error

    import torchvision

    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(torchvision.models, "get_model", offline)
    with pytest.raises(posthoc.ConfigError, match="could not fetch the pretrained weights of torchvision:resnet18"):
        build_model("torchvision:resnet18")
    recipe = _recipe("imagenet_torchvision")
    assert recipe.main(["--model", "resnet18", "--val", str(image_folders["val"]), "--out", str(tmp_path)]) == 2
    assert "--pretrained false with --checkpoint" in capsys.readouterr().err


def test_evaluate_cli_reports_guarantees_and_calibrators(image_folders: dict[str, Path], tmp_path: Path) -> None:
    """--alpha, --target-risk and --calibrator: coverage/set size and deferral columns on every row (shift
    included), a table of calibrators and the metrics before/after, all in metrics.json too."""
    parser = argparse.ArgumentParser()
    add_evaluate_arguments(parser)
    out = tmp_path / "report"
    args = parser.parse_args(
        [
            "--model",
            f"{_digits_factory(tmp_path)}:digits",
            "--val",
            str(image_folders["val"]),
            "--calibration",
            str(image_folders["calibration"]),
            "--shift",
            str(image_folders["shift"]),
            "--method",
            "temperature",
            "--alpha",
            "0.2",
            "--target-risk",
            "0.5",
            "--calibrator",
            "temperature",
            "--workers",
            "0",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert run_evaluate(args) == out / "report.md"
    report = (out / "report.md").read_text()
    metrics = json.loads((out / "metrics.json").read_text())
    header = "| coverage (alpha=0.2) | set size | deferral (target risk=0.5) | accepted error |"
    assert report.count(header) == 3  # test set, shift, calibrator before/after
    for row in metrics["rows"]:
        for result in [row["test"], *row["shifts"].values()]:
            assert result["alpha"] == 0.2 and 0 <= result["coverage"] <= 1 and result["set_size"] >= 0
            assert result["target_risk"] == 0.5 and 0 <= result["deferral"] <= 1
    calibrator = metrics["calibrator"]
    assert calibrator["requested"] == "temperature" and calibrator["method"] in {
        "temperature",
        "none",
    }  # none: kept plain
    assert set(calibrator["table"]) == {"temperature"} and calibrator["table"]["temperature"]["nll"] > 0
    assert set(calibrator["before"]) == {"plain (test)", f"plain ({image_folders['shift']})"}
    assert "## Calibrator: temperature" in report and "| temperature | – | – |" in report
    plain, tempered = calibrator["before"]["plain (test)"], calibrator["after"]["temperature (test)"]
    assert tempered["accuracy"] == plain["accuracy"]
    # the selection step either fitted a temperature or kept the identity, and the report says which
    assert "temperature's held-out choice: kept '" in report
    assert (tempered["nll"] != plain["nll"]) == ("kept 'none'" not in report)
    # a risk no threshold can meet on 24 calibration images is reported, not fatal
    args.target_risk, args.calibrator, args.out = 0.001, None, tmp_path / "unreachable"
    run_evaluate(args)
    unreachable = json.loads((tmp_path / "unreachable" / "metrics.json").read_text())
    assert all(
        "target risk unreachable" in row["note"] and "deferral" not in row["test"] for row in unreachable["rows"]
    )
    args.alpha = 1.5
    with pytest.raises(posthoc.ConfigError, match="--alpha must be a number strictly between 0 and 1"):
        run_evaluate(args)


# ------------------------------------------------------------------------------------------ image regression recipe


def _write_targets(folder: Path, name: str, count: int, seed: int) -> Path:
    """``count`` 24-px RGB images of random brightness; the target is their mean pixel value (0..255)."""
    generator = torch.Generator().manual_seed(seed)
    lines = ["image,brightness"]
    for index in range(count):
        pixels = (torch.rand(24, 24, 3, generator=generator) * 255 * torch.rand(1, generator=generator)).byte().numpy()
        Image.fromarray(pixels).save(folder / f"{name}_{index}.png")
        lines.append(f"{name}_{index}.png,{pixels.mean():.4f}")
    (folder / f"{name}.csv").write_text("\n".join(lines) + "\n")
    return folder / f"{name}.csv"


def test_timm_regression_recipe_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture, one_thread) -> None:
    recipe = _recipe("timm_regression")
    assert "recipes/timm_regression.py" in recipe.__doc__ and "num_classes=1" in recipe.__doc__
    files = {
        name: _write_targets(tmp_path, name, count, seed)
        for name, count, seed in (("train", 24, 0), ("val", 24, 1), ("test", 16, 2))
    }
    model = recipe.load_model("test_convnext", pretrained=False)
    assert model(torch.rand(2, 3, 32, 32)).shape == (2, 1)  # the one-output head
    torch.save(model.state_dict(), tmp_path / "regressor.pth")
    out = tmp_path / "report"
    assert (
        recipe.main(
            [
                "--model",
                "test_convnext",
                "--pretrained",
                "false",
                "--checkpoint",
                str(tmp_path / "regressor.pth"),
                "--image-size",
                "32",
                "--train",
                str(files["train"]),
                "--val",
                str(files["val"]),
                "--test",
                str(files["test"]),
                "--target",
                "brightness",
                "--method",
                "laplace",
                "--alpha",
                "0.2",
                "--batch-size",
                "8",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    assert [row["method"] for row in metrics["rows"]] == ["none", "laplace"]
    assert metrics["sizes"] == {"train": 24, "val": 24, "test": 16}
    laplace = metrics["rows"][1]["test"]
    assert (
        f"| laplace | {laplace['rmse']:.4f} |" in printed.replace("**", "")
        and (out / "calibration.png").stat().st_size > 1000
    )
    # an untrained head predicts about 0 for targets of 0..255: the noise fitted on val covers that error
    assert laplace["rmse"] > 10 and 0.5 <= laplace["coverage_90"] <= 1.0 and laplace["coverage"] is not None
    assert math.isfinite(laplace["nll"]) and math.isfinite(laplace["crps"])
