"""Activation shaping: scores that reshape the head's input (or its weights) and read the energy of what the head
then gives. No backbone runs again: the features of the one forward pass are reshaped and the head alone is re-run.

With ``h`` the head's input (``D`` values per example), ``k = D - round(D percentile)`` the number of activations
above the fraction ``percentile`` and ``E(l) = -log sum_c exp(l_c)``:

- ``ash`` (Djurisic et al., ICLR 2023): keep the ``k`` largest activations, zero the rest; variant ``"p"`` keeps
  them, ``"b"`` sets each to ``s1 / k``, ``"s"`` multiplies them by ``exp(s1 / s2)`` (``s1``: the sum of ``h``,
  ``s2``: the sum kept); the score is ``E(head(ash(h)))``.
- ``scale`` (Xu et al., ICLR 2024): ``E(head(h exp(s1 / s2)))``, nothing pruned (``s2``: the sum of the top ``k``).
- ``lts`` (Djurisic et al., 2025): the logits times ``(sum relu(h) / sum of the top k' of relu(h))^2``, with
  ``k' = max(1, D - round(D (1 - p)))``.
- ``react`` (Sun et al., NeurIPS 2021): ``E(head(min(h, t)))``, ``t`` the ``clip_quantile`` quantile of every
  training activation.
- ``dice`` (Sun & Li, ECCV 2022): the head's weights ``w_cd`` kept where their contribution ``mean_train(h_d) w_cd``
  exceeds its ``sparsity`` quantile, zeroed elsewhere; ``E`` of the sparsified head's logits.

They equal pytorch-ood's ``ASH``, ``SCALE``, ``LTS``, ``ReAct`` and ``DICE`` with their default energy (on features
given as ``D x 1 x 1`` maps where it asks for maps). ``react`` keeps the training features (``4 N D`` bytes) for its
exact quantile; ``dice`` keeps only their sum.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.ood.base import Outputs
    >>> from posthoc.ood.shaping import ASH
    >>> head = nn.Linear(16, 3)
    >>> features = torch.rand(8, 16)
    >>> ASH(variant="p", percentile=0.5)(Outputs(features=features, logits=head(features), head=head)).shape
    torch.Size([8])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from posthoc.core import distributed
from posthoc.core.checks import fraction
from posthoc.core.options import option
from posthoc.errors import ConfigError
from posthoc.ood.base import FeatureMean, Outputs, Score, energy, linear_head

FEATURES = frozenset({"features"})
ASH_VARIANTS = ("p", "b", "s")


def quantile(values: Tensor, q: float) -> Tensor:
    """The ``q`` quantile of ``values`` along its first dimension, interpolated linearly between order statistics
    (numpy's default); unlike ``torch.quantile``, for any number of values.

    Example:
        >>> import torch
        >>> from posthoc.ood.shaping import quantile
        >>> quantile(torch.tensor([[1.0], [2.0], [4.0]]), 0.75)
        tensor([3.])
    """
    ordered = values.sort(dim=0).values
    position = q * (values.shape[0] - 1)
    below = int(position)
    above = min(below + 1, values.shape[0] - 1)
    return ordered[below] + (position - below) * (ordered[above] - ordered[below])


def kept_count(width: int, percentile: float, score: str) -> int:
    """How many of ``width`` activations lie above the fraction ``percentile``; at least one."""
    kept = width - round(width * percentile)
    if kept < 1:
        raise ConfigError(
            f"the OOD score '{score}' with percentile={percentile} keeps none of the {width} features; "
            f"pass percentile= below {1 - 0.5 / width:.4f}"
        )
    return kept


class ShapedEnergy(Score):
    """The energy of the head's output once :meth:`logits` has reshaped its input or its weights."""

    uses = FEATURES

    def logits(self, outputs: Outputs) -> Tensor:
        """The head's logits after shaping."""
        raise NotImplementedError

    def __call__(self, outputs: Outputs) -> Tensor:
        self.check_fitted()
        return energy(self.logits(outputs))


class ASH(ShapedEnergy):
    """ASH: prune all but the largest activations, then keep (``p``), binarise (``b``) or rescale (``s``) them."""

    name = "ash"

    @dataclass(frozen=True, kw_only=True)
    class Options(Score.Options):
        variant: Literal[ASH_VARIANTS] = option(
            "s", "'p' prune, 'b' binarise, 's' prune and rescale (the paper's best)"
        )
        percentile: float = option(0.65, "the fraction of each example's activations set to zero")

    def __init__(self, *, variant: str = "s", percentile: float = 0.65) -> None:
        super().__init__()
        self.variant = variant
        self.percentile = fraction(percentile, "percentile")

    def logits(self, outputs: Outputs) -> Tensor:
        features = outputs.features
        kept, index = features.topk(kept_count(features.shape[-1], self.percentile, self.name), dim=-1)
        total = features.sum(-1, keepdim=True)
        if self.variant == "b":
            kept = (total / kept.shape[-1]).expand_as(kept)
        elif self.variant == "s":
            kept = kept * torch.exp(total / kept.sum(-1, keepdim=True))
        return outputs.head(torch.zeros_like(features).scatter(-1, index, kept))


class Scale(ShapedEnergy):
    """SCALE: every activation times ``exp(sum / sum of the largest)``; none pruned."""

    name = "scale"

    @dataclass(frozen=True, kw_only=True)
    class Options(Score.Options):
        percentile: float = option(0.65, "the fraction of activations left out of the largest ones' sum")

    def __init__(self, *, percentile: float = 0.65) -> None:
        super().__init__()
        self.percentile = fraction(percentile, "percentile")

    def logits(self, outputs: Outputs) -> Tensor:
        features = outputs.features
        top = features.topk(kept_count(features.shape[-1], self.percentile, self.name), dim=-1).values
        return outputs.head(features * torch.exp(features.sum(-1, keepdim=True) / top.sum(-1, keepdim=True)))


class LogitScaling(ShapedEnergy):
    """LTS: the logits times the squared ratio of the rectified activations' sum to the sum of the largest ones."""

    name = "lts"

    @dataclass(frozen=True, kw_only=True)
    class Options(Score.Options):
        p: float = option(0.05, "the fraction of the largest activations in the ratio's denominator")

    def __init__(self, *, p: float = 0.05) -> None:
        super().__init__()
        self.p = fraction(p, "p")

    def logits(self, outputs: Outputs) -> Tensor:
        rectified = outputs.features.relu()
        width = rectified.shape[-1]
        top = rectified.topk(max(1, width - round(width * (1 - self.p))), dim=-1).values
        factor = (rectified.sum(-1, keepdim=True) / top.sum(-1, keepdim=True)).square()
        return outputs.head(outputs.features) * factor


class ReAct(ShapedEnergy):
    """ReAct: activations clipped at a high quantile of the training activations."""

    name, fit_passes = "react", 1

    @dataclass(frozen=True, kw_only=True)
    class Options(Score.Options):
        clip_quantile: float = option(0.9, "the quantile of the training activations where they are clipped")

    def __init__(self, *, clip_quantile: float = 0.9) -> None:
        self.clip_quantile = fraction(clip_quantile, "clip_quantile")
        super().__init__()

    def reset(self) -> None:
        super().reset()
        self._parts: list[Tensor] = []
        self.threshold: Tensor | None = None

    def update(self, outputs: Outputs, labels: Tensor | None, pass_index: int) -> None:
        self._parts.append(outputs.features.detach().reshape(-1))

    def finish(self, pass_index: int) -> None:
        activations = distributed.gather_cat(torch.cat(self._parts))
        self._parts = []
        self.threshold = quantile(activations.double()[:, None], self.clip_quantile)[0]
        self.fitted = True

    def logits(self, outputs: Outputs) -> Tensor:
        return outputs.head(outputs.features.clamp(max=self.threshold.to(outputs.features)))


class DICE(FeatureMean, ShapedEnergy):
    """DICE: the head's weights sparsified to those whose mean training contribution is largest."""

    name, uses = "dice", FEATURES

    @dataclass(frozen=True, kw_only=True)
    class Options(Score.Options):
        sparsity: float = option(0.7, "the fraction of the head's weights set to zero (the paper's p; 0.7 on ImageNet)")

    def __init__(self, *, sparsity: float = 0.7) -> None:
        self.sparsity = fraction(sparsity, "sparsity")
        super().__init__()

    def update(self, outputs: Outputs, labels: Tensor | None, pass_index: int) -> None:
        super().update(outputs, labels, pass_index)
        self.weight, self.bias = linear_head(outputs.head)

    def finish(self, pass_index: int) -> None:
        super().finish(pass_index)
        contribution = self.mean.to(self.weight.dtype) * self.weight
        threshold = quantile(contribution.reshape(-1, 1), self.sparsity)[0]
        self.masked_weight = torch.where(contribution > threshold, self.weight, torch.zeros_like(self.weight))

    def logits(self, outputs: Outputs) -> Tensor:
        features = outputs.features
        return features @ self.masked_weight.to(features).T + self.bias.to(features)
