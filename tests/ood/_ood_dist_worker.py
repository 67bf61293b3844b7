"""Worker process for the distributed test of tests/ood/test_ood.py (gloo on loopback); not a test module."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset

import posthoc
from posthoc_apps.demo import data, zoo

#: rank 0 gets more examples (and batches) than rank 1: uneven shards must not hang
SHARD_SIZES = (350, 250)
#: every score with training statistics: sums reduced over ranks, banks and kept features gathered
SCORES = [
    "mahalanobis",
    "relative-mahalanobis",
    "vim",
    "knn",
    "nnguide",
    "react",
    "dice",
    "fdbd",
    "nci",
    "she",
    "kl-matching",
    "openmax",
]


def shards(dataset):
    bounds = [0, SHARD_SIZES[0], SHARD_SIZES[0] + SHARD_SIZES[1]]
    return [Subset(dataset, range(bounds[i], bounds[i + 1])) for i in range(2)]


def run(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        splits = data.load_digits()
        det = posthoc.detector(zoo.pretrained(), score=SCORES, k=10)
        det.fit(DataLoader(shards(splits.fit)[rank], batch_size=64), progress=False)
        torch.save(det.scores(splits.test.tensors[0][:50]), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
