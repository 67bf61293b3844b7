"""Scores of where the head's input lies against the linear head's class vectors ``w_c`` (and bias ``b_c``).

With ``h`` the head's input, ``l = W h + b`` the logits, ``y = argmax_c l_c`` the predicted class and ``mu`` the
mean of the training features (one pass of running sums):

- ``max-cosine``: ``-max_c cos(h, w_c)``, the angle to the closest class vector (the cosine classifier's
  confidence, e.g. Techapanurak et al., ACCV 2020, read off an ordinary linear head).
- ``fdbd`` (Liu & Qin, ICML 2024): ``-(1 / (C - 1)) sum_{c != y} |l_y - l_c| / ||w_y - w_c||``, the mean distance
  to the decision boundaries, divided by ``||h - mu||``.
- ``nci`` (Liu & Qin, CVPR 2025): ``-cos(h - mu, w_y) ||w_y|| - alpha ||h||_1``, the alignment of the centred
  features with the predicted class's vector (the inner product over the centred norm), and their L1 norm.

``fdbd`` and ``nci`` equal pytorch-ood's ``fDBD`` and ``NCI``; ``max-cosine`` has no peer there.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.ood.base import Outputs
    >>> from posthoc.ood.head_geometry import MaxCosine
    >>> head = nn.Linear(2, 2, bias=False)
    >>> _ = head.weight.data.copy_(torch.eye(2))
    >>> features = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    >>> MaxCosine()(Outputs(features=features, logits=head(features), head=head))
    tensor([-1.0000, -0.7071])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posthoc.core.checks import non_negative
from posthoc.core.options import option
from posthoc.ood.base import FeatureMean, Outputs, Score, linear_head


class MaxCosine(Score):
    """The negated largest cosine between the head's input and a class vector."""

    name, uses = "max-cosine", frozenset({"features"})

    def __call__(self, outputs: Outputs) -> Tensor:
        weight, _ = linear_head(outputs.head)
        features = outputs.features
        unit = features / features.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        directions = weight / weight.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return -(unit @ directions.to(unit).T).max(-1).values


class FDBD(FeatureMean):
    """fDBD: the mean distance to the other classes' decision boundaries over the distance to the training mean."""

    name = "fdbd"

    def reset(self) -> None:
        super().reset()
        self.boundary_norms: Tensor | None = None

    def update(self, outputs: Outputs, labels: Tensor | None, pass_index: int) -> None:
        super().update(outputs, labels, pass_index)
        if self.boundary_norms is None:
            weight = linear_head(outputs.head)[0].double()
            distances = torch.cdist(weight, weight, compute_mode="donot_use_mm_for_euclid_dist")
            #: ``||w_c - w_c'||``, 1 on the diagonal (whose margin is 0)
            self.boundary_norms = distances.fill_diagonal_(1.0)

    def __call__(self, outputs: Outputs) -> Tensor:
        self.check_fitted()
        logits, features = outputs.logits, outputs.features
        top, predicted = logits.max(-1)
        margins = (top[:, None] - logits) / self.boundary_norms.to(logits)[predicted]
        spread = (features - self.mean.to(features)).norm(dim=-1).clamp_min(1e-8)
        return -margins.sum(-1) / ((logits.shape[-1] - 1) * spread)


class NCI(FeatureMean):
    """NCI: the centred features' alignment with the predicted class's vector, plus ``alpha`` times their L1 norm."""

    name = "nci"

    @dataclass(frozen=True, kw_only=True)
    class Options(Score.Options):
        alpha: float = option(0.0, "the weight of the L1 norm of the features (tuned per model in the paper)")

    def __init__(self, *, alpha: float = 0.0) -> None:
        self.alpha = non_negative(alpha, "alpha")
        super().__init__()

    def __call__(self, outputs: Outputs) -> Tensor:
        self.check_fitted()
        weight, _ = linear_head(outputs.head)
        features = outputs.features
        centred = features - self.mean.to(features)
        vectors = weight.to(features)[outputs.logits.argmax(-1)]
        alignment = (centred * vectors).sum(-1) / centred.norm(dim=-1)
        return -alignment - self.alpha * features.abs().sum(-1)
