"""Tuning the prior precision of a Laplace approximation.

With a prior ``N(0, δ⁻¹ I)`` and a GGN of eigenvalues ``s_k`` (``P`` of them) the Laplace log evidence is

    log p(D | δ) ≈ -loss - ½ [Σ_k log(s_k + δ) - P log δ + δ ‖θ‖²]

with ``loss`` the summed training NLL at the checkpoint ``θ``. Its maximiser is the unique root of
``γ(δ) = δ ‖θ‖²``, ``γ(δ) = Σ_k s_k / (s_k + δ)`` the effective number of parameters: found from the spectrum alone,
each step ``O(P)``. Under a Gaussian likelihood with noise ``σ`` the eigenvalues are ``s_k / σ²`` and
``loss = U / σ² + (M/2) log(2π σ²)`` (``U = ½ Σ r²`` over ``M`` target values): :func:`optimize_noise_and_prior`
maximises over ``log σ`` (a grid, then golden section), ``δ`` at its optimum for every ``σ``. ``δ`` is searched in
standardised units, ``δ s²`` for targets of scale ``s``, so the answer does not depend on the targets' units.

Example:
    >>> import torch
    >>> from posthoc.methods.laplace.marglik import effective_parameters, optimize_prior_precision
    >>> spectrum = torch.tensor([10.0, 1.0, 0.1], dtype=torch.float64)
    >>> delta = optimize_prior_precision(spectrum, loss=5.0, square_norm=2.0)
    >>> float(effective_parameters(spectrum, delta) - delta * 2.0) < 1e-8
    True
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from torch import Tensor

from posthoc.core.likelihood import golden_minimum

#: points of the coarse grid in ``log σ`` (from 1e-3 to 10 times the residuals' RMS) before the golden section
NOISE_GRID = 41
#: spectra longer than this are summed in slices (a head of 50,000 classes has 4e7 eigenvalues)
SPECTRUM_CHUNK = 2**22

#: prior precisions are searched inside this range, in standardised units (a fit that reaches a bound warns)
MIN_PRIOR_PRECISION, MAX_PRIOR_PRECISION = 1e-8, 1e8


def prior_bounds(scale: float = 1.0) -> tuple[float, float]:
    """The search range of ``δ`` for targets of scale ``scale``: ``[MIN, MAX] / scale²`` (see module docs).

    Example:
        >>> from posthoc.methods.laplace.marglik import prior_bounds
        >>> prior_bounds(1e4)
        (1e-16, 1.0)
    """
    return MIN_PRIOR_PRECISION / scale**2, MAX_PRIOR_PRECISION / scale**2


def effective_parameters(spectrum: Tensor, prior_precision: float) -> Tensor:
    """``γ(δ) = Σ_k s_k / (s_k + δ)``: how many parameter directions the data determine."""
    return (spectrum / (spectrum + prior_precision)).sum()


def log_marginal_likelihood(
    spectrum: Tensor, loss: float | Tensor, square_norm: float | Tensor, prior_precision: float | Tensor
) -> Tensor:
    """The Laplace log marginal likelihood for a scalar prior precision (see module docs)."""
    delta = torch.as_tensor(prior_precision, dtype=spectrum.dtype, device=spectrum.device)
    log_det_ratio = torch.log(spectrum + delta).sum() - spectrum.numel() * torch.log(delta)
    return -torch.as_tensor(loss, dtype=spectrum.dtype) - 0.5 * (log_det_ratio + delta * square_norm)


def _log_prior_root(spectrum: np.ndarray, square_norm: float, iterations: int, scale: float = 1.0) -> float:
    """The root ``u = log δ`` of ``h(u) = log γ(e^u) - u - log ‖θ‖²`` in the search range, or the bound it passes:
    ``h`` falls with a slope between -2 and -1, so bracketed Newton steps converge in a few ``O(P)`` steps."""
    low, high = (math.log(bound) for bound in prior_bounds(scale))
    if square_norm <= 0:
        return high

    def sums(u: float) -> tuple[float, float]:  # γ and Σ r (1 - r), over slices of a large spectrum
        gamma = spread = 0.0
        for start in range(0, max(spectrum.size, 1), SPECTRUM_CHUNK):
            ratio = spectrum[start : start + SPECTRUM_CHUNK] / (spectrum[start : start + SPECTRUM_CHUNK] + math.exp(u))
            gamma, spread = gamma + float(ratio.sum()), spread + float((ratio * (1 - ratio)).sum())
        return gamma, spread

    def value_and_slope(u: float) -> tuple[float, float]:
        gamma, spread = sums(u)
        if gamma <= 0:
            return -math.inf, -1.0
        return math.log(gamma) - u - math.log(square_norm), -spread / gamma - 1

    if value_and_slope(high)[0] > 0:
        return high
    if value_and_slope(low)[0] < 0:
        return low
    # γ <= P puts the root at or below log(P / ‖θ‖²): Newton starts there
    u = min(math.log(spectrum.size / square_norm), high)
    for _ in range(iterations):
        value, slope = value_and_slope(u)
        if value > 0:
            low = u
        else:
            high = u
        step = -value / slope if math.isfinite(value) else math.inf
        if abs(step) < 1e-13 or high - low < 1e-13:
            return u + step if math.isfinite(step) else u
        u = u + step if low < u + step < high else (low + high) / 2
    return u


def optimize_prior_precision(
    spectrum: Tensor, loss: float | Tensor, square_norm: float | Tensor, *, iterations: int = 200, scale: float = 1.0
) -> float:
    """The prior precision maximising the evidence (``loss`` does not move it), in :func:`prior_bounds`."""
    log_delta = _log_prior_root(
        spectrum.detach().to(torch.float64).cpu().numpy(), float(square_norm), iterations, scale
    )
    value = math.exp(log_delta)
    bounds = prior_bounds(scale)
    if log_delta in tuple(math.log(bound) for bound in bounds):
        value = bounds[0] if log_delta == math.log(bounds[0]) else bounds[1]
        warnings.warn(
            f"the marginal likelihood is maximised at the bound prior_precision={value:g} (the weights "
            f"have squared norm {float(square_norm):.3g}); pass a fixed prior_precision or use "
            "prior_precision='val' with a validation loader",
            RuntimeWarning,
            stacklevel=2,
        )
    return value


def gaussian_nll(unit_loss: float, values: int, noise_std: float) -> float:
    """The summed Gaussian NLL ``U / σ² + (M/2) log(2π σ²)`` from ``U = ½ Σ r²`` over ``M`` target values."""
    return unit_loss / noise_std**2 + 0.5 * values * math.log(2 * math.pi * noise_std**2)


def optimize_noise_and_prior(
    unit_spectrum: Tensor,
    unit_loss: float,
    values: int,
    square_norm: float,
    *,
    prior_precision: float | None = None,
    noise_std: float | None = None,
    scale: float = 1.0,
) -> tuple[float, float]:
    """``(δ, σ)`` maximising the evidence of a Gaussian likelihood; a given ``prior_precision`` or ``noise_std`` stays.

    Example:
        >>> import torch
        >>> from posthoc.methods.laplace.marglik import optimize_noise_and_prior
        >>> delta, std = optimize_noise_and_prior(torch.tensor([40.0, 4.0], dtype=torch.float64), 2.0, 40, 1.0)
        >>> 0 < std < 1
        True
    """
    unit = unit_spectrum.detach().to(torch.float64).cpu().numpy()

    def negative_evidence(log_std: float) -> float:
        variance = math.exp(2 * log_std)
        spectrum = unit / variance
        log_delta = (
            math.log(prior_precision)
            if prior_precision is not None
            else _log_prior_root(spectrum, square_norm, 200, scale)
        )
        delta = math.exp(log_delta)
        log_det_ratio = float(np.log(spectrum + delta).sum()) - spectrum.size * log_delta
        return gaussian_nll(unit_loss, values, math.sqrt(variance)) + 0.5 * (log_det_ratio + delta * square_norm)

    if noise_std is None:
        rms = math.sqrt(max(2 * unit_loss / max(values, 1), 1e-24))
        grid = [math.log(rms) + t for t in torch.linspace(math.log(1e-3), math.log(10.0), NOISE_GRID).tolist()]
        best = min(range(NOISE_GRID), key=lambda i: negative_evidence(grid[i]))
        noise_std = math.exp(
            golden_minimum(negative_evidence, grid[max(best - 1, 0)], grid[min(best + 1, NOISE_GRID - 1)])
        )
    delta = (
        prior_precision
        if prior_precision is not None
        else optimize_prior_precision(unit_spectrum / noise_std**2, 0.0, square_norm, scale=scale)
    )
    return delta, noise_std
