"""The guarantee and calibrator parts of ``posthoc evaluate``: ``--alpha``, ``--target-risk``, ``--calibrator``.

- ``--alpha A``: every method row gets conformal sets at miscoverage ``A`` (score ``--conformal-score``),
  calibrated on the calibration split; the report shows their coverage and mean size on the test
  set and on each ``--shift`` set (where nothing is guaranteed: the shift breaks exchangeability).
- ``--target-risk R``: every row gets a selective (deferral) rule whose error on accepted examples
  is at most ``R`` with probability ``>= 1 - --delta``; the report shows the deferral rate and the
  error on the accepted test examples (``unreachable`` when no threshold meets ``R``).
- ``--calibrator NAME``: the plain model's logits on the calibration split are calibrated with
  ``posthoc.calibrate(logits, labels, method=NAME)`` (``auto`` compares the suite by cross-validated
  NLL); the report gets a table of calibrators (cross-validated NLL/ECE, test NLL/ECE/Brier) and
  the test metrics before and after.

The guarantees are calibrated on the same split that fitted the methods' own calibration (e.g. a
temperature); with few fitted parameters the effect is small, but strictly the conformal guarantee
needs a split the model never saw.

Example:
    $ posthoc evaluate --model timm:resnet50 --val val/ --method temperature --alpha 0.1 \\
        --target-risk 0.02 --calibrator auto --out report/
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

import posthoc
from posthoc.core.inputs import check_labels, iterate, run_model
from posthoc.errors import PosthocError
from posthoc.evaluation.report import Report, markdown_table
from posthoc.guarantees import ConformalPredictor, RiskNotReachableError, SelectivePredictor
from posthoc.guarantees.scores import SCORES

CALIBRATOR_NAMES = ("auto", "temperature", "vector", "matrix", "dirichlet", "ets", "histogram", "isotonic", "platt")


def add_guarantee_arguments(parser: argparse.ArgumentParser) -> None:
    """``--alpha``, ``--conformal-score``, ``--target-risk``, ``--delta`` and ``--calibrator``."""
    group = parser.add_argument_group("guarantees and calibrators (fitted on the calibration split)")
    group.add_argument(
        "--alpha",
        type=float,
        default=None,
        metavar="A",
        help="conformal prediction sets with miscoverage A, e.g. 0.1 (report: coverage, set size)",
    )
    group.add_argument(
        "--conformal-score",
        choices=SCORES,
        default="lac",
        help="conformity score of the sets (default: lac, the smallest sets)",
    )
    group.add_argument(
        "--target-risk",
        type=float,
        default=None,
        metavar="R",
        help="selective prediction: defer so that accepted examples err at most R (report: deferral)",
    )
    group.add_argument(
        "--delta",
        type=float,
        default=0.05,
        metavar="D",
        help="the risk guarantee holds with probability >= 1 - D (default: 0.05)",
    )
    group.add_argument(
        "--calibrator",
        default=None,
        metavar="NAME",
        help=f"calibrate the plain model's logits: {'|'.join(CALIBRATOR_NAMES)} (report: a table of "
        "calibrators, NLL/ECE/Brier before and after)",
    )


@dataclass
class Guarantees:
    """The guarantees fitted for one method row (``None`` where not asked); ``note`` says why one is missing."""

    conformal: ConformalPredictor | None = None
    selective: SelectivePredictor | None = None
    note: str = ""


def _guarantees(source: Any, labels: Any, args: argparse.Namespace, progress: bool) -> Guarantees:
    """Conformal sets and a selective rule from calibration ``source``/``labels``, as ``args`` asks."""
    out = Guarantees()
    if args.alpha is not None:
        out.conformal = posthoc.conformal(
            source, labels, alpha=args.alpha, score=args.conformal_score, seed=args.seed, progress=progress
        )
    if args.target_risk is not None:
        try:
            out.selective = posthoc.selective(
                source, labels, target_risk=args.target_risk, delta=args.delta, seed=args.seed, progress=progress
            )
        except RiskNotReachableError as err:
            out.note = f"target risk unreachable: {err}"
            print(f"[posthoc] {out.note}", flush=True)
    return out


def fit_guarantees(um: posthoc.UncertainModel, calibration: Iterable, args: argparse.Namespace) -> Guarantees:
    """The guarantees of one fitted method row, calibrated on the calibration loader.

    Example:
        >>> import argparse
        >>> import posthoc
        >>> from posthoc_apps.cli.guarantees import add_guarantee_arguments, fit_guarantees
        >>> from posthoc_apps.demo.examples import um, calibration_loader, test_loader
        >>> parser = argparse.ArgumentParser()
        >>> add_guarantee_arguments(parser)
        >>> args = parser.parse_args(["--alpha", "0.1", "--target-risk", "0.25"])
        >>> args.seed, args.no_progress = 0, True
        >>> guarantees = fit_guarantees(um, calibration_loader, args)
        >>> report = posthoc.evaluate(um, test_loader, conformal=guarantees.conformal, selective=guarantees.selective,
        ...                           progress=False)
        >>> 0 < report.coverage <= 1, guarantees.selective is not None
        (True, True)
    """
    return _guarantees(um, calibration, args, progress=not args.no_progress)


@torch.no_grad()
def model_logits(model: nn.Module, loader: Iterable, device: torch.device, progress: bool) -> tuple[Tensor, Tensor]:
    """The model's logits ``(N, C)`` and the labels over a labelled loader, on the CPU."""
    logits, labels = [], []
    for x, y in iterate(loader, device=device, progress=progress, desc="logits"):
        out = run_model(model, x).float()
        logits.append(out.cpu())
        labels.append(check_labels(y, out.shape[-1]).cpu())
    return torch.cat(logits), torch.cat(labels)


def _report(name: str, probs: Tensor, labels: Tensor, guarantees: Guarantees) -> Report:
    conformal, selective = guarantees.conformal, guarantees.selective
    return Report.from_predictions(
        name,
        probs,
        labels,
        sets=None if conformal is None else conformal.sets(probs),
        alpha=None if conformal is None else conformal.alpha,
        accepted=None if selective is None else selective.accept(probs),
        target_risk=None if selective is None else selective.target_risk,
    )


@dataclass
class CalibratorResult:
    """The calibrator asked for with ``--calibrator``, every calibrator's scores, and before/after reports."""

    requested: str
    method: str
    table: dict[str, dict[str, float | None]]
    before: list[Report]
    after: list[Report]
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "method": self.method,
            "table": self.table,
            "notes": self.notes,
            "before": {r.name: r.as_dict() for r in self.before},
            "after": {r.name: r.as_dict() for r in self.after},
        }


def _candidate_row(
    name: str, cv: dict[str, float], calibration: tuple[Tensor, Tensor], test: tuple[Tensor, Tensor]
) -> tuple[dict[str, float | None], str]:
    """Cross-validated scores of one calibrator, and its test NLL/ECE/Brier when fitted on all calibration logits."""
    row: dict[str, float | None] = {"cv_nll": cv.get("nll"), "cv_ece": cv.get("ece")}
    try:
        fitted = posthoc.calibrate(*calibration, method=name)
    except PosthocError as err:
        return {**row, "nll": None, "ece": None, "brier": None}, f"{name} not fitted on all calibration logits: {err}"
    report = Report.from_predictions(name, fitted(test[0]), test[1])
    return {**row, "nll": report.nll, "ece": report.ece, "brier": report.brier}, ""


def fit_calibrator(
    model: nn.Module, calibration: Iterable, tests: dict[str, Iterable], args: argparse.Namespace, device: torch.device
) -> CalibratorResult:
    """``posthoc.calibrate(method=args.calibrator)`` on the model's calibration logits, measured on each test set.

    ``tests`` maps a set name (``"test"``, shift folders) to its loader; the first is the test set
    the calibrator table is measured on.

    Example:
        >>> import argparse
        >>> import torch
        >>> from posthoc_apps.cli.guarantees import add_guarantee_arguments, fit_calibrator
        >>> from posthoc_apps.demo.examples import model, calibration_loader, test_loader
        >>> parser = argparse.ArgumentParser()
        >>> add_guarantee_arguments(parser)
        >>> args = parser.parse_args(["--calibrator", "temperature"])
        >>> args.seed, args.no_progress = 0, True
        >>> result = fit_calibrator(model, calibration_loader, {"test": test_loader}, args, torch.device("cpu"))
        >>> result.method, [report.name for report in result.after]   # with --calibrator auto: the chosen one
        ('temperature', ['temperature (test)'])
    """
    progress = not args.no_progress
    cal_logits, cal_labels = model_logits(model, calibration, device, progress)
    calibrator = posthoc.calibrate(cal_logits, cal_labels, method=args.calibrator)
    logits = {name: model_logits(model, loader, device, progress) for name, loader in tests.items()}
    plain = _guarantees(torch.softmax(cal_logits, -1), cal_labels, args, progress=False)
    calibrated = _guarantees(calibrator(cal_logits), cal_labels, args, progress=False)
    test = next(iter(logits.values()))
    # rows are named by the calibrator asked for; with auto, by the one it chose (a kept-plain fit says so in its note)
    shown = calibrator.chosen_name if args.calibrator == "auto" else args.calibrator
    table, notes = ({}, [f"{who}: {g.note}" for who, g in (("plain", plain), (shown, calibrated)) if g.note])
    record = getattr(calibrator, "selection", None)
    if record:  # the selection step's choice of configuration (posthoc.calibrate guards every calibrator)
        notes.append(f"{shown}'s held-out choice: {selection_summary(record)}")
    for name, cv in (calibrator.scores or {shown: {}}).items():
        table[name], note = _candidate_row(name, cv, (cal_logits, cal_labels), test)
        notes += [note] if note else []
    before = [_report(f"plain ({name})", torch.softmax(z, -1), y, plain) for name, (z, y) in logits.items()]
    after = [_report(f"{shown} ({name})", calibrator(z), y, calibrated) for name, (z, y) in logits.items()]
    return CalibratorResult(args.calibrator, calibrator.chosen_name, table, before, after, notes)


def selection_summary(record: dict) -> str:
    """One line of a calibrator's selection record: what it kept, and, when that is the identity, why not the rest.

    Example:
        >>> from posthoc_apps.cli.guarantees import selection_summary
        >>> selection_summary({"chosen": "none", "candidates": [{"candidate": "none", "reason": None},
        ...     {"candidate": "clean fit", "reason": "in-distribution NLL excess -0.0100 nats, 90% bound +0.0197 > "
        ...      "tolerance 0.0050"}]})
        "kept 'none' (clean fit: in-distribution NLL excess -0.0100 nats, 90% bound +0.0197 > tolerance 0.0050)"
    """
    text = f"kept {record['chosen']!r}"
    refused = [row for row in record.get("candidates", []) if row.get("reason")]
    if record["chosen"] == "none" and refused:
        text += f" ({refused[-1]['candidate']}: {refused[-1]['reason']})"
    return text


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"


def calibrator_markdown(result: CalibratorResult) -> list[str]:
    """Report lines: the table of calibrators, then the metrics before and after on every test set."""
    chosen = f"{result.requested} → {result.method}" if result.requested != result.method else result.method
    lines = [
        f"## Calibrator: {chosen}",
        "",
        "Fitted on the plain model's logits of the calibration split; CV: cross-validated on those logits "
        "(what `auto` chooses by); test: fitted on all of them, measured on the test set.",
        "",
        "| calibrator | CV NLL | CV ECE | test NLL | test ECE | test Brier | chosen |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in result.table.items():
        cells = [name, *(_number(row[k]) for k in ("cv_nll", "cv_ece", "nll", "ece", "brier"))]
        lines.append("| " + " | ".join(cells) + f" | {'✓' if name == result.method else ''} |")
    lines += ["", markdown_table([r for pair in zip(result.before, result.after) for r in pair]), ""]
    lines += [f"- {note}" for note in result.notes] + ([""] if result.notes else [])
    return lines
