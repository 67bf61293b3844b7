"""Conformity scores of every class for every example (larger = conforms less), and their options.

- ``"lac"`` (least ambiguous set-valued classifier, Sadinle et al. 2019): ``1 - p_y``.
- ``"aps"`` (adaptive prediction sets, Romano et al. 2020): the probability mass of the classes
  ranked above ``y`` plus ``u * p_y``; ``u ~ U(0, 1)`` per example when randomised, ``u = 1``
  otherwise (conservative: coverage above ``1 - alpha``).
- ``"raps"`` (regularised APS, Angelopoulos et al. 2021): APS plus ``lam * max(0, rank_y - k_reg)``
  (``rank_y`` 1-based), which penalises long tails of small probabilities.
- ``"saps"`` (sorted APS, Huang et al. 2024): keeps only the largest probability ``p_max`` and the rank: ``u * p_max``
  for the top class, ``p_max + lam * (rank_y - 2 + u)`` for the others. The small, noisy probabilities of the tail
  no longer enter the score, which gives smaller sets than APS and RAPS at the same coverage.

Scores of all classes are computed at once, with one ``u`` per example shared by its classes, so
that a set ``{y : score_y <= threshold}`` is the top-``k`` classes for some ``k`` (APS/RAPS).

Example:
    >>> import torch
    >>> from posthoc.guarantees.scores import ConformityScore
    >>> probs = torch.tensor([[0.6, 0.3, 0.1]], dtype=torch.float64)
    >>> ConformityScore("lac")(probs)
    tensor([[0.4000, 0.7000, 0.9000]], dtype=torch.float64)
    >>> ConformityScore("aps", randomized=False)(probs)
    tensor([[0.6000, 0.9000, 1.0000]], dtype=torch.float64)
    >>> ConformityScore("saps", randomized=False, lam=0.5)(probs)
    tensor([[0.6000, 1.1000, 1.6000]], dtype=torch.float64)
"""

from __future__ import annotations

import torch
from torch import Tensor

from posthoc.core.checks import integer_at_least, known_name, non_negative, positive_number
from posthoc.errors import ConfigError

SCORES = ("lac", "aps", "raps", "saps")
#: RAPS defaults (Angelopoulos et al. 2021 tune them on held-out data; these are their typical values)
RAPS_DEFAULTS = {"k_reg": 1, "lam": 0.01}
#: the SAPS weight of a rank (TorchCP's default; Huang et al. 2024 tune it on held-out data)
SAPS_DEFAULT_LAM = 0.2


def saps_ranked(ranked: Tensor, u: Tensor, lam: float) -> Tensor:
    """SAPS scores in rank order: ``ranked`` the probabilities sorted in decreasing order ``(N, C)``, ``u`` in ``[0, 1]``
    (``(N, 1)`` shared by an example's classes, or one per class ``(N, C)``), ``lam`` the weight of a rank.

    Example:
        >>> import torch
        >>> from posthoc.guarantees.scores import saps_ranked
        >>> saps_ranked(torch.tensor([[0.5, 0.3, 0.2]]), torch.ones(1, 1), lam=0.1)
        tensor([[0.5000, 0.6000, 0.7000]])
    """
    top = ranked[:, :1]
    rank = torch.arange(ranked.shape[-1], dtype=ranked.dtype, device=ranked.device)  # 0-based: rank_y - 1
    below_top = top + lam * (rank - 1 + u)
    return torch.where(rank == 0, u * top, below_top)


class ConformityScore:
    """One conformity score with its options (see module docs); ``score(probs)`` gives ``(N, C)`` scores.
    ``randomized`` defaults to ``True`` for APS/RAPS (exact coverage) and must stay off for LAC."""

    def __init__(
        self,
        name: str,
        *,
        randomized: bool | None = None,
        k_reg: int | None = None,
        lam: float | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        known_name(name, "conformity score", SCORES)
        if name == "lac" and randomized:
            raise ConfigError(
                "score='lac' is not randomised (its sets are already exact up to ties); "
                "use score='aps' or 'raps' for randomised sets"
            )
        if name != "raps" and k_reg is not None:
            raise ConfigError(f"k_reg is an option of score='raps', not of score={name!r}")
        if name not in ("raps", "saps") and lam is not None:
            raise ConfigError(f"lam is an option of score='raps' or 'saps', not of score={name!r}")
        self.name = name
        self.randomized = name != "lac" and (True if randomized is None else bool(randomized))
        self.k_reg = (
            integer_at_least(
                RAPS_DEFAULTS["k_reg"] if k_reg is None else k_reg,
                "k_reg",
                0,
                why="the set size from which RAPS penalises",
            )
            if name == "raps"
            else 0
        )
        self.lam = 0.0
        if name == "raps":
            self.lam = non_negative(
                RAPS_DEFAULTS["lam"] if lam is None else lam, "lam", why="the RAPS penalty per class"
            )
        elif name == "saps":
            self.lam = positive_number(SAPS_DEFAULT_LAM if lam is None else lam, "lam", why="the SAPS weight of a rank")
        self.generator = generator

    def __call__(self, probs: Tensor) -> Tensor:
        """Scores ``(N, C)`` of every class; ``probs`` ``(N, C)`` (computed in float64)."""
        probs = probs.double()
        if self.name == "lac":
            return 1.0 - probs
        ranked, order = probs.sort(dim=-1, descending=True, stable=True)
        above = ranked.cumsum(-1) - ranked  # mass of the classes ranked strictly above
        if self.randomized:
            u = torch.rand(probs.shape[0], 1, generator=self.generator, dtype=torch.float64).to(probs.device)
        else:
            u = torch.ones((), dtype=torch.float64, device=probs.device)
        if self.name == "saps":
            ranked_scores = saps_ranked(ranked, u, self.lam)
            return torch.empty_like(ranked_scores).scatter_(-1, order, ranked_scores)
        ranked_scores = above + u * ranked
        if self.lam:
            rank = torch.arange(1, probs.shape[-1] + 1, dtype=torch.float64, device=probs.device)
            ranked_scores = ranked_scores + self.lam * (rank - self.k_reg).clamp_min(0)
        return torch.empty_like(ranked_scores).scatter_(-1, order, ranked_scores)

    def describe(self) -> str:
        """A short label, e.g. ``"raps (randomised, k_reg=1, lam=0.01)"``."""
        parts = (
            (["randomised"] if self.randomized else [])
            + ([f"k_reg={self.k_reg}", f"lam={self.lam:g}"] if self.name == "raps" else [])
            + ([f"lam={self.lam:g}"] if self.name == "saps" else [])
        )
        return self.name + (f" ({', '.join(parts)})" if parts else "")
