"""Fitting ensemble members across ``torch.distributed`` ranks: each member fitted once, then shared (the runner's,
not an ensemble's mathematics).

Member ``i`` is fitted on rank ``i % world_size`` alone (:func:`~posthoc.core.distributed.local_only`), then its
posterior is broadcast, so every rank ends with every member fitted. Each rank therefore needs the whole training
data: loaders sharded by a ``DistributedSampler`` are refused.

Example (inside each rank, after ``torch.distributed.init_process_group``)::

    um = posthoc.wrap([net_a, net_b, net_c, net_d], method="laplace").fit(full_train_loader)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch.distributed as dist
from torch.utils.data import DistributedSampler

from posthoc.core import distributed
from posthoc.core.method import Method
from posthoc.errors import InputError


def owner(index: int, world: int) -> int:
    """The rank that fits member ``index`` of an ensemble on ``world`` ranks (round robin).

    Example:
        >>> from posthoc.engine.ranks_spread import owner
        >>> [owner(i, 2) for i in range(5)]
        [0, 1, 0, 1, 0]
    """
    return index % world


def _refuse_shards(loaders: Iterable[Iterable | None]) -> None:
    for loader in loaders:
        if isinstance(getattr(loader, "sampler", None), DistributedSampler):
            raise InputError(
                "under torch.distributed an ensemble fits each member on one rank over the whole data, but a "
                "loader is sharded by a DistributedSampler; give every rank the full loaders (members, not "
                "data, are spread over the ranks)"
            )


def fit_spread(
    members: Sequence[Method], fit_one: Callable[[int, Method], None], loaders: Iterable[Iterable | None] = ()
) -> None:
    """Call ``fit_one(index, member)`` for every member once, spread over ranks (see module docs)."""
    if not distributed.active():
        for index, member in enumerate(members):
            fit_one(index, member)
        return
    _refuse_shards(loaders)
    rank, world = dist.get_rank(), distributed.world_size()
    with distributed.local_only():
        for index, member in enumerate(members):
            if owner(index, world) == rank:
                fit_one(index, member)
    for index, member in enumerate(members):
        mine = owner(index, world) == rank
        state = {k: v.detach().cpu() for k, v in member.posterior_state().items()} if mine else None
        state = distributed.broadcast_object(state, src=owner(index, world))
        if not mine:
            member.load_posterior_state(state)
            member.fitted.fill_(True)
            member.follow_model_device()
