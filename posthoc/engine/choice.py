"""The runner of a held-out choice: a method's :class:`~posthoc.core.knob.Knob` through the selection step.

:func:`make_choice` scores the knob's candidates on the held-out data (:mod:`posthoc.engine.selection`), keeps the
record on the method and applies the chosen value.

Example:
    >>> import posthoc
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 3)).eval()
    >>> method = posthoc.wrap(net, method="mc-dropout", p="auto").method
    >>> method.knob().name, method.knob().values()[:3]
    ('dropout rate', [0.0, 0.01, 0.02])
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from posthoc.core.json_state import record_tensor
from posthoc.core.method import Method
from posthoc.core.modules import eval_mode
from posthoc.engine.held_out import HeldOut
from posthoc.engine.selection import Selection, warn_fallback


def makes_choice(method: Method) -> bool:
    """Whether ``method`` makes a held-out choice (declares a :meth:`~posthoc.core.method.Method.knob`)."""
    return method.knob() is not None


def make_choice(
    method: Method, held_out: HeldOut, *, train_loader: Iterable | None = None, progress: bool = True
) -> None:
    """Make ``method``'s held-out choice on ``held_out`` (nothing if it declares no knob)."""
    knob = method.knob()
    if knob is None:
        return
    if knob.choose is not None:
        selection = knob.choose(held_out, train_loader, progress)
        if selection is not None:
            record_selection(method, selection)
        return
    with torch.no_grad(), eval_mode(method.model):
        data = held_out if knob.prepare is None else knob.prepare(held_out, train_loader)
        selection = held_out.select(
            list(knob.candidates),
            lambda index: knob.score(knob.candidates[index][1], data),
            knob=knob.name,
            walk=True,
            start=knob.start_index(),
        )
    if knob.fallback is not None:
        who, kept, advice = knob.fallback
        warn_fallback(selection, method=who, fallback=kept, advice=advice, stacklevel=4)
    record_selection(method, selection)
    knob.apply(selection.value)
    if knob.then is not None:
        knob.then(selection, held_out, train_loader, progress)


def record_selection(method: Method, selection: Selection) -> None:
    """Keep ``selection`` on ``method`` for the model card and the file (the object in ``method.last_selection``)."""
    method.selection_record = record_tensor(selection.to_dict(), method.device)
    method.__dict__["_last_selection"] = selection


def training_rows(method: Method, train_loader: Iterable | None) -> Iterable | None:
    """What ``method`` chooses on when ``fit`` gets no ``val_loader`` (``None``: no choice is made then)."""
    knob = method.knob()
    if knob is None or knob.training_rows is None:
        return None
    return knob.training_rows(train_loader)


def movable(method: Any) -> bool:
    """Whether ``method``'s knob sets another candidate at once (a stacked calibrator then re-chooses it per fold)."""
    knob = method.knob() if isinstance(method, Method) else None
    return knob is not None and knob.movable
