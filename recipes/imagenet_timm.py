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

import sys
from pathlib import Path

import timm
from torch import nn

from posthoc_apps.cli.evaluate import recipe_parser, run_recipe
from posthoc_apps.loading.models import fetching_weights, load_checkpoint, model_options, parse_model_spec


def load_model(name: str, pretrained: bool, num_classes: int | None, checkpoint: Path | None) -> nn.Module:
    """``timm.create_model`` with the published ImageNet weights (or random ones), then your checkpoint."""
    spec = parse_model_spec(f"timm:{name}")
    options = model_options(spec, pretrained, num_classes)  # checks the name; {"num_classes": N} if given
    with fetching_weights(spec):  # offline and not cached: a clear error instead of a network traceback
        model = timm.create_model(name, pretrained=pretrained, **options)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint, architecture=str(spec))
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    args = recipe_parser(__doc__, "timm", "timm.list_models()").parse_args(argv)
    return run_recipe(args, "timm", load_model)


if __name__ == "__main__":
    sys.exit(main())
