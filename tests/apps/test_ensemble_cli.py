"""``posthoc evaluate`` with several checkpoints: one ensemble row per method."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import pytest
import torch
from test_recipes import FACTORY_SOURCE, _write_images

import posthoc
from posthoc_apps.cli.evaluate import add_evaluate_arguments, member_specs, run_evaluate
from posthoc_apps.demo import data


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, digits: data.DigitsSplits) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ensemble_folders")
    _write_images(digits.fit, root / "train", 3)
    _write_images(digits.test, root / "val", 4)
    _write_images(digits.ood, root / "ood", 6, flat=True)
    return {name: root / name for name in ("train", "val", "ood")}


def test_checkpoints_pair_with_models_or_expand_one_model(tmp_path: Path) -> None:
    for name in ("b.pt", "a.pt"):
        (tmp_path / name).write_bytes(b"")
    assert member_specs(["f.py:net"], [str(tmp_path / "*.pt")]) == [
        ("f.py:net", tmp_path / "a.pt"),
        ("f.py:net", tmp_path / "b.pt"),
    ]
    assert member_specs(["x", "y"], []) == [("x", None), ("y", None)]
    assert member_specs(["x", "y"], ["1.pt", "2.pt"]) == [("x", Path("1.pt")), ("y", Path("2.pt"))]
    with pytest.raises(posthoc.ConfigError, match="one --checkpoint per --model"):
        member_specs(["x", "y"], ["1.pt"])
    with pytest.raises(posthoc.ConfigError, match="matches no file"):
        member_specs(["x"], [str(tmp_path / "none*.pt")])


def test_evaluate_several_checkpoints_as_one_ensemble(folders: dict[str, Path], tmp_path: Path) -> None:
    factory = tmp_path / "my_models.py"
    factory.write_text(FACTORY_SOURCE)
    spec = f"{factory}:digits"
    namespace = {}
    exec(FACTORY_SOURCE, namespace)  # the factory's model, to write two checkpoints of it
    base = namespace["digits"](pretrained=True)
    other = copy.deepcopy(base)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    for index, model in enumerate((base, other)):
        torch.save(model.state_dict(), tmp_path / f"seed{index}.pt")
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
            str(tmp_path / "seed*.pt"),
            "--train",
            str(folders["train"]),
            "--val",
            str(folders["val"]),
            "--ood",
            str(folders["ood"]),
            "--method",
            "temperature",
            "--option",
            "max_iter=30",
            "--workers",
            "0",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert run_evaluate(args) == out / "report.md"
    metrics = json.loads((out / "metrics.json").read_text())
    assert [row["method"] for row in metrics["rows"]] == ["none", "temperature"]
    assert "ensemble of 2" in metrics["title"]
    for row in metrics["rows"]:
        assert row["summary"]["posterior"][0]["members"] == 2
        assert row["test"]["accuracy"] >= 0.8 and row["test"]["ood_auroc"] > 0.5
