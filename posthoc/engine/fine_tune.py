"""One fine-tuning loop for every method that trains from the checkpoint (SWAG, SGLD, IVON, the ELBO fits).

:func:`fine_tune` owns the iteration, the method the maths: each step asks for the batch's loss, refuses a NaN/inf loss
(before the update) with a :class:`~posthoc.NumericalError` worded by the method, then lets the method update; what a
method does between steps (a SWAG snapshot, an SGLD sample) goes in the hooks. Under ``torch.distributed``
:func:`backward` averages the gradients of the method's own weights over ranks.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from torch.nn import functional as F
    >>> from posthoc.engine.fine_tune import fine_tune
    >>> from posthoc_apps.demo.examples import x, y
    >>> net = nn.Linear(4, 3)
    >>> batches = [(x, y)] * 4
    >>> optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> def update(loss, step):
    ...     optimizer.zero_grad(); loss.backward(); optimizer.step()
    >>> loss_of = lambda x, y: F.cross_entropy(net(x), y)
    >>> fine_tune(lambda epoch: batches, lambda batch, step: loss_of(*batch), update, epochs=2, total=None,
    ...           failure=lambda value, step: f"the loss became {value}", desc="demo", progress=False)
    8
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import Tensor

from posthoc.core.inputs import Inputs, iterate
from posthoc.core.progress import progress_bar
from posthoc.engine.runner import average_gradients
from posthoc.errors import NumericalError

Batch = TypeVar("Batch")


@dataclass(frozen=True)
class Step:
    """Where the loop stands: ``epoch`` and ``index`` within it, ``number`` over the run (all 0-based), and
    the run's ``total`` steps (``None`` for a loader without a length)."""

    epoch: int
    index: int
    number: int
    epochs: int
    total: int | None

    @property
    def done(self) -> float:
        """The fraction of the run before this step (by epochs where the total is unknown).

        Example:
            >>> from posthoc.engine.fine_tune import Step
            >>> Step(epoch=1, index=0, number=4, epochs=2, total=8).done
            0.5
        """
        return self.number / self.total if self.total else self.epoch / self.epochs


def fine_tune(
    epoch_batches: Callable[[int], Iterable[Batch]],
    loss: Callable[[Batch, Step], Tensor],
    update: Callable[[Tensor, Step], None],
    *,
    epochs: int,
    total: int | None,
    failure: Callable[[float, Step], str],
    desc: str,
    progress: bool,
    after_step: Callable[[Step], None] | None = None,
    after_epoch: Callable[[int, int], None] | None = None,
    postfix: Callable[[float, Step], dict[str, Any]] | None = None,
) -> int:
    """Run ``epochs`` passes of ``loss`` then ``update`` over ``epoch_batches(epoch)``; returns the steps taken.

    Args:
        total: the steps in all (``None``: unknown), for the progress bar.
        failure: the message of the :class:`~posthoc.NumericalError` raised on a NaN/inf loss.
        after_epoch: called after every epoch with its index and the steps it took.
        postfix: the progress bar's fields after a step.
    """
    number = 0
    bar = progress_bar(total=total, desc=desc, progress=progress)
    try:
        for epoch in range(epochs):
            index = -1
            for index, batch in enumerate(epoch_batches(epoch)):
                step = Step(epoch=epoch, index=index, number=number, epochs=epochs, total=total)
                value_tensor = loss(batch, step)
                value = float(value_tensor.detach())
                if not math.isfinite(value):
                    raise NumericalError(failure(value, step))
                update(value_tensor, step)
                if after_step is not None:
                    after_step(step)
                number += 1
                bar.update(1)
                if postfix is not None:
                    bar.set_postfix(**postfix(value, step))
            if after_epoch is not None:
                after_epoch(epoch, index + 1)
    finally:
        bar.close()
    return number


def backward(loss: Tensor, trained: Iterable[Tensor]) -> None:
    """``loss.backward()``, then the gradients of ``trained`` averaged over the ranks of ``torch.distributed``.

    Example:
        >>> import torch
        >>> from posthoc.engine.fine_tune import backward
        >>> w = torch.ones(2, requires_grad=True)
        >>> backward((3 * w).sum(), [w])
        >>> w.grad.tolist()
        [3.0, 3.0]
    """
    loss.backward()
    average_gradients(trained)


def loader_batches(loader: Iterable, *, device: Any, steps: int | None, desc: str) -> Iterator[tuple[Inputs, Tensor]]:
    """One epoch of ``(x, y)`` from ``loader`` on ``device``, at most ``steps`` of them (``None``: all)."""
    for index, batch in enumerate(iterate(loader, device=device, progress=False, desc=desc)):
        if steps is not None and index >= steps:
            break
        yield batch


def loader_length(loader: Iterable) -> int | None:
    """``len(loader)``, or ``None`` for a loader without a length."""
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None
