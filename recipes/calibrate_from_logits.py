"""Calibrate a deployed classifier from its saved logits alone: fit a temperature, report before/after.

No model is needed: save the logits your classifier produces on a held-out labelled set (and,
ideally, on a second set to test on) as ``.npy`` or ``.pt`` files::

    np.save("val_logits.npy", logits)        # (N, C) float, or (N,) for a binary classifier
    np.save("val_labels.npy", labels)        # (N,) integer class indices

    python recipes/calibrate_from_logits.py --logits val_logits.npy --labels val_labels.npy \\
        --test-logits test_logits.npy --test-labels test_labels.npy --out reports/calibration

It writes to ``--out``: ``temperature.json`` (``{"temperature": T, ...}`` — in production divide
the logits by T before the softmax), ``report.md`` (accuracy, NLL, ECE, Brier, AURC before and
after) and ``reliability.png`` (before | after). Without a test set the report is computed on the
fitting data itself, which flatters the calibrated row; the report says so. ``--save-probs``
also writes the calibrated test probabilities as ``calibrated_probs.npy``.

The same in Python: ``calibrator = posthoc.calibrate(logits, labels); calibrator(test_logits)``.
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
from posthoc.evaluation import plots
from posthoc.core.inputs import check_labels
from posthoc.core.errors import InputError, exit_status
from posthoc.core.logits import check_finite_logits, class_log_probs
from posthoc.evaluation.report import Report, markdown_table


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
    parser.add_argument("--logits", type=Path, metavar="FILE", required=True,
                        help="held-out logits, .npy or .pt, shape (N, C)")
    parser.add_argument("--labels", type=Path, metavar="FILE", required=True,
                        help="held-out labels, .npy or .pt, shape (N,)")
    parser.add_argument("--test-logits", type=Path, metavar="FILE", default=None,
                        help="logits of a second set to report on")
    parser.add_argument("--test-labels", type=Path, metavar="FILE", default=None, help="labels of that second set")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    parser.add_argument("--save-probs", action="store_true", help="also write calibrated_probs.npy for the test set")
    return parser


def calibrate_files(args: argparse.Namespace) -> float:
    """Fit, evaluate and write every output; return the fitted temperature."""
    if (args.test_logits is None) != (args.test_labels is None):
        raise InputError("pass both --test-logits and --test-labels, or neither")
    logits, labels = held_out_pair(args.logits, args.labels)
    calibrator = posthoc.calibrate(logits, labels)
    if args.test_logits is None:
        test_logits, test_labels, in_sample = logits, labels, True
    else:
        test_logits, test_labels = held_out_pair(args.test_logits, args.test_labels)
        in_sample = False
    before = class_log_probs(test_logits.float()).exp()
    after = calibrator(test_logits)
    targets = check_labels(test_labels, before.shape[-1])
    reports = [Report.from_predictions("before (softmax)", before, targets),
               Report.from_predictions(f"after (T = {calibrator.temperature:.4f})", after, targets)]

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    plots.reliability_diagram({r.name: (r.probs, r.labels) for r in reports}, out / "reliability.png")
    test_set = (f"the fitting data itself ({args.logits}): in-sample, so the 'after' row is optimistic; pass "
                "--test-logits/--test-labels for an honest estimate") if in_sample else str(args.test_logits)
    (out / "report.md").write_text("\n".join([
        "# Temperature scaling from saved logits", "",
        f"- fitted on {len(labels)} examples from {args.logits}, {before.shape[-1]} classes",
        f"- temperature T = {calibrator.temperature:.4f} (divide the logits by T before the softmax)",
        f"- evaluated on {len(targets)} examples from {test_set}", "",
        markdown_table(reports), "",
        "![reliability diagram](reliability.png)", "",
    ]))
    (out / "temperature.json").write_text(json.dumps({
        "temperature": calibrator.temperature, "fitted_on": str(args.logits), "num_examples": len(labels),
        "num_classes": before.shape[-1], "in_sample": in_sample,
        "before": reports[0].as_dict(), "after": reports[1].as_dict(),
    }, indent=2))
    if args.save_probs:
        np.save(out / "calibrated_probs.npy", after.numpy())
    print(f"temperature {calibrator.temperature:.4f}; ECE {reports[0].ece:.4f} -> {reports[1].ece:.4f}, "
          f"NLL {reports[0].nll:.4f} -> {reports[1].nll:.4f}; wrote {out / 'report.md'}")
    return calibrator.temperature


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return exit_status(lambda: calibrate_files(args))


if __name__ == "__main__":
    sys.exit(main())
