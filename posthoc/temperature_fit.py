"""Fitting a temperature by minimising NLL over ``log T`` with L-BFGS, bounded.

Works on cached log-probabilities ``(N, C)`` or on per-sample log-probabilities ``(S, N, C)``
(then the tempered predictive is the mean of the tempered samples). ``T`` is kept inside
``[1e-2, 1e2]``; a fit that reaches a bound warns.

Example:
    >>> logits = torch.randn(200, 5) * 4
    >>> labels = torch.distributions.Categorical(logits=logits / 4).sample()
    >>> round(fit_temperature(torch.log_softmax(logits, -1), labels), 1)
    4.0
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-2, 1e2


def tempered_log_probs(log_probs: Tensor, temperature: Tensor | float) -> Tensor:
    """Apply ``T`` to log-probabilities ``(N, C)`` or samples ``(S, N, C)``; returns ``(N, C)``."""
    tempered = torch.log_softmax(log_probs / temperature, dim=-1)
    if log_probs.dim() == 3:
        return torch.logsumexp(tempered, dim=0) - math.log(log_probs.shape[0])
    return tempered


def fit_temperature(log_probs: Tensor, labels: Tensor, *, max_iter: int = 100) -> float:
    """The temperature minimising the NLL of ``labels`` under the tempered predictive."""
    log_probs = log_probs.detach().double().clamp_min(-1e4)
    labels = labels.to(log_probs.device)
    log_t = torch.zeros((), dtype=torch.float64, device=log_probs.device, requires_grad=True)
    bound = math.log(MAX_TEMPERATURE)
    optimizer = torch.optim.LBFGS([log_t], lr=0.5, max_iter=max_iter, line_search_fn="strong_wolfe")

    def nll() -> Tensor:
        optimizer.zero_grad()
        temperature = log_t.clamp(-bound, bound).exp()
        loss = torch.nn.functional.nll_loss(tempered_log_probs(log_probs, temperature), labels)
        loss.backward()
        return loss

    optimizer.step(nll)
    value = float(log_t.detach().clamp(-bound, bound).exp())
    if not math.isfinite(value):
        value = 1.0
    if value <= MIN_TEMPERATURE * 1.01 or value >= MAX_TEMPERATURE * 0.99:
        warnings.warn(
            f"the fitted temperature hit its bound ({value:.3g}); the held-out data may be too small, "
            "mislabelled, or perfectly separated",
            RuntimeWarning,
            stacklevel=2,
        )
    return value
