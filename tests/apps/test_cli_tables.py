"""``posthoc evaluate --likelihood regression``: CSV files and a saved nn.Module in, the regression report out."""

from __future__ import annotations

import csv
import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc_apps.cli.main import main
from posthoc_apps.demo.data import auto_mpg, train_mlp

COLUMNS = ["a", "b", "c"]


def _write_csv(path: Path, x: torch.Tensor, y: torch.Tensor, columns: list[str] = COLUMNS, target: str = "y") -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([*columns, target])
        for features, value in zip(x.tolist(), y[:, 0].tolist()):
            writer.writerow([repr(v) for v in features] + [repr(value)])  # float32 values round-trip exactly
    return path


def _pairs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, generator=generator) * 2 - 1
    return x, x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(n, 1, generator=generator)


@pytest.fixture(scope="module")
def files(tmp_path_factory, one_thread) -> dict[str, Path]:
    """train / val / test / shifted CSVs of a linear target of three features, and an MLP saved whole."""
    folder = tmp_path_factory.mktemp("tabular")
    parts = {name: _pairs(n, seed) for name, n, seed in (("train", 120, 0), ("val", 60, 1), ("test", 60, 2))}
    paths = {name: _write_csv(folder / f"{name}.csv", *pair) for name, pair in parts.items()}
    far_x, far_y = _pairs(40, 3)
    paths["far"] = _write_csv(folder / "far.csv", far_x + 1.5, (far_x + 1.5)[:, :1] * 2 - (far_x + 1.5)[:, 1:2])
    paths["model"] = folder / "model.pt"
    torch.save(train_mlp(parts["train"], hidden=16, epochs=200, seed=0), paths["model"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch announces TorchScript's deprecation
        torch.jit.save(torch.jit.script(torch.load(paths["model"], weights_only=False)), folder / "scripted.pt")
    paths["scripted"] = folder / "scripted.pt"
    paths["state"] = folder / "state.pt"
    torch.save(torch.load(paths["model"], weights_only=False).state_dict(), paths["state"])
    return paths


def _args(files: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        "evaluate",
        "--likelihood",
        "regression",
        "--model",
        str(files["model"]),
        "--train",
        str(files["train"]),
        "--val",
        str(files["val"]),
        "--target",
        "y",
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]


def test_the_regression_cli_writes_the_report_of_every_method(files, tmp_path, capsys) -> None:
    out = tmp_path / "report"
    main(
        _args(
            files,
            out,
            "--test",
            str(files["test"]),
            "--method",
            "laplace",
            "--method",
            "mc-dropout",
            "--alpha",
            "0.1",
            "--shift",
            str(files["far"]),
        )
    )
    for name in (
        "report.md",
        "report.html",
        "summary.md",
        "metrics.json",
        "calibration.png",
        "error_std.png",
        "shift.png",
    ):
        assert (out / name).stat().st_size > 0, name
    report = (out / "report.md").read_text()
    rows = re.findall(r"^\| (none|laplace|mc-dropout) \| (?:\*\*)?\d", report, flags=re.M)
    assert rows[:3] == ["none", "laplace", "mc-dropout"]  # the plain model first, in the test table
    assert "conformal coverage (alpha=0.1)" in report and "## Shifted test sets" in report
    assert "| method | test | far |" in report
    metrics = json.loads((out / "metrics.json").read_text())
    assert [row["method"] for row in metrics["rows"]] == ["none", "laplace", "mc-dropout"]
    assert metrics["features"] == COLUMNS and metrics["sizes"] == {"train": 120, "val": 60, "test": 60, "shift far": 40}
    # the CLI's numbers are the library's: the same model wrapped and fitted in Python on the same rows
    model = torch.load(files["model"], weights_only=False)
    loaders = {
        name: DataLoader(TensorDataset(*_pairs(n, seed)), batch_size=64)
        for name, n, seed in (("train", 120, 0), ("val", 60, 1), ("test", 60, 2))
    }
    um = posthoc.wrap(model, method="laplace", likelihood="regression").fit(
        loaders["train"], loaders["val"], progress=False
    )
    direct = posthoc.evaluate(um, loaders["test"], progress=False)
    # (the CLI shuffles the training rows: the curvature's sums run in another order, hence 1e-4, not 1e-9)
    assert metrics["rows"][1]["test"]["crps"] == pytest.approx(direct.crps, rel=1e-4)
    assert metrics["rows"][1]["test"]["coverage"] >= 0.75  # conformal at alpha 0.1 on 60 rows (binomial sd 0.04)
    far = metrics["shift"]["values"]["laplace"]
    assert far["far"]["0"]["rmse"] > 2 * far["test"]["0"]["rmse"]  # far outside the training square
    assert "wrote" in capsys.readouterr().out


def test_without_a_test_file_the_val_file_is_split(files, tmp_path) -> None:
    out = tmp_path / "split"
    scripted = [arg if arg != str(files["model"]) else str(files["scripted"]) for arg in _args(files, out)]
    main([*scripted, "--method", "none", "--calibration-fraction", "0.5"])  # a TorchScript model, plain
    assert json.loads((out / "metrics.json").read_text())["sizes"] == {"train": 120, "val": 30, "test": 30}


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--calibrator", "temperature"], "--calibrator is for classifiers; under --likelihood regression use --alpha"),
        (["--target-risk", "0.1", "--shift", "contrast"], "--target-risk, --shift KIND are for classifiers"),
        (["--method", "temperature"], "method 'temperature' does not do likelihood='regression'"),
    ],
)
def test_classification_only_options_are_refused_under_regression(files, tmp_path, capsys, extra, says) -> None:
    with pytest.raises(SystemExit):
        main(_args(files, tmp_path / "refused", *extra))
    assert says in capsys.readouterr().err
    assert not (tmp_path / "refused" / "report.md").exists()


def test_bad_files_and_missing_targets_are_named(files, tmp_path, capsys) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b,c,y\n1,2,x,4\n")
    cases = [
        (_args(files, tmp_path / "o", "--test", str(bad)), "bad.csv, line 2, column 'c': 'x' is not a number"),
        (
            [arg if arg != str(files["model"]) else str(files["state"]) for arg in _args(files, tmp_path / "o")],
            "holds a state_dict, not a model; save the module itself",
        ),
        ([arg if arg != "y" else "mpg" for arg in _args(files, tmp_path / "o")], "has no column(s) ['mpg']"),
        (
            [arg if arg != str(files["model"]) else str(files["scripted"]) for arg in _args(files, tmp_path / "o")],
            "a TorchScript model is a black box to posthoc: only --method none",
        ),
        (
            ["evaluate", "--model", "x.pt", "--val", "v", "--out", "o", "--target", "y"],
            "--target is for CSV files under --likelihood regression",
        ),
    ]
    for argv, says in cases:
        with pytest.raises(SystemExit):
            main(argv)
        assert says in capsys.readouterr().err


def test_auto_mpg_through_the_cli(tmp_path, one_thread) -> None:
    """The demo's Auto MPG (standardised, the heavier cars and a band of middle weights held out) as CSV files."""
    data = auto_mpg(0, split="shift")
    columns = ["cylinders", "displacement", "horsepower", "weight", "acceleration", "year", "origin"]
    paths = {
        name: _write_csv(tmp_path / f"{name}.csv", *pair, columns, "mpg")
        for name, pair in {"train": data.train, "val": data.val, "test": data.test, **data.shifted}.items()
    }
    torch.save(train_mlp(data.train, epochs=200, seed=0), tmp_path / "mpg.pt")
    out = tmp_path / "reports" / "mpg"
    main(
        [
            "evaluate",
            "--likelihood",
            "regression",
            "--model",
            str(tmp_path / "mpg.pt"),
            "--train",
            str(paths["train"]),
            "--val",
            str(paths["val"]),
            "--test",
            str(paths["test"]),
            "--shift",
            str(paths["extrapolation"]),
            "--shift",
            str(paths["gap"]),
            "--target",
            "mpg",
            "--method",
            "laplace",
            "--alpha",
            "0.1",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["sizes"] == {"train": 132, "val": 44, "test": 44, "shift extrapolation": 118, "shift gap": 54}
    laplace = metrics["rows"][1]["test"]
    assert laplace["rmse"] < 0.6  # standardised mpg: the MLP explains most of the variance (RMSE 1 = the mean)
    assert set(metrics["shift"]["kinds"]) == {"test", "extrapolation", "gap"}


def _rewritten(source: Path, target: Path, columns: list[str], rename: dict[str, str] | None = None) -> Path:
    """``source`` with its columns in the order ``columns`` (dropping the others), some renamed."""
    with source.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    with target.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([(rename or {}).get(name, name) for name in columns])
        writer.writerows([[row[name] for name in columns] for row in rows])
    return target


def test_the_files_columns_are_matched_by_name(files, tmp_path) -> None:
    """A test CSV with its feature columns in another order reads the same numbers (was: read by position, silently
    wrong: RMSE 0.73 -> 1.35 on the issue's data, exit 0)."""
    reordered = _rewritten(files["test"], tmp_path / "reordered.csv", ["c", "y", "a", "b"])
    runs = {}
    for name, test in (("plain", files["test"]), ("reordered", reordered)):
        main(_args(files, tmp_path / name, "--test", str(test), "--method", "none"))
        runs[name] = json.loads((tmp_path / name / "metrics.json").read_text())
    assert runs["reordered"]["rows"][0]["test"] == runs["plain"]["rows"][0]["test"]
    assert runs["reordered"]["features"] == COLUMNS


@pytest.mark.parametrize(
    ("flag", "columns", "rename", "says"),
    [
        ("--test", ["a", "b", "c", "y"], {"c": "g"}, "renamed.csv lacks ['c'] and has ['g'], which"),
        ("--test", ["a", "b", "c", "c2", "y"], None, "renamed.csv has ['c2'], which"),
        (
            "--shift",
            ["a", "b", "y"],
            None,
            "renamed.csv lacks ['c']: the files of one run must have the same feature columns",
        ),
    ],
)
def test_a_missing_extra_or_renamed_column_is_refused_naming_the_file(
    files, tmp_path, capsys, flag, columns, rename, says
) -> None:
    """Was: a renamed column was read in its place, an extra column or a --shift file missing one ended in the
    model's shape error without naming the file."""
    source = tmp_path / "wide.csv"
    with files["test"].open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    with source.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([*COLUMNS, "c2", "y"])
        writer.writerows([[row["a"], row["b"], row["c"], row["c"], row["y"]] for row in rows])
    bad = _rewritten(source, tmp_path / "renamed.csv", columns, rename)
    extra = ["--test", str(bad)] if flag == "--test" else ["--test", str(files["test"]), "--shift", str(bad)]
    with pytest.raises(SystemExit) as exit_:
        main(_args(files, tmp_path / "refused", *extra, "--method", "none"))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and says in err and "train.csv" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--batch-size", "0"], "error: --batch-size must be a positive integer, got 0"),
        (["--calibration-fraction", "nan"], "error: --calibration-fraction must be a number strictly between 0 and 1"),
        (["--batch-size", "x"], "error: argument --batch-size: invalid int value: 'x' (see posthoc evaluate --help)"),
        (["--bootstraps", "1", "--ci", "0.9"], "error: --bootstraps must be an integer with --bootstraps >= 2"),
        (["--num-samples", "-3"], "error: --num-samples must be a positive integer or None"),
        (["--shift", "FILE/test.csv"], "is named 'test', the name of the test set's row in the report"),
    ],
)
def test_every_cli_misuse_is_one_line_naming_the_flag_with_status_2(files, tmp_path, capsys, extra, says) -> None:
    """Was: --batch-size 0 and --calibration-fraction nan ended in tracebacks; argparse's own errors printed the usage."""
    extra = [value.replace("FILE/test.csv", str(files["test"])) for value in extra]
    with pytest.raises(SystemExit) as exit_:
        main(_args(files, tmp_path / "refused", "--method", "none", *extra))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_the_regression_cli_runs_auto_and_opens_with_its_verdict(files, tmp_path, monkeypatch) -> None:
    # wrap still refuses method="auto" under regression as if it meant posthoc.calibrate's "auto" (api.py, the
    # selection step's WIP); the method itself is registered for regression, so the refusal is lifted here
    monkeypatch.setattr(posthoc.api, "REGRESSION_CALIBRATORS", ("variance-scaling",))
    out = tmp_path / "auto"
    main(
        _args(
            files,
            out,
            "--test",
            str(files["test"]),
            "--method",
            "auto",
            "--method",
            "laplace",
            "--shift",
            str(files["far"]),
        )
    )
    report = (out / "report.md").read_text()
    metrics = json.loads((out / "metrics.json").read_text())
    chosen = metrics["rows"][1]["summary"]["selection"]["chosen"]
    assert chosen in ("none", "laplace", "mc-dropout") and metrics["verdict"]["recommended"] == "auto"
    verdict = report.split("## Verdict\n\n")[1].split("\n## ")[0]
    assert report.index("## Verdict") < report.index("\n|") and "![frontier" in verdict
    if chosen == "none":
        assert verdict.startswith("**Keep the plain model**: `auto` found no candidate")
    else:
        assert verdict.startswith(f"**Use `auto`**: on held-out data it picked `{chosen}` among")
        assert re.search(r"\| NLL on `far` \| -?\d+\.\d{4} \| -?\d+\.\d{4} \| [+-]\d+\.\d{4} \[.*\] \|", verdict)
    assert "## How `auto` chose, on held-out data" in report and "| fit s | predict x fwd | verdict |" in report
    assert (out / "frontier.png").stat().st_size > 10_000
    assert '<section class="verdict">' in (out / "report.html").read_text()


def test_dac_runs_on_a_tabular_regressor_from_the_command_line(files, tmp_path) -> None:
    """``--method laplace+dac``: the variance inflation on a regressor, its shift-aware fit graded by RMSE."""
    out = tmp_path / "dac"
    main(_args(files, out, "--test", str(files["test"]), "--method", "laplace+dac", "--shift", str(files["far"])))
    metrics = json.loads((out / "metrics.json").read_text())
    assert [row["method"] for row in metrics["rows"]] == ["none", "laplace+dac"]
    assert "laplace+dac" in (out / "report.md").read_text()
