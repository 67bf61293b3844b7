"""``"knn"``: distance to the k-th nearest training feature, on unit-normalised features (Sun et al., ICML 2022).

``z = phi / ||phi||``; the score is ``||z - z_(k)||``, the Euclidean distance to the ``k``-th nearest normalised
training feature, as pytorch-ood's ``KNN`` (``normalize=True``). The search is exact
(:func:`posthoc.engine.feature_bank.kth_distance`, shared with ``"dac"``). The training features are kept as a float32
bank of ``4 N D`` bytes (on a large set, fit on a random subset, as the paper does with 1% of ImageNet); under
``torch.distributed`` every rank gathers the whole bank.

Example:
    >>> import torch
    >>> from posthoc.ood.base import Outputs
    >>> from posthoc.ood.knn import KNN
    >>> outputs = Outputs(features=torch.randn(64, 16), logits=torch.randn(64, 3))   # one batch of the model
    >>> score = KNN(k=5)
    >>> score.update(outputs, None, 0); score.finish(0)
    >>> score(outputs).shape
    torch.Size([64])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posthoc.core import distributed
from posthoc.core.checks import memory_bytes, positive_int
from posthoc.core.options import option
from posthoc.engine.feature_bank import kth_distance, normalised
from posthoc.errors import InputError
from posthoc.ood.base import Outputs, Score


class KNN(Score):
    """Distance to the ``k``-th nearest neighbour among the normalised training features."""

    name, uses, fit_passes = "knn", frozenset({"features"}), 1
    tasks = frozenset({"classification", "regression"})

    @dataclass(frozen=True, kw_only=True)
    class Options(Score.Options):
        k: int = option(50, "which neighbour (the paper's 50 on CIFAR-10; 1000 on 1% of ImageNet)")
        max_memory: int | None = option(None, "bytes of similarities one scoring step may hold")

    def __init__(self, *, k: int = 50, max_memory: int | None = None) -> None:
        self.k = positive_int(k, "k")
        self.max_memory = memory_bytes(max_memory)
        super().__init__()

    def reset(self) -> None:
        super().reset()
        self._parts: list[Tensor] = []
        self.bank: Tensor | None = None

    def update(self, outputs: Outputs, labels: Tensor | None, pass_index: int) -> None:
        self._parts.append(normalised(outputs.features))

    def finish(self, pass_index: int) -> None:
        bank = distributed.gather_cat(torch.cat(self._parts))
        self._parts = []
        if bank.shape[0] < self.k:
            raise InputError(
                f"the {self.name} score's k={self.k} exceeds the {bank.shape[0]} training examples; "
                f"pass k= at most {bank.shape[0]} or fit on more data"
            )
        self.bank = bank
        self.fitted = True

    def __call__(self, outputs: Outputs) -> Tensor:
        self.check_fitted()
        distance = kth_distance(normalised(outputs.features), self.bank, self.k, max_memory=self.max_memory)
        return distance.to(outputs.features.dtype)
