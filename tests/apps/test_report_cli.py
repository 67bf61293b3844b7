"""``posthoc evaluate --method auto`` on image folders: the verdict and the frontier first, auto's record after."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from test_recipes import FACTORY_SOURCE, _write_images

from posthoc_apps.cli.evaluate import add_evaluate_arguments, run_evaluate
from posthoc_apps.demo import data

#: the folders of the run: name -> (digits split, images per class, how they are written)
LAYOUT = {
    "train": ("fit", 12, {}),
    "calibration": ("calibration", 12, {}),
    "val": ("test", 10, {}),
    "rotated": ("test", 6, {"rotate": 60}),
    "ood": ("ood", 30, {"flat": True}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, digits: data.DigitsSplits) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("auto_folders")
    for name, (split, per_class, options) in LAYOUT.items():
        _write_images(getattr(digits, split), root / name, per_class, **options)
    (root / "factory.py").write_text(FACTORY_SOURCE)
    return {name: root / name for name in (*LAYOUT, "factory.py")}


def test_evaluate_auto_opens_with_its_verdict_and_frontier(folders: dict[str, Path], tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_evaluate_arguments(parser)
    out = tmp_path / "report"
    args = parser.parse_args(
        [
            "--model",
            f"{folders['factory.py']}:digits",
            "--train",
            str(folders["train"]),
            "--calibration",
            str(folders["calibration"]),
            "--val",
            str(folders["val"]),
            "--shift",
            str(folders["rotated"]),
            "--ood",
            str(folders["ood"]),
            "--method",
            "auto",
            "--method",
            "temperature",
            "--workers",
            "0",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    run_evaluate(args)
    report = (out / "report.md").read_text()
    metrics = json.loads((out / "metrics.json").read_text())
    chosen = metrics["rows"][1]["summary"]["selection"]["chosen"]
    assert metrics["verdict"]["recommended"] == "auto" and metrics["verdict"]["basis"] == "auto"
    merged = [(m["label"], m["into"]) for m in metrics["merged"]]  # temperature kept T = 1: the plain model's row
    assert merged in ([], [("temperature", "none")]) and len(metrics["rows"]) == 3
    assert [row["label"] for row in metrics["verdict"]["rows"]] == ["none", "auto", "temperature"][: 3 - len(merged)]
    title, verdict = report.split("\n\n## Verdict\n\n")
    assert title.startswith("# posthoc evaluate:") and "\n|" not in title
    verdict = verdict.split("\n## ")[0]
    if chosen == "none":
        assert verdict.startswith("**Keep the plain model**: `auto` found no candidate")
    else:
        assert verdict.startswith(f"**Use `auto`**: on held-out data it picked `{chosen}` among")
        assert re.search(r"\| NLL on `.*rotated` \| \d\.\d{4} \| \d\.\d{4} \| [+-]\d\.\d{4} \[.*\] \| ", verdict)
        assert re.search(r"\| OOD AUROC \(entropy\) \| \d\.\d{3} \| \d\.\d{3} \| [+-]\d\.\d{3} \[.*\] \| – \|", verdict)
        assert re.search(r"; a prediction costs [\d,.]+x a plain forward( \(.* µs against .* µs\))?\.", verdict)
    assert "![frontier" in verdict and "--method auto" not in verdict  # auto itself is the row: no hint needed
    # the tables after, the best entries in bold; auto's held-out record after the test table
    assert report.index("## Test set") < report.index("## How `auto` chose, on held-out data")
    assert "| predict x fwd |" in report and "**" in report.split("## Test set")[1].split("\n\n")[1]
    assert (out / "frontier.png").stat().st_size > 10_000 and (out / "selection_frontier.png").stat().st_size > 10_000
    page = (out / "report.html").read_text()
    assert (
        page.index('<section class="verdict">') < page.index("data:image/png;base64,") < page.index("<th>method</th>")
    )
    summary = (out / "summary.md").read_text()
    assert "Held-out choice of the method" in summary and "chosen_posterior" not in summary
    assert "![auto's candidates on held-out data](selection_frontier.png)" in summary
    if chosen != "none":
        assert f"### 1.1 {chosen.split('+')[0]} (in the chosen chain)" in summary
