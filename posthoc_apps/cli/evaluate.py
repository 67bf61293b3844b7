"""``posthoc evaluate``: retrofit methods onto a timm / torchvision / your own model and report on image folders.

::

    posthoc evaluate --model timm:resnet50 --train imagenet/train --val imagenet/val \\
        --ood imagenet-o --method laplace --method laplace+temperature --train-subset 20000 --out reports/r50

Each ``--method`` is one row of the report (``a+b`` composes, inner first); the plain model
(``none``) is always the first row. The ``--val`` folder is split with a fixed seed into a
calibration half (the ``val_loader`` of ``fit``) and a test half (the report), unless a separate
``--calibration`` folder is given. ``--shift`` folders (e.g. ImageNet-C ``corruption/severity``
folders) are labelled test sets with the same classes; ``--shift gaussian-noise,contrast --severities 1,3,5``
corrupts the test set on the fly instead (see :mod:`posthoc_apps.cli.shift`); ``--ci 0.95`` adds bootstrap
intervals to every metric; ``--ood`` is an unlabelled folder.

A regressor on CSV files runs through ``--likelihood regression`` (:mod:`posthoc_apps.cli.tables`).

``--model hf:<repo-or-path>`` loads a Hugging Face classifier with its own image processor (image
folders) or tokenizer; for text, every data argument is a CSV / JSON-lines file with ``text`` and
``label`` columns (:func:`load_texts`, :mod:`posthoc_apps.loading.hf`).

``--alpha``, ``--target-risk`` and ``--calibrator`` add conformal coverage and set size, deferral,
and a table of calibrators (see :mod:`posthoc_apps.cli.guarantees`). ``--ood-scores energy,knn,...`` reports post-hoc
OOD scores of the plain model next to each row's entropy / MI (see :mod:`posthoc_apps.cli.ood`).

``--method auto`` is the method the selection step picks on the calibration half (``method="auto"``).

Writes ``OUT/report.md``: first the verdict (which row to use for this model: auto's pick when there is an auto
row, else the lowest NLL under the shifts among the rows within the in-distribution tolerance on the test half;
its NLL change in distribution and under each shift, its OOD AUROC change and predict cost) and, with shifts, the
frontier ``OUT/frontier.png``; then the tables, the best entry of each column in bold; an auto row's record of
its candidates on held-out data with ``OUT/selection_frontier.png``. Also ``OUT/summary.md`` (each row's model
card, from ``um.summary()``), ``OUT/metrics.json`` (with the verdict), ``OUT/reliability.png`` and
``OUT/risk_coverage.png``; with corruption kinds also ``OUT/shift.png`` (NLL and ECE against severity) and
``OUT/confidence.png`` (mean confidence and accuracy against severity, the plain model against the row with
the lowest NLL at the top severity). The recipes in ``recipes/`` call :func:`run_recipe` after loading
their model with the library's own loading code.

Example:
    >>> import argparse
    >>> from posthoc_apps.cli.evaluate import add_evaluate_arguments
    >>> parser = argparse.ArgumentParser()
    >>> add_evaluate_arguments(parser)
    >>> args = parser.parse_args(["--model", "tv:resnet18", "--val", "val/", "--method", "temperature",
    ...                           "--out", "report/"])
    >>> args.method, args.out
    (['temperature'], PosixPath('report'))
    >>> run_evaluate(args)   # downloads resnet18's ImageNet weights, reads the folder val/  # doctest: +SKIP
    PosixPath('report/report.md')
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import posthoc
from posthoc.core.checks import probability
from posthoc.core.inputs import Inputs, split_batch
from posthoc.core.registry import method_class, method_names
from posthoc.errors import ConfigError, exit_status
from posthoc.evaluation.comparison import candidate, predict_timing
from posthoc.evaluation.duplicates import Merged, merge_identical, merge_note, without
from posthoc.evaluation.report import Report, markdown_table, operating_points
from posthoc.evaluation.shift import ShiftTable
from posthoc.evaluation.table import BEST_CAPTION
from posthoc.evaluation.verdict import (
    SELECTION_FRONTIER_FILE,
    Verdict,
    cost_cell,
    judge,
)
from posthoc.shift import KINDS
from posthoc_apps.cli.flags import check_numbers
from posthoc_apps.cli.guarantees import (
    CalibratorResult,
    add_guarantee_arguments,
    calibrator_markdown,
    fit_calibrator,
    fit_guarantees,
)
from posthoc_apps.cli.ood import add_ood_arguments, fit_ood_detector, ood_lines
from posthoc_apps.cli.shift import (
    ShiftAction,
    add_shift_arguments,
    corruption_lines,
    corruption_table,
    transform_normalization,
)
from posthoc_apps.loading import folders, hf
from posthoc_apps.loading.models import build_model, load_checkpoint
from posthoc_apps.report import page, plots
from posthoc_apps.report.sections import selection_section, verdict_section

BASELINE = "none"
#: fitted scalars shown in the report table (metrics.json keeps every fitted scalar)
FEATURED_STATE = ("temperature", "prior_precision")
OUTPUT_FILES = ("report.md", "report.html", "summary.md", "metrics.json", "reliability.png", "risk_coverage.png")
#: how the CLI's verdict names the held-out choice and the shifts, in command-line terms
AUTO_HINT = "`--method auto`"
SHIFT_HINT = "pass `--shift DIR` (a labelled shifted folder) or `--shift KIND[,KIND]` (corruptions)"
GUARANTEE_LEGEND = [
    "coverage: fraction of test sets holding the true label, guaranteed >= 1 - alpha on average over exchangeable "
    "calibration/test draws (not under shift); set size: mean number of classes per set.",
    "",
    "deferral: fraction of test examples deferred so that the accepted ones err at most the target risk (with "
    "probability >= 1 - delta over the calibration draw); accepted error: the error rate of the accepted ones.",
    "",
]


def parse_bool(text: str) -> bool:
    """``true/false/yes/no/1/0`` (any case) as a bool, for ``--pretrained false``."""
    value = text.strip().lower()
    if value in ("true", "yes", "1", "on"):
        return True
    if value in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE read as a Python literal where possible (``prior_precision=1.0``)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"options are KEY=VALUE, got {text!r}")
    try:
        return key.strip(), ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return key.strip(), raw


def recipe_parser(description: str, library: str, list_models: str) -> argparse.ArgumentParser:
    """The command line of an ImageNet recipe: ``--model NAME``, ``--checkpoint``, model, data and run options."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default="resnet50",
        metavar="NAME",
        help=f"a {library} model name, see {list_models} (default: resnet50)",
    )
    parser.add_argument(
        "--checkpoint", type=Path, default=None, metavar="FILE", help="a state_dict to load on top (fine-tuned weights)"
    )
    add_model_options(parser)
    add_run_arguments(parser)
    return parser


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--pretrained``, ``--num-classes`` and ``--image-size`` (shared by the CLI and the recipes)."""
    group = parser.add_argument_group("model")
    group.add_argument(
        "--pretrained",
        type=parse_bool,
        default=True,
        metavar="true|false",
        help="load the published weights (needs internet or a filled cache); false = random weights (default: true)",
    )
    group.add_argument(
        "--num-classes",
        type=int,
        metavar="N",
        default=None,
        help="size of the classifier head, for fine-tuned checkpoints (default: the architecture's)",
    )
    group.add_argument(
        "--image-size",
        type=int,
        metavar="N",
        default=None,
        help="override the crop size of the model's preprocessing (default: the model's own)",
    )
    group.add_argument(
        "--channels",
        type=int,
        choices=(1, 3),
        default=None,
        help="the channels the model takes: 1 reads the images as grey (default: 3)",
    )
    for flag, what in (("--mean", "mean"), ("--std", "standard deviation")):
        group.add_argument(
            flag,
            type=float,
            nargs="+",
            metavar="X",
            default=None,
            help=f"the per-channel {what} the model's inputs are normalised with, of pixels in [0, 1] (default: the "
            "model's pretrained_cfg, else ImageNet's)",
        )
    group.add_argument(
        "--resize", type=int, metavar="N", default=None, help="resize the shorter side to N pixels (default: as above)"
    )
    group.add_argument("--crop", type=int, metavar="N", default=None, help="centre crop N x N (default: as above)")
    group.add_argument(
        "--expect-accuracy",
        type=float,
        metavar="P",
        default=None,
        help="the plain model's known accuracy (e.g. on its own validation set): a test accuracy far below it is "
        "flagged in the verdict as a possible preprocessing mismatch (default: a checkpoint's 'accuracy' entry)",
    )


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Data, method and output arguments (shared by the CLI and the recipes)."""
    data = parser.add_argument_group("data (ImageFolder layout: ROOT/CLASS/image.jpg)")
    data.add_argument(
        "--train", type=Path, metavar="DIR", default=None, help="training images, used to fit the methods"
    )
    data.add_argument(
        "--val",
        type=Path,
        metavar="DIR",
        required=True,
        help="held-out labelled images: split into calibration and test halves",
    )
    data.add_argument(
        "--calibration",
        type=Path,
        metavar="DIR",
        default=None,
        help="separate calibration folder; then all of --val is the test set",
    )
    data.add_argument(
        "--calibration-fraction",
        type=float,
        default=0.5,
        metavar="F",
        help="fraction of --val used for calibration when no --calibration folder is given (default: 0.5)",
    )
    data.add_argument(
        "--ood",
        type=Path,
        metavar="DIR",
        default=None,
        help="out-of-distribution images (labels ignored; flat folder ok)",
    )
    data.add_argument(
        "--shift",
        action=ShiftAction,
        metavar="DIR|KIND[,KIND...]",
        default=[],
        help="labelled shifted test folder with the same classes, e.g. ImageNet-C, or corruption kinds "
        f"applied to the test set on the fly ({', '.join(KINDS)}) (repeatable)",
    )
    data.add_argument(
        "--train-subset", type=int, metavar="N", default=None, help="fit on this many random training images"
    )
    data.add_argument("--val-subset", type=int, metavar="N", default=None, help="use this many random --val images")
    data.add_argument(
        "--ood-subset", type=int, metavar="N", default=None, help="use this many random images per --ood/--shift folder"
    )
    data.add_argument("--batch-size", type=int, default=64, metavar="N", help="(default: 64)")
    data.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        metavar="N",
        help="DataLoader worker processes (default: min(8, CPU count))",
    )

    methods = parser.add_argument_group("methods")
    methods.add_argument(
        "--method",
        action="append",
        default=None,
        metavar="NAME[+NAME]",
        help=f"a method row, 'a+b' composes (repeatable; default auto, as posthoc.wrap); available: "
        f"{', '.join(method_names())}",
    )
    methods.add_argument(
        "--option",
        type=parse_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a method or fit option, given to every row whose methods accept it (repeatable)",
    )
    methods.add_argument(
        "--num-samples", type=int, metavar="N", default=None, help="samples for sampling methods (default: theirs)"
    )
    add_guarantee_arguments(parser)
    add_shift_arguments(parser)
    add_ood_arguments(parser, parse_option)

    run = parser.add_argument_group("run")
    run.add_argument(
        "--out", type=Path, metavar="DIR", required=True, help="output folder for report.md, metrics.json and PNGs"
    )
    run.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    run.add_argument("--seed", type=int, default=0, help="seeds subsets, splits and sampling (default: 0)")
    run.add_argument("--no-progress", action="store_true", help="hide progress bars")


def add_evaluate_arguments(parser: argparse.ArgumentParser) -> None:
    """All arguments of ``posthoc evaluate``."""
    parser.add_argument(
        "--model",
        required=True,
        metavar="SPEC",
        action="append",
        help="timm:NAME, torchvision:NAME, hf:REPO-OR-PATH (Hugging Face; text data as .csv/.jsonl "
        "files with text and label columns) or path/to/file.py:factory; repeat it (with one "
        "--checkpoint each) for an ensemble",
    )
    parser.add_argument(
        "--checkpoint",
        metavar="FILE",
        action="append",
        default=[],
        help="a state_dict to load into the model (e.g. your fine-tuned weights); several, or a "
        "quoted glob such as 'ckpt/seed*.pt', make one --model an ensemble of those checkpoints",
    )
    add_model_options(parser)
    add_run_arguments(parser)


# --------------------------------------------------------------------------------------------- data


@dataclass
class FolderData:
    """The loaders of one run, and what they hold (for the report)."""

    classes: list[str]
    train: Any
    calibration: Any
    test: Any
    ood: Any
    shifts: dict[str, Any]
    sizes: dict[str, int] = field(default_factory=dict)


def load_folders(model: nn.Module, transform: Callable, args: argparse.Namespace) -> FolderData:
    """Build the loaders named by ``args`` and check every labelled folder against the model's head."""
    seed = args.seed
    val = folders.image_folder(args.val, transform, subset=args.val_subset, seed=seed)
    num_classes = folders.head_size(model, val)
    folders.check_classes(val, num_classes, args.val)
    train = None
    if args.train is not None:
        train = folders.image_folder(args.train, transform, subset=args.train_subset, seed=seed)
        folders.check_classes(train, num_classes, args.train, reference=val.classes)
    if args.calibration is not None:
        calibration, test = folders.image_folder(args.calibration, transform, seed=seed), val
        folders.check_classes(calibration, num_classes, args.calibration, reference=val.classes)
    else:
        calibration, test = folders.split_held_out(val, args.calibration_fraction, seed=seed)
    ood = (
        None
        if args.ood is None
        else folders.image_folder(args.ood, transform, subset=args.ood_subset, seed=seed, allow_flat=True)
    )
    shifts = {}
    for root in args.shift:
        shifts[str(root)] = folders.image_folder(root, transform, subset=args.ood_subset, seed=seed)
        folders.check_classes(shifts[str(root)], num_classes, root, reference=val.classes)

    pin = run_device(args.device).type == "cuda"

    def make(dataset: Any, shuffle: bool = False) -> Any:
        if dataset is None:
            return None
        return folders.loader(
            dataset, batch_size=args.batch_size, workers=args.workers, shuffle=shuffle, seed=seed, pin_memory=pin
        )

    sizes = {
        "train": 0 if train is None else len(train),
        "calibration": len(calibration),
        "test": len(test),
        "ood": 0 if ood is None else len(ood),
        **{f"shift {k}": len(v) for k, v in shifts.items()},
    }
    return FolderData(
        list(val.classes),
        make(train, shuffle=True),
        make(calibration),
        make(test),
        make(ood),
        {k: make(v) for k, v in shifts.items()},
        sizes,
    )


# ------------------------------------------------------------------------------------------ methods


def method_rows(methods: Iterable[str] | None) -> list[list[str]]:
    """``["laplace", "laplace+temperature"]`` -> ``[["none"], ["laplace"], ["laplace", "temperature"]]``."""
    rows = [[name.strip() for name in entry.split("+")] for entry in (methods or ["auto"])]
    for row in rows:
        for name in row:
            method_class(name)  # refuses unknown names, listing the valid ones
    if [BASELINE] not in rows:
        rows.insert(0, [BASELINE])
    return rows


def route_options(rows: list[list[str]], options: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Per row, the ``(wrap options, fit options)`` its methods accept; refuse options no row accepts."""
    routed, used = [], set()
    for row in rows:
        wrap_valid = {k for name in row for k in method_class(name).option_defaults()}
        fit_valid = {k for name in row for k in method_class(name).fit_option_defaults()}
        routed.append(
            (
                {k: v for k, v in options.items() if k in wrap_valid},
                {k: v for k, v in options.items() if k in fit_valid},
            )
        )
        used |= (wrap_valid | fit_valid) & set(options)
    unknown = sorted(set(options) - used)
    if unknown:
        listing = "; ".join(
            f"{name}: "
            + (
                ", ".join(
                    f"{k}={v!r}"
                    for k, v in {
                        **method_class(name).option_defaults(),
                        **method_class(name).fit_option_defaults(),
                    }.items()
                )
                or "(none)"
            )
            for name in sorted({n for row in rows for n in row})
        )
        raise ConfigError(f"option(s) {unknown} are accepted by none of the methods; valid options — {listing}")
    return routed


@dataclass
class MethodResult:
    """One report row: the fitted model's reports on the test set and on each shift, and its timings."""

    name: str
    test: Report
    shifts: dict[str, Report]
    fit_seconds: float
    eval_seconds: float
    state: dict[str, float]
    note: str = ""
    card: dict[str, Any] | None = None
    corruptions: ShiftTable | None = None
    #: predict time over a plain forward on one test batch (:func:`posthoc.evaluation.comparison.predict_timing`)
    predict_cost: float | None = None


def _scalar_state(um: posthoc.UncertainModel) -> dict[str, float]:
    """The fitted finite scalars of the method chain (e.g. the temperature), not the model's own buffers."""
    state = {}
    for key, value in um.method.posterior_state().items():
        if value.numel() == 1 and value.is_floating_point() and "model." not in key and torch.isfinite(value).all():
            state[key] = float(value)
    return state


def _check_loaders(wrapped: list[posthoc.UncertainModel], data: FolderData) -> None:
    """Refuse, before any fit, a row with a method (inner ones included) that is fitted on the training images
    when no ``--train`` was given; wrapped methods say so with the options they got (``p="auto"``)."""
    for um in wrapped:
        method = um.method
        for name in reversed(um.methods):  # the chain from the top; an ensemble's entry names its members' method
            if method.requires_fit and not method.needs_val and data.train is None:
                raise ConfigError(
                    f"method '{name}' is fitted on training images: pass --train DIR "
                    "(with --train-subset N to fit on a random subset)"
                )
            method = method.inner if method.stacks else method


def fit_and_evaluate(
    model: nn.Module, data: FolderData, args: argparse.Namespace, *, normalization: tuple[Any, Any] | None = None
) -> list[MethodResult]:
    """Wrap ``model`` with each ``--method`` row, fit it, and evaluate it on the test, OOD and shift loaders, and on
    the test set corrupted by the ``--shift`` kinds (in the pixel space of ``normalization=(mean, std)``)."""
    rows = method_rows(args.method)
    routed = route_options(rows, dict(args.option))
    wrapped = [posthoc.wrap(model, method=row, **wrap_options) for row, (wrap_options, _) in zip(rows, routed)]
    _check_loaders(wrapped, data)
    progress = not args.no_progress
    ood_detector = fit_ood_detector(model, data.train, data.ood, args)
    probe = probe_batch(data.test)
    results = []
    for row, um, (_, fit_options) in zip(rows, wrapped, routed):
        name = "+".join(row)
        print(f"[posthoc] {name}: fit and evaluate", flush=True)
        start = time.perf_counter()
        um.fit(data.train, data.calibration, progress=progress, **fit_options)
        fit_seconds = time.perf_counter() - start
        timing = predict_timing(um, probe)
        guarantees = fit_guarantees(um, data.calibration, args)
        measured = {"conformal": guarantees.conformal, "selective": guarantees.selective}
        start = time.perf_counter()
        test = posthoc.evaluate(
            um,
            data.test,
            data.ood,
            name=name,
            progress=progress,
            num_samples=args.num_samples,
            seed=args.seed,
            ood_scores=ood_detector,
            ci=args.ci,
            bootstraps=args.bootstraps,
            **measured,
        )
        test.predict_cost, test.forward_seconds = timing.ratio, timing.forward_seconds
        eval_seconds = time.perf_counter() - start
        shifts = {
            root: posthoc.evaluate(
                um,
                loader,
                name=name,
                progress=progress,
                num_samples=args.num_samples,
                seed=args.seed,
                ci=args.ci,
                bootstraps=args.bootstraps,
                **measured,
            )
            for root, loader in data.shifts.items()
        }
        results.append(
            MethodResult(
                name,
                test,
                shifts,
                fit_seconds,
                eval_seconds,
                _scalar_state(um),
                guarantees.note,
                um.summary(),
                corruption_table(um, name, data.test, args, normalization),
                timing.ratio,
            )
        )
    return results


def probe_batch(loader: Iterable) -> Inputs:
    """The inputs of the first batch of ``loader``: what each row's predict cost is timed on."""
    x, _ = split_batch(next(iter(loader)))
    return x


def shift_names(roots: list[str]) -> dict[str, str]:
    """A short name for each ``--shift`` folder, for the verdict and its plot: the folder's own name, or its last
    parts where two would read alike.

    Example:
        >>> from posthoc_apps.cli.evaluate import shift_names
        >>> shift_names(["/data/imagenet-c/blur/3", "/data/imagenet-c/noise/3", "/data/rotated"])
        {'/data/imagenet-c/blur/3': 'blur/3', '/data/imagenet-c/noise/3': 'noise/3', '/data/rotated': 'rotated'}
    """
    depth = dict.fromkeys(roots, 1)
    while True:
        short = {root: "/".join(Path(root).parts[-depth[root] :]) for root in roots}
        alike = [root for root in roots if list(short.values()).count(short[root]) > 1]
        deeper = [root for root in alike if depth[root] < len(Path(root).parts)]
        if not deeper:
            return short if not alike else {root: root for root in roots}
        for root in deeper:
            depth[root] += 1


def _names(results: list[MethodResult]) -> str:
    return ", ".join(f"`{r.name}`" for r in results)


def merged_results(results: list[MethodResult]) -> list[Merged]:
    """The rows that predict the same as another (the test set, the OOD set, every ``--shift`` folder and
    corruption), merged into it; the plain row and an auto row are never merged away
    (:func:`posthoc.evaluation.duplicates.merge_identical`)."""

    def predictions(r: MethodResult) -> list[Any]:
        ood = r.test.ood_values or {}
        corrupted = {} if r.corruptions is None else r.corruptions.reports.get(r.name, {})
        return [
            r.test.probs,
            *(r.shifts[root].probs for root in sorted(r.shifts)),
            *(corrupted[key].probs for key in sorted(corrupted)),
            *(value for name in sorted(ood) for value in ood[name]),
        ]

    def why(label: str, into: str) -> str:
        state = next(r.state for r in results if r.name == label)
        kept = [v for k, v in state.items() if k.rpartition(".")[2] == "temperature"]
        return "its temperature kept T = 1" if kept and all(v == 1.0 for v in kept) else "the same predictions"

    keep = [results[0].name, *(r.name for r in results if r.test.selection)]
    return merge_identical({r.name: predictions(r) for r in results}, keep=keep, why=why)


def run_verdict(results: list[MethodResult], *, compared: int | None = None) -> Verdict | None:
    """The verdict on the rows against the plain one (the first): each row's test report, its reports on the
    ``--shift`` folders and its corruption table (per severity, the mean over the kinds), its predict cost and an
    auto row's selection record (:mod:`posthoc_apps.report.sections`); ``None`` when only the plain row was asked for
    (``compared``: the rows asked for, before merging rows that predict the same; default ``len(results)``)."""
    if (len(results) if compared is None else compared) < 2:
        return None
    names = shift_names(list(results[0].shifts))
    candidates = [
        candidate(
            r.test,
            {names[root]: report for root, report in r.shifts.items()},
            predict_cost=r.predict_cost,
            shifted=None if r.corruptions is None else r.corruptions.example_nll(r.name),
        )
        for r in results
    ]
    kinds = next((r.corruptions.kinds for r in results if r.corruptions is not None), ())
    note = f"severities: each the mean over {', '.join(kinds)}" if kinds else ""
    return judge(candidates, results[0].name, auto_hint=AUTO_HINT, shift_hint=SHIFT_HINT, shift_note=note)


def selection_lines(results: list[MethodResult], out: Path, heading: str = "##") -> list[str]:
    """How each auto row chose on held-out data (its record and ``selection_frontier.png``); empty without one."""
    autos = [r for r in results if r.test.selection]
    return [selection_section(r.test.selection, out, heading=heading, label=r.name) for r in autos[:1]]


# ------------------------------------------------------------------------------------------- report


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's arguments as plain JSON data (paths as strings), for metrics.json."""
    return json.loads(json.dumps({k: v for k, v in vars(args).items() if not callable(v)}, default=str))


def write_run_report(
    out: Path,
    args: argparse.Namespace,
    *,
    title: str,
    verdict: Verdict | None,
    verdict_title: str,
    about: list[str],
    body: list[str],
    cards: list[str],
    metrics: dict[str, Any],
    alerts: list[str] = (),
) -> Path:
    """Write a run's report to ``out`` and return its path; every ``posthoc evaluate`` run (a classifier's
    :func:`write_report`, a regressor's :func:`posthoc_apps.cli.tables.write_regression_report`) goes through here.

    ``report.md`` is the title, ``alerts`` (a possible preprocessing mismatch), the verdict (``verdict_title`` names
    its test set), ``## Data`` (``about``), then
    ``## Test set`` and the rest (``body``); ``report.html`` is the same page self-contained; ``summary.md`` holds each
    row's model card (``cards``) and ``metrics.json`` ``metrics`` with the run's settings and the verdict."""
    lines = [
        f"# {title}",
        "",
        *alerts,
        *([] if verdict is None else [verdict_section(verdict, out, title=verdict_title), ""]),
        "## Data",
        "",
        *about,
        "",
        "## Test set",
        "",
        *body,
    ]
    metrics = {
        "title": title,
        **metrics,
        "settings": run_settings(args),
        "verdict": None if verdict is None else verdict.as_dict(),
    }
    report_path = out / "report.md"
    report_path.write_text("\n".join(lines))
    page.write_markdown_page("\n".join(lines), out / "report.html", title=title)
    (out / "summary.md").write_text("\n\n".join(cards) + "\n")
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str))
    return report_path


def write_report(
    results: list[MethodResult],
    data: FolderData,
    args: argparse.Namespace,
    *,
    title: str,
    calibrator: CalibratorResult | None = None,
    preprocessing: str | None = None,
) -> Path:
    """Write ``report.md`` (and the same as one self-contained ``report.html``), ``summary.md`` (each row's model
    card), ``metrics.json``, ``reliability.png``, ``risk_coverage.png`` (and ``shift.png`` and ``confidence.png``
    with corruption kinds)
    to ``args.out``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    every = results
    merged = merged_results(results)
    results = without(results, merged, lambda r: r.name)
    found = run_verdict(results, compared=len(every))
    drawn = [r for r in results if found is None or r.name in set(found.featured())]
    curves = {r.name: (r.test.probs, r.test.labels) for r in drawn}
    plots.reliability_diagram(curves, out / "reliability.png")
    plots.risk_coverage_curve(
        curves, out / "risk_coverage.png", operating_points(*(r.test for r in drawn)), args.target_risk
    )

    timing = {"fit s": [f"{r.fit_seconds:.1f}" for r in results], "eval s": [f"{r.eval_seconds:.1f}" for r in results]}
    fitted = {
        "fitted": [
            ", ".join(
                f"{k.rpartition('.')[2]}={v:.4g}" for k, v in r.state.items() if k.rpartition(".")[2] in FEATURED_STATE
            )
            or "–"
            for r in results
        ]
    }
    sizes = ", ".join(f"{k} {v}" for k, v in data.sizes.items() if v)
    test_source = args.val if args.calibration is not None else f"{args.val} (test part; the rest calibrates)"
    shifted = [*shift_names(list(data.shifts)).values()]
    shifted += ["corruptions " + ",".join(args.corruptions)] if args.corruptions else []
    about = [
        f"- classes: {len(data.classes)} ({', '.join(data.classes[:5])}{', ...' if len(data.classes) > 5 else ''})",
        f"- images: {sizes}",
        f"- test set: {test_source}" + (f"; OOD set: {args.ood}" if args.ood else ""),
        f"- device: {run_device(args.device)}, seed {args.seed}",
        *([] if preprocessing is None else [f"- preprocessing: `{preprocessing}`"]),
    ]
    lines = [
        markdown_table(
            [r.test for r in results],
            {
                **timing,
                **fitted,
                "predict x fwd": [cost_cell(r.predict_cost, r.test.forward_seconds) for r in results],
            },
        ),
        "",
        BEST_CAPTION,
        "",
        *([merge_note(merged), ""] if merged else []),
        *(f"- {r.name}: {r.note}" for r in results if r.note),
        *([""] if any(r.note for r in results) else []),
        *selection_lines(results, out),
    ]
    for root in data.shifts:
        lines += [f"## Shift: {root}", "", markdown_table([r.shifts[root] for r in results]), ""]
    lines += corruption_lines([r.corruptions for r in results], out, drawn=[r.name for r in drawn])
    lines += ood_lines([(r.name, r.test) for r in results], out)
    if calibrator is not None:
        lines += calibrator_markdown(calibrator)
    lines += [
        "acc: accuracy; NLL: negative log-likelihood; ECE: expected calibration error (15 equal-width bins); "
        "adaptive ECE: the same with 15 equal-mass bins; smECE: smooth ECE (kernel-smoothed, no bins; relplot's); "
        "AURC: area under the risk–coverage curve; AUGRC: area under the generalized risk (accepted and wrong) "
        "against coverage; OOD AUROC (H): detecting the OOD set by predictive entropy, (MI) by mutual information. "
        "Lower is better except acc and AUROC.",
        "",
        *GUARANTEE_LEGEND[: 2 * (args.alpha is not None) + 2 * (args.target_risk is not None)],
        "![reliability diagram](reliability.png)",
        "",
        f"Reliability diagrams of {_names(drawn)} (the plain model, the recommended row and the few best; every row "
        "is in the tables).",
        "",
        "![risk-coverage curve](risk_coverage.png)",
        "",
        f"Risk against coverage of {_names(drawn)}.",
        "",
    ]
    cards = [
        f"# {r.name}\n\n{r.card.to_markdown()}"
        + (f"\n![{r.name}'s candidates on held-out data]({SELECTION_FRONTIER_FILE})\n" if r.test.selection else "")
        for r in every
        if r.card is not None
    ]
    metrics = {
        "classes": data.classes,
        "sizes": data.sizes,
        "merged": [{"label": m.label, "into": m.into, "why": m.why} for m in merged],
        "rows": [
            {
                "method": r.name,
                "fit_seconds": r.fit_seconds,
                "eval_seconds": r.eval_seconds,
                "fitted": r.state,
                "test": r.test.as_dict(),
                "shifts": {k: v.as_dict() for k, v in r.shifts.items()},
                "note": r.note,
                "summary": r.card,
                "corruptions": None if r.corruptions is None else r.corruptions.as_dict(),
            }
            for r in every
        ],
        "calibrator": None if calibrator is None else calibrator.as_dict(),
    }
    return write_run_report(
        out,
        args,
        title=title,
        verdict=found,
        verdict_title="test set; NLL under shift: mean over " + "; ".join(shifted),
        about=about,
        body=lines,
        cards=cards,
        metrics=metrics,
        alerts=mismatch_lines(results, getattr(args, "expect_accuracy", None)),
    )


def run_device(name: str) -> torch.device:
    """The torch device of ``--device`` (``auto``: cuda if available)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def run_retrofit(
    model: nn.Module | list[nn.Module],
    transform: Callable,
    args: argparse.Namespace,
    *,
    title: str,
    load_data: Callable[..., FolderData] = load_folders,
) -> Path:
    """Load the folders, fit and evaluate every ``--method`` row on ``model`` (or on the ensemble of a list of
    models, whose first member's head checks the folders), write the report; return its path.

    Example (what the recipes do after loading their model):
        >>> report_path = run_retrofit(model, transform, args, title="timm resnet50")  # image folders  # doctest: +SKIP
    """
    torch.manual_seed(args.seed)
    for name in ("alpha", "target_risk", "delta"):
        if getattr(args, name) is not None:
            probability(getattr(args, name), "--" + name.replace("_", "-"))
    if isinstance(model, list):
        model = [member.to(run_device(args.device)).eval() for member in model]
        if args.calibrator is not None:
            raise ConfigError(
                "--calibrator calibrates one model's logits; with several --model/--checkpoint (an "
                "ensemble) compose a calibrator instead, e.g. --method none+temperature"
            )
    else:
        model = model.to(run_device(args.device)).eval()
    data = load_data(model[0] if isinstance(model, list) else model, transform, args)
    calibrator = None
    if args.calibrator is not None:
        print(f"[posthoc] calibrator {args.calibrator}: fit on the calibration logits", flush=True)
        calibrator = fit_calibrator(
            model, data.calibration, {"test": data.test, **data.shifts}, args, run_device(args.device)
        )
    results = fit_and_evaluate(model, data, args, normalization=transform_normalization(transform))
    preprocessing = folders.describe_transform(transform) if load_data is load_folders else None
    report_path = write_report(results, data, args, title=title, calibrator=calibrator, preprocessing=preprocessing)
    print(f"[posthoc] wrote {report_path}")
    return report_path


def run_recipe(args: argparse.Namespace, source: str, load_model: Callable[..., nn.Module]) -> int:
    """An ImageNet recipe after parsing: ``load_model(name, pretrained, num_classes, checkpoint)``, then
    :func:`run_retrofit` with the model's own preprocessing; the exit status (``2`` after a posthoc error).

    Example:
        >>> args = recipe_parser(__doc__, "timm", "timm.list_models()").parse_args()  # doctest: +SKIP
        >>> run_recipe(args, "timm", load_model)  # ImageNet folders and weights  # doctest: +SKIP
        0
    """

    def run() -> None:
        check_numbers(args)
        torch.manual_seed(args.seed)
        model = load_model(args.model, args.pretrained, args.num_classes, args.checkpoint)
        transform = folders.model_transform(model, f"{source}:{args.model}", args.image_size, transform_flags(args))
        weights = "ImageNet weights" if args.pretrained else "random weights"
        run_retrofit(model, transform, args, title=f"{source} {args.model} ({weights})")

    return exit_status(run)


def load_texts(model: nn.Module, tokenizer: Any, args: argparse.Namespace) -> FolderData:
    """The loaders of a text run: ``--train``/``--val``/``--calibration``/``--shift`` are CSV or JSON-lines files
    with ``text`` and ``label`` columns, ``--ood`` one whose labels are ignored (see :mod:`posthoc_apps.loading.hf`)."""
    if getattr(args, "corruptions", None):
        raise ConfigError(
            f"--shift {','.join(args.corruptions)} corrupts images; for a text model pass shifted "
            "text files instead (--shift shifted.jsonl)"
        )

    def read(path: Path | None, subset: int | None = None, labelled: bool = True) -> Any:
        return (
            None
            if path is None
            else folders.take_subset(hf.TextFile(path, model, labelled=labelled), subset, seed=args.seed)
        )

    val, train = read(args.val, args.val_subset), read(args.train, args.train_subset)
    if args.calibration is not None:
        calibration, test = read(args.calibration), val
    else:
        calibration, test = folders.split_held_out(val, args.calibration_fraction, seed=args.seed)
    ood = read(args.ood, args.ood_subset, labelled=False)
    shifts = {str(root): read(root, args.ood_subset) for root in args.shift}

    def make(dataset: Any, shuffle: bool = False) -> Any:
        return (
            None
            if dataset is None
            else hf.text_loader(dataset, tokenizer, batch_size=args.batch_size, shuffle=shuffle, seed=args.seed)
        )

    sizes = {
        "train": 0 if train is None else len(train),
        "calibration": len(calibration),
        "test": len(test),
        "ood": 0 if ood is None else len(ood),
        **{f"shift {k}": len(v) for k, v in shifts.items()},
    }
    return FolderData(
        list(val.classes),
        make(train, shuffle=True),
        make(calibration),
        make(test),
        make(ood),
        {k: make(v) for k, v in shifts.items()},
        sizes,
    )


def member_specs(models: list[str], checkpoints: list[str]) -> list[tuple[str, Path | None]]:
    """``(model spec, checkpoint)`` per member from repeated ``--model`` / ``--checkpoint`` (globs expanded, sorted).

    One ``--model`` takes every checkpoint (an ensemble of one architecture); several ``--model`` pair with as
    many checkpoints, or with none.

    Example:
        >>> from posthoc_apps.cli.evaluate import member_specs
        >>> member_specs(["f.py:net"], ["a.pt", "b.pt"])
        [('f.py:net', PosixPath('a.pt')), ('f.py:net', PosixPath('b.pt'))]
    """
    files: list[Path] = []
    for pattern in checkpoints:
        if any(char in pattern for char in "*?["):
            found = [Path(name) for name in sorted(glob.glob(pattern))]
            if not found:
                raise ConfigError(f"--checkpoint {pattern!r} matches no file")
            files += found
        else:
            files.append(Path(pattern))
    if len(models) == 1:
        return [(models[0], file) for file in files] or [(models[0], None)]
    if not files:
        return [(model, None) for model in models]
    if len(files) != len(models):
        raise ConfigError(
            f"{len(models)} --model but {len(files)} checkpoint(s): give one --checkpoint per --model, "
            "or one --model with several checkpoints"
        )
    return list(zip(models, files))


def run_evaluate(args: argparse.Namespace) -> Path:
    """``posthoc evaluate``: build the model from ``--model`` / ``--checkpoint``, then :func:`run_retrofit`.

    ``--model hf:<repo-or-path>`` loads a Hugging Face classifier with its own image processor (image
    folders) or tokenizer (text files, :func:`load_texts`). Several ``--model`` / ``--checkpoint`` (see
    :func:`member_specs`) are evaluated as one ensemble (``posthoc.wrap([...])``), with the first member's
    preprocessing."""
    members = member_specs(list(args.model), list(args.checkpoint or []))
    weights = "pretrained" if args.pretrained or any(path for _, path in members) else "random weights"
    if len(members) > 1:
        if any(spec.startswith(hf.PREFIX) for spec, _ in members):
            raise ConfigError(
                "ensembles of Hugging Face models are not supported by posthoc evaluate yet; pass "
                "timm:, torchvision: or file.py: models"
            )
        models = [
            build_model(spec, pretrained=args.pretrained, num_classes=args.num_classes, checkpoint=checkpoint)
            for spec, checkpoint in members
        ]
        transform = folders.model_transform(models[0], members[0][0], args.image_size, transform_flags(args))
        listing = ", ".join(f"{spec}" + (f" ({checkpoint})" if checkpoint else "") for spec, checkpoint in members)
        return run_retrofit(
            models, transform, args, title=f"posthoc evaluate: ensemble of {len(models)}: {listing} ({weights})"
        )
    spec, checkpoint_path = members[0]
    if spec.startswith(hf.PREFIX):
        model, processor = hf.load_classifier(spec, pretrained=args.pretrained, num_classes=args.num_classes)
        if checkpoint_path is not None:
            load_checkpoint(model, checkpoint_path, architecture=spec)
        title = f"posthoc evaluate: {spec}" + (
            f" (checkpoint {checkpoint_path})"
            if checkpoint_path
            else (" (random weights)" if not args.pretrained else "")
        )
        if hf.is_tokenizer(processor):
            return run_retrofit(model, processor, args, title=title, load_data=load_texts)
        return run_retrofit(model, hf.image_transform(processor, args.image_size), args, title=title)
    model = build_model(spec, pretrained=args.pretrained, num_classes=args.num_classes, checkpoint=checkpoint_path)
    transform = folders.model_transform(model, spec, args.image_size, transform_flags(args))
    if checkpoint_path is not None:
        weights = f"checkpoint {checkpoint_path}"
        if args.expect_accuracy is None:
            args.expect_accuracy = checkpoint_accuracy(checkpoint_path)
    return run_retrofit(model, transform, args, title=f"posthoc evaluate: {spec} ({weights})")


def transform_flags(args: argparse.Namespace) -> folders.TransformFlags:
    """The preprocessing flags of ``args`` (``--channels``, ``--mean``, ``--std``, ``--resize``, ``--crop``)."""
    return folders.TransformFlags(
        channels=getattr(args, "channels", None),
        mean=None if getattr(args, "mean", None) is None else tuple(args.mean),
        std=None if getattr(args, "std", None) is None else tuple(args.std),
        resize=getattr(args, "resize", None),
        crop=getattr(args, "crop", None),
    )


#: the entries of a checkpoint file that may hold the model's own validation accuracy (a share, or a percentage)
ACCURACY_KEYS = ("accuracy", "acc", "val_accuracy", "val_acc", "top1", "acc1", "best_acc1")
#: the fitted temperatures beyond which a well-preprocessed model is unlikely: a sign the inputs are not what it saw
PLAUSIBLE_TEMPERATURE = (0.4, 2.5)


def checkpoint_accuracy(path: Path) -> float | None:
    """The accuracy a checkpoint file records about its model (:data:`ACCURACY_KEYS`, top level), as a share; ``None``
    when it records none."""
    try:
        found = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # an unreadable file is refused by name where it is loaded as weights
        return None
    if not isinstance(found, dict):
        return None
    for key in ACCURACY_KEYS:
        value = found.get(key)
        if isinstance(value, (int, float, torch.Tensor)) and not isinstance(value, bool):
            value = float(value)
            return value / 100 if value > 1 else value
    return None


def mismatch_lines(results: list[MethodResult], expected: float | None) -> list[str]:
    """The report's warning of a possible preprocessing mismatch: the plain accuracy far (three standard errors and 5
    points) below ``expected``, or a fitted temperature beyond :data:`PLAUSIBLE_TEMPERATURE`.

    Example:
        >>> from types import SimpleNamespace
        >>> from posthoc_apps.cli.evaluate import mismatch_lines
        >>> plain = SimpleNamespace(test=SimpleNamespace(accuracy=0.8, labels=[0] * 400), state={}, name="none")
        >>> tempered = SimpleNamespace(state={"method.temperature": 3.47}, name="temperature")
        >>> print(mismatch_lines([plain, tempered], 0.915)[0])  # doctest: +ELLIPSIS
        **Possible preprocessing mismatch**: the plain model's test accuracy 0.800 is far below the expected 0.915; ...
    """
    reasons = []
    plain = results[0].test
    count = max(1, len(plain.labels))
    if expected is not None:
        margin = max(0.05, 3 * math.sqrt(max(expected * (1 - expected), 1e-4) / count))
        if plain.accuracy < expected - margin:
            reasons.append(
                f"the plain model's test accuracy {plain.accuracy:.3f} is far below the expected {expected:.3f}"
            )
    low, high = PLAUSIBLE_TEMPERATURE
    for result in results:
        for key, value in result.state.items():
            if key.rpartition(".")[2] == "temperature" and not low <= float(value) <= high:
                reasons.append(f"`{result.name}` fitted a temperature T = {float(value):.2f} (outside {low}-{high})")
    if not reasons:
        return []
    return [
        f"**Possible preprocessing mismatch**: {'; '.join(reasons)}. Check the preprocessing in the Data section "
        "against the model's own (set it with --channels, --mean, --std, --resize and --crop): calibration can hide "
        "inputs the model was not trained on, but cannot undo them.",
        "",
    ]
