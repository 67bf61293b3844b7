"""The curvature structures: each block's posterior queries against the dense posterior ``(GGN + δ I)⁻¹``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import posthoc
from posthoc.methods.laplace import Laplace, LastLayerLaplace, SubsetLaplace
from posthoc.methods.laplace.structures import STRUCTURES

OUT, IN, C, N, T, DELTA = 3, 4, 5, 6, 2, 0.7
#: the structures that cover layers inside a network ("kron-diag" is a head's only)
LAYER_STRUCTURES = sorted(set(STRUCTURES) - {"kron-diag"})


def _psd(size: int, generator: torch.Generator) -> torch.Tensor:
    factor = torch.randn(size, size + 2, generator=generator, dtype=torch.float64)
    return factor @ factor.T


def _block(structure: str, bias: bool = False):
    """A fitted block of a weight ``(OUT, IN)`` (or a bias ``(OUT,)``) from random curvature sums."""
    generator = torch.Generator().manual_seed(0)
    size = OUT if bias else OUT * IN
    if structure == "kron":
        return STRUCTURES["kron"].from_sums([_psd(OUT, generator)] + ([] if bias else [_psd(IN, generator)]), 1)
    if structure == "kron-diag":  # exact variances here (no grouping of A's eigen-directions)
        block = STRUCTURES["kron-diag"].from_factors(
            torch.rand(OUT, generator=generator, dtype=torch.float64) + 0.1, _psd(IN, generator)
        )
        block.groups = None
        return block
    if structure == "diag":
        return STRUCTURES["diag"].from_sums(
            [torch.rand((OUT,) if bias else (OUT, IN), generator=generator, dtype=torch.float64)], 1
        )
    return STRUCTURES["full"].from_sums([_psd(size, generator)], 1)


def _posterior(block) -> torch.Tensor:
    dense = block.dense()
    return torch.linalg.inv(dense + DELTA * torch.eye(dense.shape[0], dtype=torch.float64))


@pytest.mark.parametrize("structure", LAYER_STRUCTURES)
@pytest.mark.parametrize("kind", ["weight", "positional", "bias"])
def test_jacobian_variance_is_the_sandwich_with_the_dense_posterior(structure: str, kind: str) -> None:
    generator = torch.Generator().manual_seed(1)
    block = _block(structure, bias=kind == "bias")
    if kind == "positional":
        g = torch.randn(N, C, T, OUT, generator=generator, dtype=torch.float64)
        a = torch.randn(N, T, IN, generator=generator, dtype=torch.float64)
        jacobian = torch.einsum("ncto,nti->ncoi", g, a).flatten(2)
    else:
        g = torch.randn(N, C, OUT, generator=generator, dtype=torch.float64)
        a = None if kind == "bias" else torch.randn(N, IN, generator=generator, dtype=torch.float64)
        jacobian = g if a is None else (g[..., None] * a[:, None, None, :]).flatten(2)
    expected = jacobian @ _posterior(block) @ jacobian.transpose(1, 2)
    torch.testing.assert_close(block.jacobian_variance(g, a, DELTA), expected)


@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_head_variance_spectrum_and_samples_match_the_dense_posterior(structure: str) -> None:
    generator = torch.Generator().manual_seed(2)
    block = _block(structure)  # a head of OUT classes over IN = D + 1 inputs
    phi_aug, mean = (
        torch.randn(N, IN, generator=generator, dtype=torch.float64),
        torch.randn(N, OUT, dtype=torch.float64),
    )
    sigma = _posterior(block)
    jacobian = torch.kron(torch.eye(OUT, dtype=torch.float64), phi_aug[:, None, :])
    expected = jacobian @ sigma @ jacobian.transpose(1, 2)
    gaussian = block.head_variance(phi_aug, mean, DELTA)
    torch.testing.assert_close(gaussian.covariance(), expected)
    torch.testing.assert_close(gaussian.variance(), expected.diagonal(dim1=1, dim2=2))
    torch.testing.assert_close(gaussian.row_sums(), expected.sum(-1))
    torch.testing.assert_close(
        block.spectrum().sort().values, torch.linalg.eigvalsh(block.dense()).clamp_min(0), atol=1e-9, rtol=1e-9
    )
    draws = block.sample(
        torch.zeros(OUT, IN, dtype=torch.float64), DELTA, 20_000, torch.Generator().manual_seed(3)
    ).reshape(20_000, -1)
    stderr = ((sigma.diagonal()[:, None] * sigma.diagonal()[None] + sigma.square()) / 20_000).sqrt()
    assert ((draws.T @ draws / 20_000 - sigma).abs() / stderr).max() < 5.5


def test_constructing_laplace_builds_the_algorithm_of_its_options() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    assert type(Laplace.build(model)) is LastLayerLaplace
    assert type(Laplace.build(model, subset=["0", "2"], hessian="diag")) is SubsetLaplace
    assert type(posthoc.wrap(model, method="laplace", hessian="full").method.blocks[0]) is STRUCTURES["full"]
