"""``posthoc.shift.corrupt``: a loader whose batches are corrupted on the fly, seeded and reproducible.

Inputs are images ``(N, C, H, W)``: float in ``[0, 1]``, ``uint8``, or float normalised by the model's preprocessing
(then pass ``normalization=(mean, std)``: each batch is un-normalised to ``[0, 1]``, where ImageNet-C defines the
corruptions, corrupted, clipped and normalised again). Dict inputs (Hugging Face) have their ``pixel_values``
corrupted. The draws of a pass come from one generator seeded with ``seed`` at its start, so two passes over the same
batches see identical corruptions.

Example:
    >>> import torch
    >>> import posthoc
    >>> images = (torch.rand(16, 1, 28, 28) - 0.1307) / 0.3081           # normalised images (N, C, H, W)
    >>> digits = [(images, torch.arange(16) % 8)]
    >>> noisy = posthoc.shift.corrupt(digits, "gaussian-noise", 3, normalization=((0.1307,), (0.3081,)))
    >>> from posthoc_apps.demo import zoo
    >>> report = posthoc.evaluate(posthoc.wrap(zoo.pretrained(), method="none"), noisy, progress=False)
    >>> 0 <= report.ece <= 1
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from posthoc.core.checks import generator as check_generator
from posthoc.core.checks import integer
from posthoc.core.inputs import batch_size, check_batch, check_label_count, check_loader
from posthoc.errors import ConfigError, InputError
from posthoc.shift.kinds import CORRUPTIONS, KINDS

Normalization = tuple[Sequence[float] | float, Sequence[float] | float]
#: how far outside [0, 1] float inputs may stray (rounding) before they count as normalised
RANGE_TOLERANCE = 1e-3
PIXELS = "pixel_values"


def check_kind(kind: str, severity: int) -> None:
    """Refuse an unknown ``kind`` (listing the valid ones) or a severity outside 1..5."""
    if kind not in CORRUPTIONS:
        raise ConfigError(f"unknown corruption kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    if isinstance(severity, bool) or not isinstance(severity, int) or not 1 <= severity <= 5:
        raise ConfigError(f"severity must be an integer from 1 to 5, got {severity!r}")


def check_normalization(normalization: Any) -> None:
    """Refuse a ``normalization`` that is not ``(mean, std)`` of finite numbers with every std > 0.

    Example:
        >>> from posthoc.shift.loader import check_normalization
        >>> check_normalization(((0.5,), (0.0,)))
        Traceback (most recent call last):
        posthoc.errors.ConfigError: normalization std must be finite and > 0 for every channel...
    """
    if normalization is None:
        return
    if not isinstance(normalization, (tuple, list)) or len(normalization) != 2:
        raise ConfigError(
            f"normalization must be a pair (mean, std) of the model's preprocessing, got {normalization!r}"
        )
    try:
        mean, std = (torch.as_tensor(part, dtype=torch.float64).flatten() for part in normalization)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ConfigError(
            f"normalization must be (mean, std) of numbers, per channel or scalars, got {normalization!r}"
        ) from err
    if not bool(torch.isfinite(mean).all()) or mean.numel() == 0:
        raise ConfigError(f"normalization mean must be finite numbers, got {mean.tolist()}")
    if std.numel() == 0 or not bool((torch.isfinite(std) & (std > 0)).all()):
        raise ConfigError(
            f"normalization std must be finite and > 0 for every channel, got {std.tolist()}: pass the "
            "std the model's preprocessing divides by (e.g. (0.229, 0.224, 0.225) for ImageNet)"
        )


def _per_channel(values: Sequence[float] | float, like: Tensor, what: str) -> Tensor:
    tensor = torch.as_tensor(values, dtype=like.dtype, device=like.device).flatten()
    if tensor.numel() not in (1, like.shape[1]):
        raise ConfigError(
            f"normalization {what} has {tensor.numel()} values for {like.shape[1]} channels; "
            "give one per channel or one for all"
        )
    return tensor.view(1, -1, 1, 1)


def corrupt_images(
    x: Tensor, kind: str, severity: int, generator: torch.Generator, normalization: Normalization | None = None
) -> Tensor:
    """One batch of images corrupted by ``kind`` at ``severity`` (same shape, dtype and device).

    Example:
        >>> import torch
        >>> from posthoc.shift.loader import corrupt_images
        >>> corrupt_images(torch.rand(4, 1, 28, 28), "shot-noise", 2, torch.Generator().manual_seed(0)).shape
        torch.Size([4, 1, 28, 28])
    """
    check_kind(kind, severity)
    check_normalization(normalization)
    check_generator(generator)
    check_batch(x, "posthoc.shift.corrupt")
    if not isinstance(x, Tensor) or x.dim() != 4:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise InputError(f"corruptions need image batches (N, C, H, W), got {shape}")
    if x.dtype == torch.uint8:
        if normalization is not None:
            raise ConfigError("uint8 images are not normalised; leave normalization=None")
        return (corrupt_images(x.float() / 255, kind, severity, generator) * 255).round().to(torch.uint8)
    if not x.is_floating_point():
        raise InputError(f"images must be float or uint8, got {x.dtype}")
    work = x.float()
    if normalization is not None:
        mean, std = _per_channel(normalization[0], work, "mean"), _per_channel(normalization[1], work, "std")
        work = work * std + mean
    low, high = float(work.min()), float(work.max())
    if low < -RANGE_TOLERANCE or high > 1 + RANGE_TOLERANCE:
        hint = (
            "check the normalization's mean and std"
            if normalization is not None
            else "pass normalization=(mean, std) of the model's preprocessing"
        )
        raise InputError(f"images must lie in [0, 1] before corruption, got values in [{low:.3g}, {high:.3g}]; {hint}")
    out = CORRUPTIONS[kind](work.clamp(0, 1), severity, generator)
    if normalization is not None:
        out = (out - mean) / std
    return out.to(x.dtype)


def _corrupt_inputs(
    x: Any, kind: str, severity: int, generator: torch.Generator, normalization: Normalization | None
) -> Any:
    if isinstance(x, Mapping):
        if PIXELS not in x:
            raise InputError(
                f"dict inputs are corrupted through their {PIXELS!r} entry; this dict has "
                f"{sorted(x)}: corrupt the images before tokenising/processing them instead"
            )
        return {**x, PIXELS: corrupt_images(x[PIXELS], kind, severity, generator, normalization)}
    return corrupt_images(x, kind, severity, generator, normalization)


class CorruptedLoader:
    """Iterates ``loader`` and corrupts the inputs of every batch (labels and other entries pass through)."""

    def __init__(
        self, loader: Iterable, kind: str, severity: int, *, seed: int = 0, normalization: Normalization | None = None
    ) -> None:
        check_kind(kind, severity)
        check_normalization(normalization)
        integer(seed, "seed")
        check_loader(loader, "posthoc.shift.corrupt")
        self.loader, self.kind, self.severity, self.seed, self.normalization = (
            loader,
            kind,
            severity,
            seed,
            normalization,
        )

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"CorruptedLoader({self.kind!r}, severity={self.severity}, seed={self.seed})"

    def __iter__(self) -> Iterator[Any]:
        generators: dict[torch.device, torch.Generator] = {}
        for index, batch in enumerate(self.loader):
            x = batch[0] if isinstance(batch, (tuple, list)) else batch
            tensor = x.get(PIXELS) if isinstance(x, Mapping) else x
            device = tensor.device if isinstance(tensor, Tensor) else torch.device("cpu")
            if device not in generators:
                generators[device] = torch.Generator(device=device).manual_seed(self.seed)
            corrupted = _corrupt_inputs(x, self.kind, self.severity, generators[device], self.normalization)
            if isinstance(batch, (tuple, list)) and len(batch) >= 2 and isinstance(x, (Tensor, Mapping)):
                check_label_count(
                    batch_size(x), torch.as_tensor(batch[1]), f"batch {index} (0-based) of the loader to corrupt"
                )
            yield (corrupted, *batch[1:]) if isinstance(batch, (tuple, list)) else corrupted
        if not generators:
            raise InputError("the loader to corrupt yielded no batches; pass a non-empty loader")


def corrupt(
    loader: Iterable, kind: str, severity: int, seed: int = 0, *, normalization: Normalization | None = None
) -> CorruptedLoader:
    """Wrap ``loader`` so that each batch's images are corrupted by ``kind`` (:mod:`posthoc.shift.kinds`) at
    ``severity`` (1..5)."""
    return CorruptedLoader(loader, kind, severity, seed=seed, normalization=normalization)
