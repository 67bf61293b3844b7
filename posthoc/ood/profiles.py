"""Scores against a typical profile of each class, summed in one pass over the training data.

- ``she`` (Simplified Hopfield Energy, Zhang et al., ICLR 2023): ``S_c`` is the mean head input of the training
  examples of class ``c`` that the model classifies correctly; the score is ``-h^T S_y`` for the predicted class
  ``y``. It reads the labels.
- ``kl-matching`` (Hendrycks et al., ICML 2022): ``d_k`` is the mean softmax of the training examples the model
  predicts as ``k`` (no labels); the score is ``min_k KL(p(x) || d_k)`` over the classes predicted at least once.

Both equal pytorch-ood's ``SHE`` and ``KLMatching`` (which fits KL matching on whatever data it is given; here the
training loader of ``fit``).

Example:
    >>> import torch
    >>> from posthoc.ood.base import Outputs
    >>> from posthoc.ood.profiles import KLMatching
    >>> logits = torch.tensor([[4.0, 0.0], [0.0, 4.0], [3.0, 1.0]])
    >>> score = KLMatching()
    >>> score.update(Outputs(logits=logits), None, 0); score.finish(0)
    >>> score(Outputs(logits=logits)).shape
    torch.Size([3])
"""

from __future__ import annotations

import torch
from torch import Tensor

from posthoc.core import distributed
from posthoc.errors import InputError
from posthoc.ood.base import Outputs, Score, running_sum


class SHE(Score):
    """Simplified Hopfield energy: the inner product with the predicted class's mean correctly classified feature."""

    name, uses, fit_passes, needs_labels = "she", frozenset({"features", "logits"}), 1, True

    def reset(self) -> None:
        super().reset()
        self._sums: dict[str, Tensor] = {}

    def update(self, outputs: Outputs, labels: Tensor | None, pass_index: int) -> None:
        features, logits = outputs.features.detach().double(), outputs.logits.detach()
        correct = logits.argmax(-1) == labels
        classes = logits.shape[-1]
        running_sum(
            self._sums,
            "features",
            features.new_zeros(classes, features.shape[-1]).index_add_(0, labels[correct], features[correct]),
        )
        running_sum(
            self._sums,
            "count",
            features.new_zeros(classes).index_add_(0, labels[correct], features.new_ones(int(correct.sum()))),
        )

    def finish(self, pass_index: int) -> None:
        sums = {name: distributed.all_reduce_sum(value) for name, value in self._sums.items()}
        self._sums = {}
        empty = (sums["count"] == 0).nonzero().flatten().tolist()
        if empty:
            raise InputError(
                f"the OOD score 'she' averages the correctly classified training examples of each class, but the "
                f"model classifies none of class(es) {empty[:10]} correctly; fit on a training loader with examples "
                "of every class that the model gets right"
            )
        self.patterns = sums["features"] / sums["count"][:, None]
        self.fitted = True

    def __call__(self, outputs: Outputs) -> Tensor:
        self.check_fitted()
        features = outputs.features
        return -(features * self.patterns.to(features)[outputs.logits.argmax(-1)]).sum(-1)


class KLMatching(Score):
    """KL divergence of the softmax to the closest mean softmax of a predicted class."""

    name, uses, fit_passes = "kl-matching", frozenset({"logits"}), 1

    def reset(self) -> None:
        super().reset()
        self._sums: dict[str, Tensor] = {}

    def update(self, outputs: Outputs, labels: Tensor | None, pass_index: int) -> None:
        probs = outputs.logits.detach().double().softmax(-1)
        predicted = probs.argmax(-1)
        running_sum(
            self._sums, "probs", torch.zeros_like(probs[0]).repeat(probs.shape[-1], 1).index_add_(0, predicted, probs)
        )
        running_sum(
            self._sums,
            "count",
            probs.new_zeros(probs.shape[-1]).index_add_(0, predicted, probs.new_ones(probs.shape[0])),
        )

    def finish(self, pass_index: int) -> None:
        sums = {name: distributed.all_reduce_sum(value) for name, value in self._sums.items()}
        self._sums = {}
        predicted = sums["count"] > 0
        typical = sums["probs"][predicted] / sums["count"][predicted, None]
        #: ``log d_k`` of the classes predicted in training, ``-inf`` (a probability 0) as the most negative float
        self.log_typical = typical.log().clamp_min(torch.finfo(typical.dtype).min)
        self.fitted = True

    def __call__(self, outputs: Outputs) -> Tensor:
        self.check_fitted()
        probs = outputs.logits.double().softmax(-1)
        divergence = torch.special.xlogy(probs, probs).sum(-1, keepdim=True) - probs @ self.log_typical.T
        return divergence.min(-1).values.to(outputs.logits.dtype)
