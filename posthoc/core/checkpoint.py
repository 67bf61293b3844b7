"""Loading a checkpoint's ``state_dict`` into a model strictly, with the keys that do not fit listed.

A checkpoint file holds a ``state_dict`` (optionally under one of :data:`STATE_DICT_KEYS`; a DistributedDataParallel
``module.`` prefix is stripped).

Example:
    >>> import tempfile, torch
    >>> from torch import nn
    >>> from posthoc.core.checkpoint import load_checkpoint
    >>> path = f"{tempfile.mkdtemp()}/linear.pt"
    >>> torch.save(nn.Linear(3, 2).state_dict(), path)
    >>> load_checkpoint(nn.Linear(3, 2), path)
    Linear(in_features=3, out_features=2, bias=True)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posthoc.errors import InputError

STATE_DICT_KEYS = ("state_dict", "model", "model_state_dict", "state_dict_ema")
SHOWN_KEYS = 12


def _state_dict_of(loaded: Any, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    if isinstance(loaded, nn.Module):
        loaded = loaded.state_dict()
    if isinstance(loaded, Mapping):
        for key in STATE_DICT_KEYS:
            if isinstance(loaded.get(key), Mapping):
                loaded = loaded[key]
                break
    if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise InputError(
            f"{path} does not hold a state_dict (a dict of tensors, possibly under one of {STATE_DICT_KEYS}); "
            "save it with torch.save(model.state_dict(), path)"
        )
    if loaded and all(k.startswith("module.") for k in loaded):
        loaded = {k[len("module.") :]: v for k, v in loaded.items()}
    return dict(loaded)


def _listing(keys: list[str]) -> str:
    shown = ", ".join(keys[:SHOWN_KEYS])
    return shown + (f", ... ({len(keys) - SHOWN_KEYS} more)" if len(keys) > SHOWN_KEYS else "")


def load_checkpoint(model: nn.Module, path: str | os.PathLike, *, architecture: str = "the model") -> nn.Module:
    """Load the ``state_dict`` stored at ``path`` into ``model`` strictly (an :class:`~posthoc.InputError` lists the
    missing, unexpected and mis-shaped keys); return ``model``."""
    if not Path(path).is_file():
        raise InputError(f"checkpoint {path} does not exist")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle / zip errors come in many types
        raise InputError(
            f"could not read checkpoint {path} with torch.load(weights_only=True): {err}. Save plain "
            "state_dicts (torch.save(model.state_dict(), path))"
        ) from err
    state = _state_dict_of(loaded, path)
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mis_shaped = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or mis_shaped:
        parts = [f"checkpoint {path} does not fit {architecture}:"]
        if missing:
            parts.append(f"missing keys ({len(missing)}): {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {_listing(unexpected)}")
        if mis_shaped:
            parts.append(f"shape mismatches, checkpoint vs model ({len(mis_shaped)}): {_listing(mis_shaped)}")
        parts.append(
            "Check the architecture name and --num-classes (a different head size shows as a shape mismatch "
            "in the classifier weights)."
        )
        raise InputError("\n  ".join(parts))
    model.load_state_dict(state)
    return model
