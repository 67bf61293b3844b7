"""The runner: what every method needs and none writes.

A method is its mathematics: it accumulates statistics, finalises its posterior and predicts on one chunk. Around it,
the runner owns the memory budget (:class:`RunOptions`; a method plans with :mod:`posthoc.core.chunks` and never sees
a byte count), threads (small dense work on one thread), ranks (:func:`sum_over_ranks`, :func:`gather_rows`,
:func:`steps_on_every_rank`) and the held-out choice, made around each ``fit`` by :mod:`posthoc.engine.selection`.

Example:
    >>> import posthoc
    >>> from posthoc.engine.runner import RunOptions
    >>> with RunOptions(max_memory=2**20).scope():
    ...     posthoc.settings.memory_budget()
    1048576
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from posthoc.core import distributed
from posthoc.core.chain import RUN_OPTION_NAMES
from posthoc.core.checks import memory_bytes
from posthoc.core.chunks import budget_scope
from posthoc.core.threads import SMALL_WORK_BYTES, single_thread_if

Statistics = Tensor | Mapping[str, Any] | list | tuple | int | float


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How the runner runs a wrapped model: ``max_memory``, the bytes one chunk of work may hold (``None``:
    ``posthoc.settings.max_memory`` at call time).

    Example:
        >>> from posthoc.engine.runner import RunOptions
        >>> RunOptions.from_spec([{"name": "laplace", "options": {}, "run": {"max_memory": 2**20}}])
        RunOptions(max_memory=1048576)
    """

    max_memory: int | None = None

    def __post_init__(self) -> None:
        memory_bytes(self.max_memory)

    @classmethod
    def from_spec(cls, spec: list[dict[str, Any]]) -> RunOptions:
        """The run options a spec records (``spec[0]["run"]``), or those a file of an earlier release kept among a
        method's options."""
        if not spec:
            return cls()
        found = dict(spec[0].get("run") or {})
        for entry in spec:
            for name in RUN_OPTION_NAMES:
                if entry.get("options", {}).get(name) is not None:
                    found.setdefault(name, entry["options"][name])
        return cls(**{name: found[name] for name in RUN_OPTION_NAMES if name in found})

    def to_spec(self) -> dict[str, Any]:
        """What a spec records (only the options that differ from the defaults)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @contextmanager
    def scope(self, budget: int | None = None) -> Iterator[None]:
        """Run the block under ``budget`` bytes (a ``predict`` call's own), else this run's ``max_memory``."""
        with budget_scope(budget if budget is not None else self.max_memory):
            yield


def split_run_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``options`` of ``wrap`` as (run options, method options).

    Example:
        >>> from posthoc.engine.runner import split_run_options
        >>> split_run_options({"max_memory": 2**20, "hessian": "diag"})
        ({'max_memory': 1048576}, {'hessian': 'diag'})
    """
    run = {k: v for k, v in options.items() if k in RUN_OPTION_NAMES}
    return run, {k: v for k, v in options.items() if k not in RUN_OPTION_NAMES}


def sum_over_ranks(value: Statistics) -> Any:
    """``value`` (a tensor, a number, or a dict / list / tuple of them) summed over the ranks of ``torch.distributed``.

    Example:
        >>> import torch
        >>> from posthoc.engine.runner import sum_over_ranks
        >>> sum_over_ranks({"count": 3, "sums": [torch.ones(2)]})
        {'count': 3, 'sums': [tensor([1., 1.])]}
    """
    if not distributed.active():
        return value
    if isinstance(value, Tensor):
        return distributed.all_reduce_sum(value)
    if isinstance(value, Mapping):
        return {key: sum_over_ranks(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(sum_over_ranks(item) for item in value)
    if isinstance(value, (bool, int, float)):
        total = distributed.all_reduce_sum(torch.tensor(float(value), dtype=torch.float64)).item()
        return type(value)(round(total)) if isinstance(value, int) else total
    raise TypeError(f"cannot sum a {type(value).__name__} over ranks")


def gather_rows(rows: Tensor, dim: int = 0) -> Tensor:
    """This rank's ``rows`` concatenated with every other rank's, in rank order (``rows`` in one process).

    Example:
        >>> import torch
        >>> from posthoc.engine.runner import gather_rows
        >>> gather_rows(torch.arange(3)).tolist()
        [0, 1, 2]
    """
    return distributed.gather_cat(rows, dim)


def examples_over_ranks(count: int) -> int:
    """``count`` examples of this rank's shard summed over ranks.

    Example:
        >>> from posthoc.engine.runner import examples_over_ranks
        >>> examples_over_ranks(350)
        350
    """
    return distributed.total_examples(count)


def steps_on_every_rank(length: int | None, what: str) -> int | None:
    """The optimizer steps per epoch that every rank can take (the shortest shard's batches)."""
    return distributed.common_length(length, what)


def average_gradients(parameters: Iterable[Tensor]) -> None:
    """Average ``.grad`` over ranks in place after a backward (a no-op in one process)."""
    distributed.average_gradients(parameters)


def replica(module: nn.Module) -> nn.Module:
    """``module`` as a ``DistributedDataParallel`` replica under ``torch.distributed``, else ``module`` itself.

    Example:
        >>> from torch import nn
        >>> from posthoc.engine.runner import replica
        >>> net = nn.Linear(2, 2)
        >>> replica(net) is net
        True
    """
    return DistributedDataParallel(module) if distributed.active() else module


@contextmanager
def small_dense_work(elements: int, device: torch.device) -> Iterator[None]:
    """Run a block of ``elements`` float32 temporaries on one thread when it is small work on the CPU.

    Example:
        >>> import torch
        >>> from posthoc.engine.runner import small_dense_work
        >>> with small_dense_work(600 * 8, torch.device("cpu")):
        ...     torch.linalg.eigh(torch.eye(4)).eigenvalues.tolist()
        [1.0, 1.0, 1.0, 1.0]
    """
    with single_thread_if(device.type == "cpu" and 4 * elements <= SMALL_WORK_BYTES):
        yield


#: input elements below which an iterative fit (L-BFGS over held-out predictions) runs on one CPU thread
SMALL_FIT = 1 << 20


@contextmanager
def small_fit(*inputs: Tensor | None) -> Iterator[None]:
    """Run an iterative fit over ``inputs`` on one thread when they hold fewer than :data:`SMALL_FIT` elements on the
    CPU: a calibration fit is thousands of tiny ops, where intra-op threads only wait on each other.

    Example:
        >>> import torch
        >>> from posthoc.engine.runner import small_fit
        >>> scale = torch.zeros((), requires_grad=True)
        >>> with small_fit(torch.randn(600, 10), None):
        ...     (scale - 1).pow(2).backward()
        >>> float(scale.grad)
        -2.0
    """
    given = [tensor for tensor in inputs if tensor is not None]
    small = bool(given) and given[0].device.type == "cpu" and sum(tensor.numel() for tensor in given) < SMALL_FIT
    with single_thread_if(small):
        yield


def eigh(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.eigh`` of a symmetric ``matrix``, on one thread when it is small (at most 1,024 rows on the CPU).

    Example:
        >>> import torch
        >>> from posthoc.engine.runner import eigh
        >>> eigh(torch.diag(torch.tensor([2.0, 1.0])))[0].tolist()
        [1.0, 2.0]
    """
    with single_thread_if(matrix.device.type == "cpu" and matrix.shape[-1] <= 1024):
        return torch.linalg.eigh(matrix)
