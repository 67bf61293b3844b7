"""Fitting a calibration map's parameters by the (penalised) NLL of held-out labels, with L-BFGS.

Example:
    >>> scale = torch.zeros((), dtype=torch.float64, requires_grad=True)
    >>> minimise(lambda: mixture_nll(torch.log_softmax(logits * scale.exp(), -1), labels), [scale], max_iter=100)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posthoc.core.logits import log_mean_exp


def mixture_nll(log_probs: Tensor, labels: Tensor) -> Tensor:
    """Mean NLL of ``labels`` under log-probabilities ``(N, C)``, or under the average of samples ``(S, N, C)``."""
    predictive = log_mean_exp(log_probs) if log_probs.dim() == 3 else log_probs
    return torch.nn.functional.nll_loss(predictive, labels)


def minimise(objective: Callable[[], Tensor], parameters: list[Tensor], *, max_iter: int) -> None:
    """Minimise ``objective()`` over ``parameters`` (leaf tensors with ``requires_grad``) in place."""
    optimizer = torch.optim.LBFGS(parameters, lr=0.5, max_iter=max_iter, line_search_fn="strong_wolfe",
                                  tolerance_grad=1e-10, tolerance_change=1e-14)

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = objective()
        loss.backward()
        return loss

    optimizer.step(closure)
