"""The weights a sampling method moves, as private copies: the head on cached features, or the whole model.

Methods that run an optimiser or a Markov chain from the checkpoint (SGLD, IVON) never touch the user's model.
:class:`PrivateWeights` holds what they train: with ``layers="head"`` copies of the head's weight and bias, on the
backbone's features (cached when they fit the memory budget, batches shuffled per epoch); with ``layers="all"`` a deep
copy of the model in train mode. :func:`unflatten` turns a flat row back into a ``{name: tensor}`` state.

Example:
    >>> import torch
    >>> from posthoc.engine.head import FeatureSplit
    >>> from posthoc.engine.private_weights import PrivateWeights
    >>> from posthoc_apps.demo.examples import model, train_loader
    >>> weights = PrivateWeights(model, "head", train_loader, split=FeatureSplit(model))
    >>> for inputs, y in weights.epoch(torch.Generator().manual_seed(0)):
    ...     loss = weights.loss(inputs, y)
    >>> weights.weights_vector().shape        # the head's C * D + C values
    torch.Size([195])
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posthoc import settings
from posthoc.core import distributed
from posthoc.core.inputs import Inputs, check_labels, iterate, run_model
from posthoc.core.likelihood import Categorical, Likelihood, model_outputs
from posthoc.core.logits import as_class_logits
from posthoc.core.modules import eval_mode, qualified
from posthoc.engine.bn_refresh import batchnorm_layers
from posthoc.engine.head import FeatureSplit
from posthoc.engine.objective import predicts_classes, training_loss
from posthoc.engine.runner import examples_over_ranks, steps_on_every_rank, sum_over_ranks
from posthoc.errors import ConfigError

LAYERS = ("head", "all")


def check_layers(layers: Any) -> str:
    """``layers`` if it is ``"head"`` or ``"all"``, else a ConfigError listing both."""
    if layers not in LAYERS:
        raise ConfigError(
            f"layers must be 'head' (the classifier head) or 'all' (every trainable weight), got {layers!r}"
        )
    return layers


def trained_names(model: nn.Module, layers: str, split: FeatureSplit | None) -> list[str]:
    """The parameter names ``layers`` trains: the head's weight and bias, or every parameter requiring a gradient.

    Example:
        >>> from torch import nn
        >>> from posthoc.engine.private_weights import trained_names
        >>> trained_names(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)), "all", None)
        ['0.weight', '0.bias', '1.weight', '1.bias']
    """
    if layers == "head":
        head = split.head
        return [qualified(split.head_name, "weight")] + (
            [qualified(split.head_name, "bias")] if head.bias is not None else []
        )
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    if not names:
        raise ConfigError("layers='all' found no trainable parameter: every one is frozen (requires_grad=False)")
    return names


def buffer_names(model: nn.Module, layers: str) -> list[str]:
    """The BatchNorm running statistics kept with each ``"all"`` sample (none for the head)."""
    if layers == "head":
        return []
    return [f"{name}.{kind}" for name in batchnorm_layers(model) for kind in ("running_mean", "running_var")]


def unflatten(row: Tensor, model: nn.Module, names: list[str]) -> dict[str, Tensor]:
    """A flat row back into ``{name: tensor}`` shaped (and typed, and placed) like ``model``'s tensors ``names``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from posthoc.engine.private_weights import unflatten
        >>> unflatten(torch.arange(6.0), nn.Linear(2, 2), ["weight", "bias"])["bias"]
        tensor([4., 5.])
    """
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    state, offset = {}, 0
    for name in names:
        like = tensors[name]
        state[name] = row[offset : offset + like.numel()].reshape(like.shape).to(like.device, like.dtype)
        offset += like.numel()
    if offset != row.numel():
        raise ConfigError(
            f"a weight sample holds {row.numel()} values but the model's tensors {names[:3]}... need {offset}"
        )
    return state


class PrivateWeights:
    """Private, trainable copies of the weights ``layers`` names (module docs); ``split`` is needed for ``"head"``,
    ``likelihood`` is what :meth:`loss` is the NLL of (``None``: class labels)."""

    def __init__(
        self,
        model: nn.Module,
        layers: str,
        loader: Iterable,
        *,
        split: FeatureSplit | None = None,
        likelihood: Likelihood | None = None,
    ) -> None:
        self.layers, self.loader = check_layers(layers), loader
        self.likelihood = Categorical() if likelihood is None else likelihood
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._cached: list[tuple[Tensor, Tensor]] | None = None
        if layers == "head":
            self._split = split
            self.size = examples_over_ranks(self._cache_features())
            head = split.head
            self.trained = [head.weight.detach().clone().float().requires_grad_(True)]
            if head.bias is not None:
                self.trained.append(head.bias.detach().clone().float().requires_grad_(True))
            self.buffers: list[Tensor] = []
            self.steps_per_epoch = self._count_steps()
            return
        self.copy = copy.deepcopy(model).train()
        names = set(trained_names(model, layers, split))
        for name, p in self.copy.named_parameters():
            p.requires_grad_(name in names)
        self.trained = [p for name, p in self.copy.named_parameters() if name in names]
        found = dict(self.copy.named_buffers())
        self.buffers = [found[name] for name in buffer_names(model, layers)]
        self.size = examples_over_ranks(_examples(loader))
        self.steps_per_epoch = self._count_steps()

    def _count_steps(self) -> int:
        """Batches in one :meth:`epoch` (the shortest shard's under torch.distributed), counted once."""
        if self._cached is not None:
            local = len(self._cached)
        else:
            try:
                local = len(self.loader)  # type: ignore[arg-type]
            except TypeError:
                local = sum(1 for _ in iterate(self.loader, device="cpu", progress=False, desc="count"))
        return steps_on_every_rank(local, "fine-tuning")

    @property
    def num_weights(self) -> int:
        """The number of trained scalar weights."""
        return sum(t.numel() for t in self.trained)

    def _cache_features(self) -> int:
        """Run the backbone over the loader once; keep the features if they fit the budget. Returns ``N``."""
        batches, size, kept = [], 0, 0
        with torch.no_grad(), eval_mode(self._split.model):
            for x, y in iterate(self.loader, device=self.device, progress=False, desc="features"):
                phi, logits = self._split(x)
                y = self._targets(y, logits)
                size += y.shape[0]
                kept += phi.numel() * 4
                if kept <= settings.memory_budget():
                    batches.append((phi.float(), y))
        self._cached = batches if kept <= settings.memory_budget() else None
        return size

    def _targets(self, y: Tensor, outputs: Tensor) -> Tensor:
        """A batch's labels checked against its logits, or its real targets ``(n, D)`` against its outputs."""
        if predicts_classes(self.likelihood):
            return check_labels(y, as_class_logits(outputs).shape[-1])
        return self.likelihood.targets(y, model_outputs(outputs))

    def epoch(self, generator: torch.Generator) -> Iterator[tuple[Inputs, Tensor]]:
        """One pass over the training data: ``(inputs, targets)`` for :meth:`forward` (features for the head)."""
        steps = self.steps_per_epoch
        if self._cached is not None:
            for index in torch.randperm(len(self._cached), generator=generator).tolist()[:steps]:
                yield self._cached[index]
            return
        for index, (x, y) in enumerate(iterate(self.loader, device=self.device, progress=False, desc="fine-tune")):
            if index >= steps:
                break
            if self.layers == "head":
                with torch.no_grad(), eval_mode(self._split.model):
                    x, _ = self._split(x)
            yield x, y

    def forward(self, inputs: Inputs) -> Tensor:
        """Outputs (logits) of the private weights on one batch from :meth:`epoch`."""
        if self.layers == "head":
            return F.linear(inputs.float(), self.trained[0], self.trained[1] if len(self.trained) > 1 else None)
        return run_model(self.copy, inputs)

    def loss(self, inputs: Inputs, y: Tensor) -> Tensor:
        """The mean NLL of one batch from :meth:`epoch` (:func:`~posthoc.engine.objective.training_loss`)."""
        return training_loss(self.likelihood, self.forward(inputs), y)

    def weights_vector(self) -> Tensor:
        """The current trained weights as one float32 row."""
        return torch.cat([t.detach().reshape(-1).float() for t in self.trained])

    def buffers_vector(self) -> Tensor:
        """The copy's BatchNorm running statistics as one float32 row (empty for the head), averaged over ranks."""
        if not self.buffers:
            return torch.zeros(0, device=self.device)
        row = torch.cat([t.detach().reshape(-1).float() for t in self.buffers])
        return sum_over_ranks(row) / distributed.world_size() if distributed.active() else row


def sample_names(model: nn.Module, layers: str, split: FeatureSplit | None) -> list[str]:
    """The tensor names of a row ``[weights_vector(), buffers_vector()]``, in order."""
    return trained_names(model, layers, split) + buffer_names(model, layers)


def _examples(loader: Iterable) -> int:
    """The number of training examples: ``len(loader.dataset)`` where it exists, else one pass counting labels."""
    dataset = getattr(loader, "dataset", None)
    if dataset is not None and hasattr(dataset, "__len__"):
        return len(dataset)
    return sum(
        torch.as_tensor(y).reshape(-1).numel() for _, y in iterate(loader, device="cpu", progress=False, desc="count")
    )
