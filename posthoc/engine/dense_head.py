"""The per-position head of a dense network, seen as one ``nn.Linear`` over rows of features.

A segmentation network's classifier is usually a 1x1 convolution ``(N, D, H, W) -> (N, C, H, W)``, and a language
model's head a Linear applied at every position ``(N, T, D) -> (N, T, V)``: at each position both are the same
affine map ``W phi + b`` of the features ``phi`` there. :class:`PositionHead` finds that module, gives the rows of
its input ``(N·P, D)`` (in the order of :func:`~posthoc.engine.dense.to_rows`) and an ``nn.Linear`` that shares its
weights, so the last-layer methods written for one label per input work per position unchanged.

The head is the model's ``get_output_embeddings()`` (Hugging Face language models) or else its last registered
module, when that is a Linear or an ungrouped 1x1 convolution; its output must be the model's logits (checked on the
first batch), so a network that resizes or post-processes its logits after the head is refused.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.engine.dense_head import position_head
    >>> net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 1))
    >>> head = position_head(net)
    >>> x = torch.randn(2, 1, 4, 4)
    >>> rows = head.as_linear()(head.feature_rows(net, x))             # (2·4·4, 3)
    >>> torch.allclose(rows, net(x).movedim(1, -1).reshape(-1, 3), atol=1e-6)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from posthoc.core.inputs import Inputs, run_model
from posthoc.core.modules import module_name
from posthoc.engine.hooks import hooked
from posthoc.errors import HeadNotFoundError


class _Stop(Exception):
    """Raised by the pre-hook once the head's input is captured: the head and what follows it need not run."""


@dataclass
class PositionHead:
    """A dense network's per-position head ``module`` (called ``name`` in the network); ``conv``: a 1x1 convolution
    (features ``(N, D, *P)``), else a Linear (features ``(N, *P, D)``)."""

    name: str
    module: nn.Module
    conv: bool

    def as_linear(self) -> nn.Linear:
        """The head as a new ``nn.Linear`` over feature rows whose parameters share the module's storage (a new
        module: a language model ties its head's weight to its input embedding, which would hide it under that name)."""
        weight, bias = self.module.weight, self.module.bias
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device)
        linear.weight = nn.Parameter(weight.detach().view(weight.shape[0], weight.shape[1]), weight.requires_grad)
        if bias is not None:
            linear.bias = nn.Parameter(bias.detach(), bias.requires_grad)
        return linear

    def feature_rows(self, model: nn.Module, x: Inputs) -> Tensor:
        """The head's input at every position of ``x``, as rows ``(N·P, D)``; the head itself does not run."""
        features = self.features(model, x)
        return features.reshape(-1, features.shape[-1])

    def features(self, model: nn.Module, x: Inputs, *, stop: bool = True) -> Tensor:
        """The head's input at every position of ``x``, features last: ``(N, *P, D)``; with ``stop`` the head and
        what follows it do not run (``stop=False``: the whole forward runs, as a tracer such as ``torch.export``
        needs every module call to return)."""
        captured: list[Tensor] = []

        def capture(module: nn.Module, args: tuple) -> None:
            captured.append(args[0])
            if stop:
                raise _Stop

        handle = self.module.register_forward_pre_hook(capture)
        try:
            if stop:
                run_model(model, x)
            else:  # the whole forward: its per-position logits are not read here (nor refused by run_model)
                model(**x) if isinstance(x, Mapping) else model(x)
        except _Stop:
            pass
        finally:
            handle.remove()
        if not captured:
            raise HeadNotFoundError(f"the head '{self.name}' was not called in the forward pass")
        return captured[0].movedim(1, -1) if self.conv else captured[0]

    def check(self, logits_of: Callable[[Inputs], Tensor], x: Inputs, class_dim: int) -> None:
        """Refuse a head whose output is not the logits ``logits_of(x)`` (a network that resizes them afterwards)."""
        captured: list[Tensor] = []
        with hooked([(self.module, "output", lambda module, args, out: captured.append(out))]):
            logits = logits_of(x)
        expected_dim = 1 if self.conv else logits.dim() - 1
        if not captured or captured[-1].shape != logits.shape or class_dim != expected_dim:
            shape = tuple(captured[-1].shape) if captured else None
            raise HeadNotFoundError(
                f"the per-position head '{self.name}' gives {shape}, not the model's logits {tuple(logits.shape)} "
                "(the network changes them after its head, e.g. resizes them): last-layer methods on dense outputs "
                "need a head whose output is the logits; use method='temperature' or 'none' for this model"
            )
        if not torch.equal(captured[-1], logits):
            raise HeadNotFoundError(
                f"the model's logits are not the output of its per-position head '{self.name}' (the network "
                "transforms them afterwards); last-layer methods on dense outputs need a head whose output is the logits"
            )


def position_head(model: nn.Module) -> PositionHead:
    """The per-position head of ``model`` (module docs), or a :class:`~posthoc.errors.HeadNotFoundError`."""
    output_embeddings = getattr(model, "get_output_embeddings", None)
    module = output_embeddings() if callable(output_embeddings) else None
    if not isinstance(module, nn.Linear):
        leaves = [m for m in model.modules() if not list(m.children())]
        module = leaves[-1] if leaves else None
    conv = isinstance(module, nn.Conv2d) and module.kernel_size == (1, 1) and module.groups == 1
    if not (conv or isinstance(module, nn.Linear)):
        raise HeadNotFoundError(
            f"last-layer methods on dense outputs need a per-position head: a 1x1 nn.Conv2d or an nn.Linear as the "
            f"network's last module (or a Hugging Face model's get_output_embeddings()); {type(model).__name__}'s "
            f"last module is {type(module).__name__}"
        )
    return PositionHead(module_name(model, module) or "", module, conv)
