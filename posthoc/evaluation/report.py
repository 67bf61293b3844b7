"""``posthoc.evaluate``: run a wrapped model over a test loader and summarise it in a :class:`Report`.

Example:
    >>> report = posthoc.evaluate(um, test_loader, ood_loader=noise_loader)
    >>> print(report.to_markdown())
    >>> report.reliability_diagram("reliability.png")
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from posthoc.core import distributed
from posthoc.evaluation import metrics, plots
from posthoc.core.uncertain_model import UncertainModel
from posthoc.core.inputs import check_labels, iterate


@dataclass
class Report:
    """Metrics of one predictive on one test set (and optionally an OOD set).

    ``ood_auroc`` ranks by total predictive entropy, ``ood_auroc_mi`` by mutual information
    (``None`` for deterministic predictives or without an OOD set).
    """

    name: str
    accuracy: float
    nll: float
    ece: float
    brier: float
    aurc: float
    ood_auroc: float | None = None
    ood_auroc_mi: float | None = None
    probs: Tensor = field(repr=False, default=None)
    labels: Tensor = field(repr=False, default=None)

    COLUMNS = ("accuracy", "nll", "ece", "brier", "aurc", "ood_auroc", "ood_auroc_mi")

    @classmethod
    def from_predictions(cls, name: str, probs: Tensor, labels: Tensor, entropy: Tensor | None = None,
                         ood_entropy: Tensor | None = None, epistemic: Tensor | None = None,
                         ood_epistemic: Tensor | None = None) -> "Report":
        """Compute every metric from collected probabilities (and OOD scores if given)."""
        has_ood = entropy is not None and ood_entropy is not None
        has_mi = has_ood and epistemic is not None and ood_epistemic is not None and bool((epistemic > 0).any() or (ood_epistemic > 0).any())
        return cls(
            name=name,
            accuracy=metrics.accuracy(probs, labels),
            nll=metrics.nll(probs, labels),
            ece=metrics.ece(probs, labels),
            brier=metrics.brier(probs, labels),
            aurc=metrics.aurc(probs, labels),
            ood_auroc=metrics.ood_auroc(entropy, ood_entropy) if has_ood else None,
            ood_auroc_mi=metrics.ood_auroc(epistemic, ood_epistemic) if has_mi else None,
            probs=probs,
            labels=labels,
        )

    def as_dict(self) -> dict[str, float | None]:
        return {column: getattr(self, column) for column in self.COLUMNS}

    def to_markdown(self) -> str:
        """A one-row Markdown table of the metrics."""
        return markdown_table([self])

    def reliability_diagram(self, path: str | os.PathLike) -> None:
        plots.reliability_diagram({self.name: (self.probs, self.labels)}, path)

    def risk_coverage_curve(self, path: str | os.PathLike) -> None:
        plots.risk_coverage_curve({self.name: (self.probs, self.labels)}, path)


def _cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"


def markdown_table(reports: list[Report], extra: dict[str, list[str]] | None = None) -> str:
    """Markdown rows of several reports; ``extra`` adds columns (header -> one cell per report)."""
    extra = extra or {}
    header = ["method", "acc", "NLL", "ECE", "Brier", "AURC", "OOD AUROC (H)", "OOD AUROC (MI)", *extra]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, report in enumerate(reports):
        cells = [report.name, *(_cell(v) for v in report.as_dict().values()), *(col[i] for col in extra.values())]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@torch.no_grad()
def collect(um: UncertainModel, loader: Iterable, *, labelled: bool = True, progress: bool = True,
            num_samples: int | None = None, generator: torch.Generator | None = None) -> dict[str, Tensor]:
    """Run ``um.predict`` over a loader; return concatenated probs, entropy, epistemic (and labels).

    Under ``torch.distributed`` each rank predicts its shard and the results are gathered, so
    every rank computes the same metrics over the union of the shards.
    """
    parts: dict[str, list[Tensor]] = {"probs": [], "entropy": [], "epistemic": [], "labels": []}
    for x, y in iterate(loader, device=um.device, progress=progress, desc="evaluate", require_labels=labelled):
        pred = um.predict(x, num_samples=num_samples, generator=generator)
        parts["probs"].append(pred.probs.cpu())
        parts["entropy"].append(pred.entropy.cpu())
        parts["epistemic"].append(pred.epistemic.cpu())
        if labelled:
            parts["labels"].append(check_labels(y, pred.num_classes).cpu())
    return {k: distributed.gather_cat(torch.cat(v)) for k, v in parts.items() if v}


def evaluate(um: UncertainModel, test_loader: Iterable, ood_loader: Iterable | None = None, *,
             name: str | None = None, progress: bool = True, num_samples: int | None = None,
             seed: int = 0) -> Report:
    """Evaluate ``um`` on a labelled test loader, and on an OOD loader (labels ignored) if given.

    Example:
        >>> report = posthoc.evaluate(um, test_loader)
        >>> 0 <= report.ece <= 1
        True
    """
    generator = torch.Generator(device=um.device).manual_seed(seed)
    test = collect(um, test_loader, progress=progress, num_samples=num_samples, generator=generator)
    ood = None
    if ood_loader is not None:
        ood = collect(um, ood_loader, labelled=False, progress=progress, num_samples=num_samples, generator=generator)
    return Report.from_predictions(
        name or "+".join(um.methods), test["probs"], test["labels"], test["entropy"],
        None if ood is None else ood["entropy"], test["epistemic"], None if ood is None else ood["epistemic"],
    )
