"""The units of a regressor's targets, which Laplace's prior search is standardised to.

A network trained on targets ``c`` times larger has an optimal prior precision ``c²`` times smaller, so the prior
is searched in units of the targets' spread, rounded to a power of ten (standardised data keep the plain range
exactly). :class:`TargetMoments` reads the spread as the curvature pass reads the targets, at no extra pass.

Example:
    >>> import torch
    >>> from posthoc.methods.laplace.units import TargetMoments
    >>> moments = TargetMoments([(torch.zeros(4, 2), torch.tensor([1.0, 3.0, 1.0, 3.0]))])
    >>> _ = list(moments); moments.decade()
    1.0
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from posthoc.core.inputs import split_batch
from posthoc.engine.runner import sum_over_ranks


class TargetMoments:
    """An iterable passing ``loader``'s batches through unchanged and summing their real targets' moments.

    Batches whose targets are not a tensor are passed on unrecorded (the loader's own checks refuse them).
    """

    def __init__(self, loader: Iterable) -> None:
        self.loader = loader
        #: count, Σ y², Σ (y - its batch's mean)² over every target value
        self.sums = torch.zeros(3, dtype=torch.float64)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            try:
                _, y = split_batch(batch)
            except Exception:  # noqa: BLE001  (a malformed batch is the loader checks' to refuse, with their message)
                y = None
            if isinstance(y, Tensor) and y.numel() and not y.is_complex():
                values = y.detach().to("cpu", torch.float64).reshape(len(y), -1)
                centred = values - values.mean(0)  # per batch and output: an offset is no spread
                self.sums += torch.tensor(
                    [values.numel(), float(values.square().sum()), float(centred.square().sum())], dtype=torch.float64
                )
            yield batch

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        """The wrapped loader's attributes (its ``sampler``, ``dataset``, ...)."""
        return getattr(self.__dict__["loader"], name)

    def decade(self) -> float:
        """The power of ten nearest the targets' spread (the root mean square deviation from each batch's mean, over
        every rank; batches of one row: the root mean square), or ``1.0`` when all targets are 0."""
        count, square, centred = sum_over_ranks(self.sums).tolist()
        spread = math.sqrt((centred if centred > 0 else square) / count) if count else 0.0
        return 10.0 ** round(math.log10(spread)) if spread > 0 and math.isfinite(spread) else 1.0
