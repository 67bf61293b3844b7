"""Learn then Test: one threshold that controls several risks at once, each with high probability.

Learn then Test (Angelopoulos, Bates, Candès, Jordan & Lei, "Learn then Test: Calibrating Predictive Algorithms to
Achieve Risk Control", 2021) turns risk control into multiple testing. For every threshold ``t`` of a grid and every
risk ``j``, the null hypothesis ``H_tj: R_j(t) > alpha_j`` is tested on the ``n`` calibration examples with the
Hoeffding-Bentkus p-value

    ``p_j(t) = min(exp(-n h(min(R_hat, alpha), alpha)), c * P(Binomial(n, alpha) <= ceil(n R_hat)))``,

``h(a, b) = a log(a / b) + (1 - a) log((1 - a) / (1 - b))``, ``c = e`` (``c = 1`` with one position per example,
where every loss is 0 or 1). A
threshold is valid for all risks when ``p(t) = max_j p_j(t)`` is rejected by a procedure that controls the
family-wise error rate at ``delta`` over the grid (Bonferroni-Holm by default, or Bonferroni), so that

    ``P(R_j(t) <= alpha_j for every j and every valid t) >= 1 - delta``

over the calibration draw, whatever the losses' dependence on ``t`` (no monotonicity is needed). Among the valid
thresholds the one kept has the smallest empirical value of the first risk (``objective`` picks another).

The losses of an example, for the mask of its positions of probability at least ``t`` (each in ``[0, 1]``):

- ``"fnr"``: the fraction of its positives the mask misses (0 without positives);
- ``"fdr"``: the fraction of the mask that is not a positive (0 for an empty mask): one minus precision;
- ``"size"``: the fraction of its (valid) positions in the mask: the set size over the number of labels.

Example:
    >>> import torch
    >>> import posthoc
    >>> g = torch.Generator().manual_seed(0)
    >>> targets = (torch.rand(1000, 8, generator=g) < 0.2).long()
    >>> probs = torch.sigmoid(2.5 * (2 * targets - 1) + 1.5 * torch.randn(1000, 8, generator=g))
    >>> rc = posthoc.risk_control(probs, targets, alpha=[0.2, 0.3], loss=["fnr", "size"], method="ltt", delta=0.1)
    >>> rc.risks                                         # the calibration risks at the threshold kept
    {'fnr': 0.1..., 'size': 0.2...}
    >>> rc.mask(probs).shape
    torch.Size([1000, 8])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from scipy import stats
from torch import Tensor

from posthoc.core.checks import known_name, one_of, probability
from posthoc.core.inputs import like_given
from posthoc.errors import ConfigError
from posthoc.guarantees.selective import RiskNotReachableError

#: the losses Learn then Test controls (each in [0, 1], computed per example)
LTT_LOSSES = ("fnr", "fdr", "size")
#: the family-wise error procedures over the grid of thresholds
FWER_METHODS = ("bonferroni_holm", "bonferroni")
#: the default grid of thresholds (MAPIE's): 0, 0.01, ..., 0.99
DEFAULT_THRESHOLDS = tuple(round(0.01 * k, 2) for k in range(100))


def example_losses(name: str, mask: Tensor, truth: Tensor, valid: Tensor) -> Tensor:
    """The loss ``name`` of every example for every threshold: ``mask`` ``(T, N, P)`` (bool, a mask per threshold),
    ``truth`` and ``valid`` ``(N, P)``; returns ``(T, N)`` in float64.

    Example:
        >>> import torch
        >>> from posthoc.guarantees.learn_then_test import example_losses
        >>> mask = torch.tensor([[[True, True, False, False]]])
        >>> truth, valid = torch.tensor([[True, False, True, False]]), torch.ones(1, 4, dtype=torch.bool)
        >>> [float(example_losses(name, mask, truth, valid)) for name in ("fnr", "fdr", "size")]
        [0.5, 0.5, 0.5]
    """
    mask = mask & valid
    if name == "fnr":
        return (truth & ~mask).sum(-1).double() / truth.sum(-1).clamp_min(1).double()
    if name == "fdr":
        return (mask & ~truth).sum(-1).double() / mask.sum(-1).clamp_min(1).double()
    return mask.sum(-1).double() / valid.sum(-1).clamp_min(1).double()


def hoeffding_bentkus(risks: np.ndarray, n: int, alpha: float, binary: bool) -> np.ndarray:
    """The Hoeffding-Bentkus p-values of ``H: R > alpha`` for empirical risks ``risks`` on ``n`` examples (module
    docs); ``binary`` for losses that are 0 or 1 (Bentkus' factor ``e`` drops).

    Example:
        >>> import numpy as np
        >>> from posthoc.guarantees.learn_then_test import hoeffding_bentkus
        >>> hoeffding_bentkus(np.array([0.05, 0.1, 0.2]), 500, 0.1, binary=False).round(4)
        array([1.e-04, 1.e+00, 1.e+00])
    """
    capped = np.minimum(risks, alpha)
    with np.errstate(divide="ignore", invalid="ignore"):
        first = np.where(capped > 0, capped * np.log(capped / alpha), 0.0)
    divergence = first + (1 - capped) * np.log((1 - capped) / (1 - alpha))
    hoeffding = np.exp(-n * divergence)
    bentkus = (1.0 if binary else math.e) * stats.binom.cdf(np.ceil(n * risks), n, alpha)
    return np.minimum(hoeffding, bentkus)


def fwer_rejections(p_values: np.ndarray, delta: float, method: str) -> np.ndarray:
    """The indices ``(k,)`` (sorted) of the hypotheses rejected at family-wise error ``delta``: Bonferroni (``p <=
    delta / m``) or Bonferroni-Holm (step down: the ``i``-th smallest is rejected while ``p_(i) <= delta / (m - i)``).

    Example:
        >>> import numpy as np
        >>> from posthoc.guarantees.learn_then_test import fwer_rejections
        >>> p = np.array([0.01, 0.04, 0.03, 0.5])
        >>> fwer_rejections(p, 0.1, "bonferroni"), fwer_rejections(p, 0.1, "bonferroni_holm")
        (array([0]), array([0, 1, 2]))
    """
    m = len(p_values)
    if method == "bonferroni":
        return np.flatnonzero(p_values <= delta / m)
    order = np.argsort(p_values, kind="stable")
    passes = p_values[order] <= delta / (m - np.arange(m))
    rejected = m if passes.all() else int(np.argmin(passes))
    return np.sort(order[:rejected])


class MultiRiskController:
    """A threshold that controls several risks at once (Learn then Test); build with ``posthoc.risk_control(...,
    method="ltt")``. ``threshold`` is the one kept, ``valid`` every valid threshold of the grid, ``p_values`` the
    p-value of each threshold (the largest over the risks), ``risks`` the calibration risks at ``threshold``."""

    def __init__(
        self,
        *,
        losses: tuple[str, ...],
        alphas: tuple[float, ...],
        delta: float,
        thresholds: np.ndarray,
        valid: np.ndarray,
        p_values: np.ndarray,
        empirical: np.ndarray,
        chosen: int,
        num_calibration: int,
        object_scores: Any,
    ) -> None:
        self.losses, self.alphas, self.delta = losses, alphas, delta
        self.thresholds, self.p_values, self.empirical = thresholds, p_values, empirical
        self.valid = thresholds[valid]
        self.threshold = float(thresholds[chosen])
        self.risks = {name: float(empirical[j, chosen]) for j, name in enumerate(losses)}
        self.num_calibration, self._object_scores = num_calibration, object_scores

    def mask(self, probs: Any) -> Any:
        """The predicted mask: the positions whose probability reaches ``threshold`` (numpy for numpy)."""
        scores, _ = self._object_scores(probs)
        return like_given(scores >= self.threshold, probs)

    def __repr__(self) -> str:
        levels = ", ".join(f"{name}<={alpha:g}" for name, alpha in zip(self.losses, self.alphas))
        return (
            f"MultiRiskController({levels}, delta={self.delta:g}, threshold={self.threshold:.4g}, "
            f"valid={len(self.valid)} of {len(self.thresholds)}, n={self.num_calibration})"
        )


def as_levels(loss: Any, alpha: Any) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """``loss`` and ``alpha`` as two tuples of the same length (one level per loss), checked."""
    losses = (loss,) if isinstance(loss, str) else tuple(loss)
    alphas = (alpha,) if isinstance(alpha, (int, float)) else tuple(alpha)
    if len(losses) != len(alphas):
        raise ConfigError(
            f"Learn then Test takes one level per loss: got {len(losses)} losses {list(losses)} and {len(alphas)} "
            f"levels {list(alphas)}"
        )
    losses = tuple(known_name(name, "Learn-then-Test loss", LTT_LOSSES) for name in losses)
    if len(set(losses)) != len(losses):
        raise ConfigError(f"each loss once: got {list(losses)}")
    return losses, tuple(probability(a, "alpha") for a in alphas)


def learn_then_test(
    scores: Tensor,
    truth: Tensor,
    valid: Tensor,
    *,
    loss: str | Sequence[str],
    alpha: float | Sequence[float],
    delta: float,
    thresholds: Sequence[float] | None,
    fwer: str,
    objective: str | None,
    object_scores: Any,
) -> MultiRiskController:
    """Calibrate a :class:`MultiRiskController` on object scores ``(N, ...)`` with their positives and valid positions
    (called by ``posthoc.risk_control(..., method="ltt")``; the module docs)."""
    losses, alphas = as_levels(loss, alpha)
    delta = probability(delta, "delta")
    one_of(fwer, "fwer", FWER_METHODS)
    objective = losses[0] if objective is None else known_name(objective, "objective", losses)
    grid = np.asarray(DEFAULT_THRESHOLDS if thresholds is None else thresholds, dtype=np.float64)
    if grid.ndim != 1 or not len(grid) or not np.isfinite(grid).all():
        raise ConfigError("thresholds must be a non-empty 1-D sequence of finite numbers")
    n = scores.shape[0]
    scores, truth, valid = scores.reshape(n, -1).double(), truth.reshape(n, -1), valid.reshape(n, -1)
    masks = scores[None] >= torch.from_numpy(grid)[:, None, None]
    per_example = {name: example_losses(name, masks, truth, valid) for name in losses}  # (T, N) each
    empirical = np.stack([per_example[name].mean(1).numpy() for name in losses])  # (J, T)
    binary = scores.shape[1] == 1  # one position per example: every loss is 0 or 1
    p_values = np.stack([hoeffding_bentkus(empirical[j], n, alphas[j], binary) for j in range(len(losses))]).max(0)
    rejected = fwer_rejections(p_values, delta, fwer)
    if not len(rejected):
        best = int(np.argmin(p_values))
        raise RiskNotReachableError(
            f"no threshold of the grid controls {', '.join(f'{name} <= {a:g}' for name, a in zip(losses, alphas))} with "
            f"probability {1 - delta:g} on {n} calibration examples (the best, t={grid[best]:.3g}, has calibration "
            f"risks {', '.join(f'{name} {empirical[j, best]:.3f}' for j, name in enumerate(losses))} and p-value "
            f"{p_values[best]:.3g}); raise alpha or delta, add calibration examples, or drop a risk"
        )
    target = empirical[losses.index(objective), rejected]
    chosen = int(rejected[np.flatnonzero(target == target.min())[0]])
    return MultiRiskController(
        losses=losses,
        alphas=alphas,
        delta=delta,
        thresholds=grid,
        valid=rejected,
        p_values=p_values,
        empirical=empirical,
        chosen=chosen,
        num_calibration=n,
        object_scores=object_scores,
    )
