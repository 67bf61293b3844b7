"""The augmentation families of ``"tta"``, one per input layout, and how the views of a batch are made.

Each family is a function ``(x, strength, generator, scale) -> x'`` acting on every example independently (so an
example's views do not depend on its neighbours); ``scale`` is the per-channel or per-feature std measured on the
training inputs at fit. Images get ``noise``, ``blur`` and ``zoom``, feature vectors ``feature-noise``, token ids none
(a replaced token changes the meaning of a text: pass callables). A strength multiplies the noise std, the blur sigma
and the zoom's log-range. None is a kind the evaluation reports (:data:`posthoc.shift.EVALUATION_KINDS`), so a
benchmark under those kinds measures shifts the augmentations never imitated.

Example:
    >>> import torch
    >>> from posthoc.methods.tta.augment import Views, families_for
    >>> views = Views(families_for(["noise", "zoom"], torch.zeros(2, 1, 8, 8)), views=3)
    >>> [v.shape for v in views.make(torch.rand(2, 1, 8, 8), 1.0, torch.Generator().manual_seed(0), torch.ones(1))]
    [torch.Size([2, 1, 8, 8]), torch.Size([2, 1, 8, 8]), torch.Size([2, 1, 8, 8])]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from posthoc.core.inputs import Inputs
from posthoc.engine.perturb import FEATURES, IMAGES, PIXELS, image_blur, input_layout, same_layout
from posthoc.errors import ConfigError

#: ``family(x, strength, generator, scale) -> x'``
Family = Callable[[Inputs, float, torch.Generator, Tensor], Inputs]
#: at strength 1: the noise std in units of the training std, the blur sigma as a fraction of the shorter side,
#: the zoom's largest factor
NOISE, BLUR, ZOOM = 0.1, 0.02, 1.05


def _pixels(x: Inputs) -> Tensor:
    return x[PIXELS] if isinstance(x, Mapping) else x


def _with_pixels(x: Inputs, pixels: Tensor) -> Inputs:
    return {**x, PIXELS: pixels} if isinstance(x, Mapping) else pixels


def image_noise(x: Inputs, strength: float, generator: torch.Generator, scale: Tensor) -> Inputs:
    """``x + NOISE · strength · std_c · N(0, 1)``, ``std_c`` the training std of channel ``c``."""
    images = _pixels(x)
    noise = torch.randn(images.shape, generator=generator, device=images.device, dtype=images.dtype)
    std = scale.to(images.device, images.dtype).view(1, -1, 1, 1)
    return _with_pixels(x, images + NOISE * strength * std * noise)


def image_blur_view(x: Inputs, strength: float, generator: torch.Generator, scale: Tensor) -> Inputs:
    """A Gaussian blur of sigma ``BLUR · strength · u ·`` the shorter side, ``u`` drawn in ``[0.5, 1.5)``."""
    u = 0.5 + float(torch.rand((), generator=generator, device=generator.device))
    return image_blur(x, BLUR * strength * u, generator)


def image_zoom(x: Inputs, strength: float, generator: torch.Generator, scale: Tensor) -> Inputs:
    """A zoom about the centre by ``ZOOM ** (strength · v)`` per example, ``v`` uniform in ``[-1, 1]``."""
    images = _pixels(x)
    n = images.shape[0]
    v = torch.rand(n, generator=generator, device=images.device, dtype=torch.float64) * 2 - 1
    factor = torch.exp(v * strength * math.log(ZOOM)).to(images.dtype if images.is_floating_point() else torch.float32)
    theta = torch.zeros(n, 2, 3, device=images.device, dtype=factor.dtype)
    theta[:, 0, 0] = theta[:, 1, 1] = 1 / factor  # a sampling grid shrunk by the factor: the image grows
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    zoomed = F.grid_sample(images.to(factor.dtype), grid, mode="bilinear", padding_mode="border", align_corners=False)
    return _with_pixels(x, zoomed.to(images.dtype))


def feature_noise(x: Inputs, strength: float, generator: torch.Generator, scale: Tensor) -> Inputs:
    """``x + NOISE · strength · std_j · N(0, 1)``, ``std_j`` the training std of feature ``j``."""
    noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    return x + NOISE * strength * scale.to(x.device, x.dtype) * noise


#: the built-in families by layout, in the order ``augmentations="auto"`` takes them
FAMILIES: dict[str, dict[str, Family]] = {
    IMAGES: {"noise": image_noise, "blur": image_blur_view, "zoom": image_zoom},
    FEATURES: {"feature-noise": feature_noise},
}
#: every built-in family name
FAMILY_NAMES = tuple(name for families in FAMILIES.values() for name in families)
#: the families that scale by a training std (measured at fit)
SCALED = ("noise", "feature-noise")


def check_augmentations(augmentations: Any) -> list[str | Callable[[Inputs], Inputs]] | str:
    """``"auto"``, or a non-empty list of built-in family names and callables ``x -> x'``; anything else is refused.

    Example:
        >>> from posthoc.methods.tta.augment import check_augmentations
        >>> check_augmentations(["noise", "rotate"])
        Traceback (most recent call last):
        posthoc.errors.ConfigError: augmentations[1]: unknown family 'rotate'...
    """
    if augmentations == "auto":
        return "auto"
    if isinstance(augmentations, str) or callable(augmentations):
        augmentations = [augmentations]
    if not isinstance(augmentations, (list, tuple)) or not augmentations:
        raise ConfigError(
            "augmentations must be 'auto' or a non-empty list of family names "
            f"({', '.join(FAMILY_NAMES)}) and callables x -> x', got {augmentations!r}"
        )
    for i, item in enumerate(augmentations):
        if isinstance(item, str):
            if item not in FAMILY_NAMES:
                raise ConfigError(
                    f"augmentations[{i}]: unknown family {item!r}; the built-in families are "
                    f"{', '.join(FAMILY_NAMES)} (images: noise, blur, zoom; feature vectors: "
                    "feature-noise), or pass a callable x -> x'. Rotation, contrast, translation and "
                    "occlusion are not offered: they are the shifts the evaluation reports"
                )
        elif not callable(item):
            raise ConfigError(
                f"augmentations[{i}] must be a family name or a callable x -> x', got {type(item).__name__} {item!r}"
            )
    return list(augmentations)


def families_for(augmentations: Sequence[str | Callable] | str, x: Inputs) -> list[tuple[str, Family]]:
    """The ``(name, family)`` pairs of ``augmentations`` for inputs like ``x`` (``"auto"``: every built-in family of
    their layout); a callable ``f`` becomes a family that ignores the strength. A built-in family that does not suit
    the inputs, or ``"auto"`` for a layout without families, is refused, saying what does.

    Example:
        >>> import torch
        >>> from posthoc.methods.tta.augment import families_for
        >>> [name for name, _ in families_for("auto", torch.zeros(4, 3))]
        ['feature-noise']
    """
    layout, what = input_layout(x)
    suited = FAMILIES.get(layout, {})
    if augmentations == "auto":
        if not suited:
            raise ConfigError(
                f"tta has no built-in augmentation for {what} (images (N, C, H, W) get noise, blur "
                "and zoom; feature vectors (N, D) feature-noise; token ids none, a replaced token can "
                "change the meaning): pass augmentations=[callable, ...], each x -> x'"
            )
        return list(suited.items())
    found: list[tuple[str, Family]] = []
    for i, item in enumerate(augmentations):
        if isinstance(item, str):
            if item not in suited:
                instead = f"those that do: {', '.join(suited)}" if suited else "no built-in family does"
                raise ConfigError(
                    f"augmentations[{i}]: the family {item!r} does not suit the inputs ({what}); "
                    f"{instead}, or pass a callable x -> x'"
                )
            found.append((item, suited[item]))
        else:
            found.append((f"augmentations[{i}]", _user_family(item, i)))
    return found


def _user_family(function: Callable[[Inputs], Inputs], position: int) -> Family:
    """A user's ``x -> x'`` as a family, checked on every call to keep the inputs' kind and shape."""
    name = f"augmentations[{position}] ({getattr(function, '__name__', type(function).__name__)})"

    def family(x: Inputs, strength: float, generator: torch.Generator, scale: Tensor) -> Inputs:
        return same_layout(function(x), x, name, "an augmentation", "augmented")

    return family


@dataclass(frozen=True)
class Views:
    """``views`` views of a batch: the identity first, then the families in turn, one per view."""

    families: list[tuple[str, Family]]
    views: int

    def family_of(self, view: int) -> tuple[str, Family] | None:
        """The family of view ``view`` (``None``: the identity)."""
        return None if view == 0 else self.families[(view - 1) % len(self.families)]

    def make(
        self, x: Inputs, strength: float, generator: torch.Generator, scale: Tensor, which: range | None = None
    ) -> list[Inputs]:
        """The views ``which`` (default: all) of ``x``, drawing from ``generator`` in view order."""
        out = []
        for view in which if which is not None else range(self.views):
            family = self.family_of(view)
            out.append(x if family is None else family[1](x, strength, generator, scale))
        return out


def concat(parts: list[Inputs]) -> Inputs:
    """Batches of the same kind concatenated along examples (a dict key by key)."""
    if isinstance(parts[0], Mapping):
        return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
    return torch.cat(parts)
