"""Calibrate a deployed classifier from its saved logits alone: choose a calibrator, report before/after.

No model is needed: save the logits your classifier produces on a held-out labelled set (and,
ideally, on a second set to test on) as ``.npy`` or ``.pt`` files::

    np.save("val_logits.npy", logits)        # (N, C) float, or (N,) for a binary classifier
    np.save("val_labels.npy", labels)        # (N,) integer class indices

    python recipes/calibrate_from_logits.py --logits val_logits.npy --labels val_labels.npy \\
        --test-logits test_logits.npy --test-labels test_labels.npy --out reports/calibration

``--calibrator auto`` (the default) scores every calibrator by 5-fold cross-validated NLL on the
held-out logits and keeps the simplest one within the noise of the best, only if it beats the model's
own probabilities by more than that noise; a held-out set with fewer than 10 misclassified examples
keeps the model's own probabilities (with a warning saying how many examples would do), since on so
few errors cross-validated gains do not hold on new data; ``--calibrator temperature`` (or vector, matrix, dirichlet, ets, histogram, isotonic,
platt) fits that one. It writes to ``--out``: ``calibration.json`` (the chosen calibrator, its
temperature if it has one, the cross-validated table, and the metrics before and after),
``calibrator.pt`` (load it with ``posthoc.calibrate.load("calibrator.pt")`` and call it on new
logits), ``report.md`` (the cross-validated table, then accuracy, NLL, ECE, Brier, AURC before and
after) and ``reliability.png`` (before | after). Without a test set the before/after metrics are
computed on the fitting data itself, which flatters the calibrated row; the report says so.
``--save-probs`` also writes the calibrated test probabilities as ``calibrated_probs.npy``.

The same in Python::

    calibrator = posthoc.calibrate(logits, labels, method="auto")
    calibrator.chosen_name, calibrator.scores     # "vector", {"temperature": {"nll": ..., "ece": ...}, ...}
    calibrator(test_logits)                  # calibrated probabilities
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

import posthoc
from posthoc.core.inputs import check_labels
from posthoc.core.logits import check_finite_logits, class_log_probs
from posthoc.errors import InputError, exit_status
from posthoc.evaluation.report import Report, markdown_table
from posthoc.methods.calibration import Calibrator, calibrators
from posthoc_apps.report import plots


def load_array(path: Path, what: str) -> Tensor:
    """A ``.npy`` array or a ``.pt`` tensor (``torch.load(weights_only=True)``) as a tensor."""
    if not path.is_file():
        raise InputError(f"{what} file {path} does not exist")
    if path.suffix == ".npy":
        return torch.as_tensor(np.load(path, allow_pickle=False))
    if path.suffix in (".pt", ".pth"):
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(loaded, np.ndarray):
            loaded = torch.as_tensor(loaded)
        if not isinstance(loaded, Tensor):
            raise InputError(f"{path} holds a {type(loaded).__name__}, not a tensor; save one tensor per file")
        return loaded
    raise InputError(f"{what} file {path} must end in .npy, .pt or .pth")


def held_out_pair(logits_path: Path, labels_path: Path) -> tuple[Tensor, Tensor]:
    """Logits ``(N, C)`` and labels ``(N,)`` read from files, checked against each other."""
    logits, labels = load_array(logits_path, "logits"), load_array(labels_path, "labels").reshape(-1)
    if logits.shape[0] != labels.shape[0]:
        raise InputError(
            f"{logits_path} has {logits.shape[0]} rows of logits but {labels_path} has {labels.shape[0]} labels; "
            "save the logits and labels of the same examples, in the same order"
        )
    check_finite_logits(logits)
    return logits, labels


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--logits", type=Path, metavar="FILE", required=True, help="held-out logits, .npy or .pt, shape (N, C)"
    )
    parser.add_argument(
        "--labels", type=Path, metavar="FILE", required=True, help="held-out labels, .npy or .pt, shape (N,)"
    )
    parser.add_argument(
        "--test-logits", type=Path, metavar="FILE", default=None, help="logits of a second set to report on"
    )
    parser.add_argument("--test-labels", type=Path, metavar="FILE", default=None, help="labels of that second set")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    parser.add_argument(
        "--calibrator",
        default="auto",
        choices=sorted(calibrators()),
        help="the calibrator; auto picks one by cross-validated NLL (default)",
    )
    parser.add_argument("--save-probs", action="store_true", help="also write calibrated_probs.npy for the test set")
    return parser


def describe(calibrator: Calibrator) -> str:
    """The chosen calibrator in words, with its temperature where it has one."""
    chosen = getattr(calibrator, "chosen", calibrator)
    temperature = getattr(chosen, "temperature", None)
    return calibrator.chosen_name + ("" if temperature is None else f", T = {float(temperature):.4f}")


def cross_validated_table(calibrator: Calibrator) -> list[str]:
    """Markdown lines of ``calibrator.scores`` (empty unless ``--calibrator auto``), the chosen one marked."""
    if not calibrator.scores:
        return []
    rows = [
        f"| {name} | {row['nll']:.4f} | {row['ece']:.4f} | {'**chosen**' if name == calibrator.chosen_name else ''} |"
        for name, row in sorted(calibrator.scores.items(), key=lambda item: item[1]["nll"])
    ]
    return [
        "## Calibrators, 5-fold cross-validated on the fitting data",
        "",
        "| calibrator | NLL | ECE | |",
        "|---|---|---|---|",
        *rows,
        "",
    ]


def calibrate_files(args: argparse.Namespace) -> Calibrator:
    """Fit, evaluate and write every output; return the fitted calibrator."""
    if (args.test_logits is None) != (args.test_labels is None):
        raise InputError("pass both --test-logits and --test-labels, or neither")
    logits, labels = held_out_pair(args.logits, args.labels)
    calibrator = posthoc.calibrate(logits, labels, method=args.calibrator)
    if args.test_logits is None:
        test_logits, test_labels, in_sample = logits, labels, True
    else:
        test_logits, test_labels = held_out_pair(args.test_logits, args.test_labels)
        in_sample = False
    before = class_log_probs(test_logits.float()).exp()
    after = calibrator(test_logits)
    targets = check_labels(test_labels, before.shape[-1])
    reports = [
        Report.from_predictions("before (softmax)", before, targets),
        Report.from_predictions(f"after ({describe(calibrator)})", after, targets),
    ]

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    plots.reliability_diagram({r.name: (r.probs, r.labels) for r in reports}, out / "reliability.png")
    test_set = (
        (
            f"the fitting data itself ({args.logits}): in-sample, so the 'after' row is optimistic; pass "
            "--test-logits/--test-labels for an honest estimate"
        )
        if in_sample
        else str(args.test_logits)
    )
    (out / "report.md").write_text(
        "\n".join(
            [
                "# Calibration from saved logits",
                "",
                f"- fitted on {len(labels)} examples from {args.logits}, {before.shape[-1]} classes",
                f"- calibrator: {describe(calibrator)} (asked for: {args.calibrator}; saved as calibrator.pt)",
                f"- evaluated on {len(targets)} examples from {test_set}",
                "",
                *cross_validated_table(calibrator),
                "## Before and after",
                "",
                markdown_table(reports),
                "",
                "![reliability diagram](reliability.png)",
                "",
            ]
        )
    )
    chosen = getattr(calibrator, "chosen", calibrator)
    temperature = getattr(chosen, "temperature", None)
    (out / "calibration.json").write_text(
        json.dumps(
            {
                "method": calibrator.chosen_name,
                "requested": args.calibrator,
                "temperature": None if temperature is None else float(temperature),
                "scores": calibrator.scores,
                "fitted_on": str(args.logits),
                "num_examples": len(labels),
                "num_classes": before.shape[-1],
                "in_sample": in_sample,
                "before": reports[0].as_dict(),
                "after": reports[1].as_dict(),
            },
            indent=2,
        )
    )
    calibrator.save(out / "calibrator.pt")
    if args.save_probs:
        np.save(out / "calibrated_probs.npy", after.numpy())
    print(
        f"{describe(calibrator)}; ECE {reports[0].ece:.4f} -> {reports[1].ece:.4f}, "
        f"NLL {reports[0].nll:.4f} -> {reports[1].nll:.4f}; wrote {out / 'report.md'}"
    )
    return calibrator


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return exit_status(lambda: calibrate_files(args))


if __name__ == "__main__":
    sys.exit(main())
