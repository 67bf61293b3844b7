"""Plain-Python records kept in a method's buffers, so that they are saved and loaded with its posterior.

Which layers a method read, what a held-out choice decided: stored as UTF-8 JSON in a ``uint8`` buffer.

Example:
    >>> from posthoc.core.json_state import as_record, record_tensor
    >>> as_record(record_tensor({"chosen": "laplace", "tolerance": 0.005}))
    {'chosen': 'laplace', 'tolerance': 0.005}
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from torch import Tensor


def record_tensor(value: Any, device: torch.device | str | None = None) -> Tensor:
    """``value`` (JSON-able) as a ``uint8`` tensor of its JSON text; non-finite floats are written as strings."""
    text = json.dumps(_finite(value), sort_keys=False)
    return torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)


def as_record(tensor: Tensor | None) -> Any:
    """The value :func:`record_tensor` stored (``None`` for no tensor)."""
    if tensor is None:
        return None
    return json.loads(bytes(tensor.cpu().tolist()).decode())


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
