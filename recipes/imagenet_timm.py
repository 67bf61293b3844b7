"""Retrofit uncertainty onto a pretrained timm ImageNet classifier, and report on image folders.

Run it on a machine with internet (or a filled Hugging Face cache) and ImageNet in ImageFolder
layout (``train/n01440764/*.JPEG``, ``val/n01440764/*.JPEG``, ...)::

    python recipes/imagenet_timm.py --model resnet50 \\
        --train /data/imagenet/train --train-subset 20000 --val /data/imagenet/val --val-subset 10000 \\
        --ood /data/imagenet-o --shift /data/imagenet-c/gaussian_noise/3 \\
        --method laplace --method laplace+temperature --out reports/timm_resnet50

    # your fine-tuned timm model, 37 classes:
    python recipes/imagenet_timm.py --model convnext_tiny --pretrained false --num-classes 37 \\
        --checkpoint pets_convnext.pth --train pets/train --val pets/val --method temperature --out reports/pets

Steps: (1) ``timm.create_model(NAME, pretrained=True)`` (``--checkpoint`` loads your state_dict on
top, with missing/unexpected keys reported); (2) the model's own evaluation preprocessing,
``timm.data.resolve_data_config`` + ``create_transform``; (3) ImageFolder loaders, the class
folders checked against the model's head; (4) ``posthoc.wrap(model, method).fit(train subset,
calibration half of val)`` for each ``--method`` row, next to the plain model; (5)
``posthoc.evaluate`` on the test half of val, the OOD and the shift folders; (6) ``report.md``,
``metrics.json``, ``reliability.png`` and ``risk_coverage.png`` in ``--out``.

``--pretrained false`` gives random weights (the test suite runs this recipe offline that way).
See ``--help`` for every option.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import timm
import torch
from timm.data import create_transform, resolve_data_config
from torch import nn

from posthoc.core.errors import ConfigError, exit_status
from posthoc.cli.evaluate import recipe_parser, run_retrofit
from posthoc.loading.models import load_checkpoint, weights_unavailable


def load_model(name: str, pretrained: bool, num_classes: int | None, checkpoint: Path | None) -> nn.Module:
    """``timm.create_model`` with the published ImageNet weights (or random ones), then your checkpoint."""
    if not timm.is_model(name):
        raise ConfigError(f"timm has no model {name!r}; list them with timm.list_models('*{name[:6]}*')")
    head = {} if num_classes is None else {"num_classes": num_classes}
    try:
        model = timm.create_model(name, pretrained=pretrained, **head)
    except OSError as err:  # offline and not cached
        raise weights_unavailable(f"timm:{name}", err) from err
    if checkpoint is not None:
        load_checkpoint(model, checkpoint, architecture=f"timm:{name}")
    return model.eval()


def preprocessing(model: nn.Module, image_size: int | None):
    """The model's own evaluation transform (resize, center crop, normalise) from its pretrained config."""
    override = {} if image_size is None else {"input_size": (3, image_size, image_size)}
    return create_transform(**resolve_data_config(override, model=model), is_training=False)


def build_parser() -> argparse.ArgumentParser:
    return recipe_parser(__doc__, "timm", "timm.list_models()")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def run() -> None:
        torch.manual_seed(args.seed)
        model = load_model(args.model, args.pretrained, args.num_classes, args.checkpoint)
        weights = "ImageNet weights" if args.pretrained else "random weights"
        run_retrofit(model, preprocessing(model, args.image_size), args, title=f"timm {args.model} ({weights})")

    return exit_status(run)


if __name__ == "__main__":
    sys.exit(main())
