"""Progress display (posthoc.core.progress): a bar on a terminal, one line per finished stage in a log, nothing
when turned off; and a ``posthoc evaluate`` run redirected to a file leaves no ``\\r`` in it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_recipes import FACTORY_SOURCE, _write_images
from tqdm import tqdm as std_tqdm

import posthoc
from posthoc.core import progress
from posthoc.core.inputs import iterate
from posthoc_apps.demo import data

ROOT = Path(__file__).resolve().parents[2]


class _Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_off_a_terminal_each_stage_prints_one_line_and_no_carriage_return() -> None:
    log = io.StringIO()
    for _ in progress.progress_bar(range(5), desc="predict", unit="batches", stream=log):
        pass
    bar = progress.progress_bar(total=10, desc="fine-tune", stream=log)
    for _ in range(10):
        bar.update()
        bar.set_postfix(loss=0.123456)
    bar.close()
    bar.close()  # closing twice prints once
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 2
    assert lines[0].startswith("[posthoc] predict: 5 batches in ") and lines[0].endswith(" s")
    assert lines[1].startswith("[posthoc] fine-tune: 10 steps in ") and lines[1].endswith("(loss=0.1235)")
    # a stage that stops short says how far it got
    short = io.StringIO()
    bar = progress.progress_bar(total=8, desc="fit", stream=short)
    bar.update(3)
    bar.close()
    assert short.getvalue().startswith("[posthoc] fit: 3/8 steps in ")


def test_on_a_terminal_a_bar_is_drawn() -> None:
    screen = _Terminal()
    bar = progress.progress_bar(range(3), desc="predict", stream=screen)
    assert isinstance(bar, std_tqdm) and not bar.disable
    list(bar)
    assert "predict" in screen.getvalue() and "\r" in screen.getvalue()  # redrawn in place, as a bar should be
    assert progress.interactive(screen) and not progress.interactive(io.StringIO())


def test_in_a_notebook_the_text_bar_is_drawn_without_ipywidgets(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a Jupyter kernel standard error is no terminal, yet bars stay: tqdm's widget where ipywidgets is installed,
    its text bar otherwise (tqdm.auto would warn ``IProgress not found`` there)."""
    from tqdm.notebook import tqdm as notebook_tqdm

    assert not progress.interactive(io.StringIO()) and progress.bar_class() is std_tqdm
    monkeypatch.setattr(progress, "in_notebook", lambda: True)
    assert progress.interactive(io.StringIO())
    monkeypatch.setattr(progress.importlib.util, "find_spec", lambda name: None)
    assert progress.bar_class() is std_tqdm
    monkeypatch.setattr(progress.importlib.util, "find_spec", lambda name: object())
    assert progress.bar_class() is notebook_tqdm


def test_a_fit_of_many_stages_is_one_bar_naming_each_stage() -> None:
    """Inside ``stages`` the inner loops draw nothing of their own; the one bar names each stage and counts them
    (its ETA divides the stages left); in a log, one line per finished stage."""
    screen = _Terminal()
    with progress.stages("fit", stream=screen) as bar:
        progress.stage("reading the held-out data", more=2)
        assert progress.progress_bar(range(3), desc="inner", stream=screen).disable
        progress.stage("fitting candidate temperature")
        assert "fit 2/3: fitting candidate temperature" in screen.getvalue()
        progress.stage("fitting candidate laplace")
        assert bar.bar.total == 3 and bar.bar.n == 2
    assert "inner" not in screen.getvalue()
    log = io.StringIO()
    with progress.stages("fit", stream=log):
        progress.stage("a", more=1)
        progress.stage("b")
    lines = log.getvalue().splitlines()
    assert [line.rsplit(": ", 1)[0] for line in lines] == ["[posthoc] fit 1/2: a", "[posthoc] fit 2/2: b"]
    with posthoc.settings.override(progress=False), progress.stages("fit", stream=log) as off:
        assert off is None


@pytest.mark.parametrize("stream", [io.StringIO, _Terminal])
def test_progress_false_and_the_setting_silence_it(stream: type) -> None:
    out = stream()
    assert list(progress.progress_bar(range(3), desc="off", progress=False, stream=out)) == [0, 1, 2]
    with posthoc.settings.override(progress=False):
        assert list(progress.progress_bar(range(3), desc="setting", stream=out)) == [0, 1, 2]
        bar = progress.progress_bar(total=3, desc="setting", stream=out)
        bar.update(3)
        bar.close()
    assert out.getvalue() == ""
    assert posthoc.settings.progress is True  # restored after the override
    with pytest.raises(posthoc.ConfigError, match="True or False"), posthoc.settings.override(progress=1):
        pass


def test_the_loader_loop_reports_through_the_helper(capsys: pytest.CaptureFixture) -> None:
    """posthoc's loops write to standard error, which pytest captures (not a terminal): one line per loop."""
    loader = [(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))] * 4
    assert len(list(iterate(loader, device="cpu", progress=True, desc="toy pass"))) == 4
    assert len(list(iterate(loader, device="cpu", progress=False, desc="silent pass"))) == 4
    err = capsys.readouterr().err
    assert err.startswith("[posthoc] toy pass: 4 batches in ") and err.count("\n") == 1 and "\r" not in err


def test_a_redirected_cli_run_leaves_no_carriage_return(tmp_path: Path, digits: data.DigitsSplits) -> None:
    """``posthoc evaluate`` in a subprocess, its output and errors sent to a file, as in a CI job or ``nohup``."""
    _write_images(digits.fit, tmp_path / "train", 3)
    _write_images(digits.test, tmp_path / "val", 4)
    (tmp_path / "factory.py").write_text(FACTORY_SOURCE)
    log_path = tmp_path / "run.log"
    command = [
        sys.executable,
        "-m",
        "posthoc_apps.cli.main",
        "evaluate",
        "--model",
        f"{tmp_path / 'factory.py'}:digits",
        "--train",
        str(tmp_path / "train"),
        "--val",
        str(tmp_path / "val"),
        "--method",
        "temperature",
        "--option",
        "max_iter=20",
        "--batch-size",
        "4",
        "--workers",
        "0",
        "--ci",
        "0.9",
        "--bootstraps",
        "50",
        "--out",
        str(tmp_path / "report"),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with log_path.open("w") as log:
        done = subprocess.run(
            command, check=False, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, timeout=300
        )
    raw = log_path.read_bytes()  # bytes: reading as text would turn each \r into a newline
    text = raw.decode()
    assert done.returncode == 0, text
    assert b"\r" not in raw, text
    stages = [line for line in text.splitlines() if line.startswith("[posthoc] ") and " batches in " in line]
    assert stages, f"the run printed no stage line, so no loop reported progress:\n{text}"
    assert any(line.startswith("[posthoc] evaluate: ") for line in stages)
    assert max(len(line) for line in stages) < 200
    # standard output is flushed before each stage line, so the two streams interleave in order in one file
    assert text.index("[posthoc] none: fit and evaluate") < text.index(stages[0])
    # the same run carries the three newer metrics through the report, its HTML and metrics.json, with intervals
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| ECE | adaptive ECE | smECE | Brier | AURC | AUGRC |" in report
    assert "<th>smECE</th>" in (tmp_path / "report" / "report.html").read_text()
    rows = json.loads((tmp_path / "report" / "metrics.json").read_text())["rows"]
    for row in rows:
        for name in ("adaptive_ece", "smooth_ece", "augrc"):
            assert 0 <= row["test"][name] <= 1 and len(row["test"]["intervals"][name]) == 2, (row["method"], name)
