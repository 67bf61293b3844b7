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

import sys
from pathlib import Path

import torchvision
from torch import nn

from posthoc_apps.cli.evaluate import recipe_parser, run_recipe
from posthoc_apps.loading.models import fetching_weights, load_checkpoint, model_options, parse_model_spec


def load_model(name: str, pretrained: bool, num_classes: int | None, checkpoint: Path | None) -> nn.Module:
    """``torchvision.models.get_model`` with the DEFAULT ImageNet weights (or random ones), then your checkpoint."""
    spec = parse_model_spec(f"torchvision:{name}")
    options = model_options(spec, pretrained, num_classes)  # checks the name; {"num_classes": N} if given
    with fetching_weights(spec):  # offline and not cached: a clear error instead of a network traceback
        model = torchvision.models.get_model(name, weights="DEFAULT" if pretrained else None, **options)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint, architecture=str(spec))
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    args = recipe_parser(__doc__, "torchvision", "torchvision.models.list_models()").parse_args(argv)
    return run_recipe(args, "torchvision", load_model)


if __name__ == "__main__":
    sys.exit(main())
