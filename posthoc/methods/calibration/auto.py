"""``"auto"``: choose the calibrator by k-fold cross-validated NLL, the simplest one within the noise.

The held-out examples are split into ``folds`` stratified folds; every candidate is fitted on all
folds but one and predicts the one left out, so each example gets one out-of-fold prediction per
candidate. The choice then follows three rules, each against choosing on luck:

- **Beat no calibration.** The identity (the model's own probabilities) is always scored, and only
  candidates whose out-of-fold NLL beats it by more than one standard error of the per-example
  difference are eligible (:func:`confidently_better`: the lowest NLL of nine candidates on a few
  hundred examples is often luck).
- **Enough errors to judge.** A nearly separable held-out set (fewer than
  :data:`~posthoc.methods.calibration.base.ERRORS_WANTED` misclassified examples) keeps the identity,
  with a warning: its folds are decided by a handful of errors, and a calibrator that looks clearly
  better there (by many standard errors, the gain spread over hundreds of correct examples) often is not
  (``benchmarks/bench_auto_calibration.py`` measures this on random halvings of the bundled digits).
- **The simplest within the noise** (the one-standard-error rule): among the eligible, the candidate
  with the fewest parameters whose out-of-fold NLL is within one standard error (of the per-example
  difference) of the lowest wins; ties in size go to the lower NLL.

A candidate that has too few examples per class in the training folds is skipped with a warning
(``"platt"`` only runs on binary classifiers). The winner is then refitted on all held-out examples.

``.chosen_name`` is the chosen calibrator's name and ``.scores`` the table ``{name: {"nll", "ece"}}``
(ECE with 15 equal-width bins, top label). Registered as the method ``"auto-calibration"``.

Example:
    >>> calibrator = posthoc.calibrate(logits, labels, method="auto")
    >>> calibrator.chosen_name, calibrator.scores["temperature"]
    ('temperature', {'nll': 0.497, 'ece': 0.091})
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.checks import integer_at_least, positive_int
from posthoc.core.registry import register
from posthoc.errors import ConfigError
from posthoc.methods.calibration.base import ERRORS_WANTED, Calibrator, predictive
from posthoc.methods.calibration.method import CalibrationMethod, calibrators

#: the calibrators "auto" compares by default ("identity" is always scored as the reference)
DEFAULT_CANDIDATES = ("temperature", "vector", "matrix", "dirichlet", "ets", "histogram", "isotonic", "platt")

ECE_BINS = 15

#: a candidate must beat the identity's out-of-fold NLL by this many standard errors to be eligible, and the
#: simplest candidate within this many standard errors of the lowest out-of-fold NLL is chosen
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
        if float(difference.mean()) + STANDARD_ERRORS * _standard_error(difference) < 0:
            eligible.add(name)
    return eligible


def _standard_error(difference: Tensor) -> float:
    return float(difference.std() / math.sqrt(difference.numel())) if difference.numel() > 1 else 0.0


def simplest_within_noise(losses: dict[str, Tensor], sizes: dict[str, int]) -> str:
    """The candidate with the fewest parameters (``sizes``) whose mean per-example loss exceeds the lowest one's by
    at most :data:`STANDARD_ERRORS` standard errors of their per-example difference (ties in size: the lower loss).

    Example:
        >>> losses = {"temperature": torch.tensor([0.2, 0.1, 0.3]), "matrix": torch.tensor([0.1, 0.1, 0.35])}
        >>> simplest_within_noise(losses, {"temperature": 1, "matrix": 72})
        'temperature'
    """
    best = min(losses, key=lambda name: float(losses[name].mean()))
    within = [
        name
        for name, loss in losses.items()
        if float((loss - losses[best]).mean()) <= STANDARD_ERRORS * _standard_error(loss - losses[best])
    ]
    return min(within, key=lambda name: (sizes[name], float(losses[name].mean())))


def _rows(inputs: Tensor, keep: Tensor) -> Tensor:
    return inputs[:, keep] if inputs.dim() == 3 else inputs[keep]


class AutoCalibration(Calibrator):
    """The simplest calibrator within the noise of the best cross-validated NLL, never one no better than none."""

    name = "auto"
    interpolable = False  # its choice may differ between two fits

    @dataclass(frozen=True, kw_only=True)
    class Options(Calibrator.Options):
        candidates: tuple[str, ...] | list[str] = DEFAULT_CANDIDATES
        folds: int = 5
        seed: int = 0
        max_iter: int = 100

    def __init__(
        self,
        *,
        candidates: tuple[str, ...] | list[str] = DEFAULT_CANDIDATES,
        folds: int = 5,
        seed: int = 0,
        max_iter: int = 100,
    ) -> None:
        super().__init__()
        known = [name for name in calibrators() if name != self.name]
        if not candidates or isinstance(candidates, str) or any(name not in known for name in candidates):
            raise ConfigError(f"auto candidates must be calibrator names ({', '.join(known)}); got {candidates!r}")
        self.candidates = tuple(candidates)
        self.folds = integer_at_least(folds, "folds", 2, why="cross-validation needs two folds or more")
        self.seed, self.max_iter = seed, positive_int(max_iter, "max_iter")
        names = ["identity", *(name for name in self.candidates if name != "identity")]
        self.choices = nn.ModuleDict({name: self._candidate(name) for name in names})
        self.register_buffer("choice", torch.zeros((), dtype=torch.long))
        self.register_buffer("cross_validated", torch.full((len(names), 2), math.nan))

    def _candidate(self, name: str) -> Calibrator:
        cls = calibrators()[name]
        return cls(**{"max_iter": self.max_iter} if "max_iter" in cls.option_defaults() else {})

    @property
    def options(self) -> dict[str, Any]:
        return {"candidates": list(self.candidates), "folds": self.folds, "seed": self.seed, "max_iter": self.max_iter}

    @property
    def chosen(self) -> Calibrator:
        """The fitted calibrator that was chosen."""
        return list(self.choices.values())[int(self.choice)]

    @property
    def chosen_name(self) -> str:
        return list(self.choices)[int(self.choice)]

    @property
    def per_sample(self) -> bool:  # type: ignore[override]
        return self.chosen.per_sample

    @property
    def scores(self) -> dict[str, dict[str, float]]:
        return {
            name: {"nll": float(row[0]), "ece": float(row[1])}
            for name, row in zip(self.choices, self.cross_validated.tolist())
            if not math.isnan(row[0])
        }

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
            problem = next(
                (
                    p
                    for k in range(self.folds)
                    if (p := candidate.requirement(labels[fold != k], num_classes)) is not None
                ),
                None,
            )
            if problem is None:
                usable.append(name)
            else:
                warnings.warn(
                    f"auto calibration skips '{name}': {problem} (in each of the {self.folds} "
                    f"cross-validation training folds)",
                    RuntimeWarning,
                    stacklevel=4,
                )
        return usable

    def _fit(self, inputs: Tensor, labels: Tensor) -> None:
        num_classes = inputs.shape[-1]
        errors = int((predictive(torch.log_softmax(inputs, -1)).argmax(-1) != labels).sum())
        if errors < ERRORS_WANTED:
            self._keep_identity(errors, labels.numel())
            self.chosen.fit(inputs, labels)
            return
        fold = stratified_folds(labels, self.folds, self.seed)
        usable = self._usable(labels, fold, num_classes)
        sizes = {}
        out_of_fold = {
            name: torch.empty(labels.numel(), num_classes, dtype=inputs.dtype, device=inputs.device) for name in usable
        }
        for k in range(self.folds):
            train, test = fold != k, fold == k
            for name in usable:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    fitted = self._candidate(name).fit(_rows(inputs, train), labels[train])
                out_of_fold[name][test] = fitted.calibrated_predictive(_rows(inputs, test))
                sizes[name] = 0 if name == "identity" else fitted.num_parameters()
        names = list(self.choices)
        losses = {
            name: torch.nn.functional.nll_loss(log_probs, labels, reduction="none").double()
            for name, log_probs in out_of_fold.items()
        }
        for name, log_probs in out_of_fold.items():
            nll = float(losses[name].mean())
            self.cross_validated[names.index(name)] = torch.tensor([nll, top_label_ece(log_probs.exp(), labels)])
        eligible = confidently_better(losses)
        chosen = simplest_within_noise({name: losses[name] for name in eligible}, sizes)
        self.choice.fill_(names.index(chosen))
        self.chosen.fit(inputs, labels)

    def _keep_identity(self, errors: int, count: int) -> None:
        warnings.warn(
            f"auto calibration keeps the model's own probabilities: only {errors} of the {count} held-out examples "
            f"are misclassified, too few to tell whether a calibrator helps (on so few errors, cross-validated gains "
            f"did not hold on new data); a held-out set with at least {ERRORS_WANTED} errors (about "
            f"{math.ceil(ERRORS_WANTED * count / max(errors, 1))} examples at this error rate) lets auto choose",
            RuntimeWarning,
            stacklevel=4,
        )
        self.choice.fill_(list(self.choices).index("identity"))

    def _transform(self, logits: Tensor) -> Tensor:
        return self.chosen.transform(logits)


@register
class AutoCalibrationMethod(CalibrationMethod):
    """The calibrator with the best cross-validated NLL on val_loader (never worse than none)."""

    name = "auto-calibration"
    calibrator_class = AutoCalibration

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "scores": self.calibrator.scores}
