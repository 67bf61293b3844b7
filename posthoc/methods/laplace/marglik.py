"""Tuning the prior precision of a Laplace approximation.

With a Gaussian prior ``N(0, δ⁻¹ I)`` and a GGN with eigenvalues ``s_k`` (``P`` of them), the
Laplace log marginal likelihood is

    log p(D | δ) ≈ -loss - ½ [Σ_k log(s_k + δ) - P log δ + δ ‖θ‖²]

where ``loss`` is the summed training NLL at the checkpoint ``θ``. Its derivative in ``δ`` is
``½ (γ(δ) - δ ‖θ‖²) / δ`` with ``γ(δ) = Σ_k s_k / (s_k + δ)`` (the effective number of
parameters, decreasing in ``δ``), so the maximiser is the unique root of ``γ(δ) = δ ‖θ‖²``:
found by bisection in ``log δ`` from the spectrum alone, each step ``O(P)``, no refitting. For
KFAC the spectrum is the outer product of the two factors' eigenvalues.

The alternatives on held-out NLL are in :mod:`posthoc.methods.laplace.prior_search`.

Example:
    >>> spectrum = torch.tensor([10.0, 1.0, 0.1], dtype=torch.float64)
    >>> delta = optimize_prior_precision(spectrum, loss=5.0, square_norm=2.0)
    >>> float(effective_parameters(spectrum, delta) - delta * 2.0) < 1e-8
    True
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor


#: prior precisions are searched inside this range (a fit that reaches a bound warns)
MIN_PRIOR_PRECISION, MAX_PRIOR_PRECISION = 1e-8, 1e8


def effective_parameters(spectrum: Tensor, prior_precision: float) -> Tensor:
    """``γ(δ) = Σ_k s_k / (s_k + δ)``: how many parameter directions the data determine."""
    return (spectrum / (spectrum + prior_precision)).sum()


def log_marginal_likelihood(spectrum: Tensor, loss: float | Tensor, square_norm: float | Tensor, prior_precision: float | Tensor) -> Tensor:
    """The Laplace log marginal likelihood for a scalar prior precision (see module docs)."""
    delta = torch.as_tensor(prior_precision, dtype=spectrum.dtype, device=spectrum.device)
    log_det_ratio = torch.log(spectrum + delta).sum() - spectrum.numel() * torch.log(delta)
    return -torch.as_tensor(loss, dtype=spectrum.dtype) - 0.5 * (log_det_ratio + delta * square_norm)


def optimize_prior_precision(spectrum: Tensor, loss: float | Tensor, square_norm: float | Tensor, *, iterations: int = 200) -> float:
    """The scalar prior precision maximising the Laplace marginal likelihood (exact root, bisection).

    Args:
        spectrum: eigenvalues of the GGN (``>= 0``), flattened.
        loss: summed training NLL at the checkpoint (does not move the optimum; kept for symmetry).
        square_norm: ``‖θ‖²`` of the parameters under the prior.
        iterations: bisection steps in ``log δ`` (200 reach float64 resolution).
    """
    spectrum = spectrum.to(torch.float64)
    square_norm = float(square_norm)
    low, high = math.log(MIN_PRIOR_PRECISION), math.log(MAX_PRIOR_PRECISION)

    def gradient_sign(log_delta: float) -> float:
        delta = math.exp(log_delta)
        return float(effective_parameters(spectrum, delta)) - delta * square_norm

    if gradient_sign(high) > 0:
        value = MAX_PRIOR_PRECISION
    elif gradient_sign(low) < 0:
        value = MIN_PRIOR_PRECISION
    else:
        for _ in range(iterations):
            middle = (low + high) / 2
            if gradient_sign(middle) > 0:
                low = middle
            else:
                high = middle
            if high - low < 1e-12:
                break
        return math.exp((low + high) / 2)
    warnings.warn(
        f"the marginal likelihood is maximised at the bound prior_precision={value:g} (the weights "
        f"have squared norm {square_norm:.3g}); pass a fixed prior_precision or use "
        "prior_precision='val' with a validation loader",
        RuntimeWarning,
        stacklevel=2,
    )
    return value
