"""``posthoc demo --task segmentation``: the FCN on digit canvases end to end from the command line."""

from __future__ import annotations

import functools
import math
import re

from posthoc_apps.cli import main as cli
from posthoc_apps.demo import segmentation_run


def test_the_segmentation_demo_writes_its_tables_maps_and_risk_control(tmp_path, monkeypatch, capsys) -> None:
    # the full demo uses more canvases and epochs; the wiring is the same
    quick = functools.partial(segmentation_run.run_segmentation_demo, quick=True)
    monkeypatch.setattr(cli, "run_segmentation_demo", quick)
    cli.main(["demo", "--task", "segmentation", "--out", str(tmp_path), "--quiet"])
    printed = capsys.readouterr().out
    assert printed.startswith("Use auto (picked ")
    assert "segmentation.html" in printed
    for kind in ("clean", *segmentation_run.KINDS):
        assert (tmp_path / f"segmentation_maps_{kind}.png").stat().st_size > 10_000
    page = (tmp_path / "segmentation.html").read_text()
    assert page.count("<img") == 1 + len(segmentation_run.KINDS)  # the maps are embedded
    markdown = (tmp_path / "segmentation.md").read_text()
    for method in segmentation_run.METHODS:  # a row per method in distribution and under each kind
        assert markdown.count(f"| {method} |") == 1 + len(segmentation_run.KINDS)
    nll = [float(v) for v in re.findall(r"\| (?:none|temperature|auto) \| ([0-9.]+) \|", markdown)]
    assert len(nll) == 3 * (1 + len(segmentation_run.KINDS)) and all(math.isfinite(v) and v > 0 for v in nll)
    fnr = float(re.search(r"mean test false-negative rate ([0-9.]+)", markdown).group(1))
    assert 0.0 <= fnr < 0.3  # alpha = 0.1 in expectation; 48 test canvases scatter around it
