"""Density-aware calibration as a plain module: the feature banks and the fitted temperature map in buffers.

The temperature map is that of ``um.predict`` (:mod:`posthoc.methods.dac.temperature`), the nearest bank rows found
in one product with the bank (a fixed program, where ``predict`` plans blocks of the bank under its memory budget).

Example:
    >>> from posthoc.methods.dac.export import DensityTemperature
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.export.modules import Backbone, Plain
    >>> backbone = Backbone(nn.Sequential(nn.Linear(4, 3)))
    >>> tap = backbone.add_tap("0", "input")
    >>> bank = torch.nn.functional.normalize(torch.randn(20, 4), dim=-1)
    >>> one = torch.ones(1)
    >>> module = DensityTemperature(Plain(backbone), backbone, [tap], [bank], 2, one * -1, one, one, one)
    >>> module(torch.randn(5, 4))[0].exp().sum(-1).shape
    torch.Size([5])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from posthoc.engine.feature_bank import normalised
from posthoc.export.modules import Backbone, cast
from posthoc.methods.dac.layers import pooled
from posthoc.methods.dac.temperature import MIN_DISTANCE, excess, temperatures, tempered


class DensityTemperature(nn.Module):
    """A density-aware temperature stacked on the ``inner`` predictive (see module docs)."""

    def __init__(
        self,
        inner: nn.Module,
        backbone: Backbone,
        taps: list[int],
        banks: list[Tensor],
        k: int,
        anchors: Tensor,
        spreads: Tensor,
        temperature: Tensor,
        weights: Tensor,
    ) -> None:
        super().__init__()
        self.inner, self.backbone, self.taps, self.k = inner, backbone, list(taps), k
        for index, bank in enumerate(banks):
            self.register_buffer(f"bank{index}", bank)
        self.register_buffer("anchors", anchors)
        self.register_buffer("spreads", spreads)
        self.register_buffer("temperature", temperature)
        self.register_buffer("weights", weights)

    def log_distance(self, features: Tensor, bank: Tensor) -> Tensor:
        """``log d`` ``(N,)``: the distance of the normalised ``features`` to their ``k``-th nearest ``bank`` row."""
        queries = normalised(pooled(features, features.shape[0]))
        nearest = (cast(queries, bank.dtype) @ bank.T).topk(self.k, dim=1).indices[:, -1]
        distance = (queries.double() - bank[nearest].double()).square().sum(-1).sqrt()
        return distance.clamp_min(MIN_DISTANCE).log().float()

    def forward(self, x: Any) -> tuple[Tensor, Tensor | None]:
        log_probs, samples = self.inner(x)
        banks = [getattr(self, f"bank{index}") for index in range(len(self.taps))]
        log_d = torch.stack(
            [self.log_distance(self.backbone.tapped(tap), bank) for tap, bank in zip(self.taps, banks)], 1
        )
        t = temperatures(excess(log_d, self.anchors, self.spreads), self.temperature, self.weights)
        return tempered(log_probs if samples is None else samples, t)
