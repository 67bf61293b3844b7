"""The two finite-sample facts the guarantees rest on: the conformal rank and the binomial tail bound.

- Split conformal prediction (Vovk et al. 2005; Angelopoulos & Bates 2021, eq. 1): with ``n``
  exchangeable calibration scores, the ``k``-th smallest, ``k = ceil((n + 1)(1 - alpha))``, is a
  threshold whose sets cover a fresh example with probability in ``[1 - alpha, 1 - alpha + 1/(n + 1))``
  (the upper end for scores without ties). It exists only when ``k <= n``, i.e. ``n >= 1/alpha - 1``.
- Selection with guaranteed risk (Geifman & El-Yaniv 2017): after ``m`` accepted examples with ``e``
  errors, the true risk is at most the one-sided Clopper–Pearson bound ``b`` solving
  ``P(Binomial(m, b) <= e) = delta``, with probability at least ``1 - delta``.

Example:
    >>> from posthoc.guarantees.bounds import binomial_upper_bound, conformal_rank
    >>> conformal_rank(99, 0.1)
    90
    >>> round(binomial_upper_bound(0, 100, 0.05), 4)   # no error in 100: risk <= 1 - 0.05 ** (1/100)
    0.0295
"""

from __future__ import annotations

import math

from scipy import special
from torch import Tensor

from posthoc.errors import InputError

#: tolerance on ``(n + 1)(1 - alpha)`` being a whole number (``alpha = 0.1`` is not exactly 1/10 in binary)
RANK_TOLERANCE = 1e-9


def minimum_calibration_size(alpha: float) -> int:
    """The fewest calibration examples for which the conformal quantile at ``alpha`` exists.

    Example:
        >>> from posthoc.guarantees.bounds import minimum_calibration_size
        >>> minimum_calibration_size(0.1), minimum_calibration_size(0.05)
        (9, 19)
    """
    return max(1, math.ceil((1.0 - alpha) / alpha - RANK_TOLERANCE))


def conformal_rank(n: int, alpha: float) -> int:
    """``ceil((n + 1)(1 - alpha))``: the rank (1-based) of the calibration score used as the threshold; ``n`` below
    :func:`minimum_calibration_size` is refused."""
    rank = math.ceil((n + 1) * (1.0 - alpha) - RANK_TOLERANCE * (n + 1))
    if rank > n:
        raise InputError(
            f"conformal sets at alpha={alpha:g} need at least {minimum_calibration_size(alpha)} calibration "
            f"examples (the ceil((n+1)(1-alpha))-th smallest score must exist), got {n}; add calibration "
            "data or raise alpha"
        )
    return rank


def conformal_threshold(scores: Tensor, alpha: float) -> Tensor:
    """The ``ceil((n + 1)(1 - alpha))``-th smallest of ``n`` calibration scores (a 0-dim tensor).

    Example:
        >>> import torch
        >>> from posthoc.guarantees.bounds import conformal_threshold
        >>> conformal_threshold(torch.arange(1.0, 11.0), 0.2)    # ceil(11 * 0.8) = 9th smallest
        tensor(9.)
    """
    rank = conformal_rank(scores.numel(), alpha)
    return scores.reshape(-1).kthvalue(rank).values


def binomial_upper_bound(errors: int, n: int, delta: float) -> float:
    """The largest risk ``b`` with ``P(Binomial(n, b) <= errors) >= delta`` (1.0 when ``errors >= n``).

    Example:
        >>> from posthoc.guarantees.bounds import binomial_upper_bound
        >>> from scipy.stats import binom
        >>> b = binomial_upper_bound(3, 200, 0.05)
        >>> round(float(binom.cdf(3, 200, b)), 6)
        0.05
    """
    if n <= 0 or errors >= n:
        return 1.0
    return float(special.betaincinv(errors + 1, n - errors, 1.0 - delta))
