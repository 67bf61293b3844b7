"""Held-out rows under a Gaussian likelihood: their residuals' scale and the normal NLL that scores them.

Laplace's held-out choices under ``likelihood="regression"`` (the noise at a prior, and ``prior_precision="val"`` /
``"grid"``) read rows ``(prepared inputs, outputs (N, D), targets (N, D))``; the plain model's noise is their
residuals' root mean square (its maximum-likelihood value), and a posterior's predictive per output is
``N(f(x), J Σ Jᵀ + σ²)`` (independent outputs), scored by :func:`normal_nll`.

Example:
    >>> import torch
    >>> from posthoc.methods.laplace.gaussian_rows import normal_nll, residual_std
    >>> rows = [(None, torch.zeros(2, 1), torch.tensor([[1.0], [-1.0]]))]
    >>> residual_std(rows), float(normal_nll(torch.zeros(1, 1), torch.ones(1, 1), torch.zeros(1, 1))[0])
    (1.0, 0.9189385332046727)
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

#: golden-section steps of a held-out noise fit (the bracket of ``log σ``, 3.0 wide, shrinks to 3e-5; the NLL is flat there)
NOISE_STEPS = 24

Rows = list[tuple[Any, Tensor, Tensor]]


def residual_std(rows: Rows) -> float:
    """The root mean square of ``targets - outputs`` over ``(prepared, outputs, targets)`` rows (at least 1e-12)."""
    squares = sum(float((targets.double() - outputs.double()).square().sum()) for _, outputs, targets in rows)
    values = sum(targets.numel() for _, _, targets in rows)
    return math.sqrt(max(squares / max(values, 1), 1e-24))


def normal_nll(means: Tensor, variances: Tensor, targets: Tensor) -> Tensor:
    """``(N,)``: the NLL of ``targets`` under independent normals per output ``(N, D)``, summed over the outputs (float64)."""
    variances = variances.double()
    return 0.5 * ((targets.double() - means.double()).square() / variances + (2 * math.pi * variances).log()).sum(-1)
