"""KL weight schedules for variational fits: how the KL term of the ELBO is annealed in.

``schedule(done)`` gives the KL weight after the fraction ``done`` (in ``[0, 1)``) of the steps:

- ``"linear"``: rises linearly from 0 to ``weight`` over the first ``warmup`` fraction, then stays;
- ``"cosine"``: the same rise along half a cosine (slow start and end);
- ``"cyclical"``: ``cycles`` equal cycles, each rising linearly over its first ``warmup`` fraction,
  then at ``weight`` for the rest (Fu et al., 2019, "Cyclical annealing schedule");
- ``"constant"``: ``weight`` throughout (no warm-up).

Example:
    >>> from posthoc.engine.kl_schedule import KLSchedule
    >>> [KLSchedule("linear", weight=1.0, warmup=0.5)(t) for t in (0.0, 0.25, 0.75)]
    [0.0, 0.5, 1.0]
    >>> [KLSchedule("cyclical", warmup=0.5, cycles=2)(t) for t in (0.125, 0.375, 0.625)]
    [0.5, 1.0, 0.5]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from posthoc.core.checks import positive_int
from posthoc.errors import ConfigError

SCHEDULES = ("linear", "cosine", "cyclical", "constant")


@dataclass(frozen=True)
class KLSchedule:
    """The KL weight as a function of training progress (see module docs); checked on construction."""

    kind: str = "linear"
    weight: float = 1.0
    warmup: float = 0.5
    cycles: int = 4

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ConfigError(f"kl_schedule must be one of {SCHEDULES}, got {self.kind!r}")
        if not _finite_number(self.weight) or self.weight < 0:
            raise ConfigError(
                f"kl_weight must be a finite number >= 0 (1 is the ELBO; 0 ignores the prior), got {self.weight!r}"
            )
        if not _finite_number(self.warmup) or not 0 <= self.warmup <= 1:
            raise ConfigError(f"kl_warmup must be a fraction of the steps in [0, 1], got {self.warmup!r}")
        positive_int(self.cycles, "kl_cycles")

    def __call__(self, done: float) -> float:
        """The KL weight after the fraction ``done`` of the steps."""
        if self.kind == "constant" or self.warmup == 0:
            return self.weight
        position = (done * self.cycles) % 1.0 if self.kind == "cyclical" else done
        ramp = min(1.0, max(0.0, position) / self.warmup)
        if self.kind == "cosine":
            ramp = 0.5 * (1.0 - math.cos(math.pi * ramp))
        return self.weight * ramp


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
