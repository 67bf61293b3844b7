"""Running a wrapped model over a loader and keeping its per-example predictive (no samples).

A classifier gives a :class:`Prediction` and labels, a regressor a :class:`RegressionPrediction` (its mixture's
components kept) and float64 targets. Under ``torch.distributed`` every rank ends with the same, gathered predictions.

Example:
    >>> from posthoc.engine.predictions import predict_loader
    >>> from posthoc_apps.demo.examples import um, test_loader
    >>> pred, labels = predict_loader(um, test_loader)
    >>> pred.probs.shape, pred.samples is None
    (torch.Size([128, 3]), True)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from posthoc.core import distributed
from posthoc.core.inputs import check_labels, iterate
from posthoc.core.likelihood import real_targets
from posthoc.core.prediction import COMPONENTS, Prediction, RegressionPrediction, concat
from posthoc.engine.uncertain_model import UncertainModel

#: the per-example fields gathered from every batch (``label`` and ``confidence`` follow from ``probs``)
_GATHERED = ("probs", "entropy", "aleatoric", "epistemic")


@torch.no_grad()
def predict_loader(
    um: UncertainModel,
    loader: Iterable,
    *,
    labelled: bool = True,
    progress: bool = True,
    num_samples: int | None = None,
    generator: torch.Generator | None = None,
    desc: str = "evaluate",
) -> tuple[Prediction, Tensor | None]:
    """``um.predict`` over every batch of ``loader``, on the CPU: the :class:`Prediction` (without samples) and the
    labels (``None`` if not ``labelled``).
    """
    parts: dict[str, list[Tensor]] = {name: [] for name in (*_GATHERED, "labels")}
    for x, y in iterate(loader, device=um.device, progress=progress, desc=desc, require_labels=labelled):
        pred = um.predict(x, num_samples=num_samples, generator=generator, keep_samples=False)
        for name in _GATHERED:
            parts[name].append(getattr(pred, name).cpu())
        if labelled:
            parts["labels"].append(check_labels(y, pred.num_classes).cpu())
    fields = {name: distributed.gather_cat(torch.cat(parts[name])) for name in _GATHERED}
    confidence, label = fields["probs"].max(-1)
    labels = distributed.gather_cat(torch.cat(parts["labels"])) if labelled else None
    return Prediction(
        fields["probs"], None, fields["entropy"], fields["aleatoric"], fields["epistemic"], confidence, label
    ), labels


@torch.no_grad()
def predict_regression_loader(
    um: UncertainModel,
    loader: Iterable,
    *,
    labelled: bool = True,
    progress: bool = True,
    num_samples: int | None = None,
    generator: torch.Generator | None = None,
    desc: str = "evaluate",
) -> tuple[RegressionPrediction, Tensor | None]:
    """:func:`predict_loader` for a regressor: the :class:`RegressionPrediction` and float64 targets ``(N, D)``.

    Example:
        >>> from posthoc.engine.predictions import predict_regression_loader
        >>> from posthoc_apps.demo.examples import regression_um, reg_test_loader
        >>> pred, y = predict_regression_loader(regression_um, reg_test_loader)
        >>> pred.mean.shape == y.shape
        True
    """
    parts: list[RegressionPrediction] = []
    targets: list[Tensor] = []
    for x, y in iterate(loader, device=um.device, progress=progress, desc=desc, require_labels=labelled):
        pred = um.predict(x, num_samples=num_samples, generator=generator, keep_samples=False)
        parts.append(RegressionPrediction.from_components(*(getattr(pred, name).cpu() for name in COMPONENTS)))
        if labelled:
            targets.append(real_targets(y, pred.mean).cpu())
    joined = concat(parts)
    gathered = RegressionPrediction.from_components(
        *(distributed.gather_cat(getattr(joined, name), dim=1) for name in COMPONENTS)
    )
    return concat([gathered], keep_samples=False), distributed.gather_cat(torch.cat(targets)) if labelled else None


def collect(
    um: UncertainModel,
    loader: Iterable,
    *,
    labelled: bool = True,
    progress: bool = True,
    num_samples: int | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, Tensor]:
    """:func:`predict_loader` as a dict of concatenated ``probs``, ``entropy``, ``epistemic`` (and ``labels``).

    Example:
        >>> from posthoc.engine.predictions import collect
        >>> from posthoc_apps.demo.examples import um, test_loader
        >>> collect(um, test_loader)["probs"].shape
        torch.Size([128, 3])
    """
    pred, labels = predict_loader(
        um, loader, labelled=labelled, progress=progress, num_samples=num_samples, generator=generator
    )
    out = {"probs": pred.probs, "entropy": pred.entropy, "epistemic": pred.epistemic}
    if labels is not None:
        out["labels"] = labels
    return out
