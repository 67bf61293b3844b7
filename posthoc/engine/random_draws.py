"""Normal draws that honour the caller's ``torch.Generator`` whatever device the tensors are on.

Draws are made on the generator's device and then moved, so a CPU generator gives the same numbers for a CPU and a
CUDA model.

Example:
    >>> import torch
    >>> from posthoc.engine.random_draws import randn
    >>> randn((2, 3), generator=torch.Generator().manual_seed(0), device="cpu").shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import torch
from torch import Tensor


def draw_device(generator: torch.Generator | None, device: torch.device | str) -> torch.device:
    """Where draws for ``device`` are made: on the generator's device if one is given."""
    return generator.device if generator is not None else torch.device(device)


def randn(
    shape: tuple[int, ...] | torch.Size,
    *,
    generator: torch.Generator | None,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Standard normal draws of ``shape`` on ``device``, from ``generator`` (on its own device) if given."""
    return torch.randn(shape, generator=generator, device=draw_device(generator, device), dtype=dtype).to(device)
