"""The one selection step: every held-out choice of posthoc is made here, by one rule.

A held-out choice picks one of several *candidates*: the values of a method's knob, the configurations of a map
fitted on held-out predictions (a calibrator, DAC), or whole methods (``method="auto"``). Each candidate is described
by its :class:`Scores` per held-out example, on the clean examples and their fit-time perturbed copies
(:mod:`posthoc.engine.perturb`).

The rule (:func:`select`; the full account, and the error rates it was set by, in docs/selection.md):

1. **Admissible**: the one-sided upper bound of the NLL excess over the plain model that the candidate will show on
   new data of the held-out set's size (:func:`excess_bound`) is within the tolerance (:class:`Tolerance`). A gain
   that rests on the plain model's mistakes is judged at :data:`GAIN_CONFIDENCE` by a predictive that keeps the
   mistakes apart (:func:`predictive_excess`); anything else must pass, at :data:`CONFIDENCE`, that predictive and
   the paired normal bound with the largest gains capped (:data:`CAPPED_GAINS`), each cautious where the other is not.
2. **Among admissible candidates** that keep most of the best gain, the lowest NLL on the fit-time perturbed copies
   as a share of the plain model's (:func:`shift_ratio`) wins; without perturbed copies the last one in the order
   given (candidates come from the narrowest spread to the widest). ``walk=True`` stops at the first refused one.
3. **When nothing is admissible** the first candidate is kept and :attr:`Selection.fallback` says so.
4. **Cross-fitting** (:func:`cross_fitted`): a candidate fitted on the held-out data itself (a calibrator, DAC, a
   whole method) is scored out of fold, with each perturbed copy in its clean example's fold; a candidate stacked on
   a method that makes its own held-out choice re-makes that inner choice in each fold (its movable
   :class:`~posthoc.core.knob.Knob`).

Every candidate's :class:`Record` is kept; ``um.summary()["selection"]`` lists them.

Example:
    >>> import torch
    >>> from posthoc.engine.selection import Scores, select
    >>> plain = Scores(torch.tensor([0.10, 0.20, 0.30]))
    >>> wide = Scores(torch.tensor([0.11, 0.21, 0.29]), shifted=torch.tensor([1.0, 1.2]))
    >>> narrow = Scores(torch.tensor([0.10, 0.20, 0.30]), shifted=torch.tensor([1.5, 1.6]))
    >>> chosen = select([("narrow", 1.0), ("wide", 2.0)], [narrow, wide], plain=plain, tolerance=0.05, knob="scale")
    >>> chosen.label, chosen.value
    ('wide', 2.0)
    >>> select([("narrow", 1.0), ("wide", 2.0)], [narrow, wide], plain=plain, tolerance=0.01, knob="scale").label
    'narrow'
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np
import torch
from torch import Tensor

from posthoc.core.calibration_error import top_label_ece
from posthoc.errors import ConfigError

#: the one-sided confidence of the bound on the NLL excess on new data of a candidate that costs on held-out data
CONFIDENCE = 0.95
#: ... and of a candidate whose held-out NLL is lower than the plain model's by more than the tolerance (module docs)
GAIN_CONFIDENCE = 0.9
#: the size of the new data the bound speaks for, as a multiple of the held-out set's (module docs)
NEW_SAMPLE = 1.0
#: the share of the largest per-example gains capped in the one-stratum bound of a candidate that costs (module docs)
CAPPED_GAINS = 0.025
#: held-out mistakes of the plain model below which a nested candidate's gain over the one it extends is not judged:
#: a more flexible map's gain rests on how it treats the mistakes, and a handful of them cannot show that
MIN_NESTED_MISTAKES = 10
#: draws of the predictive of the new data's excess (:func:`predictive_excess`)
PREDICTIVE_DRAWS = 4000
#: up to this many mistakes (held out, or in a new sample) the predictive draws the new ones one by one
EXACT_MISTAKES = 1000
#: the share of the best admissible in-distribution gain a choice may give up for robustness on perturbed copies
GIVE_UP = 0.05
#: the default tolerance: this fraction of the plain model's held-out NLL ...
RELATIVE_TOLERANCE = 0.02
#: ... or this many nats per example, whichever is larger
ABSOLUTE_TOLERANCE = 0.005
#: folds of the cross-fitting
FOLDS = 5
#: a fold holds at least this many clean examples (fewer folds on a small validation set)
MIN_FOLD_EXAMPLES = 4


@dataclass(frozen=True)
class Tolerance:
    """How much held-out NLL per example a candidate may cost over the plain model: ``max(relative · |NLL_plain|, absolute)``.

    ``fit(..., tolerance=0.01)`` means 0.01 nats; ``Tolerance(relative=0.05, absolute=0)`` 5 %; ``math.inf`` admits
    every candidate.

    Example:
        >>> from posthoc.engine.selection import Tolerance
        >>> Tolerance().nats(0.1), Tolerance().nats(0.5)
        (0.005, 0.01)
    """

    relative: float = RELATIVE_TOLERANCE
    absolute: float = ABSOLUTE_TOLERANCE

    def __post_init__(self) -> None:
        for name in ("relative", "absolute"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= math.inf:
                raise ConfigError(f"Tolerance.{name} must be a number >= 0 (math.inf: no limit), got {value!r}")

    def nats(self, plain_nll: float) -> float:
        """The tolerance in nats per example for a plain model whose held-out NLL is ``plain_nll``."""
        return max(self.relative * abs(plain_nll), self.absolute)

    @classmethod
    def of(cls, value: Tolerance | float | None) -> Tolerance:
        """``None``: the default; a number: that many nats per example; a :class:`Tolerance` as it is.

        Example:
            >>> from posthoc.engine.selection import Tolerance
            >>> Tolerance.of(0.02)
            Tolerance(relative=0.0, absolute=0.02)
        """
        if value is None:
            return cls()
        if isinstance(value, Tolerance):
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= math.inf:
            raise ConfigError(
                f"tolerance must be None (the default: max(2 % of the plain model's held-out NLL, 0.005 "
                f"nats)), a number of nats per example >= 0, e.g. 0.01 (math.inf: no limit), or "
                f"posthoc.Tolerance(relative=, absolute=), got {value!r}"
            )
        return cls(relative=0.0, absolute=float(value))


@dataclass
class Scores:
    """One predictive's numbers per held-out example (float64 on the CPU).

    Attributes:
        clean: ``(N,)`` NLL of each clean example.
        shifted: ``(M,)`` NLL of each perturbed copy (``None``: no copies); ``confidence`` and ``correct`` there
            give their ECE.
        mistakes: ``(N,)`` 1.0 where the top class misses the label (the plain model's are the strata of
            :func:`excess_bound`; ``None``: one stratum).
        groups: ``(M,)`` the kind and strength that made each copy (:func:`shift_ratio` weighs groups alike).
        units: ``(N,)`` the input each example belongs to where an input holds several correlated examples (dense
            outputs): the bound is then taken over the inputs (:func:`unit_means`).
    """

    clean: Tensor
    shifted: Tensor | None = None
    confidence: Tensor | None = None
    correct: Tensor | None = None
    mistakes: Tensor | None = None
    groups: Tensor | None = None
    units: Tensor | None = None

    def __post_init__(self) -> None:
        self.clean = self.clean.detach().double().cpu().reshape(-1)
        for name in ("shifted", "confidence", "correct", "mistakes"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.detach().double().cpu().reshape(-1))
        if self.groups is not None:
            self.groups = self.groups.detach().long().cpu().reshape(-1)
        if self.units is not None:
            self.units = self.units.detach().long().cpu().reshape(-1)

    @classmethod
    def of_log_probs(
        cls,
        log_probs: Tensor,
        labels: Tensor,
        shifted_log_probs: Tensor | None = None,
        shifted_labels: Tensor | None = None,
    ) -> Scores:
        """The scores of class log-probabilities ``(N, C)`` on the clean examples and ``(M, C)`` on the perturbed ones.

        Example:
            >>> import torch
            >>> from posthoc.engine.selection import Scores
            >>> scores = Scores.of_log_probs(torch.tensor([[-0.5, -1.0]]), torch.tensor([1]))
            >>> scores.clean.tolist(), scores.mistakes.tolist()
            ([1.0], [1.0])
        """
        clean, _, correct = class_scores(log_probs, labels)
        if shifted_log_probs is None:
            return cls(clean, mistakes=1 - correct)
        nll, confidence, shifted_correct = class_scores(shifted_log_probs, shifted_labels)
        return cls(clean, nll, confidence, shifted_correct, mistakes=1 - correct)

    @property
    def nll(self) -> float:
        """Mean NLL over the clean examples."""
        return float(self.clean.mean())

    @property
    def shifted_nll(self) -> float | None:
        """Mean NLL over the perturbed copies (``None`` without them)."""
        return None if self.shifted is None else float(self.shifted.mean())

    @property
    def shifted_ece(self) -> float | None:
        """ECE (15 bins) over the perturbed copies (``None`` without them or without confidences)."""
        if self.confidence is None or self.correct is None:
            return None
        return top_label_ece(self.confidence, self.correct)

    def take(self, rows: Rows) -> Scores:
        """The scores of the examples ``rows`` (clean indices, and perturbed ones where there are any)."""
        pick = lambda t: None if t is None or rows.shifted is None else t[rows.shifted]  # noqa: E731
        return Scores(
            self.clean[rows.clean],
            pick(self.shifted),
            pick(self.confidence),
            pick(self.correct),
            None if self.mistakes is None else self.mistakes[rows.clean],
            pick(self.groups),
            None if self.units is None else self.units[rows.clean],
        )


def unit_means(values: Tensor, units: Tensor) -> Tensor:
    """The mean of ``values`` ``(N,)`` over each unit of ``units`` ``(N,)`` (the units present, in increasing order).

    Example:
        >>> import torch
        >>> from posthoc.engine.selection import unit_means
        >>> unit_means(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 2]))
        tensor([2., 5.], dtype=torch.float64)
    """
    counts = torch.bincount(units)  # units are input indices: a count per index, O(N) (no sort)
    sums = torch.bincount(units, weights=values.double(), minlength=len(counts))
    present = counts > 0
    return sums[present] / counts[present]


def class_nll(log_probs: Tensor, labels: Tensor) -> Tensor:
    """Per-example NLL ``(N,)`` of ``labels`` under class log-probabilities ``(N, C)``, in float64 (picked first: no
    float64 copy of ``(N, C)``)."""
    return -log_probs.gather(-1, labels.long().view(-1, 1)).squeeze(-1).double()


def class_scores(log_probs: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-example NLL, confidence and correctness ``(N,)`` of class log-probabilities ``(N, C)``."""
    top, predicted = log_probs.max(-1)
    return class_nll(log_probs, labels), top.double().exp(), (predicted == labels.view(-1)).double()


@dataclass(frozen=True)
class Rows:
    """Indices of held-out clean examples and of perturbed copies (``None``: no copies)."""

    clean: Tensor
    shifted: Tensor | None = None


@dataclass(frozen=True)
class Layout:
    """How the perturbed copies relate to the clean examples: ``source[j]`` is the clean example copy ``j`` perturbs.

    Example:
        >>> import torch
        >>> from posthoc.engine.selection import Layout
        >>> layout = Layout(12, torch.arange(12).repeat(2))  # two perturbed copies of each of 12 examples
        >>> fitting, scored = layout.folds(3)[0]
        >>> len(fitting.clean), len(scored.clean), len(scored.shifted)
        (8, 4, 8)
        >>> sorted(layout.source[scored.shifted].unique().tolist()) == scored.clean.tolist()
        True
    """

    count: int
    source: Tensor | None = None
    #: a number per clean example (the plain model's NLL) the folds follow instead of its position, so a shuffling loader
    #: gives the same folds
    key: Tensor | None = field(default=None, compare=False)
    #: the input each clean example belongs to where an input holds several correlated examples (the positions of one
    #: image): the folds are then drawn over the inputs, each input's examples in one fold (``key`` is ignored)
    units: Tensor | None = field(default=None, compare=False)

    def everything(self) -> Rows:
        """All clean examples and all perturbed copies."""
        return Rows(torch.arange(self.count), None if self.source is None else torch.arange(len(self.source)))

    def folds(self, k: int = FOLDS, seed: int = 0) -> list[tuple[Rows, Rows]]:
        """``(fitting rows, scored rows)`` of each of ``k`` seeded random folds (fewer on a small set; one, the whole
        set both ways, when too few to split), each perturbed copy in its clean example's fold, and with ``units`` each
        input's examples in one fold."""
        present, unit_of = (None, None) if self.units is None else torch.unique(self.units.cpu(), return_inverse=True)
        count = self.count if present is None else len(present)
        k = min(k, count // MIN_FOLD_EXAMPLES)
        if k < 2:
            return [(self.everything(), self.everything())]
        scramble = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
        if self.key is None or unit_of is not None:
            fold_of = torch.empty(count, dtype=torch.long)
            fold_of[scramble] = torch.arange(count) % k
        else:  # an example's fold follows its rank by key, not its position
            ranks = torch.empty(self.count, dtype=torch.long)
            ranks[torch.argsort(self.key.double().cpu(), stable=True)] = torch.arange(self.count)
            fold_of = scramble[ranks] % k
        if unit_of is not None:
            fold_of = fold_of[unit_of]
        out = []
        for fold in range(k):
            held = fold_of == fold
            out.append((self._rows(~held), self._rows(held)))
        return out

    def _rows(self, clean: Tensor) -> Rows:
        """The clean examples of the mask ``clean`` and their perturbed copies."""
        shifted = None if self.source is None else torch.nonzero(clean[self.source]).squeeze(1)
        return Rows(torch.nonzero(clean).squeeze(1), shifted)


def cross_fitted(
    fit_and_score: Callable[[Rows, Rows], list[Scores]], layout: Layout, *, folds: int = FOLDS, seed: int = 0
) -> list[Scores]:
    """Out-of-fold scores of candidates whose parameters are fitted on held-out data.

    ``fit_and_score(fitting, scored)`` fits every candidate on ``fitting`` and returns their :class:`Scores` on
    ``scored``, one per candidate (``None``: could not be fitted on that fold, scored ``inf``).

    Example:
        >>> import torch
        >>> from posthoc.engine.selection import Layout, Scores, cross_fitted
        >>> layout = Layout(8)
        >>> [out] = cross_fitted(lambda fit, scored: [Scores(torch.full((len(scored.clean),), float(len(fit.clean))))],
        ...                      layout, folds=2)
        >>> out.clean.tolist()
        [4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    """
    parts = [(scored, fit_and_score(fitting, scored)) for fitting, scored in layout.folds(folds, seed)]
    out = []
    for index in range(len(parts[0][1])):
        clean = torch.full((layout.count,), math.inf, dtype=torch.float64)
        perturbed = layout.source is not None
        shifted = torch.full((len(layout.source),), math.inf, dtype=torch.float64) if perturbed else None
        confidence = torch.full_like(shifted, math.nan) if perturbed else None
        correct = torch.full_like(shifted, math.nan) if perturbed else None
        for scored, found in parts:
            part = found[index]
            if part is None:
                continue
            clean[scored.clean] = part.clean
            if perturbed and scored.shifted is not None and part.shifted is not None:
                shifted[scored.shifted] = part.shifted
                if part.confidence is not None:
                    confidence[scored.shifted] = part.confidence
                    correct[scored.shifted] = part.correct
        if perturbed and bool(torch.isnan(confidence).any()):
            confidence = correct = None
        out.append(Scores(clean, shifted, confidence, correct))
    return out


def fold_count(layout: Layout, folds: int = FOLDS) -> int:
    """How many folds :func:`cross_fitted` uses on ``layout`` (1: too few examples to split, fitted and scored on all)."""
    return len(layout.folds(folds))


def _standard_error(values: Tensor) -> float | None:
    """The standard error of the mean of ``values`` (``None`` for fewer than two, or non-finite values)."""
    if values.numel() < 2 or not bool(torch.isfinite(values).all()):
        return None
    return float(values.double().std()) / math.sqrt(values.numel())


def excess_bound(
    candidate: Tensor,
    plain: Tensor,
    confidence: float = CONFIDENCE,
    *,
    mistakes: Tensor | None = None,
    new_sample: float = NEW_SAMPLE,
    capped_gains: float = 0.0,
    seed: int = 0,
) -> tuple[float, float]:
    """The mean per-example NLL excess of ``candidate`` over ``plain`` (paired, ``(N,)`` each) and the upper end of its
    one-sided ``confidence`` bound on new data of ``new_sample · N`` examples: the quantile of
    :func:`predictive_excess` with the plain model's ``mistakes`` as strata, or without them the paired normal bound
    ``mean + z · sd · sqrt(1/N + 1/N_new)`` after the gains below the ``capped_gains`` quantile are raised to it.

    Example:
        >>> import torch
        >>> from posthoc.engine.selection import excess_bound
        >>> right = torch.full((120,), 0.03)                   # a temperature costs a little on every right answer
        >>> wrong = torch.tensor([-8.0, -11.0, -6.0, -9.0])    # and gains nats on each confident mistake
        >>> excess = torch.cat([right, wrong])
        >>> mistakes = torch.cat([torch.zeros(120), torch.ones(4)])
        >>> round(excess_bound(excess, torch.zeros(124), 0.9, mistakes=mistakes)[1], 3)  # few mistakes, a clear gain
        -0.043
        >>> round(excess_bound(excess, torch.zeros(124), 0.9)[1], 3)  # one normal stratum: above a tolerance of 0.005
        0.007
    """
    difference = candidate.double() - plain.double()
    if difference.numel() == 0 or not bool(torch.isfinite(difference).all()):
        return math.inf, math.inf
    mean = float(difference.mean())
    if difference.numel() < 2:
        return mean, math.inf
    if mistakes is None:
        if capped_gains > 0:
            difference = difference.clamp_min(float(torch.quantile(difference, capped_gains)))
        spread = float(difference.std()) * math.sqrt(1 / difference.numel() + 1 / (new_sample * difference.numel()))
        return mean, float(difference.mean()) + NormalDist().inv_cdf(confidence) * spread
    draws = predictive_excess(difference, mistakes, new_sample=new_sample, seed=seed)
    return mean, float(torch.quantile(draws, confidence))


def predictive_excess(
    difference: Tensor,
    mistakes: Tensor,
    *,
    new_sample: float = NEW_SAMPLE,
    draws: int = PREDICTIVE_DRAWS,
    seed: int = 0,
) -> Tensor:
    """Draws ``(draws,)`` of the mean excess a new sample of ``new_sample · N`` examples will show, from the held-out
    per-example excess ``difference`` ``(N,)`` split by the plain model's ``mistakes`` ``(N,)``.

    ``K ~ Binomial(N_new, p)`` new mistakes with ``p ~ Beta(k + 1/2, N - k + 1/2)``; the right answers' mean excess from
    its normal posterior plus new-sample noise; the mistakes by the Bayesian bootstrap (Rubin, 1981) of the ``k`` held
    out, so a new sample may miss the few mistakes a gain rests on (docs/selection.md). With no mistake held out, a new
    one costs the largest excess seen (at least 0). ``new_sample=inf``: the true mean excess. Seeded.

    Example:
        >>> import torch
        >>> from posthoc.engine.selection import predictive_excess
        >>> difference = torch.cat([torch.full((100,), 0.01), torch.tensor([-5.0, -5.0])])
        >>> draws = predictive_excess(difference, (difference < 0).double(), draws=2000)
        >>> float((draws > 0).double().mean()) < 0.2    # a new sample rarely holds no mistake to gain on
        True
    """
    rng = np.random.default_rng(seed)
    wrong = mistakes.bool().cpu().numpy()
    values = difference.double().cpu().numpy()
    n = values.size
    n_new = math.inf if math.isinf(new_sample) else max(1, round(new_sample * n))
    right, missed = values[~wrong], values[wrong]
    k = missed.size
    rate = rng.beta(k + 0.5, n - k + 0.5, size=draws)
    count = rate * n_new if math.isinf(n_new) else rng.binomial(n_new, rate).astype(np.float64)
    new_right = np.inf if math.isinf(n_new) else np.maximum(n_new - count, 1.0)
    if right.size >= 2:
        centre, sd = right.mean(), right.std(ddof=1)
        right_mean = centre + sd * (rng.standard_normal(draws) / math.sqrt(right.size))
        right_mean += sd * rng.standard_normal(draws) / np.sqrt(new_right)
    else:
        right_mean = np.full(draws, right.mean() if right.size else 0.0)
    if k:
        weights = rng.dirichlet(np.ones(k), size=draws)
        if math.isinf(n_new):
            missed_mean = weights @ missed
        elif k > EXACT_MISTAKES or float(count.max()) > EXACT_MISTAKES:  # many mistakes: their mean is near normal
            missed_mean = weights @ missed
            spread = np.sqrt(np.maximum(weights @ missed**2 - missed_mean**2, 0.0))
            missed_mean += spread * rng.standard_normal(draws) / np.sqrt(np.maximum(count, 1.0))
        else:  # the new mistakes drawn one by one: a few large gains may be missing from them (a heavy tail)
            most = int(count.max())
            cdf = torch.from_numpy(np.cumsum(weights, axis=1))
            picks = torch.searchsorted(cdf, torch.from_numpy(rng.random((draws, max(most, 1)))) * cdf[:, -1:])
            values_drawn = torch.from_numpy(missed)[picks.clamp_max(k - 1)].numpy()
            used = np.arange(max(most, 1))[None, :] < count[:, None]
            missed_mean = np.where(count > 0, (values_drawn * used).sum(1) / np.maximum(count, 1.0), weights @ missed)
    else:
        missed_mean = np.full(draws, max(float(values.max()), 0.0))
    share = rate if math.isinf(n_new) else count / n_new
    return torch.from_numpy((1 - share) * right_mean + share * missed_mean)


def shift_ratio(candidate: Scores, plain: Scores) -> float | None:
    """``candidate``'s NLL on the perturbed copies as a share of the plain model's: the geometric mean over the groups
    of ``plain`` (each kind at each strength) of the ratio of mean NLLs, so every group counts alike.

    Example:
        >>> import torch
        >>> from posthoc.engine.selection import Scores, shift_ratio
        >>> plain = Scores(torch.zeros(2), shifted=torch.tensor([1.0, 1.0, 10.0, 10.0]), groups=torch.tensor([0, 0, 1, 1]))
        >>> round(shift_ratio(Scores(torch.zeros(2), shifted=torch.tensor([0.5, 0.5, 10.0, 10.0])), plain), 4)
        0.7071
    """
    if candidate.shifted is None or plain.shifted is None:
        return None
    groups = plain.groups if plain.groups is not None else torch.zeros(len(plain.shifted), dtype=torch.long)
    logs = []
    for group in groups.unique():
        rows = groups == group
        own, base = float(candidate.shifted[rows].mean()), float(plain.shifted[rows].mean())
        if not math.isfinite(own):
            return math.inf
        logs.append(math.log(max(own, 1e-12) / max(base, 1e-12)))
    return math.exp(sum(logs) / len(logs))


@dataclass
class Record:
    """One candidate of a selection: its in-distribution cost (``excess`` and its ``bound``, :func:`excess_bound`, in
    nats per example), its NLL and ECE on the perturbed copies, its cost in ``seconds``, and the verdict (``reason``:
    why it was not admissible or not tried)."""

    label: str
    value: Any
    clean_nll: float
    excess: float
    bound: float
    shifted_nll: float | None
    shifted_ece: float | None
    seconds: float | None
    admissible: bool
    reason: str | None = None
    chosen: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    excess_se: float | None = None
    shifted_nll_se: float | None = None
    shifted_ratio: float | None = None
    #: the confidence of the candidate's bound (:data:`GAIN_CONFIDENCE` for a gain on the mistakes, else ``CONFIDENCE``)
    confidence: float | None = None
    #: the simpler candidate this one extends (``None``: none), and the excess over it with its bound (:func:`select`)
    extends: str | None = None
    excess_over_extended: float | None = None
    bound_over_extended: float | None = None

    @property
    def tried(self) -> bool:
        """Whether the candidate was scored (a walk leaves the candidates past its first refusal untried)."""
        return not math.isnan(self.clean_nll)

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values, rounded for the model card."""
        rounded = ("clean_nll", "excess", "bound", "excess_se", "shifted_nll", "shifted_nll_se", "shifted_ece")
        out = {"candidate": self.label, "value": _plain(self.value)}
        out |= {name: _round(getattr(self, name)) for name in (*rounded, "shifted_ratio")}
        out |= {"confidence": self.confidence, "seconds": _round(self.seconds, 3), "admissible": self.admissible}
        out |= {"reason": self.reason, "chosen": self.chosen}
        if self.extends is not None:
            out |= {"extends": self.extends, "excess_over_extended": _round(self.excess_over_extended)}
            out |= {"bound_over_extended": _round(self.bound_over_extended)}
        return out | {key: _plain(value) for key, value in self.extra.items()}


def _round(value: float | None, digits: int = 6) -> float | None:
    if value is None:
        return None
    return value if not math.isfinite(value) else round(float(value), digits)


def _plain(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, float):
        return _round(value)
    return value


@dataclass
class Selection:
    """The outcome of :func:`select`: the chosen candidate, every candidate's :class:`Record`, and the plain model's
    numbers on the same examples. ``folds``: cross-fitting folds (``None``: nothing fitted on held-out data)."""

    knob: str
    records: list[Record]
    index: int
    plain_nll: float
    plain_shifted_nll: float | None
    plain_shifted_ece: float | None
    tolerance: float
    confidence: float
    examples: int
    perturbed: int
    #: the confidence of the bound of a candidate that gains more than the tolerance on held-out data
    gain_confidence: float = GAIN_CONFIDENCE
    folds: int | None = None
    fallback: bool = False
    #: what the perturbed copies were (kinds and graded strengths; ``None`` without them)
    shift: dict[str, Any] | None = None
    #: each tried candidate's scores, by index (kept for :func:`out_of_fold`; not part of the record)
    scores: dict[int, Scores] = field(default_factory=dict, repr=False)
    #: the rule's settings (``walk``, ``start``, ``rank_without_shift``) for :func:`out_of_fold`
    rule: dict[str, Any] = field(default_factory=dict, repr=False)
    #: the plain model's scores the candidates were judged against (for :func:`choice_on`; not part of the record)
    plain_scores: Scores | None = field(default=None, repr=False)
    #: candidates left out before the choice (``method="auto"``: one that cannot run on this model), with why
    left_out: dict[str, str] = field(default_factory=dict)

    @property
    def chosen(self) -> Record:
        """The chosen candidate's record."""
        return self.records[self.index]

    @property
    def label(self) -> str:
        return self.chosen.label

    @property
    def value(self) -> Any:
        return self.chosen.value

    def to_dict(self) -> dict[str, Any]:
        """The selection for the model card: the rule, the plain model's numbers, every candidate, and ``"chosen"``.

        Example:
            >>> import torch
            >>> from posthoc.engine.selection import Scores, select
            >>> plain, wide = Scores(torch.zeros(4)), Scores(torch.full((4,), 0.001))
            >>> record = select([("wide", 2.0)], [wide], plain=plain, tolerance=0.005, knob="scale").to_dict()
            >>> record["chosen"], record["candidates"][0]["excess"], record["candidates"][0]["admissible"]
            ('wide', 0.001, True)
        """
        return {
            "knob": self.knob,
            "score": self.rule.get("score", "NLL"),
            "chosen": self.label,
            "tolerance": _round(self.tolerance),
            "confidence": self.confidence,
            "gain_confidence": self.gain_confidence,
            "examples": self.examples,
            "perturbed": self.perturbed,
            "folds": self.folds,
            "fallback": self.fallback,
            "shift": self.shift,
            "plain": {
                "clean_nll": _round(self.plain_nll),
                "shifted_nll": _round(self.plain_shifted_nll),
                "shifted_ece": _round(self.plain_shifted_ece),
            },
            "candidates": [record.to_dict() for record in self.records if record.tried],
            **({"not_tried": self.not_tried()} if any(not record.tried for record in self.records) else {}),
            **({"left_out": dict(self.left_out)} if self.left_out else {}),
        }

    def not_tried(self) -> dict[str, Any]:
        """The candidates a walk did not score, in one entry: how many, the first and last, and why."""
        untried = [record for record in self.records if not record.tried]
        return {"count": len(untried), "from": untried[0].label, "to": untried[-1].label, "reason": NOT_TRIED}


#: a candidate: its label (how the record names it) and its value (what the method applies)
Candidate = tuple[str, Any]


def select(
    candidates: Sequence[Candidate],
    scores: Sequence[Scores] | Callable[[int], Scores],
    *,
    plain: Scores,
    tolerance: float,
    knob: str,
    walk: bool = False,
    start: int = 0,
    folds: int | None = None,
    confidence: float = CONFIDENCE,
    gain_confidence: float = GAIN_CONFIDENCE,
    rank_without_shift: str = "order",
    extra: Callable[[int], dict[str, Any]] | None = None,
    extends: Sequence[int | None] | None = None,
    score: str = "NLL",
) -> Selection:
    """Choose among ``candidates`` by the rule of the module docs.

    Args:
        candidates: ``(label, value)`` pairs, the most conservative first (the narrowest spread).
        scores: each candidate's :class:`Scores`, or a function ``index -> Scores`` called lazily (and timed).
        tolerance: the excess allowed, in nats per example (:meth:`Tolerance.nats`).
        knob: what is chosen, for the record.
        walk: walk the ladder from ``start``: wider while admissible, or narrower until one is; the rest are not tried.
        rank_without_shift: without perturbed copies, ``"order"`` takes the last admissible candidate, ``"clean"``
            the lowest clean NLL, ``"first"`` the first.
        extra: more fields per candidate for its record.
        extends: per candidate, the index of the simpler candidate it extends (``None``: none): a nested candidate is
            admissible only if its excess over that one also has a bound at or below 0 (its gain is sure), judged as
            any gain is (``math.inf`` tolerance: no such check). Two or three mistakes then never elect a flexible fit.
        score: what the per-example numbers are (``"NLL"``, ``"CRPS"``), for the record and the reasons.

    Example:
        >>> import torch
        >>> from posthoc.engine.selection import Scores, select
        >>> plain = Scores(torch.zeros(4))
        >>> ladder = [Scores(torch.full((4,), cost)) for cost in (0.0, 0.001, 0.1)]
        >>> select([("a", 1), ("b", 2), ("c", 3)], ladder, plain=plain, tolerance=0.01, knob="scale", walk=True).value
        2
    """
    if not candidates:
        raise ConfigError(f"no candidates to choose the {knob} from")
    if not 0 <= start < len(candidates):
        raise ConfigError(f"the walk starts at candidate {start}, outside the {len(candidates)} candidates")
    scorer = scores if callable(scores) else (lambda index: scores[index])
    records: dict[int, Record] = {}
    tried: dict[int, Scores] = {}

    def judge(index: int) -> bool:
        label, value = candidates[index]
        begin = time.perf_counter()
        found = tried[index] = scorer(index)
        seconds = time.perf_counter() - begin
        mean, upper, level = _excess_and_bound(found, plain, tolerance, confidence, gain_confidence)
        unit = " nats" if score == "NLL" else ""
        admissible = math.isfinite(upper) and upper <= tolerance
        reason = (
            None
            if admissible
            else (
                f"in-distribution {score} excess {mean:+.4f}{unit}, {level:.0%} bound {upper:+.4f} > tolerance "
                f"{tolerance:.4f}"
                if math.isfinite(upper)
                else f"the held-out {score} is not finite (or the candidate could not be fitted)"
            )
        )
        parent = None if extends is None else extends[index]
        over = (math.nan, math.nan, level)
        if (
            parent is not None
        ):  # a nested candidate: its gain over the simpler one it extends must be sure (module docs)
            if parent not in tried:
                judge(parent)
            base = tried[parent]
            if math.isinf(tolerance) or not bool(torch.isfinite(base.clean).all()):
                over = (math.nan, -math.inf, level)
            else:
                over = _excess_and_bound(
                    found, dataclasses.replace(plain, clean=base.clean), 0.0, confidence, gain_confidence
                )
            few = None if plain.mistakes is None or math.isinf(tolerance) else int(plain.mistakes.sum().item())
            if admissible and few is not None and few < MIN_NESTED_MISTAKES:
                admissible = False
                reason = (
                    f"its gain over {candidates[parent][0]!r}, which it extends, would rest on {few} held-out "
                    f"mistakes of the plain model (at least {MIN_NESTED_MISTAKES} are needed to judge it)"
                )
            elif admissible and not over[1] <= 0:
                admissible = False
                reason = (
                    f"its gain over {candidates[parent][0]!r}, which it extends, is not sure: {score} excess "
                    f"{over[0]:+.4f}{unit}, {over[2]:.0%} bound {over[1]:+.4f} > 0"
                )
        records[index] = Record(
            label,
            value,
            found.nll,
            mean,
            upper,
            found.shifted_nll,
            found.shifted_ece,
            seconds,
            admissible,
            reason,
            extra=extra(index) if extra is not None else {},
            excess_se=_standard_error(
                found.clean - plain.clean
                if plain.units is None
                else unit_means(found.clean, plain.units) - unit_means(plain.clean, plain.units)
            ),
            shifted_nll_se=None if found.shifted is None else _standard_error(found.shifted),
            shifted_ratio=shift_ratio(found, plain),
            confidence=level,
            extends=None if parent is None else candidates[parent][0],
            excess_over_extended=None if parent is None else over[0],
            bound_over_extended=None if parent is None else over[1],
        )
        return admissible

    if walk:
        index = start
        if judge(index):
            while index + 1 < len(candidates) and judge(index + 1):
                index += 1
        else:
            while index > 0 and not judge(index - 1):
                index -= 1
    else:
        for index in range(len(candidates)):
            if index not in records:
                judge(index)
    ordered = [
        records.get(index) or Record(label, value, math.nan, math.nan, math.nan, None, None, None, False, NOT_TRIED)
        for index, (label, value) in enumerate(candidates)
    ]
    index = _pick(ordered, plain.nll, tolerance, rank_without_shift)
    fallback = index is None
    index = 0 if index is None else index
    ordered[index].chosen = True
    return Selection(
        knob,
        ordered,
        index,
        plain.nll,
        plain.shifted_nll,
        plain.shifted_ece,
        tolerance,
        confidence,
        gain_confidence=gain_confidence,
        examples=len(plain.clean),
        perturbed=0 if plain.shifted is None else len(plain.shifted),
        folds=folds,
        fallback=fallback,
        scores=tried,
        rule={
            "walk": walk,
            "start": start,
            "rank_without_shift": rank_without_shift,
            "extends": extends,
            "score": score,
        },
        plain_scores=plain,
    )


def _excess_and_bound(
    found: Scores, plain: Scores, tolerance: float, confidence: float, gain_confidence: float
) -> tuple[float, float, float]:
    """The mean excess of ``found`` over ``plain``, the upper end of its bound on new data, and the bound's confidence:
    over the units where ``plain`` has them, else with the plain model's mistakes apart (module docs)."""
    if plain.units is not None:  # correlated examples: one normal stratum over the inputs, not the examples
        candidate_means, plain_means = unit_means(found.clean, plain.units), unit_means(plain.clean, plain.units)
        mean, upper = excess_bound(candidate_means, plain_means, confidence)
        upper = max(upper, excess_bound(candidate_means, plain_means, confidence, capped_gains=CAPPED_GAINS)[1])
        return mean, upper, confidence
    gain = _clear_gain(found.clean - plain.clean, plain.mistakes, tolerance)
    level = gain_confidence if gain == "mistakes" else confidence
    mean, upper = excess_bound(found.clean, plain.clean, level, mistakes=plain.mistakes)
    if gain is None:  # a cost: the larger of the two bounds, each cautious where the other is not (module docs)
        upper = max(upper, excess_bound(found.clean, plain.clean, level, capped_gains=CAPPED_GAINS)[1])
    return mean, upper, level


def _clear_gain(difference: Tensor, mistakes: Tensor | None, tolerance: float) -> str | None:
    """Where ``difference``'s gain beyond the tolerance rests: ``"mistakes"`` (a calibrator that softens; judged at
    :data:`GAIN_CONFIDENCE`), ``"right"`` (one that sharpens: a gain on the right answers at a cost on the mistakes,
    judged by the predictive alone, which draws how many mistakes new data holds), or ``None`` (no such gain)."""
    if mistakes is None or not bool(torch.isfinite(difference).all()) or float(difference.mean()) >= -tolerance:
        return None
    wrong = mistakes.bool()
    if bool(wrong.any()) and float(difference[wrong].mean()) < 0:
        return "mistakes"
    return "right" if bool((~wrong).any()) and float(difference[~wrong].mean()) < 0 else None


#: the reason of a candidate a walk did not score
NOT_TRIED = "not tried: the walk stopped at a refused candidate"


def _pick(records: list[Record], plain_nll: float, tolerance: float, rank_without_shift: str) -> int | None:
    """The index the rule picks among judged ``records`` (``None``: none admissible): of the admissible ones within
    :data:`GIVE_UP` of the best gain (or the tolerance), the lowest :func:`shift_ratio`, else by ``rank_without_shift``."""
    admissible = [i for i, record in enumerate(records) if record.admissible]
    if not admissible:
        return None
    best = min(records[i].clean_nll for i in admissible)
    floor = min(tolerance, Tolerance().nats(plain_nll)) if rank_without_shift == "first" else tolerance
    slack = max(GIVE_UP * max(plain_nll - best, 0.0), floor)
    kept = [i for i in admissible if records[i].clean_nll <= best + slack]
    if any(records[i].shifted_ratio is not None for i in kept):
        return min(kept, key=lambda i: (math.inf if records[i].shifted_ratio is None else records[i].shifted_ratio, i))
    if rank_without_shift == "clean":
        return min(kept, key=lambda i: (records[i].clean_nll, i))
    if rank_without_shift == "first":
        return kept[0]
    return kept[-1]


def out_of_fold(selection: Selection, plain: Scores, layout: Layout, *, folds: int = FOLDS, seed: int = 0) -> Scores:
    """The out-of-fold scores of a choice among fixed candidates: each fold scored by the candidate the same rule picks
    on the other folds (``method="auto"`` judges a method's own choice by it). It reuses the scores kept in ``selection``.

    Example:
        >>> import torch
        >>> from posthoc.engine.selection import Layout, Scores, out_of_fold, select
        >>> plain, cheap = Scores(torch.zeros(20)), Scores(torch.full((20,), 0.001))
        >>> selection = select([("plain", 0), ("cheap", 1)], [plain, cheap], plain=plain, tolerance=0.005, knob="k")
        >>> out_of_fold(selection, plain, Layout(20)).clean.tolist() == cheap.clean.tolist()  # every fold picks it
        True
    """

    def fold(fitting: Rows, scored: Rows) -> list[Scores]:
        index = choice_on(selection, plain, fitting)
        return [selection.scores[index].take(scored) if index in selection.scores else plain.take(scored)]

    return cross_fitted(fold, layout, folds=folds, seed=seed)[0]


def choice_on(selection: Selection, plain: Scores, rows: Rows) -> int:
    """The index of the candidate the rule of ``selection`` picks on the examples ``rows`` alone, among those it tried.

    Example:
        >>> import torch
        >>> from posthoc.engine.selection import Rows, Scores, choice_on, select
        >>> plain = Scores(torch.zeros(8))
        >>> cheap, costly = Scores(torch.full((8,), 0.001)), Scores(torch.tensor([0.0, 0.0, 0.0, 0.0, 1, 1, 1, 1]))
        >>> selection = select([("cheap", 1), ("costly", 2)], [cheap, costly], plain=plain, tolerance=0.005, knob="k")
        >>> selection.label, choice_on(selection, plain, Rows(torch.arange(4)))  # the first half alone takes 'costly'
        ('cheap', 1)
    """
    labels = [(record.label, record.value) for record in selection.records]
    missing = Scores(torch.full((len(rows.clean),), math.inf, dtype=torch.float64))

    def on_rows(index: int) -> Scores:
        found = selection.scores.get(index)
        return missing if found is None else found.take(rows)

    return select(
        labels,
        on_rows,
        plain=plain.take(rows),
        tolerance=selection.tolerance,
        knob=selection.knob,
        confidence=selection.confidence,
        gain_confidence=selection.gain_confidence,
        **selection.rule,
    ).index


def warn_fallback(selection: Selection, *, method: str, fallback: str, advice: str, stacklevel: int = 3) -> None:
    """Warn that no candidate of ``selection`` was admissible, so ``fallback`` is used, with ``advice``.

    Example:
        >>> import warnings
        >>> import torch
        >>> from posthoc.engine.selection import Scores, select, warn_fallback
        >>> plain, costly = Scores(torch.zeros(4)), Scores(torch.ones(4))
        >>> selection = select([("1", 1.0)], [costly], plain=plain, tolerance=0.005, knob="scale")
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_fallback(selection, method="SWAG", fallback="the SWA mean alone", advice="pass a fixed scale")
        >>> "no SWAG scale keeps the held-out NLL within 0.0050 nats" in str(caught[0].message)
        True
    """
    if not selection.fallback:
        return
    first = selection.records[0]
    warnings.warn(
        f"no {method} {selection.knob} keeps the held-out NLL within {selection.tolerance:.4f} nats of the "
        f"plain model's at {selection.confidence:.0%} confidence ({first.label}: {first.reason}); using "
        f"{fallback}. {advice}",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


def warn_kept_plain(selection: Selection, *, method: str, retry: str = "fit", stacklevel: int = 3) -> None:
    """Warn when ``selection`` kept its first candidate though it tried others: the refused candidate of largest gain
    and the ``tolerance=`` for ``retry(...)`` that would take it, or that no candidate lowers the held-out NLL.

    Example:
        >>> import warnings
        >>> import torch
        >>> from posthoc.engine.selection import Scores, select, warn_kept_plain
        >>> plain = Scores(torch.zeros(40), mistakes=torch.zeros(40))
        >>> gain = Scores(torch.cat([torch.full((39,), 0.05), torch.tensor([-1.0])]))
        >>> selection = select([("none", None), ("clean fit", 0.0)], [plain, gain], plain=plain,
        ...                    tolerance=0.005, knob="calibration")
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_kept_plain(selection, method="temperature")
        >>> print(caught[0].message)  # doctest: +ELLIPSIS
        'temperature' kept 'none': no other candidate lowers the held-out NLL (40 examples)...
    """
    tried = [record for record in selection.records if record.tried]
    if selection.index != 0 or selection.fallback or len(tried) < 2:
        return
    kept = selection.records[0]
    refused = [record for record in tried[1:] if not record.admissible and math.isfinite(record.excess)]
    best = min(refused, key=lambda record: record.excess, default=None)
    plain = selection.plain_scores
    mistakes = None if plain is None or plain.mistakes is None else int(plain.mistakes.sum())
    if best is None or best.excess >= 0:
        text = (
            f"'{method}' kept {kept.label!r}: no other candidate lowers the held-out NLL ({selection.examples} "
            "examples), so it predicts as the plain model does"
        )
    else:
        wanted = math.ceil(best.bound * 1000) / 1000
        few = (
            f" ({mistakes} of the {selection.examples} held-out examples are the plain model's mistakes)"
            if mistakes is not None
            else ""
        )
        text = (
            f"'{method}' kept {kept.label!r}, so it predicts as the plain model does: {best.label!r} lowers the held-out "
            f"NLL by {-best.excess:.4f} nats per example, but its {selection.gain_confidence:.0%} bound on new data of this "
            f"size, {best.bound:+.4f}, is over the tolerance {selection.tolerance:.4f}{few}; more held-out data would "
            f"show whether the gain holds, and {retry}(..., tolerance={wanted:g}) takes it"
        )
    warnings.warn(text, RuntimeWarning, stacklevel=stacklevel)
