"""A member's own data order: the same loader, reshuffled with the member's seed (MultiSWAG's runs).

Example:
    >>> from posthoc.methods.ensemble.data_order import reshuffled
    >>> from posthoc_apps.demo.examples import train_loader
    >>> from torch.utils.data import DataLoader
    >>> reshuffled(DataLoader(train_loader.dataset, batch_size=64), seed=3).sampler
    <torch.utils.data.sampler.RandomSampler object at ...>
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler


def reshuffled(loader: Iterable | None, seed: int) -> Iterable | None:
    """``loader`` drawing its examples in a random order seeded by ``seed``; only a ``DataLoader`` over a map-style
    dataset with a batch size and no ``DistributedSampler`` can be, any other iterable is returned as it is."""
    if (
        not isinstance(loader, DataLoader)
        or isinstance(loader.dataset, IterableDataset)
        or loader.batch_size is None
        or isinstance(loader.sampler, DistributedSampler)
    ):
        return loader
    sampler = RandomSampler(loader.dataset, generator=torch.Generator().manual_seed(seed))
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        drop_last=loader.drop_last,
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers,
    )
