"""Checks of an ensemble's members at wrap: count, type, device, classes.

Example:
    >>> from torch import nn
    >>> from posthoc.methods.ensemble.members import check_members
    >>> from posthoc_apps.demo.examples import net_a, net_b, net_c
    >>> check_members([net_a, net_b, net_c])                      # three classifiers of three classes: fine
    >>> check_members([net_a, nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 2))])
    Traceback (most recent call last):
    posthoc.errors.ConfigError: ensemble members must predict the same classes; their heads have member 0: 3, member 1: 2 outputs
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from posthoc.engine.head import find_head
from posthoc.errors import ConfigError, HeadNotFoundError


def _device(model: nn.Module) -> torch.device:
    return next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))


def _head_classes(model: nn.Module) -> int | None:
    """The output size of the model's head where it can be found without running the model."""
    try:
        _, head = find_head(model)
    except HeadNotFoundError:
        return None
    return getattr(head, "out_features", None)


def check_members(models: Sequence[object]) -> None:
    """Refuse an empty list, members that are not modules, members on different devices, and members whose
    heads (where they can be found) give different numbers of classes. Members whose heads cannot be found
    are compared on their outputs when they first predict."""
    if len(models) == 0:
        raise ConfigError("an ensemble needs at least one model; got an empty list")
    for index, model in enumerate(models):
        if not isinstance(model, nn.Module):
            raise ConfigError(f"ensemble member {index} must be a torch.nn.Module, got {type(model).__name__}")
    devices = [_device(model) for model in models]
    if len(set(devices)) > 1:
        listing = ", ".join(f"member {i}: {d}" for i, d in enumerate(devices))
        raise ConfigError(f"ensemble members must be on one device; got {listing}. Move them with .to(device) first")
    classes = [_head_classes(model) for model in models]
    known = {c for c in classes if c is not None}
    if len(known) > 1:
        listing = ", ".join(f"member {i}: {c}" for i, c in enumerate(classes) if c is not None)
        raise ConfigError(f"ensemble members must predict the same classes; their heads have {listing} outputs")
