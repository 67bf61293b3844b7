"""``posthoc evaluate --likelihood regression``: retrofit methods onto a regressor of CSV tables: its own module because
its data are tables read by column name and its model a saved ``nn.Module``; the report is written by
:func:`posthoc_apps.cli.evaluate.write_run_report`, as a classifier's.

::

    posthoc evaluate --likelihood regression --model model.pt --train train.csv --val val.csv --test test.csv \\
        --target mpg --method laplace --method mc-dropout --alpha 0.1 --out reports/mpg

``--model`` is a ``torch.save``'d ``nn.Module`` (or a TorchScript file, for ``--method none`` only) that maps a float feature matrix
``(N, F)`` to ``(N, D)`` (or ``(N,)``) predictions; the CSV files hold the ``--target`` column(s) and the
features, every other column in file order (:mod:`posthoc_apps.loading.tabular`). Each ``--method`` is one row
(``a+b`` composes; default ``laplace``), the plain model (``none``, its noise fitted on ``--val``) first.
``--val`` is the held-out file: it fits the methods' held-out parts (the observation noise, MC dropout's
rate, ...) and ``--alpha``'s conformal intervals; without ``--test`` it is split with ``--seed`` into that
and a test part (``--calibration-fraction``). ``--shift heavy.csv`` (repeatable) adds named shifted test
sets, scored by ``posthoc.evaluate_shift``.

``--method auto`` picks among ``none``, ``laplace`` and ``mc-dropout`` (where the model has dropout) on ``--val``.

Writes ``OUT/report.md`` (and ``report.html``): first the verdict (which row to use: auto's pick when there is an
auto row, else the lowest NLL on the ``--shift`` files among the rows within the in-distribution tolerance on the
test rows; with ``--shift`` files the frontier ``OUT/frontier.png``), then the regression report per method (the
best entry of each column in bold), NLL, CRPS, RMSE, MAE,
50/90/95 % coverage and width, MACE and ENCE (with ``--ci`` their bootstrap intervals, with ``--alpha`` the
conformal intervals' coverage and width), ``OUT/summary.md`` (each row's model card), ``OUT/metrics.json``,
``OUT/calibration.png`` and ``OUT/error_std.png`` (and ``OUT/shift.png`` with ``--shift`` files).
Classification-only options (``--calibrator``, ``--target-risk``, ``--ood``, corruption kinds, ...) are refused.

Example:
    >>> import numpy as np
    >>> import torch
    >>> from posthoc_apps.demo.examples import regressor
    >>> from posthoc_apps.cli.main import main
    >>> from posthoc_apps.demo.data import sinusoid
    >>> data = sinusoid()                       # (x, y) pairs of one feature and one target
    >>> for name in ("train", "val", "test"):
    ...     np.savetxt(f"{name}.csv", torch.cat(getattr(data, name), 1).numpy(), delimiter=",", header="x,y",
    ...                comments="")
    >>> torch.save(regressor, "net.pt")         # the whole trained nn.Module
    >>> main(["evaluate", "--likelihood", "regression", "--model", "net.pt", "--train", "train.csv",
    ...       "--val", "val.csv", "--test", "test.csv", "--target", "y", "--out", "report", "--no-progress"])
    [posthoc] none: fit and evaluate
    [posthoc] laplace: fit and evaluate
    [posthoc] wrote report/report.md
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import posthoc
from posthoc.errors import ConfigError
from posthoc.evaluation.comparison import auto_selection, candidate, predict_cost
from posthoc.evaluation.report import Report
from posthoc.evaluation.shift import ShiftTable, evaluate_shift
from posthoc.evaluation.table import BEST_CAPTION, markdown_rows, markdown_table
from posthoc.evaluation.verdict import Verdict, judge
from posthoc_apps.cli.evaluate import (
    AUTO_HINT,
    method_rows,
    parse_option,
    probe_batch,
    route_options,
    run_device,
    write_run_report,
)
from posthoc_apps.cli.flags import check_numbers
from posthoc_apps.loading.folders import split_held_out
from posthoc_apps.loading.tabular import Table, load_module, read_tables
from posthoc_apps.report import figures, plots
from posthoc_apps.report.sections import selection_section

LIKELIHOODS = ("classification", "regression")
DEFAULT_METHOD = "laplace"
#: options of ``posthoc evaluate`` that only a classifier has: ``dest -> (flag, value when not given)``
CLASSIFICATION_ONLY = {
    "calibrator": ("--calibrator", None),
    "target_risk": ("--target-risk", None),
    "ood": ("--ood", None),
    "ood_scores": ("--ood-scores", None),
    "ood_subset": ("--ood-subset", None),
    "corruptions": ("--shift KIND", []),
    "calibration": ("--calibration", None),
    "num_classes": ("--num-classes", None),
    "image_size": ("--image-size", None),
    "conformal_score": ("--conformal-score", "lac"),
    "checkpoint": ("--checkpoint", []),
    "train_subset": ("--train-subset", None),
    "val_subset": ("--val-subset", None),
}
#: the test set's row in the shift table (a ``--shift`` file may not take its name)
TEST_ROW = "test"
OUTPUT_FILES = ("report.md", "report.html", "summary.md", "metrics.json", "calibration.png", "error_std.png")
LEGEND = (
    "NLL: negative log-likelihood (nats per example, joint over targets); CRPS: continuous ranked probability "
    "score (targets' units); cov / width: the fraction of test targets inside the central interval of that "
    "level and its mean width (a calibrated 90 % interval covers 0.9); MACE: mean absolute gap of the interval "
    "calibration curve; ENCE: expected normalised calibration error. Lower is better except coverage, which "
    "should match its level."
)


def add_regression_arguments(parser: argparse.ArgumentParser) -> None:
    """``--likelihood``, ``--test``, ``--target`` and ``--features`` (the rest is shared with classification)."""
    group = parser.add_argument_group("regression (--likelihood regression: CSV files, a saved nn.Module)")
    group.add_argument(
        "--likelihood",
        choices=LIKELIHOODS,
        default="classification",
        help="classification (default: image folders or text files) or regression (CSV files; --model "
        "is a torch.save'd nn.Module or TorchScript file taking a float feature matrix)",
    )
    group.add_argument(
        "--test",
        type=Path,
        metavar="FILE",
        default=None,
        help="regression: the test CSV (default: part of --val, see --calibration-fraction)",
    )
    group.add_argument(
        "--target",
        action="append",
        default=None,
        metavar="COLUMN",
        help="regression: a target column of the CSV files (repeatable for several targets)",
    )
    group.add_argument(
        "--features",
        default=None,
        metavar="A,B,...",
        help="regression: the feature columns, in the model's order (default: every other column)",
    )


def check_regression_arguments(args: argparse.Namespace) -> None:
    """Refuse classification-only options and a run without ``--target``, naming what to do instead."""
    given = [
        flag for dest, (flag, unset) in CLASSIFICATION_ONLY.items() if getattr(args, dest, unset) not in (unset, [])
    ]
    if given:
        raise ConfigError(
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for classifiers; under --likelihood "
            "regression use --alpha (conformal intervals), --ci, --shift FILE.csv (named shifted test "
            "sets) and --val/--test files"
        )
    if not args.target:
        raise ConfigError("--likelihood regression needs the target column(s) of the CSV files: --target COLUMN")
    if len(args.model) != 1:
        raise ConfigError("--likelihood regression takes one --model file (a torch.save'd nn.Module)")


def add_recipe_arguments(parser: argparse.ArgumentParser, *, default_out: str) -> None:
    """The method, guarantee and run options of a regression recipe (the names :func:`fit_rows` reads)."""
    parser.add_argument(
        "--method",
        action="append",
        default=None,
        metavar="NAME[+NAME]",
        help=f"a method row next to the plain model, 'a+b' composes (repeatable; default {DEFAULT_METHOD})",
    )
    parser.add_argument(
        "--option",
        type=parse_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a method or fit option, given to every row whose methods accept it (repeatable)",
    )
    parser.add_argument("--num-samples", type=int, default=None, metavar="N", help="samples for sampling methods")
    parser.add_argument(
        "--alpha",
        type=float,
        default=None,
        metavar="A",
        help="conformal intervals with miscoverage A, calibrated on the validation rows",
    )
    parser.add_argument("--ci", type=float, default=None, metavar="LEVEL", help="bootstrap intervals, e.g. 0.95")
    parser.add_argument("--bootstraps", type=int, default=1000, metavar="N", help="bootstrap resamples (default: 1000)")
    parser.add_argument("--batch-size", type=int, default=32, metavar="N", help="(default: 32)")
    parser.add_argument("--seed", type=int, default=0, help="seeds splits and sampling (default: 0)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(default_out),
        metavar="DIR",
        help=f"folder for report.md, metrics.json and the PNGs (default: {default_out})",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def check_classification_arguments(args: argparse.Namespace) -> None:
    """Refuse the regression-only options on a classification run (they would be ignored)."""
    given = [
        flag
        for flag, value in (("--test", args.test), ("--target", args.target), ("--features", args.features))
        if value is not None
    ]
    if given:
        raise ConfigError(
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for CSV files under --likelihood "
            "regression; add --likelihood regression, or leave them out for a classifier"
        )


@dataclass
class RegressionData:
    """The tables of one run: fit, held-out, test and named shifted test sets."""

    train: Table | None
    val: Table
    test: Table
    shifts: dict[str, Table]

    def sizes(self) -> dict[str, int]:
        return {
            "train": 0 if self.train is None else len(self.train),
            "val": len(self.val),
            "test": len(self.test),
            **{f"shift {name}": len(table) for name, table in self.shifts.items()},
        }


def load_tables(args: argparse.Namespace) -> RegressionData:
    """Read ``--train``, ``--val``, ``--test`` and ``--shift`` files, their columns matched by name to the first
    file's (:func:`~posthoc_apps.loading.tabular.read_tables`), splitting ``--val`` when there is no ``--test``."""
    targets = list(args.target)
    features = None if args.features is None else [name.strip() for name in args.features.split(",") if name.strip()]
    names = _shift_names(args.shift)
    paths = [path for path in (args.train, args.val, args.test) if path is not None] + list(args.shift)
    tables = dict(zip(paths, read_tables(paths, targets, features)))
    val = tables[args.val]
    if args.test is not None:
        test = tables[args.test]
    else:
        order = torch.randperm(len(val), generator=torch.Generator().manual_seed(args.seed))
        cut = int(args.calibration_fraction * len(val))
        if not 0 < cut < len(val):
            raise ConfigError(
                f"--calibration-fraction {args.calibration_fraction} leaves an empty part of the "
                f"{len(val)} rows of {args.val}; pass --test FILE or a fraction in (0, 1)"
            )
        val, test = val.rows(order[:cut]), val.rows(order[cut:])
    shifts = {name: tables[path] for name, path in zip(names, args.shift)}
    return RegressionData(None if args.train is None else tables[args.train], val, test, shifts)


def _shift_names(paths: list[Path]) -> list[str]:
    """The report's name of each ``--shift`` file, its stem; two files of one stem, or one named ``test`` (the test set's
    row), are refused: one row would hide the other."""
    names = [Path(path).stem for path in paths]
    if TEST_ROW in names:
        raise ConfigError(
            f"--shift file {paths[names.index(TEST_ROW)]} is named {TEST_ROW!r}, the name of the test set's "
            "row in the report; rename it"
        )
    doubled = sorted({name for name in names if names.count(name) > 1})
    if doubled:
        clash = [str(path) for path, name in zip(paths, names) if name == doubled[0]]
        raise ConfigError(
            f"--shift files {', '.join(clash)} share the name {doubled[0]!r} that labels their row in the "
            "report; rename one"
        )
    return names


def _loader(table: Table | None, batch_size: int, shuffle: bool = False, seed: int = 0) -> DataLoader | None:
    if table is None:
        return None
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(TensorDataset(table.x, table.y), batch_size=batch_size, shuffle=shuffle, generator=generator)


@dataclass
class RegressionRow:
    """One report row: the fitted model's test report, its card, its timings."""

    name: str
    um: posthoc.UncertainModel
    test: Report
    fit_seconds: float
    eval_seconds: float
    #: predict time over a plain forward on one test batch
    predict_cost: float | None = None


def fit_rows(
    model: torch.nn.Module, loaders: tuple[Iterable | None, Iterable, Iterable], args: argparse.Namespace
) -> list[RegressionRow]:
    """Wrap ``model`` with each ``--method`` row under a regression likelihood, fit it on ``(train, val)`` and
    evaluate it on ``test`` (``loaders``); ``args`` holds ``method``, ``option``, ``alpha``, ``ci``, ``bootstraps``,
    ``num_samples``, ``seed`` and ``no_progress`` (:func:`add_recipe_arguments` adds them to a recipe)."""
    rows = method_rows(args.method or [DEFAULT_METHOD])
    if isinstance(model, torch.jit.ScriptModule) and any(row != ["none"] for row in rows):
        raise ConfigError(
            "a TorchScript model is a black box to posthoc: only --method none (its noise fitted on "
            "--val) runs on it; for laplace, mc-dropout, vi, ... save the nn.Module itself: "
            "torch.save(model, path)"
        )
    routed = route_options(rows, dict(args.option))
    wrapped = [
        posthoc.wrap(model, method=row, likelihood="regression", **wrap_options)
        for row, (wrap_options, _) in zip(rows, routed)
    ]
    progress = not args.no_progress
    train, val, test = loaders
    probe = probe_batch(test)
    results = []
    for row, um, (_, fit_options) in zip(rows, wrapped, routed):
        name = "+".join(row)
        print(f"[posthoc] {name}: fit and evaluate", flush=True)
        start = time.perf_counter()
        um.fit(train, val, progress=progress, **fit_options)
        fit_seconds = time.perf_counter() - start
        conformal = (
            None
            if args.alpha is None
            else posthoc.conformal(um, val, alpha=args.alpha, seed=args.seed, progress=progress)
        )
        start = time.perf_counter()
        report = posthoc.evaluate(
            um,
            test,
            name=name,
            progress=progress,
            num_samples=args.num_samples,
            seed=args.seed,
            conformal=conformal,
            ci=args.ci,
            bootstraps=args.bootstraps,
        )
        results.append(
            RegressionRow(name, um, report, fit_seconds, time.perf_counter() - start, predict_cost(um, probe))
        )
    return results


def _shift_table(results: list[RegressionRow], data: RegressionData, args: argparse.Namespace) -> ShiftTable | None:
    if not data.shifts:
        return None
    sets = {TEST_ROW: data.test, **data.shifts}
    loaders = {name: _loader(table, args.batch_size) for name, table in sets.items()}
    return evaluate_shift(
        {row.name: row.um for row in results},
        loaders,
        seed=args.seed,
        ci=args.ci,
        bootstraps=args.bootstraps,
        num_samples=args.num_samples,
        progress=not args.no_progress,
    )


def regression_verdict(results: list[RegressionRow], shift: ShiftTable | None) -> Verdict | None:
    """The verdict on the rows against the plain one (the first): each row's per-example Gaussian NLL on the test rows
    and on each ``--shift`` file, its predict cost and an auto row's record; ``None`` with the plain row alone."""
    if len(results) < 2:
        return None
    candidates = [
        candidate(
            row.test,
            predict_cost=row.predict_cost,
            selection=auto_selection(row.um),
            shifted=None
            if shift is None
            else {name: values for name, values in shift.example_nll(row.name).items() if name != "test"},
        )
        for row in results
    ]
    return judge(candidates, results[0].name, auto_hint=AUTO_HINT, shift_hint="pass `--shift FILE.csv`")


def write_regression_report(
    results: list[RegressionRow],
    args: argparse.Namespace,
    *,
    title: str,
    about: list[str],
    extra: dict[str, Any],
    shift: ShiftTable | None = None,
) -> Path:
    """Write ``report.md`` (``about``: lines on the data under the title), ``report.html``, ``summary.md``,
    ``metrics.json`` (with ``extra``'s entries) and the PNGs to ``args.out``; return the report's path."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    predictives = {row.name: (row.test.means, row.test.stds, row.test.targets) for row in results}
    plots.calibration_curves(predictives, out / "calibration.png")
    plots.error_against_std(predictives, out / "error_std.png", bins=min(10, len(results[0].test.targets)))
    timing = markdown_rows(
        ["method", "fit s", "eval s", "noise std", "predict x fwd"],
        [
            [
                row.name,
                f"{row.fit_seconds:.1f}",
                f"{row.eval_seconds:.1f}",
                _noise_text(row.um.likelihood.summary().get("noise_std", float("nan"))),
                "–" if row.predict_cost is None else f"{row.predict_cost:.1f}",
            ]
            for row in results
        ],
    )
    auto = next((row for row in results if auto_selection(row.um)), None)
    lines = [
        markdown_table([row.test for row in results]),
        "",
        BEST_CAPTION,
        "",
        timing,
        "",
        *([] if auto is None else [selection_section(auto_selection(auto.um), out, label=auto.name)]),
    ]
    if shift is not None:
        figures.shift_plot(shift, out / "shift.png")
        lines += [
            "## Shifted test sets (posthoc.evaluate_shift)",
            "",
            shift.to_markdown(detail=True),
            "",
            "![NLL, CRPS and 90 % coverage per test set](shift.png)",
            "",
        ]
    if args.alpha is not None:
        lines += [
            f"conformal coverage / width: split conformal intervals at alpha {args.alpha}, calibrated on "
            f"the held-out rows; coverage >= {1 - args.alpha:g} on average over exchangeable draws (not under shift).",
            "",
        ]
    lines += [
        LEGEND,
        "",
        "![observed against expected interval coverage](calibration.png)",
        "",
        "![RMSE against predicted std, per bin](error_std.png)",
        "",
    ]
    metrics = {
        "likelihood": "regression",
        **extra,
        "rows": [
            {
                "method": row.name,
                "fit_seconds": row.fit_seconds,
                "eval_seconds": row.eval_seconds,
                "test": row.test.as_dict(),
                "summary": row.um.summary(),
            }
            for row in results
        ],
        "shift": None if shift is None else shift.as_dict(),
    }
    return write_run_report(
        out,
        args,
        title=title,
        verdict=regression_verdict(results, shift),
        verdict_title="test rows; NLL under shift: mean over the --shift files",
        about=[*about, f"- seed {args.seed}"],
        body=lines,
        cards=[f"# {row.name}\n\n{row.um.summary().to_markdown()}" for row in results],
        metrics=metrics,
    )


def run_regression_recipe(
    model: torch.nn.Module,
    datasets: tuple[Dataset | None, Dataset, Dataset | None],
    make_loader: Callable[[Dataset, bool], Iterable],
    args: argparse.Namespace,
    *,
    title: str,
) -> Path:
    """A regression recipe after loading its model and its ``(train, val, test)`` datasets (``test`` ``None``:
    half of ``val``, seeded): :func:`fit_rows` on ``make_loader(dataset, shuffle)`` loaders, the test table
    printed, the report written (:func:`write_regression_report`); returns the report's path.

    Example:
        >>> run_regression_recipe(model, (train, val, None), lambda d, shuffle: DataLoader(d, 32, shuffle), args,
        ...                       title="timm resnet50 (regression)")  # an image regressor and its folders  # doctest: +SKIP
    """
    check_numbers(args)
    train, val, test = datasets
    if test is None:
        val, test = split_held_out(val, 0.5, seed=args.seed)
    loaders = (None if train is None else make_loader(train, True), make_loader(val, False), make_loader(test, False))
    results = fit_rows(model, loaders, args)
    print(markdown_table([row.test for row in results]))
    sizes = {"train": 0 if train is None else len(train), "val": len(val), "test": len(test)}
    about = [f"- target: {args.target}; rows: " + ", ".join(f"{k} {v}" for k, v in sizes.items())]
    return write_regression_report(
        results, args, title=title, about=about, extra={"targets": [args.target], "sizes": sizes}
    )


def run_regression(args: argparse.Namespace) -> Path:
    """``posthoc evaluate --likelihood regression``: load the model and the CSV files, fit every row, write the report."""
    check_regression_arguments(args)
    torch.manual_seed(args.seed)
    model = load_module(args.model[0]).to(run_device(args.device))
    data = load_tables(args)
    loaders = (
        _loader(data.train, args.batch_size, True, args.seed),
        _loader(data.val, args.batch_size),
        _loader(data.test, args.batch_size),
    )
    results = fit_rows(model, loaders, args)
    sizes = ", ".join(f"{name} {count}" for name, count in data.sizes().items() if count)
    about = [
        f"- target(s): {', '.join(data.test.targets)}; features ({len(data.test.features)}): "
        f"{', '.join(data.test.features)}",
        f"- rows: {sizes}",
        f"- test set: {args.test or f'{args.val} (test part; the rest is held out)'}",
    ]
    extra = {"targets": data.test.targets, "features": data.test.features, "sizes": data.sizes()}
    report_path = write_regression_report(
        results,
        args,
        title=f"posthoc evaluate: {args.model[0]} (regression)",
        about=about,
        extra=extra,
        shift=_shift_table(results, data, args),
    )
    print(f"[posthoc] wrote {report_path}")
    return report_path


def _noise_text(noise: float | list[float]) -> str:
    """The fitted noise for the report: one ``σ``, or one per output.

    Example:
        >>> from posthoc_apps.cli.tables import _noise_text
        >>> _noise_text(0.123456), _noise_text([0.1, 2.0])
        ('0.1235', '0.1 / 2')
    """
    return " / ".join(f"{value:.4g}" for value in noise) if isinstance(noise, list) else f"{noise:.4g}"
