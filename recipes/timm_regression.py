"""Retrofit uncertainty onto a timm image regressor (a backbone with a one-output head), and report on images.

Run it on a machine with internet (or a filled Hugging Face cache). Data are CSV files with an ``image``
column (paths relative to the CSV) and a numeric target column (``--target``, default ``target``)::

    python recipes/timm_regression.py --model convnext_tiny --checkpoint age_convnext.pth \\
        --train faces/train.csv --val faces/val.csv --test faces/test.csv --target age \\
        --method laplace --alpha 0.1 --out reports/age

Steps: (1) ``timm.create_model(NAME, pretrained=True, num_classes=1)``: the backbone's ImageNet weights and a
one-output head (``--checkpoint`` loads your fine-tuned regressor's state_dict on top; without one the
head is untrained and the report shows it); (2) the model's own evaluation preprocessing
(``timm.data.resolve_data_config`` + ``create_transform``); (3) ``posthoc_apps.loading.image_targets.ImageTargets``
loaders of ``(image, float target)``; (4) ``posthoc.wrap(model, method, likelihood="regression").fit(train,
val)`` for each ``--method`` row (default ``laplace``: last-layer Laplace on the head) next to the plain model,
whose Gaussian noise is fitted on ``--val``; (5) ``posthoc.evaluate`` on ``--test`` (default: half of
``--val``), the report printed (NLL, CRPS, RMSE, interval coverage and width, MACE, ENCE; with ``--alpha``
conformal intervals) and written with ``summary.md``, ``metrics.json`` and the calibration PNGs to ``--out``.
``--pretrained false`` gives random weights (the test suite runs it offline that way, on a tiny timm model).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import timm
import torch
from torch import nn
from torch.utils.data import DataLoader

from posthoc.errors import exit_status
from posthoc_apps.cli.evaluate import parse_bool
from posthoc_apps.cli.tables import add_recipe_arguments, run_regression_recipe
from posthoc_apps.loading.folders import model_transform
from posthoc_apps.loading.image_targets import ImageTargets
from posthoc_apps.loading.models import fetching_weights, load_checkpoint, parse_model_spec


def load_model(name: str, pretrained: bool = True, checkpoint: Path | None = None) -> nn.Module:
    """``timm.create_model(name, pretrained, num_classes=1)``, then your checkpoint, in eval mode."""
    spec = parse_model_spec(f"timm:{name}")
    with fetching_weights(spec):  # offline and not cached: a clear error instead of a network traceback
        model = timm.create_model(name, pretrained=pretrained, num_classes=1)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint, architecture=str(spec))
    return model.eval()


def parser() -> argparse.ArgumentParser:
    """``--model``, ``--checkpoint``, the CSV files, ``--target`` and the methods and run options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50", metavar="NAME", help="a timm model name (default: resnet50)")
    parser.add_argument(
        "--pretrained",
        type=parse_bool,
        default=True,
        metavar="true|false",
        help="load the published backbone weights (default: true); false = random weights",
    )
    parser.add_argument("--checkpoint", type=Path, default=None, metavar="FILE", help="your regressor's state_dict")
    parser.add_argument("--image-size", type=int, default=None, metavar="N", help="override the crop size")
    parser.add_argument("--train", type=Path, default=None, metavar="CSV", help="training images and targets")
    parser.add_argument(
        "--val", type=Path, required=True, metavar="CSV", help="held-out images: fit the noise and the methods"
    )
    parser.add_argument("--test", type=Path, default=None, metavar="CSV", help="test images (default: half of --val)")
    parser.add_argument(
        "--target", default="target", metavar="COLUMN", help="the numeric target column (default: target)"
    )
    add_recipe_arguments(parser, default_out="reports/timm-regression")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    def run() -> None:
        torch.manual_seed(args.seed)
        model = load_model(args.model, args.pretrained, args.checkpoint)
        transform = model_transform(model, f"timm:{args.model}", args.image_size)
        read = lambda path: None if path is None else ImageTargets(path, args.target, transform)  # noqa: E731
        generator = torch.Generator().manual_seed(args.seed)
        run_regression_recipe(
            model,
            (read(args.train), read(args.val), read(args.test)),
            lambda rows, shuffle: DataLoader(rows, args.batch_size, shuffle=shuffle, generator=generator),
            args,
            title=f"timm {args.model} (regression)",
        )

    return exit_status(run)


if __name__ == "__main__":
    sys.exit(main())
