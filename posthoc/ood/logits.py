"""Scores of the logits: ``"max-logit"`` and ``"energy"``.

- ``max-logit``: ``-max_c f_c(x)`` (Hendrycks et al., ICML 2022), pytorch-ood's ``MaxLogit``.
- ``energy``: ``E(x) = -T log sum_c exp(f_c(x) / T)`` (Liu et al., NeurIPS 2020), pytorch-ood's
  ``EnergyBased`` with ``t=T``: the energy itself, which is larger for OOD inputs.

Both read the base model's logits, not a wrapped predictive (a temperature fitted by a method
does not change them; pass ``temperature=`` to the energy score instead).

Example:
    >>> import torch
    >>> from posthoc.ood.base import Outputs
    >>> from posthoc.ood.logits import Energy
    >>> Energy(temperature=1.0)(Outputs(logits=torch.zeros(1, 4)))
    tensor([-1.3863])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posthoc.core.checks import positive_number
from posthoc.core.options import option
from posthoc.ood.base import Outputs, Score

LOGITS = frozenset({"logits"})


class MaxLogit(Score):
    """The negated largest logit."""

    name, uses = "max-logit", LOGITS

    def __call__(self, outputs: Outputs) -> Tensor:
        return -outputs.logits.max(-1).values


class Energy(Score):
    """The free energy ``-T logsumexp(logits / T)``."""

    name, uses = "energy", LOGITS

    @dataclass(frozen=True, kw_only=True)
    class Options(Score.Options):
        temperature: float = option(1.0, "T (the paper's default 1)")

    def __init__(self, *, temperature: float = 1.0) -> None:
        super().__init__()
        self.temperature = positive_number(temperature, "temperature")

    def __call__(self, outputs: Outputs) -> Tensor:
        return -self.temperature * torch.logsumexp(outputs.logits / self.temperature, dim=-1)
