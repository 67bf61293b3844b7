"""The ``posthoc`` command line: ``posthoc demo`` (the embedded default) and ``posthoc evaluate``.

Example:
    $ posthoc demo --out posthoc-demo
    $ posthoc demo --task regression
    $ posthoc demo --task segmentation
    $ posthoc evaluate --model timm:resnet50 --train train/ --val val/ --method laplace --out report/
    $ posthoc evaluate --likelihood regression --model model.pt --train train.csv --val val.csv --test test.csv \
        --target mpg --method laplace --out report/
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from posthoc.errors import exit_status
from posthoc_apps.cli.evaluate import add_evaluate_arguments, run_evaluate
from posthoc_apps.cli.flags import OneLineParser, check_numbers
from posthoc_apps.cli.tables import add_regression_arguments, check_classification_arguments, run_regression
from posthoc_apps.demo.run import run_demo, run_regression_demo
from posthoc_apps.demo.segmentation_demo import run_segmentation_demo


def _demo(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    if args.task == "regression":
        print(run_regression_demo(args.out, progress=not args.quiet))
        print(
            f"wrote {args.out}/regression.md, regression_band.png, regression_calibration.png, regression_error_std.png, "
            "regression_shift.png "
            f"in {time.perf_counter() - start:.0f} s"
        )
        return
    if args.task == "segmentation":
        result = run_segmentation_demo(args.out, progress=not args.quiet)
        print("\n".join(result.verdict()) + "\n")
        print(
            f"Report: {Path(args.out) / 'report.html'} (and report.md, with the maps' PNGs beside it), "
            f"written in {time.perf_counter() - start:.0f} s"
        )
        return
    rows = run_demo(args.out, methods=args.method or None, progress=not args.quiet, best=args.best, every_row=args.all)
    if rows[0].verdict is not None:
        print(rows[0].verdict.text() + "\n")
    print(
        f"Report: {Path(args.out) / 'report.html'} (and report.md, with the PNGs beside it), "
        f"written in {time.perf_counter() - start:.0f} s"
    )


def _evaluate(args: argparse.Namespace) -> None:
    check_numbers(args)
    if args.likelihood == "regression":
        run_regression(args)
    else:
        check_classification_arguments(args)
        run_evaluate(args)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="posthoc", description="Retrofit uncertainty onto trained classifiers and regressors.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="every method on the bundled digits checkpoint (about 2 minutes)")
    demo.add_argument(
        "--task",
        choices=("classification", "regression", "segmentation"),
        default="classification",
        help="classification: the bundled digits CNN (default); regression: the seed 004 sinusoid and Auto MPG; "
        "segmentation: a small FCN on canvases of digits (dense outputs, risk control of the mask)",
    )
    demo.add_argument("--out", default="posthoc-demo", help="folder for report.md and the PNGs")
    demo.add_argument("--method", action="append", help="only these methods (repeatable); default: all")
    demo.add_argument("--quiet", action="store_true", help="no progress messages")
    demo.add_argument(
        "--all",
        action="store_true",
        help="every demo row (about three times longer); by default the rows that run in about two minutes on 2 cores",
    )
    demo.add_argument(
        "--best",
        default=None,
        metavar="LABEL",
        help="the row the shift story compares with the plain model (default: the lowest NLL under the "
        "strongest shift), e.g. 'Laplace (last layer, KFAC)'",
    )
    demo.set_defaults(run=_demo)
    evaluate = commands.add_parser(
        "evaluate",
        help="retrofit methods onto a timm/torchvision/your model; report on image folders, text files or "
        "(--likelihood regression) CSV files",
    )
    add_evaluate_arguments(evaluate)
    add_regression_arguments(evaluate)
    evaluate.set_defaults(run=_evaluate)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    status = exit_status(lambda: args.run(args))
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    main()
