"""The numbers of ``posthoc evaluate`` and the recipes, checked before any work: a misuse is one line naming the flag.

``argparse`` reads ``--batch-size 0`` or ``--calibration-fraction nan`` as numbers and lets them through, to fail
deep inside (a ``DataLoader`` traceback, a split of NaN rows); :func:`check_numbers` refuses them first with the
library's own checks (:mod:`posthoc.core.checks`), naming the flag, so ``posthoc`` prints ``error: ...`` and exits
with status 2. :class:`OneLineParser` gives argparse's own errors (an unknown flag, ``--batch-size x``) the same one
line and status.

Example:
    >>> import argparse
    >>> from posthoc_apps.cli.flags import check_numbers
    >>> check_numbers(argparse.Namespace(batch_size=0))
    Traceback (most recent call last):
    posthoc.errors.ConfigError: --batch-size must be a positive integer, got 0
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from posthoc.core.checks import integer_at_least, positive_int, probability

_MISSING = object()

#: ``dest -> (flag, check(value, flag))`` for every number a run reads (absent ones are skipped)
NUMBERS: dict[str, tuple[str, Callable[[Any, str], Any]]] = {
    "batch_size": ("--batch-size", positive_int),
    "workers": ("--workers", lambda value, flag: integer_at_least(value, flag, 0)),
    "calibration_fraction": (
        "--calibration-fraction",
        lambda value, flag: probability(
            value, flag, why="the share of the held-out rows that calibrates; the rest is the test set"
        ),
    ),
    "num_samples": ("--num-samples", lambda value, flag: positive_int(value, flag, none="the method's own")),
    "train_subset": ("--train-subset", lambda value, flag: positive_int(value, flag, none="all")),
    "val_subset": ("--val-subset", lambda value, flag: positive_int(value, flag, none="all")),
    "ood_subset": ("--ood-subset", lambda value, flag: positive_int(value, flag, none="all")),
    "num_classes": ("--num-classes", lambda value, flag: positive_int(value, flag, none="the architecture's")),
    "image_size": ("--image-size", lambda value, flag: positive_int(value, flag, none="the model's own")),
    "resize": ("--resize", lambda value, flag: positive_int(value, flag, none="the model's own")),
    "crop": ("--crop", lambda value, flag: positive_int(value, flag, none="the model's own")),
    "expect_accuracy": (
        "--expect-accuracy",
        lambda value, flag: None if value is None else probability(value, flag, why="an accuracy"),
    ),
    "alpha": ("--alpha", lambda value, flag: None if value is None else probability(value, flag)),
    "target_risk": ("--target-risk", lambda value, flag: None if value is None else probability(value, flag)),
    "delta": ("--delta", probability),
    "ci": ("--ci", lambda value, flag: None if value is None else probability(value, flag, why="a confidence level")),
    "bootstraps": (
        "--bootstraps",
        lambda value, flag: integer_at_least(value, flag, 2, why="an interval needs resamples"),
    ),
}


def check_numbers(args: argparse.Namespace) -> None:
    """Refuse a number of ``args`` out of its range (:data:`NUMBERS`), naming its flag (a :class:`ConfigError`)."""
    for dest, (flag, check) in NUMBERS.items():
        value = getattr(args, dest, _MISSING)
        if value is not _MISSING:
            check(value, flag)


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``error: ...`` with a pointer to ``--help``, and status 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)
