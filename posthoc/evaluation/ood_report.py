"""The OOD part of a report: every score's values on the test and OOD sets, and their Markdown table.

The method's own predictive gives ``"entropy"`` and, with samples, ``"mutual-information"``; ``ood_scores`` adds
post-hoc detector scores (``posthoc.detector``) next to them.

Example:
    >>> from posthoc.evaluation.ood_report import ood_markdown, ood_values
    >>> from posthoc_apps.demo.examples import test_loader, ood_loader, um
    >>> from posthoc.evaluation import metrics
    >>> test_x, ood_x = test_loader.dataset.tensors[0], ood_loader.dataset.tensors[0]
    >>> values = ood_values(um, um.predict(test_x), um.predict(ood_x), test_loader, ood_loader, ["energy", "msp"])
    >>> print(ood_markdown({"laplace": {name: metrics.ood_metrics(*v) for name, v in values.items()}}))
    | method | score | AUROC | AUPR-in | AUPR-out | FPR@95TPR |
    |---|---|---|---|---|---|
    | laplace | entropy | 0.4374 | 0.5570 | 0.4483 | 0.8516 |
    | laplace | msp | 0.4319 | 0.5594 | 0.4418 | 0.8281 |
    | laplace | energy | 0.0405 | 0.3105 | 0.3101 | 1.0000 |
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from posthoc.core.prediction import Prediction
from posthoc.engine.uncertain_model import UncertainModel
from posthoc.errors import ConfigError
from posthoc.ood.detector import SCORES, Detector, detector

#: scores read from the evaluated method's own predictive rather than from a detector
OWN_SCORES = ("entropy", "mutual-information")
COLUMNS = {"auroc": "AUROC", "aupr_in": "AUPR-in", "aupr_out": "AUPR-out", "fpr95": "FPR@95TPR"}
#: ``Report.intervals`` keys of the AUROC intervals of the method's own scores (detector scores: ``ood_auroc:NAME``)
OWN_INTERVALS = {"entropy": "ood_auroc", "mutual-information": "ood_auroc_mi"}

OODValues = dict[str, tuple[Tensor, Tensor]]
OODTable = Mapping[str, Mapping[str, float]]


def own_values(test: Prediction, ood: Prediction) -> OODValues:
    """``entropy`` and (where the predictive has any) ``mutual-information`` on the test and OOD sets."""
    values = {"entropy": (test.entropy, ood.entropy)}
    if bool((test.epistemic > 0).any() or (ood.epistemic > 0).any()):
        values["mutual-information"] = (test.epistemic, ood.epistemic)
    return values


def scoring_detector(um: UncertainModel, ood_scores: Sequence[str] | Detector) -> Detector:
    """``ood_scores`` as a detector: a fitted one as given, or names of scores that need no fit, on ``um``."""
    if isinstance(ood_scores, Detector):
        return ood_scores
    names = [ood_scores] if isinstance(ood_scores, str) else list(ood_scores)
    fitted = [name for name in names if name in SCORES and SCORES[name].fit_passes]
    if fitted:
        raise ConfigError(
            f"the OOD score(s) {fitted} need training statistics: pass a fitted detector, "
            f"ood_scores=posthoc.detector(um, score={names}).fit(train_loader)"
        )
    return detector(um, score=[name for name in names if name not in OWN_SCORES] or names)


def ood_values(
    um: UncertainModel,
    test: Prediction,
    ood: Prediction,
    test_loader: Iterable,
    ood_loader: Iterable,
    ood_scores: Sequence[str] | Detector | None,
    *,
    progress: bool = True,
    generator: torch.Generator | None = None,
) -> OODValues:
    """Per score, its values ``(on the test set, on the OOD set)``: the method's own entropy / MI, then
    the detector scores of ``ood_scores`` (a fitted ``posthoc.detector``, or names of scores that need no fit)."""
    values = own_values(test, ood)
    if ood_scores is None:
        return values
    scorer = scoring_detector(um, ood_scores)
    names = [name for name in scorer.names if name not in OWN_SCORES]
    # scores of um's own predictive come from the predictions evaluate already made: no second pass
    in_hand = [name for name in names if scorer.um is um and scorer.reads_only_prediction(name)]
    if in_hand:
        on_test, on_ood = scorer.prediction_scores(test, in_hand), scorer.prediction_scores(ood, in_hand)
        values.update({name: (on_test[name].cpu(), on_ood[name].cpu()) for name in in_hand})
    names = [name for name in names if name not in in_hand]
    if names:
        on_test = scorer.score_loader(test_loader, names, progress=progress, generator=generator)
        on_ood = scorer.score_loader(ood_loader, names, progress=progress, generator=generator)
        values.update({name: (on_test[name], on_ood[name]) for name in names})
    return values


def best_score(table: OODTable, metric: str = "auroc") -> str:
    """The name of the score with the highest ``metric`` in ``table`` (``score -> metrics``).

    Example:
        >>> from posthoc.evaluation.ood_report import best_score
        >>> best_score({"msp": {"auroc": 0.9}, "knn": {"auroc": 0.95}})
        'knn'
    """
    return max(table, key=lambda name: table[name][metric])


def comparison_markdown(post_hoc: OODTable, own: Mapping[str, OODTable]) -> str:
    """One line per method: its own ``entropy`` (and ``mutual-information``) AUROC / FPR at 95% TPR next to
    the best score of ``post_hoc`` (``score -> metrics``, e.g. every detector score of the plain model).

    Example:
        >>> from posthoc.evaluation.ood_report import comparison_markdown
        >>> print(comparison_markdown({"knn": {"auroc": 0.95, "fpr95": 0.2}}, {"MAP": {"entropy": {"auroc": 0.9, "fpr95": 0.3}}}))
        | method | AUROC (H) | FPR95 (H) | AUROC (MI) | FPR95 (MI) | best post-hoc: knn AUROC | FPR95 |
        |---|---|---|---|---|---|---|
        | MAP | 0.9000 | 0.3000 | – | – | 0.9500 | 0.2000 |
    """
    best = best_score(post_hoc)

    def cells(measured: Mapping[str, float] | None) -> list[str]:
        return ["–", "–"] if measured is None else [f"{measured['auroc']:.4f}", f"{measured['fpr95']:.4f}"]

    lines = [
        f"| method | AUROC (H) | FPR95 (H) | AUROC (MI) | FPR95 (MI) | best post-hoc: {best} AUROC | FPR95 |",
        "|" + "---|" * 7,
    ]
    for method, table in own.items():
        row = [method, *cells(table.get("entropy")), *cells(table.get("mutual-information")), *cells(post_hoc[best])]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def every_score_markdown(own: Mapping[str, OODTable], shared: OODTable, metric: str = "auroc") -> str:
    """One line per method with ``metric`` for every score: the method's own scores (``own``: method -> score ->
    metrics) and, for the scores it does not have, the ``shared`` ones, marked with ``*``.

    Example:
        >>> from posthoc.evaluation.ood_report import every_score_markdown
        >>> print(every_score_markdown({"MAP": {"entropy": {"auroc": 0.9}}}, {"knn": {"auroc": 0.95}}))
        | method | entropy | knn |
        |---|---|---|
        | MAP | 0.9000 | 0.9500* |
    """
    names = list(dict.fromkeys([*(name for table in own.values() for name in table), *shared]))
    lines = ["| method | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for method, table in own.items():
        cells = [
            f"{table[name][metric]:.4f}" if name in table else f"{shared[name][metric]:.4f}*" if name in shared else "–"
            for name in names
        ]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def interval_key(score: str) -> str:
    """The ``Report.intervals`` key of a score's AUROC interval.

    Example:
        >>> from posthoc.evaluation.ood_report import interval_key
        >>> interval_key("entropy"), interval_key("knn")
        ('ood_auroc', 'ood_auroc:knn')
    """
    return OWN_INTERVALS.get(score, f"ood_auroc:{score}")


def ood_markdown(
    rows: Mapping[str, OODTable], intervals: Mapping[str, Mapping[str, tuple[float, float]]] | None = None
) -> str:
    """A Markdown table with one line per (method, score): AUROC, AUPR-in, AUPR-out, FPR at 95% TPR;
    ``intervals`` (``method -> score -> (low, high)``) adds the AUROC's bootstrap interval where given."""
    lines = ["| method | score | " + " | ".join(COLUMNS.values()) + " |", "|" + "---|" * (len(COLUMNS) + 2)]
    for method, table in rows.items():
        for name, measured in table.items():
            cells = [f"{measured[key]:.4f}" for key in COLUMNS]
            bounds = (intervals or {}).get(method, {}).get(name)
            if bounds is not None:
                cells[0] += f" [{bounds[0]:.4f}, {bounds[1]:.4f}]"
            lines.append(f"| {method} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
