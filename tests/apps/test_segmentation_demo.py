"""``posthoc demo --task segmentation``: end to end from the command line on fewer canvases and epochs (the wiring is
the same as the full demo's), and what it writes."""

from __future__ import annotations

import math
import re

import torch

from posthoc.core.prediction import Prediction
from posthoc_apps.cli.main import main
from posthoc_apps.demo import segmentation_demo
from posthoc_apps.demo.segmentation_demo import paired_difference, per_image_nll


def test_the_segmentation_demo_writes_its_page_tables_and_maps(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(segmentation_demo, "CANVASES", (128, 64, 96))
    monkeypatch.setattr(segmentation_demo, "EPOCHS", 4)
    main(["demo", "--task", "segmentation", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    files = ("report.md", "report.html", "maps_in_distribution.png", "maps_contrast_3.png", "maps_gaussian-noise_3.png")
    for name in files:
        assert (tmp_path / name).stat().st_size > 0, name
    # the console: the step lines (stderr), the verdict in three lines and the page's path; no report dump
    steps = len(segmentation_demo.STEP_SECONDS)
    assert len(re.findall(rf"^\[posthoc demo\] \d/{steps} ", captured.err, flags=re.M)) == steps
    printed = captured.out.strip().splitlines()
    assert len([line for line in printed if line]) == 4
    assert printed[-1].startswith(f"Report: {tmp_path / 'report.html'}")
    fnr_line = next(line for line in printed if line.startswith("Risk control of the foreground mask at alpha = 0.1"))
    fnr = float(re.search(r"test FNR ([0-9.]+)", fnr_line).group(1))
    assert 0.0 <= fnr <= 1.0 and "(alpha 0.1)" in fnr_line
    markdown = (tmp_path / "report.md").read_text()
    assert "| method | NLL | ECE | Brier | accuracy | mIoU | AUROC(error) |" in markdown
    for test_set in ("in distribution", "contrast 3", "gaussian-noise 3"):
        rows = re.findall(rf"^### {test_set} .*?\n\n(.*?)\n\n", markdown, flags=re.S | re.M)
        assert rows, test_set
        for method in segmentation_demo.METHODS:
            cells = re.search(rf"^\| {method} \| (.*) \|$", rows[0], flags=re.M).group(1).split(" | ")
            assert len(cells) == 6 and all(math.isfinite(float(cell)) for cell in cells[:5]), (test_set, method)
        assert re.search(rf"^\| {test_set} \| [0-9.]+ \| [0-9.]+ \| 0.1 \| [0-9.]+% \|$", markdown, flags=re.M)
        assert f"({segmentation_demo._maps_file(test_set)})" in markdown
    html = (tmp_path / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3 and "<table>" in html


def test_per_image_nll_ignores_unlabelled_pixels_and_the_paired_interval_holds_the_mean() -> None:
    probs = torch.tensor([[0.8, 0.2], [0.5, 0.5]]).T.reshape(1, 2, 1, 2)  # pixel 0: p = (0.8, 0.2); pixel 1: (0.5, 0.5)
    masks = torch.tensor([[[0, 255]]])
    prediction = Prediction(probs, None, *(torch.zeros(1, 1, 2) for _ in range(5)))
    assert torch.allclose(per_image_nll(prediction, masks), torch.tensor([-math.log(0.8)]))
    a, b = torch.rand(40, generator=torch.Generator().manual_seed(0)), torch.rand(40)
    mean, low, high = paired_difference(a, b)
    assert low <= mean <= high and math.isclose(mean, float((b - a).double().mean()), rel_tol=1e-12)
