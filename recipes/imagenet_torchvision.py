"""Retrofit uncertainty onto a pretrained torchvision ImageNet classifier, and report on image folders.

Run it on a machine with internet (or a filled torch hub cache) and ImageNet in ImageFolder
layout (``train/n01440764/*.JPEG``, ``val/n01440764/*.JPEG``, ...)::

    python recipes/imagenet_torchvision.py --model resnet50 \\
        --train /data/imagenet/train --train-subset 20000 --val /data/imagenet/val --val-subset 10000 \\
        --ood /data/imagenet-o --method laplace --method laplace+temperature --out reports/tv_resnet50

    # your fine-tuned torchvision model, 10 classes:
    python recipes/imagenet_torchvision.py --model efficientnet_b0 --pretrained false --num-classes 10 \\
        --checkpoint finetuned.pth --train data/train --val data/val --method temperature --out reports/ft

Steps: (1) ``torchvision.models.get_model(NAME, weights="DEFAULT")`` (``--checkpoint`` loads your
state_dict on top, with missing/unexpected keys reported); (2) the weights' own preprocessing,
``weights.transforms()``; (3) ImageFolder loaders, the class folders checked against the model's
head; (4) ``posthoc.wrap(model, method).fit(train subset, calibration half of val)`` for each
``--method`` row, next to the plain model; (5) ``posthoc.evaluate`` on the test half of val, the
OOD and the shift folders; (6) ``report.md``, ``metrics.json``, ``reliability.png`` and
``risk_coverage.png`` in ``--out``.

``--pretrained false`` gives random weights (the test suite runs this recipe offline that way).
See ``--help`` for every option.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torchvision
from torch import nn

from posthoc.core.errors import ConfigError, exit_status
from posthoc.cli.evaluate import recipe_parser, run_retrofit
from posthoc.loading.models import load_checkpoint, weights_unavailable


def load_model(name: str, pretrained: bool, num_classes: int | None, checkpoint: Path | None) -> nn.Module:
    """``torchvision.models.get_model`` with the DEFAULT ImageNet weights (or random ones), then your checkpoint."""
    if name not in torchvision.models.list_models():
        raise ConfigError(f"torchvision has no model {name!r}; list them with torchvision.models.list_models()")
    head = {} if num_classes is None else {"num_classes": num_classes}
    try:
        model = torchvision.models.get_model(name, weights="DEFAULT" if pretrained else None, **head)
    except OSError as err:  # offline and not cached
        raise weights_unavailable(f"torchvision:{name}", err) from err
    if checkpoint is not None:
        load_checkpoint(model, checkpoint, architecture=f"torchvision:{name}")
    return model.eval()


def preprocessing(name: str, image_size: int | None):
    """The DEFAULT weights' evaluation transform; ``image_size`` rescales its crop and resize sizes alike."""
    weights = torchvision.models.get_model_weights(name).DEFAULT
    transform = weights.transforms()
    if image_size is None:
        return transform
    ratio = transform.resize_size[0] / transform.crop_size[0]
    return weights.transforms(crop_size=image_size, resize_size=round(image_size * ratio))


def build_parser() -> argparse.ArgumentParser:
    return recipe_parser(__doc__, "torchvision", "torchvision.models.list_models()")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def run() -> None:
        torch.manual_seed(args.seed)
        model = load_model(args.model, args.pretrained, args.num_classes, args.checkpoint)
        weights = "ImageNet weights" if args.pretrained else "random weights"
        run_retrofit(model, preprocessing(args.model, args.image_size), args,
                     title=f"torchvision {args.model} ({weights})")

    return exit_status(run)


if __name__ == "__main__":
    sys.exit(main())
