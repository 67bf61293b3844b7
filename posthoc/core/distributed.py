"""Fitting and evaluating across processes on ``torch.distributed`` (the existing engine).

Every rank streams its own shard; statistics are reduced with one collective *after* each rank's loop, so ranks with
different numbers of batches never hang, and every rank ends with the posterior of one process on all the shards.

Example (inside each rank, after ``torch.distributed.init_process_group``)::

    sampler = DistributedSampler(val_set)          # num_replicas = world size
    um = posthoc.wrap(model, method="temperature").fit(val_loader=DataLoader(val_set, sampler=sampler))
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DistributedSampler

from posthoc.errors import InputError

#: how many :func:`local_only` blocks are open (inside one, this process works as if alone)
_local_depth = 0


def active() -> bool:
    """Whether a ``torch.distributed`` process group with more than one rank is initialised (and no
    :func:`local_only` block is open)."""
    return _local_depth == 0 and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextmanager
def local_only() -> Iterator[None]:
    """Work as a single process inside the block (an ensemble member fitted on one rank): no collective runs.

    Example:
        >>> from posthoc.core.distributed import active, local_only
        >>> with local_only():
        ...     active()
        False
    """
    global _local_depth
    _local_depth += 1
    try:
        yield
    finally:
        _local_depth -= 1


def broadcast_object(value: Any, src: int) -> Any:
    """``value`` as rank ``src`` holds it, on every rank (pickled; tensors should be on the CPU)."""
    if not active():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src, device=_collective_device(torch.empty(0)))
    return box[0]


def world_size() -> int:
    """The number of ranks taking part (1 without torch.distributed)."""
    return dist.get_world_size() if active() else 1


def check_loader(loader: Iterable) -> None:
    """Refuse a loader whose ``DistributedSampler`` was built for another world size or rank."""
    sampler = getattr(loader, "sampler", None)
    if not active() or not isinstance(sampler, DistributedSampler):
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    if sampler.num_replicas != world or sampler.rank != rank:
        raise InputError(
            f"the loader's DistributedSampler shards for {sampler.num_replicas} replicas (rank {sampler.rank}) "
            f"but the process group has world size {world} (this is rank {rank}); build the sampler after "
            "init_process_group, or pass num_replicas=world_size, rank=rank"
        )


def _collective_device(tensor: Tensor) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """Sum ``tensor`` over ranks (a no-op in a single process); returns the summed tensor."""
    if not active():
        return tensor
    work = tensor.to(_collective_device(tensor))
    dist.all_reduce(work, op=dist.ReduceOp.SUM)
    return work.to(tensor.device)


def total_examples(count: int) -> int:
    """``count`` summed over ranks: the examples of every rank's shard together (``count`` in one process)."""
    if not active():
        return count
    return int(all_reduce_sum(torch.tensor(float(count), dtype=torch.float64)).item())


def gather_cat(tensor: Tensor, dim: int = 0) -> Tensor:
    """Concatenate ``tensor`` from all ranks along ``dim``, in rank order (sizes may differ)."""
    if not active():
        return tensor
    device = _collective_device(tensor)
    size = torch.tensor([tensor.shape[dim]], device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    largest = int(max(s.item() for s in sizes))
    padded_shape = list(tensor.shape)
    padded_shape[dim] = largest
    padded = torch.zeros(padded_shape, dtype=tensor.dtype, device=device)
    padded.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    parts = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([part.narrow(dim, 0, int(s.item())) for part, s in zip(parts, sizes)], dim).to(tensor.device)


def rank_offset(count: int) -> int:
    """How many examples the ranks before this one hold: where this rank's rows start in a :func:`gather_cat`."""
    if not active():
        return 0
    counts = gather_cat(torch.tensor([float(count)], dtype=torch.float64))
    return int(counts[: dist.get_rank()].sum().item())


def common_length(length: int | None, what: str) -> int | None:
    """The smallest number of batches over ranks, so that every rank takes the same optimizer steps (the extra
    batches of longer shards are skipped, as with ``drop_last``)."""
    if not active():
        return length
    if length is None:
        raise InputError(f"{what} under torch.distributed needs loaders with a length (len(loader)) on every rank")
    shortest = torch.tensor([float(length)], device=_collective_device(torch.empty(0)))
    dist.all_reduce(shortest, op=dist.ReduceOp.MIN)
    return int(shortest.item())


def average_gradients(parameters: Iterable[Tensor]) -> None:
    """Average ``.grad`` over ranks in place (what DistributedDataParallel does for a module's parameters)."""
    if not active():
        return
    world = world_size()
    for parameter in parameters:
        if parameter.grad is not None:
            parameter.grad.copy_(all_reduce_sum(parameter.grad) / world)
