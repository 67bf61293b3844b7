"""``posthoc evaluate --shift gaussian-noise,contrast --severities 1,3,5 --ci 0.95``: corruptions and intervals.

``--shift`` takes either a labelled folder (e.g. an ImageNet-C ``corruption/severity`` folder, as before) or a
comma-separated list of :data:`posthoc.shift.KINDS`, which corrupt the test set on the fly
(``posthoc.evaluate_shift``, in the pixel space of the model's preprocessing). ``--ci`` adds bootstrap
intervals to every table.

Example:
    >>> import argparse
    >>> from posthoc_apps.cli.shift import ShiftAction, add_shift_arguments
    >>> parser = argparse.ArgumentParser()
    >>> _ = parser.add_argument("--shift", action=ShiftAction, default=[])
    >>> add_shift_arguments(parser)
    >>> parser.parse_args(["--shift", "gaussian-noise,contrast", "--severities", "1,5"]).corruptions
    ['gaussian-noise', 'contrast']
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from posthoc.engine.uncertain_model import UncertainModel
from posthoc.evaluation.shift import ShiftTable, evaluate_shift, plain_and_best
from posthoc.shift import KINDS
from posthoc.shift.loader import Normalization
from posthoc_apps.report import figures


class ShiftAction(argparse.Action):
    """``--shift``: corruption kinds go to ``args.corruptions``, anything else is a folder appended to ``args.shift``."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        names = [name.strip() for name in str(values).split(",") if name.strip()]
        if names and all(name in KINDS for name in names) and not Path(values).is_dir():
            corruptions = list(getattr(namespace, "corruptions", None) or [])
            namespace.corruptions = corruptions + [n for n in names if n not in corruptions]
            return
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), Path(values)])


def _severities(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(not 1 <= value <= 5 for value in values):
        raise argparse.ArgumentTypeError(
            f"severities are integers from 1 to 5, comma-separated (e.g. 1,3,5); got {text!r}"
        )
    return values


def _level(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"--ci is a confidence level in (0, 1), e.g. 0.95; got {text!r}")
    return value


def add_shift_arguments(parser: argparse.ArgumentParser) -> None:
    """``--severities`` and ``--ci`` / ``--bootstraps`` (``--shift`` itself is defined with the data arguments)."""
    group = parser.add_argument_group("shift and intervals")
    group.set_defaults(corruptions=[])
    group.add_argument(
        "--severities",
        type=_severities,
        default=[1, 3, 5],
        metavar="S[,S...]",
        help="severities (1-5) of the --shift corruption kinds (default: 1,3,5)",
    )
    group.add_argument(
        "--ci",
        type=_level,
        default=None,
        metavar="LEVEL",
        help="bootstrap confidence intervals at this level on every metric, e.g. 0.95 (default: none)",
    )
    group.add_argument("--bootstraps", type=int, default=1000, metavar="N", help="bootstrap resamples (default: 1000)")


def transform_normalization(transform: Any) -> Normalization | None:
    """The ``(mean, std)`` of the normalisation inside a preprocessing transform (torchvision's
    ``ImageClassification``, a ``Compose`` holding ``Normalize``, an object with ``image_mean`` / ``image_std``),
    or ``None`` when it has none."""
    for mean_name, std_name in (("mean", "std"), ("image_mean", "image_std")):
        mean, std = getattr(transform, mean_name, None), getattr(transform, std_name, None)
        if mean is not None and std is not None:
            return tuple(mean), tuple(std)
    for inner in getattr(transform, "transforms", None) or []:
        found = transform_normalization(inner)
        if found is not None:
            return found
    return None


def corruption_table(
    um: UncertainModel, name: str, test_loader: Iterable, args: argparse.Namespace, normalization: Normalization | None
) -> ShiftTable | None:
    """The row's :class:`ShiftTable` on the corrupted test set, or ``None`` without corruption kinds."""
    if not args.corruptions:
        return None
    return evaluate_shift(
        {name: um},
        test_loader,
        kinds=args.corruptions,
        severities=args.severities,
        normalization=normalization,
        seed=args.seed,
        ci=args.ci,
        bootstraps=args.bootstraps,
        num_samples=args.num_samples,
        progress=not args.no_progress,
    )


def corruption_lines(
    tables: Sequence[ShiftTable | None], out: Path, *, drawn: Sequence[str] | None = None
) -> list[str]:
    """The report's corruption section, ``out/shift.png`` (NLL and ECE against severity, of the rows ``drawn``:
    default all) and ``out/confidence.png`` (mean confidence and accuracy against severity, the plain model against
    the row with the lowest NLL at the top severity); nothing when no row was corrupted."""
    present = [table for table in tables if table is not None]
    if not present:
        return []
    merged = ShiftTable.merge(present)
    shown = [table for table in present if drawn is None or set(table.methods) & set(drawn)] or present
    figures.shift_plot(ShiftTable.merge(shown), out / "shift.png")
    compared = plain_and_best(merged)
    figures.confidence_plot(merged, out / "confidence.png", compared)
    return [
        "## Corruptions of the test set (posthoc.shift)",
        "",
        merged.to_markdown(detail=True),
        "",
        "![NLL and ECE against severity](shift.png)",
        "",
        f"Mean confidence (solid) against accuracy (dashed), {' against '.join(compared)}: the shaded gap is the "
        "overconfidence under shift.",
        "",
        "![confidence against severity](confidence.png)",
        "",
    ]
