"""Minimising a small smooth objective in place with L-BFGS (strong Wolfe line search).

Example:
    >>> import torch
    >>> from posthoc.engine.lbfgs import minimise
    >>> scale = torch.zeros((), dtype=torch.float64, requires_grad=True)
    >>> minimise(lambda: (scale - 2) ** 2, [scale], max_iter=50)
    >>> round(float(scale.detach()), 4)
    2.0
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def minimise(
    objective: Callable[[], Tensor], parameters: list[Tensor], *, max_iter: int, tolerance: float = 1e-7
) -> None:
    """Minimise ``objective()`` over ``parameters`` (leaf tensors with ``requires_grad``) in place; stop when
    the largest gradient entry falls below ``tolerance`` (or the loss changes by less than 1e-4 of it)."""
    optimizer = torch.optim.LBFGS(
        parameters,
        lr=0.5,
        max_iter=max_iter,
        line_search_fn="strong_wolfe",
        tolerance_grad=tolerance,
        tolerance_change=tolerance * 1e-4,
    )

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = objective()
        loss.backward()
        return loss

    optimizer.step(closure)
