"""What :meth:`UncertainModel.fit` saw and spent: examples in its loaders, wall and CPU seconds.

The example counts never cost a second pass over the data: ``len(loader.dataset)`` where the loader has one, else a
:class:`CountingLoader` counts the first full pass the methods make.

Example:
    >>> import torch
    >>> from posthoc.core.fit_record import counting, examples
    >>> batches = [(torch.zeros(3, 2), torch.zeros(3)), (torch.zeros(2, 2), torch.zeros(2))]
    >>> loader = counting(batches)
    >>> [len(x) for x, _ in loader]
    [3, 2]
    >>> examples(loader)
    5
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

from posthoc.core.inputs import batch_size, split_batch
from posthoc.errors import InputError


@dataclass(frozen=True)
class FitRecord:
    """The data a fit saw (``None``: no loader, or its size unknown) and its cost; saved with the posterior."""

    train_examples: int | None
    val_examples: int | None
    wall_seconds: float
    cpu_seconds: float
    #: the fit's feature store (posthoc.engine.feature_store): ``mode`` (``"memory"``, ``"memory-mapped"`` or
    #: ``"recomputed"``), the rows the backbone computed for it and those read back
    features: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, int | float | None]:
        """Plain Python values (what the posterior file stores)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> FitRecord | None:
        """The record saved by :meth:`to_dict`; ``None`` for files written before records were saved."""
        if not values:
            return None
        return cls(**{field.name: values.get(field.name) for field in fields(cls)})


class CountingLoader:
    """An iterable passing ``loader``'s batches through unchanged and counting the examples of its first full pass."""

    def __init__(self, loader: Iterable) -> None:
        self.loader = loader
        self.examples: int | None = None

    def __iter__(self) -> Iterator[Any]:
        count: int | None = 0
        for batch in self.loader:
            count = None if count is None else _add_examples(count, batch)
            yield batch
        if self.examples is None:
            self.examples = count

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]  # a TypeError for unsized loaders, as len() gives


def reads_once(loader: Iterable) -> bool:
    """Whether ``loader`` (or the loader a :class:`CountingLoader` wraps) is a one-shot iterator, e.g. a generator."""
    inner = loader.loader if isinstance(loader, CountingLoader) else loader
    return iter(inner) is inner


def counting(loader: Iterable | None) -> Iterable | None:
    """``loader`` itself when ``len(loader.dataset)`` tells its size, else a :class:`CountingLoader` around it."""
    if loader is None or dataset_size(loader) is not None:
        return loader
    return CountingLoader(loader)


def examples(loader: Iterable | None) -> int | None:
    """Examples in a loader returned by :func:`counting` (``None``: no loader, or not run through)."""
    if loader is None:
        return None
    if isinstance(loader, CountingLoader):
        return loader.examples
    return dataset_size(loader)


def dataset_size(loader: Iterable) -> int | None:
    """``len(loader.dataset)``, or ``None`` when the loader has no sized dataset."""
    try:
        return len(loader.dataset)  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        return None


def _add_examples(count: int, batch: Any) -> int | None:
    """``count`` plus the examples of ``batch``; ``None`` for a batch whose size cannot be read."""
    try:
        return count + batch_size(split_batch(batch, require_labels=False)[0])
    except (InputError, AttributeError):  # not (x, y) with a tensor x: the method that reads it says why
        return None
