"""The corruptions of the shift harness, each a function of a batch of ``[0, 1]`` images and a severity.

Every corruption takes ``x`` of shape ``(N, C, H, W)`` (float, values in ``[0, 1]``), a severity from 1 to 5 and a
``torch.Generator`` on ``x``'s device, and returns a corrupted batch of the same shape and dtype, clipped to ``[0,
1]``. The parameter of each severity is in :data:`SEVERITIES`; the kinds follow ImageNet-C except the last three:

- ``gaussian-noise`` (std): ``x + N(0, std²)``; ``shot-noise`` (photons ``p``): ``Poisson(x·p) / p``;
  ``salt-pepper`` (fraction): each value set to 0 or 1 (half each);
- ``gaussian-blur`` (sigma in pixels at 224 px, scaled by the shorter side / 224, the side counted as at least 64 px
  so small images still blur);
- ``contrast`` (factor): blend towards the grey image mean; ``brightness``: added to the HSV value, hue and saturation
  kept; ``pixelate`` (side factor): box-downsample, then nearest-upsample; ``jpeg`` (quality; 1 or 3 channels);
- ``rotate`` (degrees), ``translate`` (fraction of the side along both axes, signs drawn per image) and ``occlude``
  (one black square, its side a fraction of the image's, drawn uniformly inside it): black fill.

:data:`EVALUATION_KINDS` are the kinds reported by default. No fit-time perturbation (:mod:`posthoc.engine.perturb`)
is one of them, so a shift-aware fit is always judged on kinds of shift it never saw. A dense model (a segmentation
map) is evaluated on :data:`DENSE_EVALUATION_KINDS`: :data:`MOVING_KINDS` would move the pixels away from their labels.

Example:
    >>> import torch
    >>> from posthoc.shift.kinds import CORRUPTIONS
    >>> x = torch.rand(2, 3, 32, 32)
    >>> CORRUPTIONS["contrast"](x, 5, torch.Generator().manual_seed(0)).std() < x.std()
    tensor(True)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torchvision.transforms.v2.functional as TF
from torch import Tensor
from torch.nn import functional as F

from posthoc.errors import InputError

Corruption = Callable[[Tensor, int, torch.Generator], Tensor]

#: the parameter of each kind at severities 1..5 (see the module docs for what it means)
SEVERITIES: dict[str, tuple[float, ...]] = {
    "gaussian-noise": (0.08, 0.12, 0.18, 0.26, 0.38),
    "shot-noise": (60, 25, 12, 5, 3),
    "salt-pepper": (0.03, 0.06, 0.09, 0.17, 0.27),
    "gaussian-blur": (1, 2, 3, 4, 6),
    "contrast": (0.4, 0.3, 0.2, 0.1, 0.05),
    "brightness": (0.1, 0.2, 0.3, 0.4, 0.5),
    "pixelate": (0.6, 0.5, 0.4, 0.3, 0.25),
    "jpeg": (25, 18, 15, 10, 7),
    "rotate": (15, 30, 45, 60, 90),
    "translate": (0.04, 0.08, 0.12, 0.16, 0.22),
    "occlude": (0.2, 0.3, 0.4, 0.5, 0.6),
}
#: the image side the ImageNet-C blur sigmas are defined at
REFERENCE_SIDE = 224
#: images smaller than this are blurred as if they had this side (keeps severity 1 visible on 28-px digits)
MIN_BLUR_SIDE = 64


def gaussian_noise(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    std = SEVERITIES["gaussian-noise"][severity - 1]
    noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    return (x + std * noise).clamp(0, 1)


def shot_noise(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    photons = SEVERITIES["shot-noise"][severity - 1]
    return (torch.poisson(x * photons, generator=generator) / photons).clamp(0, 1)


def salt_pepper(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    fraction = SEVERITIES["salt-pepper"][severity - 1]
    draw = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    out = x.masked_fill(draw < fraction / 2, 0.0)
    return out.masked_fill((draw >= fraction / 2) & (draw < fraction), 1.0)


def gaussian_blur(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    sigma = SEVERITIES["gaussian-blur"][severity - 1] * max(min(x.shape[-2:]), MIN_BLUR_SIDE) / REFERENCE_SIDE
    size = 2 * math.ceil(3 * sigma) + 1
    return TF.gaussian_blur(x, [size, size], [sigma, sigma]).clamp(0, 1)


def contrast(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    return TF.adjust_contrast(x, SEVERITIES["contrast"][severity - 1]).clamp(0, 1)


def brightness(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    """Add to the HSV value (the channel maximum) and rescale the channels alike, so hue and saturation stay."""
    shift = SEVERITIES["brightness"][severity - 1]
    value = x.amax(dim=-3, keepdim=True)
    brighter = (value + shift).clamp(0, 1)
    scaled = x * brighter / value.clamp_min(1e-12)
    return torch.where(value > 0, scaled, brighter.expand_as(x)).clamp(0, 1)


def pixelate(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    factor = SEVERITIES["pixelate"][severity - 1]
    height, width = x.shape[-2:]
    small = F.interpolate(x, size=(max(1, round(height * factor)), max(1, round(width * factor))), mode="area")
    return F.interpolate(small, size=(height, width), mode="nearest")


def jpeg(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    if x.shape[-3] not in (1, 3):
        raise InputError(f"jpeg needs 1 or 3 channels, got {x.shape[-3]}; choose another kind for these inputs")
    quality = SEVERITIES["jpeg"][severity - 1]
    as_bytes = (x * 255).round().to(torch.uint8).cpu()
    with warnings.catch_warnings():  # torchvision 0.29 announces a move of its codecs to torchcodec
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="torchvision")
        compressed = TF.jpeg(as_bytes, quality)
    return compressed.to(device=x.device, dtype=x.dtype) / 255


def rotate(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    return TF.rotate(x, SEVERITIES["rotate"][severity - 1], fill=0.0)


def translate(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    """Move each image by the severity's fraction of its height and width, each axis in a direction drawn per image."""
    fraction = SEVERITIES["translate"][severity - 1]
    height, width = x.shape[-2:]
    signs = torch.randint(0, 2, (x.shape[0], 2), generator=generator, device=x.device) * 2 - 1
    out = torch.zeros_like(x)
    for i, (dy, dx) in enumerate(
        (signs.cpu() * torch.tensor([round(fraction * height), round(fraction * width)])).tolist()
    ):
        src_y, dst_y = slice(max(0, -dy), height - max(0, dy)), slice(max(0, dy), height - max(0, -dy))
        src_x, dst_x = slice(max(0, -dx), width - max(0, dx)), slice(max(0, dx), width - max(0, -dx))
        out[i, :, dst_y, dst_x] = x[i, :, src_y, src_x]
    return out


def occlude(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    """Black out one square per image, its side the severity's fraction of the shorter side, placed uniformly."""
    height, width = x.shape[-2:]
    side = max(1, round(SEVERITIES["occlude"][severity - 1] * min(height, width)))
    top = torch.randint(0, height - side + 1, (x.shape[0],), generator=generator, device=x.device)
    left = torch.randint(0, width - side + 1, (x.shape[0],), generator=generator, device=x.device)
    rows = torch.arange(height, device=x.device).view(1, -1, 1)
    cols = torch.arange(width, device=x.device).view(1, 1, -1)
    inside = (
        (rows >= top.view(-1, 1, 1))
        & (rows < top.view(-1, 1, 1) + side)
        & (cols >= left.view(-1, 1, 1))
        & (cols < left.view(-1, 1, 1) + side)
    )
    return x.masked_fill(inside.unsqueeze(1), 0.0)


CORRUPTIONS: dict[str, Corruption] = {
    "gaussian-noise": gaussian_noise,
    "shot-noise": shot_noise,
    "salt-pepper": salt_pepper,
    "gaussian-blur": gaussian_blur,
    "contrast": contrast,
    "brightness": brightness,
    "pixelate": pixelate,
    "jpeg": jpeg,
    "rotate": rotate,
    "translate": translate,
    "occlude": occlude,
}
KINDS = tuple(CORRUPTIONS)
#: the kinds reported by default: none of them is a fit-time perturbation
EVALUATION_KINDS = ("rotate", "contrast", "translate", "occlude")
#: the kinds that move pixels: a label map (a segmentation mask) no longer lines up with the images they corrupt
MOVING_KINDS = ("rotate", "translate")
#: the kinds reported by default for a dense model: none moves a pixel (the masks stay right), none is a fit-time
#: perturbation
DENSE_EVALUATION_KINDS = ("contrast", "brightness", "occlude")
