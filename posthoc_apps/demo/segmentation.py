"""Segmentation masks made from the bundled MNIST digits, and a small fully convolutional network trained on them.

Each canvas (``SIZE x SIZE``, one channel) holds :data:`DIGITS` digits, each shrunk to 14 x 14 and placed at a seeded
random spot (a later digit covers an earlier one). A pixel of a digit is labelled with the digit's class plus one,
the background 0, and a thin band on every digit's boundary (the pixels just outside it: the dilated digit less the digit) is
:data:`IGNORE` (255), as in Pascal VOC: the boundary is where a label is least sure. :func:`fcn` is a small fully
convolutional network (a strided convolution, dilated convolutions, an upsampling to full resolution, dropout and a
final ``1 x 1`` convolution, the head) whose logits are ``(N, 11, SIZE, SIZE)``; :func:`trained_fcn` trains it in a few
seconds, deterministically by seed.

Example:
    >>> from posthoc_apps.demo.segmentation import segmentation_data
    >>> data = segmentation_data(train=64, val=32, test=32)
    >>> images, masks = data.train.tensors
    >>> tuple(images.shape), tuple(masks.shape), int(masks.max())
    ((64, 1, 32, 32), (64, 32, 32), 255)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from posthoc_apps.demo.data import _mnist

#: side of a canvas, in pixels
SIZE = 32
#: digits per canvas
DIGITS = 2
#: classes of a pixel: the background and the ten digits
NUM_CLASSES = 11
#: the label of a pixel on a digit's boundary, ignored by fits and metrics (Pascal VOC's)
IGNORE = 255
#: a shrunk digit's pixels at or above this intensity (of 1) belong to it
INK = 0.3


@dataclass(frozen=True)
class SegmentationData:
    """Three seeded splits of ``(image, mask)`` pairs: ``train``, ``val`` and ``test``."""

    train: TensorDataset
    val: TensorDataset
    test: TensorDataset


def canvases(pixels: np.ndarray, labels: np.ndarray, count: int, seed: int) -> TensorDataset:
    """``count`` canvases with their masks, each of :data:`DIGITS` digits drawn (seeded) from ``pixels`` (MNIST rows).

    Example:
        >>> import numpy as np
        >>> from posthoc_apps.demo.segmentation import canvases
        >>> ink = np.zeros((2, 784), dtype=np.uint8); ink[:, 300:480] = 255
        >>> images, masks = canvases(ink, np.array([3, 7]), 4, seed=0).tensors
        >>> sorted(set(masks.unique().tolist()) - {0, 255}) in ([4], [8], [4, 8])
        True
    """
    rng = np.random.default_rng(seed)
    digits = torch.as_tensor(pixels, dtype=torch.float32).reshape(-1, 1, 28, 28) / 255.0
    small = F.avg_pool2d(digits, 2)  # (M, 1, 14, 14)
    images = torch.zeros(count, 1, SIZE, SIZE)
    masks = torch.zeros(count, SIZE, SIZE, dtype=torch.long)
    for n in range(count):
        for _ in range(DIGITS):
            pick = int(rng.integers(len(small)))
            top, left = (int(v) for v in rng.integers(0, SIZE - 14 + 1, size=2))
            ink = small[pick, 0]
            inside = ink >= INK
            window = (slice(top, top + 14), slice(left, left + 14))
            images[n, 0][window] = torch.maximum(images[n, 0][window], ink)
            masks[n][window][inside] = int(labels[pick]) + 1
    digit = (masks > 0).float()[:, None]
    dilated = F.max_pool2d(digit, 3, stride=1, padding=1)
    band = (dilated - digit)[:, 0] > 0
    masks[band] = IGNORE
    return TensorDataset((images - 0.1) / 0.3, masks)


def segmentation_data(train: int = 512, val: int = 256, test: int = 256, seed: int = 0) -> SegmentationData:
    """The three splits, their digits drawn from disjoint parts of the bundled MNIST digits (train and val from 4,000 of them, test from the other
    1,000), seeded."""
    pixels, labels = _mnist()
    order = np.random.default_rng(seed).permutation(len(labels))  # the bundled digits come sorted by class
    fit, held = order[:4000], order[4000:]
    return SegmentationData(
        train=canvases(pixels[fit], labels[fit], train, seed),
        val=canvases(pixels[fit], labels[fit], val, seed + 1),
        test=canvases(pixels[held], labels[held], test, seed + 2),
    )


class FCN(nn.Module):
    """A small fully convolutional network: logits ``(N, 11, H, W)`` at the input's resolution; its head is the last
    module, a ``1 x 1`` convolution after a dropout."""

    def __init__(self, width: int = 16, dropout: float = 0.1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, padding=2, dilation=2),
            nn.ReLU(),
        )
        self.refine = nn.Conv2d(2 * width + 1, width, 3, padding=1)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Conv2d(width, NUM_CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        coarse = F.interpolate(self.body(x), size=x.shape[-2:], mode="bilinear", align_corners=False)
        features = F.relu(self.refine(torch.cat([coarse, x], dim=1)))  # the input's pixels sharpen the boundaries
        return self.head(self.dropout(features))


def fcn(seed: int = 0) -> FCN:
    """An untrained :class:`FCN`, its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return FCN()


def trained_fcn(data: TensorDataset, epochs: int = 8, seed: int = 0, batch_size: int = 32) -> FCN:
    """:func:`fcn` trained on ``data`` by Adam (cross-entropy, :data:`IGNORE` ignored); deterministic by ``seed``.

    Example:
        >>> from posthoc_apps.demo.segmentation import segmentation_data, trained_fcn
        >>> data = segmentation_data(train=64, val=8, test=8)
        >>> model = trained_fcn(data.train, epochs=1)
        >>> tuple(model(data.val.tensors[0]).shape)
        (8, 11, 32, 32)
    """
    model = fcn(seed)
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    order = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for images, masks in DataLoader(data, batch_size=batch_size, shuffle=True, generator=order):
            optimiser.zero_grad()
            F.cross_entropy(model(images), masks, ignore_index=IGNORE).backward()
            optimiser.step()
    return model.eval()


def loaders(data: SegmentationData, batch_size: int = 64) -> tuple[DataLoader, DataLoader, DataLoader]:
    """Loaders of ``(image, mask)`` over the train, val and test splits (not shuffled: the fits are deterministic)."""
    return tuple(DataLoader(split, batch_size=batch_size) for split in (data.train, data.val, data.test))


#: the noise std of :func:`smoothed_targets`
REGRESSION_NOISE = 0.1


def smoothed_targets(images: torch.Tensor, seed: int, noise: float = REGRESSION_NOISE) -> torch.Tensor:
    """A per-pixel regression target for canvases ``images`` (a stand-in for depth): a smoothed copy of each canvas
    times 2 plus Gaussian noise of std ``noise`` (seeded), NaN on the top two rows (pixels without a target)."""
    drawn = noise * torch.randn(images.shape, generator=torch.Generator().manual_seed(seed))
    targets = F.avg_pool2d(images, 5, 1, 2) * 2 + drawn
    targets[..., :2, :] = float("nan")
    return targets


def trained_pixel_regressor(
    train: int = 128, val: int = 64, test: int = 64, epochs: int = 8
) -> tuple[nn.Module, list[TensorDataset]]:
    """A small fully convolutional regressor of :func:`smoothed_targets` (one output per pixel, dropout before its
    ``1 x 1`` head), trained by Adam on the squared error of the pixels with a target, and its train, val and test
    sets of ``(canvas, target)``; deterministic (seed 0).

    Example:
        >>> from posthoc_apps.demo.segmentation import trained_pixel_regressor
        >>> net, (train, val, test) = trained_pixel_regressor(train=16, val=4, test=4, epochs=1)
        >>> tuple(net(test.tensors[0]).shape), tuple(test.tensors[1].shape)
        ((4, 1, 32, 32), (4, 1, 32, 32))
    """
    data = segmentation_data(train=train, val=val, test=test)
    splits = (data.train, data.val, data.test)
    sets = [TensorDataset(d.tensors[0], smoothed_targets(d.tensors[0], i)) for i, d in enumerate(splits)]
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Dropout(0.1),
        nn.Conv2d(8, 1, 1),
    )  # fmt: skip
    optimiser = torch.optim.Adam(net.parameters(), 1e-2)
    for _ in range(epochs):
        for x, t in DataLoader(sets[0], batch_size=32, shuffle=True):
            loss = (net(x) - torch.nan_to_num(t))[torch.isfinite(t)].pow(2).mean()
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    return net.eval(), sets
