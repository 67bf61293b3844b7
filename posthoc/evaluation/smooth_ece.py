"""Smooth ECE (Błasiok & Nakkiran, 2023) of many rows of examples at once, as relplot 1.0.3 computes it.

The smooth ECE kernel-smooths the residuals ``confidence - correct`` with a Gaussian of width ``sigma`` (reflected at
0 and 1), and reports the mean absolute smoothed residual under the smoothed density of the confidences; ``sigma`` is
the fixed point ``sigma = smECE(sigma)``, found by bisection. The result needs no bins and changes continuously with
the predictions.

This module follows relplot's ``smECE`` step for step so that its values equal relplot's, but computes every row of a
``(B, n)`` batch together in torch (the convolutions through FFTs), as the bootstrap intervals need. relplot is the
test oracle, not a dependency: importing it brings pandas and seaborn.

Example:
    >>> import torch
    >>> from posthoc.evaluation.smooth_ece import smooth_ece_rows
    >>> confidence = torch.tensor([[0.9, 0.8, 0.7, 0.6]], dtype=torch.float64)
    >>> correct = torch.tensor([[1.0, 1.0, 0.0, 1.0]], dtype=torch.float64)
    >>> round(float(smooth_ece_rows(confidence, correct)[0]), 4)
    0.0958
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posthoc.errors import InputError

#: bandwidths below this count as reached in the bisection (relplot's ``eps``)
SIGMA_EPS = 1e-3
#: bisection steps of the bandwidth search (relplot's ``refine``)
REFINE = 10
#: least number of points the smoothed residual is evaluated at (relplot's ``config.smECE_mesh_pts``)
MESH_POINTS = 200
#: added to the smoothed density (relplot's ``eps`` of ``smooth``)
DENSITY_EPS = 1e-4
#: rows x grid points smoothed at once; a batch's spectra are kept per grid size up to this many
CHUNK_ELEMENTS = 1 << 22


def _linspace(points: Tensor) -> tuple[Tensor, Tensor]:
    """Per row, ``numpy.linspace(0, 1, points[row])`` padded to the longest row: ``(values, mask)``, each ``(b, T)``.

    numpy's formula (``arange * step`` and an exact last point), so that the grids equal relplot's to the bit.
    """
    longest = int(points.max())
    position = torch.arange(longest, dtype=torch.float64).expand(len(points), longest)
    values = position * (1.0 / (points.double() - 1))[:, None]
    values = torch.where(position == (points - 1)[:, None], torch.ones_like(values), values)
    return values, position < points[:, None]


def _mesh(points: int) -> Tensor:
    """``numpy.linspace(0, 1, points)`` by numpy's formula (``arange * step``, an exact last point)."""
    mesh = torch.arange(points, dtype=torch.float64) * (1.0 / (points - 1))
    mesh[-1] = 1.0
    return mesh


class _Smoother:
    """The smooth ECE of every row of a batch at any bandwidths, keeping what does not depend on the bandwidth.

    relplot's ``ReflectedGaussianKernel.apply`` spreads each example's value onto a ``grid``-point mesh of [0, 1],
    mirrors it at both ends and convolves it with a Gaussian. That mirror image is one window of the even periodic
    extension of period ``2 (grid - 1)``, so a circular convolution gives the same numbers: the extension's spectrum
    is kept per grid size, the kernel's computed once per distinct bandwidth.
    """

    def __init__(self, confidence: Tensor, residual: Tensor) -> None:
        self.confidence, self.residual = confidence, residual
        self.spectra: dict[int, Tensor] = {}

    def spectrum(self, rows: Tensor, grid: int) -> Tensor:
        """The rfft of the periodic extension of the gridded residuals and counts of ``rows``: ``(b, 2, grid)``."""
        if grid in self.spectra:
            kept = self.spectra[grid]
            return kept if len(rows) == len(kept) else kept[rows]  # rows are sorted and distinct: all of them
        keep = len(self.confidence) * grid <= CHUNK_ELEMENTS
        picked = slice(None) if keep else rows
        confidence, residual = self.confidence[picked], self.residual[picked]
        position = confidence * (grid - 1)
        lower = position.long().clamp(0, grid - 2)  # truncation, as numpy's astype(int)
        upper_share = position - lower
        weights = torch.stack([residual, torch.ones_like(residual)], 1)  # (b, 2, n)
        index = lower[:, None].expand_as(weights)
        values = torch.zeros(len(confidence), 2, grid, dtype=torch.float64)
        values.scatter_add_(2, index, (1 - upper_share)[:, None] * weights)
        values.scatter_add_(2, index + 1, upper_share[:, None] * weights)
        spectrum = torch.fft.rfft(torch.cat([values, values.flip(-1)[..., 1:-1]], -1))
        if keep:
            self.spectra[grid] = spectrum
            return spectrum if len(rows) == len(spectrum) else spectrum[rows]
        return spectrum

    def smooth_ece(self, rows: Tensor, sigma: Tensor) -> Tensor:
        """relplot's ``smooth_ece(f, y, sigma)`` of ``rows`` at their bandwidths ``sigma`` ``(b,)``: ``(b,)``."""
        grid = (torch.round(20 / sigma).clamp_min(2000).long() // 2) + 1
        points = torch.round(10 / sigma).clamp_min(MESH_POINTS).long()
        out = torch.empty(len(sigma), dtype=torch.float64)
        for size in grid.unique().tolist():
            where = (grid == size).nonzero().squeeze(-1)
            for part in where.split(max(1, CHUNK_ELEMENTS // (4 * size))):
                out[part] = self._at_grid(rows[part], sigma[part], points[part], size)
        return out

    def _at_grid(self, rows: Tensor, sigma: Tensor, points: Tensor, grid: int) -> Tensor:
        period = 2 * (grid - 1)
        widths, which = sigma.unique(return_inverse=True)
        mesh = _mesh(grid)
        kernel = (
            torch.exp(-(mesh - 0.5) * (mesh - 0.5) / (2 * (widths**2)[:, None]))
            / (math.sqrt(2 * math.pi) * widths)[:, None]
        )
        circular = torch.zeros(len(widths), period, dtype=torch.float64)
        circular[:, (torch.arange(grid) - grid // 2) % period] = kernel  # the kernel's centre at offset 0
        product = self.spectrum(rows, grid) * torch.fft.rfft(circular)[which][:, None]
        smoothed = torch.fft.irfft(product, period)[..., :grid]  # (b, 2, grid)
        at, mask = _linspace(points)
        mean_residual, density = _interpolate(smoothed, at).unbind(1)
        density = density + DENSITY_EPS
        return ((mean_residual / density).abs() * density * mask).sum(-1) / (density * mask).sum(-1)


def _interpolate(smoothed: Tensor, at: Tensor) -> Tensor:
    """Linear interpolation of ``smoothed`` ``(b, 2, grid)`` (on the uniform mesh of [0, 1]) at ``at`` ``(b, T)``."""
    grid = smoothed.shape[-1]
    step = 1 / (grid - 1)
    lower = (at * (grid - 1)).long().clamp(0, grid - 2)
    share = ((at - lower * step) / step)[:, None]
    index = lower[:, None].expand(-1, 2, -1)
    return smoothed.gather(-1, index) * (1 - share) + smoothed.gather(-1, index + 1) * share


def smooth_ece_rows(confidence: Tensor, correct: Tensor) -> Tensor:
    """The smooth ECE of each row of ``confidence`` ``(B, n)`` (the predicted class's probability) against
    ``correct`` ``(B, n)`` (1 where that class is the label): ``(B,)``, float64.

    The bandwidth of each row is relplot's: 1 if ``1 < smECE(1)``; else ``REFINE`` bisection steps on (0, 1], keeping
    the last bandwidth where ``sigma < smECE(sigma)`` did not hold.

    Example:
        >>> import torch
        >>> from posthoc.evaluation.smooth_ece import smooth_ece_rows
        >>> confidence = torch.full((2, 4), 0.75, dtype=torch.float64)
        >>> correct = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
        >>> [round(v, 3) for v in smooth_ece_rows(confidence, correct).tolist()]
        [0.0, 0.25]
    """
    confidence = confidence.double().cpu()
    if confidence.dim() != 2 or confidence.shape != correct.shape:
        raise InputError(
            f"smooth_ece_rows takes (B, n) confidences and correctness flags of one shape, got "
            f"{tuple(confidence.shape)} and {tuple(correct.shape)}"
        )
    residual = confidence - correct.double().cpu()
    rows = len(confidence)
    start = torch.ones(rows, dtype=torch.float64)
    end = torch.zeros(rows, dtype=torch.float64)
    smoother = _Smoother(confidence, residual)
    every = torch.arange(rows)
    at_one = smoother.smooth_ece(every, start)
    settled = start < at_one  # relplot returns at once when the first bandwidth, 1, already satisfies the test
    start_value = at_one
    for _ in range(REFINE):
        middle = (start + end) / 2
        value = torch.full_like(middle, math.nan)
        wide = (middle >= SIGMA_EPS).nonzero().squeeze(-1)
        if len(wide):
            value[wide] = smoother.smooth_ece(wide, middle[wide])
        holds = (middle < SIGMA_EPS) | (middle < value)
        end = torch.where(holds, middle, end)
        start = torch.where(holds, start, middle)
        start_value = torch.where(holds, start_value, value)
    return torch.where(settled, at_one, start_value)
