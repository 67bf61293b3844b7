"""The OOD-score part of ``posthoc evaluate``: ``--ood-scores energy,mahalanobis,...``.

With ``--ood`` and ``--ood-scores``, one ``posthoc.detector`` is fitted on the plain model (on
``--train`` for ``mahalanobis`` / ``vim`` / ``knn``) and reported next to every method row's own
entropy and mutual information: ``report.md`` gets a table of every score of the plain model
(AUROC, AUPR-in, AUPR-out, FPR at 95% TPR) and one line per method comparing its entropy / MI with
the best of them; ``ood_scores.png`` shows each score's in-distribution and OOD histograms.

Example:
    $ posthoc evaluate --model timm:resnet50 --train train/ --train-subset 20000 --val val/ \\
        --ood imagenet-o/ --ood-scores energy,vim,knn --method laplace --out report/
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from torch import nn

from posthoc.errors import ConfigError
from posthoc.evaluation import ood_report
from posthoc.evaluation.report import Report
from posthoc.ood.detector import Detector, available_scores, detector
from posthoc_apps.report import figures

HISTOGRAM_FILE = "ood_scores.png"


def parse_scores(text: str) -> list[str]:
    """``"energy, knn"`` -> ``["energy", "knn"]``, refusing names that are not OOD scores."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in available_scores()]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown OOD score(s) {unknown or text!r}; valid: {','.join(available_scores())}"
        )
    return names


def add_ood_arguments(parser: argparse.ArgumentParser, parse_option: Callable[[str], tuple[str, Any]]) -> None:
    """``--ood-scores`` and ``--ood-option`` (``KEY=VALUE`` read by ``parse_option``)."""
    group = parser.add_argument_group("OOD scores (with --ood)")
    group.add_argument(
        "--ood-scores",
        type=parse_scores,
        default=None,
        metavar="NAME[,NAME]",
        help="post-hoc OOD scores of the plain model reported next to each method's entropy / MI: "
        f"{','.join(available_scores())} (those with training statistics, e.g. mahalanobis, knn, react, "
        "openmax, read --train)",
    )
    group.add_argument(
        "--ood-option",
        type=parse_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an OOD score option, e.g. k=10 (knn), dim=32 (vim), temperature=2 (energy) (repeatable)",
    )


def fit_ood_detector(
    model: nn.Module, train: Iterable | None, ood: Iterable | None, args: argparse.Namespace
) -> Detector | None:
    """The plain model's detector for ``--ood-scores`` (fitted on ``train`` where a score needs it), or ``None``.

    ``entropy`` and ``mutual-information`` come from each method row's own predictive, not from the detector.
    """
    names = [name for name in (args.ood_scores or []) if name not in ood_report.OWN_SCORES]
    if args.ood_scores and ood is None:
        raise ConfigError("--ood-scores scores the --ood folder: pass --ood DIR")
    if not names:
        return None
    scorer = detector(model, score=names, **dict(args.ood_option))
    if scorer.requires_fit:
        if train is None:
            raise ConfigError(
                f"--ood-scores {','.join(names)} reads training statistics: pass --train DIR "
                "(with --train-subset N to use a random subset)"
            )
        print(f"[posthoc] OOD scores {','.join(names)}: fit on the training images", flush=True)
        scorer.fit(train, progress=not args.no_progress)
    return scorer


def ood_lines(rows: list[tuple[str, Report]], out: Path) -> list[str]:
    """``report.md`` lines for the OOD scores (and ``ood_scores.png`` written to ``out``); ``rows`` are
    ``(name, test report)`` with the plain model first. Empty when no OOD set was scored."""
    measured = [(name, report) for name, report in rows if report.ood]
    if not measured:
        return []
    plain_name, plain = measured[0]
    figures.ood_histograms(plain, out / HISTOGRAM_FILE)
    own = {name: {k: v for k, v in report.ood.items() if k in ood_report.OWN_SCORES} for name, report in measured}
    return [
        f"## OOD detection: post-hoc scores of {plain_name}",
        "",
        ood_report.ood_markdown({plain_name: plain.ood}),
        "",
        "## OOD detection: each method's entropy (H) and mutual information (MI) next to the best post-hoc score",
        "",
        ood_report.comparison_markdown(plain.ood, own),
        "",
        "Every score is larger for inputs that look more OOD; AUPR-in / AUPR-out take the in-distribution / OOD "
        "set as positive; FPR95: fraction of test images flagged at the threshold that flags 95% of the OOD set.",
        "",
        f"![OOD score histograms]({HISTOGRAM_FILE})",
        "",
    ]
