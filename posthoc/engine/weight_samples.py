"""Predictives over weight samples: stacked head rows (one backbone pass) or whole-model states.

Methods that end a fit with weight samples (SGLD's iterates, draws from IVON's Gaussian) predict through
:func:`head_log_predictive` (each sample a head row ``[W.flatten(), b]``, the backbone run once, the heads applied in
batched matmuls under the memory budget) or :func:`state_log_predictive` (each sample a ``{name: tensor}`` state run
through the model functionally, one pass per sample).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.engine.head import FeatureSplit
    >>> from posthoc.engine.weight_samples import head_log_predictive, head_rows
    >>> net = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 3))
    >>> split = FeatureSplit(net)                       # net's head: Linear(8, 3)
    >>> rows = head_rows(split.head).expand(5, -1)       # five copies of the checkpoint's head
    >>> log_probs, samples = head_log_predictive(split, lambda s: rows[s], 5, torch.randn(4, 2))
    >>> samples.shape
    torch.Size([5, 4, 3])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from posthoc.core.chunks import chunks
from posthoc.core.inputs import Inputs, run_model_with
from posthoc.core.likelihood import model_outputs
from posthoc.core.logits import class_log_probs, log_mean_exp
from posthoc.engine.head import FeatureSplit

#: dtypes whose weight samples run in float32 (a sample a little larger than the checkpoint overflows float16)
LOW_PRECISION = (torch.float16, torch.bfloat16)
#: ``rows(samples)`` returns the head rows ``(len(samples), P)`` of the samples in a ``slice``
RowSource = Callable[[slice], Tensor]


def head_rows(head: nn.Linear) -> Tensor:
    """The head's weight and bias as one flat row ``[W.flatten(), b]`` (``P = C * D (+ C)``), detached.

    Example:
        >>> from torch import nn
        >>> from posthoc.engine.weight_samples import head_rows
        >>> head_rows(nn.Linear(4, 3)).shape
        torch.Size([15])
    """
    parts = [head.weight.detach().reshape(-1)] + ([head.bias.detach()] if head.bias is not None else [])
    return torch.cat(parts)


def head_logits(rows: Tensor, features: Tensor, head: nn.Linear) -> Tensor:
    """Logits of head rows ``(S, P)`` on features ``(N, D)``: ``(S, N, C)`` in one batched matmul.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from posthoc.engine.weight_samples import head_logits, head_rows
        >>> head = nn.Linear(4, 3)
        >>> x = torch.randn(2, 4)
        >>> torch.allclose(head_logits(head_rows(head)[None], x, head)[0], head(x))
        True
    """
    size = head.out_features * head.in_features
    weight = rows[:, :size].unflatten(-1, (head.out_features, head.in_features))
    logits = features.unsqueeze(0) @ weight.transpose(-1, -2)
    return logits + rows[:, size:].unsqueeze(1) if rows.shape[1] > size else logits


def head_outputs(
    split: FeatureSplit, rows: RowSource, count: int, x: Inputs, *, transform: Callable[[Tensor], Tensor] | None = None
) -> Tensor:
    """``(S, N, C)``: the outputs of ``count`` head samples (through ``transform``, e.g. a log-softmax), the backbone run once.

    ``rows(slice)`` gives the rows of the samples in the slice, taken in groups under the memory budget.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from posthoc.engine.head import FeatureSplit
        >>> from posthoc.engine.weight_samples import head_outputs, head_rows
        >>> split = FeatureSplit(nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 3)))
        >>> head_outputs(split, lambda s: head_rows(split.head).expand(s.stop - s.start, -1), 5, torch.randn(4, 2)).shape
        torch.Size([5, 4, 3])
    """
    phi, _ = split(x)
    phi, head = phi.float(), split.head
    classes = head.out_features
    row_bytes = 4 * (head.in_features * classes + classes + 3 * phi.shape[0] * classes)
    groups = []
    for samples in chunks(count, row_bytes):
        outputs = head_logits(rows(samples).to(phi.device, torch.float32), phi, head)
        groups.append(outputs if transform is None else transform(outputs))
    return groups[0] if len(groups) == 1 else torch.cat(groups)


def _head_log_softmax(logits: Tensor) -> Tensor:
    """Log-probabilities of head logits ``(S, N, C)``; a binary classifier's single logit ``z`` is the classes ``[0, z]``."""
    if logits.shape[-1] == 1:
        logits = torch.cat([torch.zeros_like(logits), logits], dim=-1)
    return torch.log_softmax(logits, dim=-1)


def head_log_predictive(split: FeatureSplit, rows: RowSource, count: int, x: Inputs) -> tuple[Tensor, Tensor]:
    """``(log_probs (N, C), sample_log_probs (S, N, C))`` of ``count`` head samples (:func:`head_outputs`)."""
    sample_log_probs = head_outputs(split, rows, count, x, transform=_head_log_softmax)
    return log_mean_exp(sample_log_probs), sample_log_probs


def state_outputs(
    model: nn.Module,
    states: Callable[[int], Mapping[str, Tensor]],
    count: int,
    x: Inputs,
    *,
    transform: Callable[[Tensor], Tensor] = model_outputs,
) -> Tensor:
    """``(S, N, ...)``: ``transform`` of the outputs of ``count`` whole-model states, one pass each, in float32.

    ``states(s)`` gives sample ``s`` as ``{name: tensor}`` replacing the model's own (the model is not changed). A
    float16 / bfloat16 model runs its samples in float32.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from posthoc.engine.weight_samples import state_outputs
        >>> net = nn.Linear(2, 1)
        >>> state_outputs(net, lambda s: {"bias": torch.full((1,), float(s))}, 4, torch.randn(5, 2)).shape
        torch.Size([4, 5, 1])
    """
    base = _float32_tensors(model)
    if base:  # a float16 / bfloat16 model: weight samples run in float32, where they cannot overflow
        x = {k: _float32(v) for k, v in x.items()} if isinstance(x, Mapping) else _float32(x)
    rows = [
        transform(
            run_model_with(model, {**base, **{k: _float32(v) for k, v in states(s).items()}} if base else states(s), x)
        ).float()
        for s in range(count)
    ]
    return torch.stack(rows)


def state_log_predictive(
    model: nn.Module, states: Callable[[int], Mapping[str, Tensor]], count: int, x: Inputs
) -> tuple[Tensor, Tensor]:
    """``(log_probs (N, C), sample_log_probs (S, N, C))`` of ``count`` whole-model states (:func:`state_outputs`).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from posthoc.engine.weight_samples import state_log_predictive
        >>> net = nn.Linear(2, 3)
        >>> lp, samples = state_log_predictive(net, lambda s: {"bias": torch.full((3,), float(s))}, 4, torch.randn(5, 2))
        >>> samples.shape
        torch.Size([4, 5, 3])
    """
    sample_log_probs = state_outputs(model, states, count, x, transform=class_log_probs)
    return log_mean_exp(sample_log_probs), sample_log_probs


def _float32(value: Tensor) -> Tensor:
    return value.float() if isinstance(value, Tensor) and value.dtype in LOW_PRECISION else value


def _float32_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every low-precision parameter and buffer of ``model`` in float32 (``{}`` for a float32 model)."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    if not any(t.dtype in LOW_PRECISION for t in tensors.values()):
        return {}
    return {name: t.detach().float() for name, t in tensors.items() if t.dtype in LOW_PRECISION}
