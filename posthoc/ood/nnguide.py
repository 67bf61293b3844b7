"""``"nnguide"``: the energy guided by the nearest training features (Park et al., ICCV 2023).

The bank holds each training example's unit-normalised head input scaled by its ``log sum_c exp f_c``. The guidance
of an input is the mean of its ``k`` largest inner products (unit-normalised) with the bank, and the score is
``-guidance * log sum_c exp f_c(x)``, as pytorch-ood's ``NNGuide`` (the paper's confidence, negated). The bank is
``4 N D`` bytes (the paper fits on a random subset of a large training set); under ``torch.distributed`` every rank
gathers all of it. The similarities are taken in blocks of at most ``max_memory`` bytes.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.ood.base import Outputs
    >>> from posthoc.ood.nnguide import NNGuide
    >>> head = nn.Linear(16, 3)
    >>> features = torch.randn(64, 16)
    >>> outputs = Outputs(features=features, logits=head(features).detach(), head=head)   # one batch of the model
    >>> score = NNGuide(k=5)
    >>> score.update(outputs, None, 0); score.finish(0)
    >>> score(outputs).shape
    torch.Size([64])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posthoc.core.chunks import chunks
from posthoc.core.options import option
from posthoc.engine.feature_bank import FLOAT32_BYTES, normalised
from posthoc.ood.base import Outputs
from posthoc.ood.knn import KNN


class NNGuide(KNN):
    """The log-sum-exp of the logits times the mean similarity to the ``k`` closest energy-scaled training features
    (the bank, its fit and its ``k`` check are those of ``"knn"``)."""

    name, uses, tasks = "nnguide", frozenset({"features", "logits"}), frozenset({"classification"})

    @dataclass(frozen=True, kw_only=True)
    class Options(KNN.Options):
        k: int = option(10, "how many of the most similar training features the guidance averages")

    def __init__(self, *, k: int = 10, max_memory: int | None = None) -> None:
        super().__init__(k=k, max_memory=max_memory)

    def update(self, outputs: Outputs, labels: Tensor | None, pass_index: int) -> None:
        scale = torch.logsumexp(outputs.logits.detach().float(), dim=-1, keepdim=True)
        self._parts.append(normalised(outputs.features) * scale)

    def __call__(self, outputs: Outputs) -> Tensor:
        self.check_fitted()
        queries = normalised(outputs.features).to(self.bank)
        best = queries.new_full((queries.shape[0], 0), -float("inf"))
        for rows in chunks(self.bank.shape[0], FLOAT32_BYTES * queries.shape[0], max_memory=self.max_memory):
            best = torch.cat([best, queries @ self.bank[rows].T], dim=1)
            best = best.topk(min(self.k, best.shape[1]), dim=1).values
        guidance = best.mean(-1)
        return -(guidance * torch.logsumexp(outputs.logits.to(guidance), dim=-1)).to(outputs.logits.dtype)
