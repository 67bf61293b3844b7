"""``posthoc demo --task regression``: both parts run end to end from the command line and write what they say."""

from __future__ import annotations

import re

import pytest

from posthoc_apps.cli.main import main
from posthoc_apps.demo import regression_run


def test_the_regression_demo_writes_its_tables_and_pictures(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(regression_run, "SINUSOID_EPOCHS", 60)  # the full demo trains longer; the wiring is the same
    monkeypatch.setattr(regression_run, "AUTO_MPG_EPOCHS", 40)
    main(["demo", "--task", "regression", "--out", str(tmp_path), "--quiet"])
    printed = capsys.readouterr().out
    for name in (
        "regression.md",
        "regression_band.png",
        "regression_calibration.png",
        "regression_error_std.png",
        "regression_shift.png",
    ):
        assert (tmp_path / name).stat().st_size > 0
    markdown = (tmp_path / "regression.md").read_text()
    assert markdown in printed
    labels = [label for label, _, _ in regression_run.CONFIGS]
    for label in labels:
        assert markdown.count(f"| {label} |") == 2 + 3  # one row in each table, and in each of the shift's three
    assert "| method | random | extrapolation | gap |" in markdown
    # the plain model's predictive is homoscedastic: one std in every region, a gap/training ratio of 1
    plain = re.search(r"\| plain \(noise on val\) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+)x \|", markdown)
    assert plain and plain.group(1) == plain.group(2) == plain.group(3) and plain.group(4) == "1.00"


def test_an_unknown_task_is_refused_by_the_parser(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--task", "segmentation"])
    assert "invalid choice" in capsys.readouterr().err
