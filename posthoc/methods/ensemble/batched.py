"""Members of one architecture run as one batched forward: parameters batched, the forward vmapped.

``torch.func.stack_module_state`` stacks the members' parameters and buffers along a new first dimension, and
``torch.vmap`` over ``torch.func.functional_call`` runs all ``M`` members in one pass. The stacked copy is rebuilt
when a member's tensors change (each tensor's storage and version counter are checked).

Example:
    >>> from posthoc.methods.ensemble.batched import BatchedForward
    >>> from posthoc_apps.demo.examples import net_a, net_b, x
    >>> forward = BatchedForward([net_a, net_b])
    >>> forward(x).shape                  # (M, N, C) log-probabilities
    torch.Size([2, 8, 3])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from posthoc.core.inputs import Inputs, run_model_with
from posthoc.core.logits import class_log_probs


def _layout(model: nn.Module) -> tuple:
    """What must agree for two models to share one vmapped forward: class, names, shapes, dtypes, devices."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return (type(model), tuple((name, tuple(t.shape), t.dtype, t.device) for name, t in tensors))


def same_architecture(models: Sequence[nn.Module]) -> bool:
    """Whether ``models`` can run as one batched forward: one class, and the same tensors by name, shape, dtype and device.

    Example:
        >>> from torch import nn
        >>> from posthoc.methods.ensemble.batched import same_architecture
        >>> same_architecture([nn.Linear(2, 3), nn.Linear(2, 3)]), same_architecture([nn.Linear(2, 3), nn.Linear(2, 4)])
        (True, False)
    """
    first = _layout(models[0])
    return all(_layout(model) == first for model in models[1:])


def _tensors(model: nn.Module) -> list[Tensor]:
    return [*model.parameters(), *model.buffers()]


class BatchedForward:
    """The members' log-probabilities ``(M, N, C)`` from one vmapped forward (see module docs), the first member's
    module (in eval mode) the template of ``functional_call``."""

    def __init__(self, models: Sequence[nn.Module]) -> None:
        self.models = list(models)
        self._key: tuple | None = None
        self._state: dict[str, Tensor] = {}

    def _batched_state(self) -> dict[str, Tensor]:
        key = tuple((t.data_ptr(), t._version, t.device) for model in self.models for t in _tensors(model))
        if key != self._key:
            self._state = {}  # free the old copy before building the new one
            params, buffers = torch.func.stack_module_state(self.models)
            self._state = {name: value.detach() for name, value in {**params, **buffers}.items()}
            self._key = key
        return self._state

    def __call__(self, x: Inputs) -> Tensor:
        template = self.models[0]

        def member(state: dict[str, Tensor], inputs: Inputs) -> Tensor:
            return class_log_probs(run_model_with(template, state, inputs))

        return torch.vmap(member, in_dims=(0, None))(self._batched_state(), x)
