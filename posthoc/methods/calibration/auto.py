"""``"auto"``: choose the calibrator by k-fold cross-validated NLL, never one worse than no calibration.

The held-out examples are split into ``folds`` stratified folds; every candidate is fitted on all
folds but one and predicts the one left out, so each example gets one out-of-fold prediction per
candidate. The identity (the model's own probabilities) is always scored, and only candidates whose
out-of-fold NLL beats it by more than one standard error of the per-example difference are
eligible (:func:`confidently_better`: the lowest NLL of nine candidates on a few hundred examples is
often luck). Among the eligible, the lowest out-of-fold NLL wins; candidates within 0.1% of it count
as tied and the lowest out-of-fold ECE (15 equal-width bins, top label) breaks the tie. A candidate that has too few examples per class in the training folds
is skipped with a warning (``"platt"`` only runs on binary classifiers). The winner is then refitted
on all held-out examples.

``.method`` is the chosen calibrator's name and ``.scores`` the table ``{name: {"nll", "ece"}}``.

Example:
    >>> calibrator = posthoc.calibrate(logits, labels, method="auto")
    >>> calibrator.method, calibrator.scores["temperature"]
    ('vector', {'nll': 0.212, 'ece': 0.018})
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.checks import positive_int
from posthoc.core.errors import ConfigError
from posthoc.methods.calibration import (  # noqa: F401  (registers the candidates)
    dirichlet, ets, histogram, identity, isotonic, matrix, platt, temperature, vector,
)
from posthoc.methods.calibration.base import CALIBRATORS, Calibrator, register_calibrator

#: the calibrators "auto" compares by default ("identity" is always scored as the reference)
DEFAULT_CANDIDATES = ("temperature", "vector", "matrix", "dirichlet", "ets", "histogram", "isotonic", "platt")

#: candidates within this relative NLL of the best count as tied (the lowest ECE wins)
NLL_TIE = 1e-3

ECE_BINS = 15

#: a candidate must beat the identity's out-of-fold NLL by this many standard errors to be eligible
STANDARD_ERRORS = 1.0


def top_label_ece(probs: Tensor, labels: Tensor, bins: int = ECE_BINS) -> float:
    """Top-label ECE with ``bins`` equal-width bins ``(lo, hi]``, as :func:`posthoc.evaluation.metrics.ece`."""
    confidence, predicted = probs.double().max(-1)
    index = (torch.ceil(confidence * bins).long() - 1).clamp(0, bins - 1)
    correct = (predicted == labels).double()
    gap = torch.bincount(index, weights=confidence - correct, minlength=bins)
    return float(gap.abs().sum() / labels.numel())


def stratified_folds(labels: Tensor, folds: int, seed: int) -> Tensor:
    """A fold number in ``[0, folds)`` per example, each class spread evenly over the folds (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(labels.numel(), generator=generator)
    order = order[torch.sort(labels.cpu()[order], stable=True).indices]
    fold = torch.empty(labels.numel(), dtype=torch.long)
    fold[order] = torch.arange(labels.numel()) % folds
    return fold.to(labels.device)


def confidently_better(losses: dict[str, Tensor], reference: str = "identity") -> set[str]:
    """``reference`` and the candidates whose out-of-fold NLL beats it by more than :data:`STANDARD_ERRORS`
    standard errors of the per-example difference: with many candidates and a few hundred examples, the
    lowest cross-validated NLL alone often belongs to one that only got lucky on these folds (a
    histogram chosen on one fold split of the digits CNN cost 1.3x the test NLL of no calibration).

    Example:
        >>> confidently_better({"identity": torch.tensor([0.1, 0.2]), "vector": torch.tensor([0.1, 0.19])})
        {'identity'}
    """
    base = losses[reference]
    eligible = {reference}
    for name, loss in losses.items():
        difference = loss - base
        spread = difference.std() / math.sqrt(difference.numel()) if difference.numel() > 1 else difference.new_tensor(0.0)
        if float(difference.mean() + STANDARD_ERRORS * spread) < 0:
            eligible.add(name)
    return eligible


def _rows(inputs: Tensor, keep: Tensor) -> Tensor:
    return inputs[:, keep] if inputs.dim() == 3 else inputs[keep]


@register_calibrator
class AutoCalibration(Calibrator):
    """The calibrator with the best cross-validated NLL (ECE breaks ties), never worse than none."""

    name = "auto"

    def __init__(self, *, candidates: tuple[str, ...] | list[str] = DEFAULT_CANDIDATES, folds: int = 5, seed: int = 0,
                 max_iter: int = 100) -> None:
        super().__init__()
        unknown = [name for name in candidates if name not in CALIBRATORS or name == self.name]
        if unknown or not candidates:
            valid = ", ".join(name for name in CALIBRATORS if name != self.name)
            raise ConfigError(f"auto candidates must be calibrator names ({valid}); got {list(candidates)!r}")
        self.candidates = tuple(candidates)
        self.folds = positive_int(folds, "folds")
        if self.folds < 2:
            raise ConfigError(f"folds must be at least 2 for cross-validation, got {folds}")
        self.seed, self.max_iter = seed, positive_int(max_iter, "max_iter")
        names = ["identity", *(name for name in self.candidates if name != "identity")]
        self.choices = nn.ModuleDict({name: self._candidate(name) for name in names})
        self.register_buffer("choice", torch.zeros((), dtype=torch.long))
        self.register_buffer("cross_validated", torch.full((len(names), 2), math.nan))

    def _candidate(self, name: str) -> Calibrator:
        cls = CALIBRATORS[name]
        return cls(**{"max_iter": self.max_iter} if "max_iter" in cls.option_defaults() else {})

    @property
    def options(self) -> dict[str, Any]:
        return {"candidates": list(self.candidates), "folds": self.folds, "seed": self.seed, "max_iter": self.max_iter}

    @property
    def chosen(self) -> Calibrator:
        """The fitted calibrator that was chosen."""
        return list(self.choices.values())[int(self.choice)]

    @property
    def method(self) -> str:
        return list(self.choices)[int(self.choice)]

    @property
    def per_sample(self) -> bool:  # type: ignore[override]
        return self.chosen.per_sample

    @property
    def scores(self) -> dict[str, dict[str, float]]:
        return {name: {"nll": float(row[0]), "ece": float(row[1])}
                for name, row in zip(self.choices, self.cross_validated.tolist()) if not math.isnan(row[0])}

    def num_parameters(self) -> int:
        return self.chosen.num_parameters()

    def _reset(self) -> None:
        self.choice.fill_(0)
        self.cross_validated.fill_(math.nan)

    def _usable(self, labels: Tensor, fold: Tensor, num_classes: int) -> list[str]:
        usable = []
        for name, candidate in self.choices.items():
            if candidate.binary_only and num_classes != 2:
                continue
            problem = next((p for k in range(self.folds)
                            if (p := candidate.requirement(labels[fold != k], num_classes)) is not None), None)
            if problem is None:
                usable.append(name)
            else:
                warnings.warn(f"auto calibration skips '{name}': {problem} (in each of the {self.folds} "
                              f"cross-validation training folds)", RuntimeWarning, stacklevel=4)
        return usable

    def _fit(self, inputs: Tensor, labels: Tensor) -> None:
        num_classes = inputs.shape[-1]
        fold = stratified_folds(labels, self.folds, self.seed)
        usable = self._usable(labels, fold, num_classes)
        out_of_fold = {name: torch.empty(labels.numel(), num_classes, dtype=inputs.dtype, device=inputs.device)
                       for name in usable}
        for k in range(self.folds):
            train, test = fold != k, fold == k
            for name in usable:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    fitted = self._candidate(name).fit(_rows(inputs, train), labels[train])
                out_of_fold[name][test] = fitted.calibrated_predictive(_rows(inputs, test))
        names = list(self.choices)
        losses = {name: torch.nn.functional.nll_loss(log_probs, labels, reduction="none").double()
                  for name, log_probs in out_of_fold.items()}
        for name, log_probs in out_of_fold.items():
            nll = float(losses[name].mean())
            self.cross_validated[names.index(name)] = torch.tensor([nll, top_label_ece(log_probs.exp(), labels)])
        self.choice.fill_(names.index(self._select(confidently_better(losses))))
        self.chosen.fit(inputs, labels)

    def _select(self, eligible: set[str]) -> str:
        scores = {name: row for name, row in self.scores.items() if name in eligible}
        best = min(row["nll"] for row in scores.values())
        tied = [name for name, row in scores.items() if row["nll"] <= best + NLL_TIE * abs(best)]
        return min(tied, key=lambda name: (scores[name]["ece"], scores[name]["nll"]))

    def _transform(self, logits: Tensor) -> Tensor:
        return self.chosen.transform(logits)

