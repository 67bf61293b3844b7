"""Conformity scores of every class for every example (larger = conforms less), and their options.

- ``"lac"`` (least ambiguous set-valued classifier, Sadinle et al. 2019): ``1 - p_y``.
- ``"aps"`` (adaptive prediction sets, Romano et al. 2020): the probability mass of the classes
  ranked above ``y`` plus ``u * p_y``; ``u ~ U(0, 1)`` per example when randomised, ``u = 1``
  otherwise (conservative: coverage above ``1 - alpha``).
- ``"raps"`` (regularised APS, Angelopoulos et al. 2021): APS plus ``lam * max(0, rank_y - k_reg)``
  (``rank_y`` 1-based), which penalises long tails of small probabilities.

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
"""

from __future__ import annotations

import torch
from torch import Tensor

from posthoc.core.checks import integer_at_least, known_name, non_negative
from posthoc.errors import ConfigError

SCORES = ("lac", "aps", "raps")
#: RAPS defaults (Angelopoulos et al. 2021 tune them on held-out data; these are their typical values)
RAPS_DEFAULTS = {"k_reg": 1, "lam": 0.01}


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
        if name != "raps" and (k_reg is not None or lam is not None):
            raise ConfigError(f"k_reg and lam are options of score='raps', not of score={name!r}")
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
        self.lam = (
            non_negative(RAPS_DEFAULTS["lam"] if lam is None else lam, "lam", why="the RAPS penalty per extra class")
            if name == "raps"
            else 0.0
        )
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
        ranked_scores = above + u * ranked
        if self.lam:
            rank = torch.arange(1, probs.shape[-1] + 1, dtype=torch.float64, device=probs.device)
            ranked_scores = ranked_scores + self.lam * (rank - self.k_reg).clamp_min(0)
        return torch.empty_like(ranked_scores).scatter_(-1, order, ranked_scores)

    def describe(self) -> str:
        """A short label, e.g. ``"raps (randomised, k_reg=1, lam=0.01)"``."""
        parts = (["randomised"] if self.randomized else []) + (
            [f"k_reg={self.k_reg}", f"lam={self.lam:g}"] if self.name == "raps" else []
        )
        return self.name + (f" ({', '.join(parts)})" if parts else "")
