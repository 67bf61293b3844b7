"""Retrofit uncertainty onto a Hugging Face text regressor (``num_labels=1``), and report on text files.

Run it on a machine with internet (or a filled Hugging Face cache). Data are CSV or JSON-lines files with a
``text`` column and a numeric target column (``--target``, default ``score``)::

    python recipes/huggingface_regression.py --model my-finetuned-stsb-regressor --train train.jsonl \\
        --val val.jsonl --test test.jsonl --target score --method laplace --alpha 0.1 --out reports/stsb

Steps: (1) ``AutoModelForSequenceClassification.from_pretrained(name, num_labels=1,
problem_type="regression")`` and ``AutoTokenizer.from_pretrained`` (a model fine-tuned as a regressor keeps
its one-output head; a classifier checkpoint gets a fresh one, ``ignore_mismatched_sizes``); its ``logits``
``(N, 1)`` are the predicted means; (2) the text files, batched with the model's own tokenizer into
``(BatchEncoding, float targets)`` pairs (``posthoc_apps.loading.hf.TextFile(..., target=...)``);
(3) ``posthoc.wrap(model, method, likelihood="regression").fit(train, val)`` for each ``--method`` row
(default ``laplace``: last-layer Laplace on the head ``classifier`` / ``score``) next to the plain model,
whose Gaussian noise is fitted on ``--val``; (4) ``posthoc.evaluate`` on ``--test`` (default: half of
``--val``) and the report printed: NLL, CRPS, RMSE, interval coverage and width, MACE, ENCE (with
``--alpha``, conformal intervals); (5) ``report.md``, ``summary.md``, ``metrics.json`` and the
calibration PNGs in ``--out``. ``--pretrained false`` builds the architecture with random weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posthoc.errors import exit_status
from posthoc_apps.cli.evaluate import parse_bool
from posthoc_apps.cli.tables import add_recipe_arguments, run_regression_recipe
from posthoc_apps.loading.hf import TextFile, require_transformers, text_loader

REGRESSION = {"num_labels": 1, "problem_type": "regression"}


def load_model(name: str, pretrained: bool = True) -> tuple[nn.Module, Any]:
    """The one-output regressor and its tokenizer, by ``from_pretrained`` (or from the config, random weights)."""
    transformers = require_transformers()  # ImportError naming pip install 'posthoc[hf]' when missing
    if pretrained:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            name, ignore_mismatched_sizes=True, **REGRESSION
        )
    else:
        config = transformers.AutoConfig.from_pretrained(name, **REGRESSION)
        model = transformers.AutoModelForSequenceClassification.from_config(config)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(name)


def parser() -> argparse.ArgumentParser:
    """``--model``, the text files, ``--target`` and the methods and run options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", required=True, metavar="NAME", help="a Hugging Face Hub id or a save_pretrained folder"
    )
    parser.add_argument(
        "--pretrained",
        type=parse_bool,
        default=True,
        metavar="true|false",
        help="load the published weights (default: true); false = random weights",
    )
    parser.add_argument("--train", type=Path, default=None, metavar="FILE", help="training rows (.csv / .jsonl)")
    parser.add_argument(
        "--val", type=Path, required=True, metavar="FILE", help="held-out rows: fit the noise and the methods"
    )
    parser.add_argument("--test", type=Path, default=None, metavar="FILE", help="test rows (default: half of --val)")
    parser.add_argument(
        "--target", default="score", metavar="COLUMN", help="the numeric target column (default: score)"
    )
    add_recipe_arguments(parser, default_out="reports/hf-regression")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    def run() -> None:
        torch.manual_seed(args.seed)
        model, tokenizer = load_model(args.model, args.pretrained)
        read = lambda path: None if path is None else TextFile(path, model, target=args.target)  # noqa: E731
        run_regression_recipe(
            model,
            (read(args.train), read(args.val), read(args.test)),
            lambda rows, shuffle: text_loader(
                rows, tokenizer, batch_size=args.batch_size, shuffle=shuffle, seed=args.seed
            ),
            args,
            title=f"Hugging Face {args.model} (regression)",
        )

    return exit_status(run)


if __name__ == "__main__":
    sys.exit(main())
