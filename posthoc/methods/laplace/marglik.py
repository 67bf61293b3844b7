"""Tuning the prior precision of a Laplace approximation.

With a Gaussian prior ``N(0, δ⁻¹ I)`` and a GGN with eigenvalues ``s_k`` (``P`` of them), the
Laplace log marginal likelihood is

    log p(D | δ) ≈ -loss - ½ [Σ_k log(s_k + δ) - P log δ + δ ‖θ‖²]

where ``loss`` is the summed training NLL at the checkpoint ``θ``. Its derivative in ``δ`` is
``½ (γ(δ) - δ ‖θ‖²) / δ`` with ``γ(δ) = Σ_k s_k / (s_k + δ)`` (the effective number of
parameters, decreasing in ``δ``), so the maximiser is the unique root of ``γ(δ) = δ ‖θ‖²``:
found by bisection in ``log δ`` from the spectrum alone, each step ``O(P)``, no refitting. For
KFAC the spectrum is the outer product of the two factors' eigenvalues.

Under a Gaussian likelihood with noise ``σ`` the GGN is the unit-noise one over ``σ²`` (eigenvalues
``s_k / σ²``) and ``loss = U / σ² + (M/2) log(2π σ²)`` with ``U = ½ Σ r²`` over ``M`` target values:
:func:`optimize_noise_and_prior` maximises the evidence over ``log σ`` (a grid, then golden section
around its best point), with ``δ`` at its exact optimum for every ``σ`` (or fixed).

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

from posthoc.core.likelihood import golden_minimum

#: points of the coarse grid in ``log σ`` (from 1e-3 to 10 times the residuals' RMS) before the golden section
NOISE_GRID = 41


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


def gaussian_nll(unit_loss: float, values: int, noise_std: float) -> float:
    """The summed Gaussian NLL ``U / σ² + (M/2) log(2π σ²)`` from ``U = ½ Σ r²`` over ``M`` target values."""
    return unit_loss / noise_std**2 + 0.5 * values * math.log(2 * math.pi * noise_std**2)


def optimize_noise_and_prior(unit_spectrum: Tensor, unit_loss: float, values: int, square_norm: float, *,
                             prior_precision: float | None = None, noise_std: float | None = None) -> tuple[float, float]:
    """``(δ, σ)`` maximising the Laplace evidence of a Gaussian likelihood (see module docs); a given ``prior_precision``
    or ``noise_std`` stays fixed.

    Example:
        >>> delta, std = optimize_noise_and_prior(torch.tensor([40.0, 4.0], dtype=torch.float64), 2.0, 40, 1.0)
        >>> 0 < std < 1
        True
    """
    unit_spectrum = unit_spectrum.to(torch.float64)

    def best_prior(std: float, quiet: bool = True) -> float:
        if prior_precision is not None:
            return prior_precision
        with warnings.catch_warnings():
            if quiet:
                warnings.simplefilter("ignore", RuntimeWarning)
            return optimize_prior_precision(unit_spectrum / std**2, 0.0, square_norm)

    def negative_evidence(log_std: float) -> float:
        std = math.exp(log_std)
        return -float(log_marginal_likelihood(unit_spectrum / std**2, gaussian_nll(unit_loss, values, std), square_norm,
                                              best_prior(std)))

    if noise_std is None:
        rms = math.sqrt(max(2 * unit_loss / max(values, 1), 1e-24))
        grid = [math.log(rms) + t for t in torch.linspace(math.log(1e-3), math.log(10.0), NOISE_GRID).tolist()]
        best = min(range(NOISE_GRID), key=lambda i: negative_evidence(grid[i]))
        noise_std = math.exp(golden_minimum(negative_evidence, grid[max(best - 1, 0)], grid[min(best + 1, NOISE_GRID - 1)]))
    return best_prior(noise_std, quiet=False), noise_std
