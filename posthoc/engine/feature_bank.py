"""A bank of unit-normalised training features and the distance of a query to its k-th nearest row.

The distance of an example's normalised features to the ``k``-th nearest normalised training feature is a strong,
assumption-free density signal (Sun et al., ICML 2022), read by the OOD score ``"knn"`` and by ``"dac"``.
:func:`kth_distance` is exact (the winner's distance recomputed in float64: ``1 - cos`` loses digits near 0), and
:class:`Reservoir` keeps a uniform random subset of a stream of rows (the smallest random priorities stay, also
across ranks).

Example:
    >>> from posthoc.engine.feature_bank import rows_within
    >>> rows_within([64, 32, 16], 64 * 2**20)
    149796
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from posthoc.core.chunks import chunks
from posthoc.engine.runner import gather_rows

FLOAT32_BYTES = 4


def normalised(features: Tensor) -> Tensor:
    """Rows scaled to unit Euclidean norm (a zero row stays zero), in float32."""
    features = features.detach().float()
    return features / features.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def kth_distance(queries: Tensor, bank: Tensor, k: int, *, max_memory: int | None = None) -> Tensor:
    """Euclidean distance ``(B,)`` of each normalised query ``(B, D)`` to its ``k``-th nearest row of ``bank (N, D)``.

    ``k`` must be at most ``N``; the result is float64. ``max_memory`` bounds one block of similarities.

    Example:
        >>> import torch
        >>> from posthoc.engine.feature_bank import kth_distance, normalised
        >>> bank = normalised(torch.eye(3))
        >>> kth_distance(bank[:1], bank, k=2)
        tensor([1.4142], dtype=torch.float64)
    """
    queries = queries.to(bank.dtype)  # the bank follows the module's dtype (float32 unless moved with .to)
    best = queries.new_full((queries.shape[0], k), -float("inf"))
    best_index = torch.zeros(queries.shape[0], k, dtype=torch.long, device=queries.device)
    for rows in chunks(bank.shape[0], FLOAT32_BYTES * queries.shape[0], max_memory=max_memory):
        top, picked = (queries @ bank[rows].T).topk(min(k, rows.stop - rows.start), dim=1)
        if rows.start == 0 and rows.stop - rows.start >= k:
            best, best_index = top, picked
            continue
        best, order = torch.cat([best, top], dim=1).topk(k, dim=1)
        best_index = torch.cat([best_index, picked + rows.start], dim=1).gather(1, order)
    kth = bank[best_index[:, -1]]
    return (queries.double() - kth.double()).norm(dim=-1)


def rows_within(widths: Sequence[int], max_bytes: int) -> int:
    """How many float32 rows of features of ``widths`` fit in ``max_bytes`` (at least 1)."""
    return max(1, int(max_bytes) // (FLOAT32_BYTES * max(1, sum(int(w) for w in widths))))


class Reservoir:
    """A uniform random subset of at most ``capacity`` rows of a stream, kept in one pass.

    ``add(rows)`` takes a batch ``(B, D)``; :meth:`rows` is the kept subset and :attr:`seen` the rows offered.

    Example:
        >>> import torch
        >>> from posthoc.engine.feature_bank import Reservoir
        >>> reservoir = Reservoir(100, torch.Generator().manual_seed(0))
        >>> for _ in range(10):
        ...     reservoir.add(torch.randn(64, 8))
        >>> reservoir.rows().shape, reservoir.seen
        (torch.Size([100, 8]), 640)
    """

    def __init__(self, capacity: int, generator: torch.Generator) -> None:
        self.capacity = int(capacity)
        self.generator = generator
        self.seen = 0
        self._rows: Tensor | None = None
        self._keys: Tensor | None = None

    def add(self, rows: Tensor) -> None:
        keys = torch.rand(rows.shape[0], generator=self.generator, device=self.generator.device).to(rows.device)
        self.seen += rows.shape[0]
        if self._rows is None:
            self._rows, self._keys = rows[:0].clone(), keys[:0]
        assert self._keys is not None
        free = self.capacity - self._rows.shape[0]
        if free > 0:  # still filling: keep the first rows outright
            self._rows = torch.cat([self._rows, rows[:free]])
            self._keys = torch.cat([self._keys, keys[:free]])
            rows, keys = rows[free:], keys[free:]
        if rows.shape[0] == 0:
            return
        # full: a new row replaces a kept one when its priority is among the `capacity` smallest
        winners = torch.cat([self._keys, keys]).topk(self.capacity, largest=False).indices
        new = winners[winners >= self.capacity] - self.capacity
        if new.numel() == 0:
            return
        kept = torch.zeros(self.capacity, dtype=torch.bool, device=rows.device)
        kept[winners[winners < self.capacity]] = True
        slots = (~kept).nonzero().squeeze(1)
        self._rows[slots] = rows[new]
        self._keys[slots] = keys[new]

    def rows(self) -> Tensor:
        """The kept rows ``(min(capacity, seen), D)``; every rank's reservoirs merged under ``torch.distributed``."""
        if self._rows is None:
            raise ValueError("the reservoir has seen no rows")
        rows, keys = gather_rows(self._rows), gather_rows(self._keys)  # themselves in one process
        if rows.shape[0] <= self.capacity:
            return rows
        return rows[keys.topk(self.capacity, largest=False).indices]
