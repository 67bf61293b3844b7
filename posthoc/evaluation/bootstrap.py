"""Bootstrap confidence intervals over test examples for the report's metrics, and paired differences.

One ``(B, N)`` matrix of resampled example indices is shared by every metric (and, for a paired comparison, by both
reports); every metric is computed for all ``B`` resamples at once, in chunks. Intervals are percentile intervals by
default; ``method="bca"`` gives bias-corrected and accelerated intervals (its jackknife is ``O(N²)``).

Example:
    >>> from posthoc.evaluation.bootstrap import example_statistics, intervals
    >>> from posthoc_apps.demo.examples import probs, labels
    >>> stats = example_statistics(probs, labels)
    >>> intervals(stats, len(labels), ci=0.95, bootstraps=1000)["nll"]   # 128 examples: a wide interval
    (0.28, 0.93)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch
from scipy.special import ndtr, ndtri
from torch import Tensor

from posthoc.core.calibration_error import equal_mass_gap
from posthoc.core.checks import integer_at_least, known_name, probability
from posthoc.errors import InputError
from posthoc.evaluation import metrics
from posthoc.evaluation.smooth_ece import smooth_ece_rows

#: a metric of the examples picked by an index matrix ``(B, n)``: one value per row ``(B,)``
Statistic = Callable[[Tensor], Tensor]
#: resampled indices kept alive at once (B chunk × N)
CHUNK_ELEMENTS = 4_000_000
METHODS = ("percentile", "bca")


def mean_of(values: Tensor) -> Statistic:
    """The mean of per-example ``values`` ``(N,)`` over the examples an index matrix picks."""
    return lambda index: values[index].mean(-1)


def _ece_of(confidence: Tensor, correct: Tensor, bins: int) -> Statistic:
    edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64)
    bin_of = torch.bucketize(confidence.contiguous(), edges[1:-1])
    gap = confidence - correct

    def ece(index: Tensor) -> Tensor:
        rows = torch.arange(index.shape[0]).unsqueeze(-1) * bins + bin_of[index]
        sums = torch.zeros(index.shape[0] * bins, dtype=torch.float64).index_add_(
            0, rows.flatten(), gap[index].flatten()
        )
        return sums.view(-1, bins).abs().sum(-1) / index.shape[1]

    return ece


def _aurc_of(confidence: Tensor, correct: Tensor, generalized: bool = False) -> Statistic:
    """AURC (or with ``generalized``, AUGRC: the risk times the coverage) of the picked examples."""

    def aurc(index: Tensor) -> Tensor:
        order = confidence[index].argsort(dim=-1, descending=True, stable=True)
        errors = (1 - correct[index]).gather(-1, order)
        kept = torch.arange(1, index.shape[1] + 1, dtype=torch.float64)
        return (errors.cumsum(-1) / (index.shape[1] if generalized else kept)).mean(-1)

    return aurc


def example_statistics(probs: Tensor, labels: Tensor, bins: int = 15) -> dict[str, Statistic]:
    """The metrics of :mod:`posthoc.evaluation.metrics` as functions of an index matrix (on the identity index they
    give the report's values).

    Example:
        >>> import torch
        >>> from posthoc.evaluation import metrics
        >>> from posthoc.evaluation.bootstrap import example_statistics
        >>> from posthoc_apps.demo.examples import probs, labels
        >>> stats = example_statistics(probs, labels)
        >>> float(stats["nll"](torch.arange(len(labels))[None])[0]) == metrics.nll(probs, labels)
        True
    """
    probs, labels = probs.double().cpu(), labels.cpu()
    confidence, predicted = probs.max(-1)
    correct = (predicted == labels).double()
    picked = probs.gather(-1, labels[:, None]).squeeze(-1)
    onehot = torch.nn.functional.one_hot(labels, probs.shape[-1]).double()
    return {
        "accuracy": mean_of(correct),
        "nll": mean_of(-picked.clamp_min(metrics.EPS).log()),
        "ece": _ece_of(confidence, correct, bins),
        "adaptive_ece": lambda index: equal_mass_gap(confidence[index], correct[index], bins),
        "smooth_ece": lambda index: smooth_ece_rows(confidence[index], correct[index]),
        "brier": mean_of(((probs - onehot) ** 2).sum(-1)),
        "aurc": _aurc_of(confidence, correct),
        "augrc": _aurc_of(confidence, correct, generalized=True),
    }


def check_level(ci: float, bootstraps: int, method: str = "percentile") -> None:
    """Refuse a confidence level outside (0, 1), fewer than 2 resamples, or an unknown method."""
    probability(ci, "ci", why="a confidence level, e.g. 0.95")
    integer_at_least(bootstraps, "bootstraps", 2, why="1000 is usual")
    known_name(method, "bootstrap method", METHODS)


def resample_index(n: int, bootstraps: int, seed: int = 0) -> Tensor:
    """``(bootstraps, n)`` indices drawn with replacement from ``range(n)``, seeded."""
    if n < 2:
        raise InputError(f"a bootstrap needs at least 2 examples, got {n}")
    return torch.randint(n, (bootstraps, n), generator=torch.Generator().manual_seed(seed))


def _chunked(statistic: Statistic, index: Tensor) -> Tensor:
    rows = max(1, CHUNK_ELEMENTS // max(1, index.shape[1]))
    return torch.cat([statistic(part) for part in index.split(rows)])


def _jackknife_index(n: int) -> Tensor:
    """Row ``i`` holds every index but ``i``: ``(n, n - 1)``."""
    full = torch.arange(n).expand(n, n)
    return full[~torch.eye(n, dtype=torch.bool)].view(n, n - 1)


def _interval(
    draws: np.ndarray, observed: float, ci: float, method: str, jackknife: np.ndarray | None
) -> tuple[float, float]:
    tails = np.array([(1 - ci) / 2, (1 + ci) / 2])
    if method == "bca":
        below = np.mean(draws < observed) + np.mean(draws == observed) / 2
        bias = ndtri(np.clip(below, 1e-12, 1 - 1e-12))
        spread = jackknife.mean() - jackknife
        denominator = 6 * np.sum(spread**2) ** 1.5
        accel = np.sum(spread**3) / denominator if denominator > 0 else 0.0
        z = ndtri(tails)
        tails = ndtr(bias + (bias + z) / (1 - accel * (bias + z)))
    low, high = np.nanquantile(draws, tails)
    return float(low), float(high)


def intervals(
    statistics: Mapping[str, Statistic],
    n: int,
    *,
    ci: float = 0.95,
    bootstraps: int = 1000,
    seed: int = 0,
    method: str = "percentile",
    index: Tensor | None = None,
) -> dict[str, tuple[float, float]]:
    """``name -> (low, high)``: the ``ci`` bootstrap interval of each statistic over ``n`` examples.

    ``index`` reuses a resample matrix (e.g. the one of a paired comparison); by default one is drawn from ``seed``.

    Example:
        >>> from posthoc.evaluation.bootstrap import intervals, mean_of
        >>> from posthoc_apps.demo.examples import x
        >>> intervals({"mean": mean_of(x[:, 0])}, len(x), ci=0.9)   # the first feature's mean over 8 examples
        {'mean': (-0.43, 1.14)}
    """
    check_level(ci, bootstraps, method)
    index = resample_index(n, bootstraps, seed) if index is None else index
    identity = torch.arange(n)[None]
    jack = _jackknife_index(n) if method == "bca" else None
    out = {}
    for name, statistic in statistics.items():
        draws = _chunked(statistic, index).numpy()
        observed = float(statistic(identity)[0])
        jackknife = None if jack is None else _chunked(statistic, jack).numpy()
        out[name] = _interval(draws, observed, ci, method, jackknife)
    return out


def draws(statistics: Mapping[str, Statistic], index: Tensor, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The values of the ``names`` statistics on every resample of ``index`` (``B`` each)."""
    return {name: _chunked(statistics[name], index).numpy() for name in names}


def percentile_interval(values: np.ndarray, ci: float) -> tuple[float, float]:
    """The central ``ci`` interval of bootstrap ``values`` (NaN resamples ignored)."""
    low, high = np.nanquantile(values, [(1 - ci) / 2, (1 + ci) / 2])
    return float(low), float(high)


def difference(first: Statistic, second: Statistic) -> Statistic:
    """The paired statistic ``first - second`` on the same resampled examples."""
    return lambda index: first(index) - second(index)


def _resample_counts(n: int, rows: int, generator: torch.Generator) -> Tensor:
    """How often each of ``n`` examples is drawn in each of ``rows`` resamples with replacement: ``(rows, n)``."""
    picks = torch.randint(n, (rows, n), generator=generator)
    return torch.zeros(rows, n, dtype=torch.float64).scatter_add_(1, picks, torch.ones(rows, n, dtype=torch.float64))


def auroc_draws(in_scores: Tensor, out_scores: Tensor, bootstraps: int = 1000, seed: int = 0) -> Tensor:
    """The OOD AUROC of ``bootstraps`` resamples ``(B,)``, in-distribution and OOD examples resampled independently.

    Each resample's AUROC is the Mann–Whitney statistic with ties counted half, from the resample's counts of each
    example over scores sorted once, so a resample costs ``O(n + m)``.
    """
    inside, outside = in_scores.double().cpu().flatten(), out_scores.double().cpu().flatten()
    if inside.numel() == 0 or outside.numel() == 0:
        raise InputError("an AUROC interval needs at least one in-distribution and one OOD example")
    ordered, order = inside.sort()
    below = torch.searchsorted(ordered, outside, right=False)
    up_to = torch.searchsorted(ordered, outside, right=True)
    generator = torch.Generator().manual_seed(seed)
    rows = max(1, CHUNK_ELEMENTS // (inside.numel() + outside.numel()))
    draws = []
    for start in range(0, bootstraps, rows):
        size = min(rows, bootstraps - start)
        weights = _resample_counts(inside.numel(), size, generator)[:, order]
        cumulative = torch.cat([torch.zeros(size, 1, dtype=torch.float64), weights.cumsum(1)], 1)
        lower, tied = cumulative[:, below], cumulative[:, up_to] - cumulative[:, below]
        counts = _resample_counts(outside.numel(), size, generator)
        draws.append((counts * (lower + tied / 2)).sum(1) / (inside.numel() * outside.numel()))
    return torch.cat(draws)


def auroc_interval(
    in_scores: Tensor, out_scores: Tensor, *, ci: float = 0.95, bootstraps: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """Percentile interval of the OOD AUROC over :func:`auroc_draws`.

    Example:
        >>> from posthoc.evaluation.bootstrap import auroc_interval
        >>> from posthoc_apps.demo.examples import report
        >>> test_entropy, ood_entropy = report.ood_values["entropy"]
        >>> auroc_interval(test_entropy, ood_entropy, ci=0.95)   # far-away inputs get confident predictions
        (0.37, 0.50)
    """
    check_level(ci, bootstraps)
    low, high = np.quantile(auroc_draws(in_scores, out_scores, bootstraps, seed).numpy(), [(1 - ci) / 2, (1 + ci) / 2])
    return float(low), float(high)


def guarantee_statistics(
    labels: Tensor, sets: Tensor | None, accepted: Tensor | None, correct: Tensor
) -> dict[str, Statistic]:
    """Coverage and set size of conformal ``sets``, deferral and accepted error (if any is accepted) of a
    selective rule, per index matrix."""
    out: dict[str, Statistic] = {}
    if sets is not None:
        sets = sets.cpu().bool()
        out["coverage"] = mean_of(sets.gather(-1, labels.cpu()[:, None]).squeeze(-1).double())
        out["set_size"] = mean_of(sets.sum(-1).double())
    if accepted is not None:
        kept, wrong = accepted.cpu().double(), 1 - correct.cpu().double()
        out["deferral"] = mean_of(1 - kept)
    if accepted is not None and bool(accepted.any()):
        out["selective_risk"] = lambda index: (wrong[index] * kept[index]).sum(-1) / kept[index].sum(-1)
    return out


def report_intervals(
    probs: Tensor,
    labels: Tensor,
    *,
    ci: float = 0.95,
    bootstraps: int = 1000,
    seed: int = 0,
    method: str = "percentile",
    sets: Tensor | None = None,
    accepted: Tensor | None = None,
    ood: Mapping[str, tuple[Tensor, Tensor]] | None = None,
) -> dict[str, tuple[float, float]]:
    """Intervals of every metric of a report: the classification metrics, the guarantees measured (``sets``,
    ``accepted``) and each OOD AUROC given as ``name -> (in-distribution scores, OOD scores)``.

    Example:
        >>> from posthoc.evaluation.bootstrap import report_intervals
        >>> from posthoc_apps.demo.examples import report
        >>> test_entropy, ood_entropy = report.ood_values["entropy"]
        >>> found = report_intervals(report.probs, report.labels, ci=0.95, ood={"ood_auroc": (test_entropy, ood_entropy)})
        >>> found["nll"], found["ood_auroc"]
        ((0.35, 0.66), (0.37, 0.50))
    """
    stats = example_statistics(probs, labels)
    correct = probs.argmax(-1).cpu() == labels.cpu()
    guarantees = guarantee_statistics(labels, sets, accepted, correct)
    out = intervals({**stats, **guarantees}, len(labels), ci=ci, bootstraps=bootstraps, seed=seed, method=method)
    for name, (inside, outside) in (ood or {}).items():
        out[name] = auroc_interval(inside, outside, ci=ci, bootstraps=bootstraps, seed=seed)
    return out
