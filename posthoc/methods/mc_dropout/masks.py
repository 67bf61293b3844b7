"""Dropout masks: Bernoulli keep masks drawn fast from a ``torch.Generator``, and applying them.

Four mask entries come from each random 64-bit word (16 uniform bits per entry), several times
cheaper than ``bernoulli_``. Masks are drawn on the generator's device when one is given, so a CPU
generator gives the same masks for a CPU and a CUDA model.

Example:
    >>> import torch
    >>> from posthoc.methods.mc_dropout.masks import dropped, keep_mask
    >>> keep = keep_mask((1000, 100), 0.25, generator=torch.Generator().manual_seed(0), device="cpu")
    >>> round(keep.float().mean().item(), 2)
    0.75
    >>> dropped(torch.ones(2, 4), 0.5, generator=torch.Generator().manual_seed(0))
    tensor([[0., 0., 2., 0.],
            [0., 0., 0., 0.]])
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posthoc.engine.random_draws import draw_device


def keep_probability(p: float) -> float:
    """The exact keep probability of the masks for rate ``p`` (``p`` rounded to 1/65536)."""
    return 1.0 - round(p * 65536) / 65536


def drop_mask(
    shape: torch.Size | tuple[int, ...], p: float, *, generator: torch.Generator | None, device: torch.device | str
) -> Tensor:
    """Boolean mask of ``shape``, ``True`` where an entry is dropped (probability ``1 - keep_probability(p)``)."""
    numel = math.prod(shape)
    words = torch.empty((numel + 3) // 4, dtype=torch.int64, device=draw_device(generator, device)).random_(
        -(2**63), None, generator=generator
    )
    threshold = round(p * 65536) - 32768
    return (words.view(torch.int16)[:numel] < threshold).reshape(shape).to(device)


def keep_mask(
    shape: torch.Size | tuple[int, ...], p: float, *, generator: torch.Generator | None, device: torch.device | str
) -> Tensor:
    """The complement of :func:`drop_mask` (the same draws): ``True`` where an entry is kept."""
    return drop_mask(shape, p, generator=generator, device=device).logical_not_()


def dropped(x: Tensor, p: float, *, channel_dims: int = 0, generator: torch.Generator | None = None) -> Tensor:
    """``x`` with entries zeroed at rate ``p`` and the rest scaled by ``1 / keep_probability(p)``; ``channel_dims=k``
    drops whole channels (shared over the ``k`` trailing dimensions), as ``nn.Dropout{k}d`` does."""
    if p <= 0 or not isinstance(x, Tensor) or not x.is_floating_point():
        return x
    shape = x.shape
    if channel_dims and x.dim() >= channel_dims + 2:
        shape = x.shape[: x.dim() - channel_dims] + (1,) * channel_dims
    return x.masked_fill(drop_mask(shape, p, generator=generator, device=x.device), 0.0).mul_(1.0 / keep_probability(p))
