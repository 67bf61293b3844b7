"""Images with a real target each, for an image regressor: a CSV file naming the images and their targets.

The CSV has a header row with an ``image`` column (a path relative to the CSV's folder, or absolute) and the
target column (e.g. ``age``); :class:`ImageTargets` yields ``(transform(image), target)`` with float targets,
ready for a ``DataLoader`` and ``posthoc.wrap(model, likelihood="regression")``.

Example:
    >>> rows = ImageTargets("faces/train.csv", "age", transform)  # an image folder  # doctest: +SKIP
    >>> x, y = rows[0]  # doctest: +SKIP
    >>> x.shape, y  # doctest: +SKIP
    (torch.Size([3, 224, 224]), tensor(31.))
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset

from posthoc.errors import InputError

IMAGE_COLUMN = "image"


class ImageTargets(Dataset):
    """``(transform(image), float32 target)`` rows of a CSV file with an ``image`` column and a ``target`` column."""

    def __init__(self, path: str | os.PathLike, target: str, transform: Callable[[Image.Image], Any]) -> None:
        self.path, self.transform = Path(path), transform
        if not self.path.is_file():
            raise InputError(
                f"no CSV file at {self.path}; image regression data is a CSV with '{IMAGE_COLUMN}' and "
                f"'{target}' columns"
            )
        with self.path.open(newline="") as handle:
            rows = list(csv.DictReader(handle))
        if not rows or IMAGE_COLUMN not in rows[0] or target not in rows[0]:
            columns = sorted(rows[0]) if rows else []
            raise InputError(f"{self.path} needs rows with '{IMAGE_COLUMN}' and '{target}' columns; it has {columns}")
        self.images, self.targets = [], []
        for line, row in enumerate(rows, start=2):
            try:
                self.targets.append(float(row[target]))
            except (TypeError, ValueError):
                raise InputError(f"{self.path}, line {line}: target {row[target]!r} is not a number") from None
            self.images.append(self.path.parent / row[IMAGE_COLUMN])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Any, torch.Tensor]:
        path = self.images[index]
        if not path.is_file():
            raise InputError(f"{self.path} names the image {path}, which does not exist")
        with Image.open(path) as image:
            return self.transform(image.convert("RGB")), torch.tensor(self.targets[index], dtype=torch.float32)
