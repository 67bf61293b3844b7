"""Overconfident tabular classifiers, trained in a second on data scikit-learn ships: what a deployed model looks like.

A small MLP (``features-64-64-classes`` with ReLU and dropout) trained full-batch by Adam for 400 steps on
standardised features reaches a training NLL near zero: it is overconfident, and its held-out NLL is a handful of
confident mistakes at many nats each. That is the case post-hoc calibration exists for, and the case the selection
step (:mod:`posthoc.engine.selection`) has to get right: a few mistakes carry the whole gain.

The data: ``"breast_cancer"`` (569 rows, 30 features, 2 classes), ``"digits"`` (the 8×8 digits as 64 features, 1,797
rows, 10 classes) and ``"wine"`` (178 rows, 13 features, 3 classes), each split at random (seeded) into the rows the
model is trained on and the held-out *pool* that validation and test sets are drawn from.

Example:
    >>> from posthoc_apps.demo.tabular import load, overfit_mlp
    >>> splits = load("breast_cancer", seed=0)
    >>> splits.train[0].shape, splits.pool[0].shape, splits.num_classes
    (torch.Size([284, 30]), torch.Size([285, 30]), 2)
    >>> model = overfit_mlp(splits, seed=0)
    >>> model(splits.pool[0][:2]).shape
    torch.Size([2, 2])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from posthoc.core.threads import single_thread_if

#: the datasets, by name: scikit-learn's loader of each (all ship with scikit-learn; nothing is downloaded)
DATASETS = ("breast_cancer", "digits", "wine")
#: the share of the rows the model is trained on (the rest is the held-out pool)
TRAIN_SHARE = 0.5


@dataclass(frozen=True)
class TabularSplits:
    """Standardised features (by the training rows' mean and spread) and labels: ``train`` and the held-out ``pool``."""

    name: str
    train: tuple[Tensor, Tensor]
    pool: tuple[Tensor, Tensor]
    num_classes: int


def _loader(name: str) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
    from sklearn import datasets

    found = {"breast_cancer": datasets.load_breast_cancer, "digits": datasets.load_digits, "wine": datasets.load_wine}
    if name not in found:
        raise ValueError(f"unknown tabular dataset {name!r}; one of {list(DATASETS)}")
    return lambda: found[name](return_X_y=True)


def load(name: str, *, seed: int = 0) -> TabularSplits:
    """One of :data:`DATASETS`, split at random (``seed``) into training rows and the held-out pool."""
    features, labels = _loader(name)()
    x = torch.as_tensor(features, dtype=torch.float32)
    y = torch.as_tensor(labels, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(TRAIN_SHARE * len(y))
    train, pool = order[:cut], order[cut:]
    mean, std = x[train].mean(0), x[train].std(0)
    std = torch.where(
        std > 1e-6, std, torch.ones_like(std)
    )  # a feature constant in training stays as it is (as StandardScaler)
    x = (x - mean) / std
    return TabularSplits(name, (x[train], y[train]), (x[pool], y[pool]), int(y.max()) + 1)


def overfit_mlp(
    splits: TabularSplits, *, seed: int = 0, steps: int = 400, hidden: int = 64, dropout: float = 0.2
) -> nn.Module:
    """A ``features-64-64-classes`` ReLU MLP with dropout, trained full-batch by Adam (lr 3e-3) for ``steps`` steps on
    ``splits.train`` (in float64), returned in float32 and eval mode: overconfident on held-out data."""
    x, y = splits.train
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(x.shape[1], hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, splits.num_classes),
    )
    model.double()  # trained in float64, so that every CPU trains the same model (float32 sums differ in the last bits)
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    with single_thread_if(True):  # a few hundred rows: more threads only wait on each other
        for _ in range(steps):
            optimiser.zero_grad()
            nn.functional.cross_entropy(model(x.double()), y).backward()
            optimiser.step()
    return model.float().eval()
