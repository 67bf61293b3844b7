"""Fitting iBNN node posteriors: the ELBO, its SGD loop, and BatchNorm statistics with the nodes on.

Each training example is repeated ``train_samples`` times (batch-major, see :func:`expand`) and
copy ``i`` is routed to component ``i mod K``, so one forward pass covers every component.

Example:
    >>> from posthoc.methods.ibnn.elbo import ElboOptions, fit_nodes
    >>> from posthoc.methods.ibnn.nodes import NodeSet
    >>> from posthoc_apps.demo.examples import model, train_loader
    >>> nodes = NodeSet(model, components=2)
    >>> before = nodes.kl().item()                     # the KL of the initial node posteriors to the prior
    >>> fit_nodes(model, nodes, train_loader, ElboOptions(epochs=1), progress=False)
    >>> before, nodes.kl().item()
    (44.7, 43.2)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from posthoc.core.checks import positive_int
from posthoc.core.inputs import Inputs, batch_size, check_labels, iterate, run_model
from posthoc.core.likelihood import Gaussian, Likelihood, model_outputs
from posthoc.core.logits import class_log_probs
from posthoc.core.modules import eval_mode, requires_grad
from posthoc.engine import elbo as engine_elbo
from posthoc.engine.bn_refresh import batchnorm_layers, refresh_batchnorm
from posthoc.engine.fine_tune import Step
from posthoc.engine.kl_schedule import KLSchedule
from posthoc.errors import ConfigError
from posthoc.methods.ibnn.nodes import NodeSet


def expand(x: Inputs, repeats: int) -> Inputs:
    """Repeat every example ``repeats`` times, batch-major (rows ``i*repeats ... i*repeats + repeats - 1``).

    Example:
        >>> import torch
        >>> from posthoc.methods.ibnn.elbo import expand
        >>> expand(torch.tensor([[1], [2]]), 2).flatten().tolist()
        [1, 1, 2, 2]
    """
    if isinstance(x, Mapping):
        return {k: v.repeat_interleave(repeats, 0) if isinstance(v, Tensor) else v for k, v in x.items()}
    return x.repeat_interleave(repeats, 0)


def routes(examples: int, repeats: int, components: int, device: torch.device) -> Tensor:
    """The component of every row of an expanded batch: row ``r`` uses ``r mod K``."""
    return torch.arange(examples * repeats, device=device) % components


#: how BatchNorm layers behave during the fit: "train" (the paper's: batch statistics, re-estimated) or "frozen"
BATCHNORM_MODES = ("train", "frozen")
#: the node learning rate (the paper's code): constant for half the steps, then linear down to the final one at 90 %
ANNEAL_START, ANNEAL_END = 0.5, 0.9


@dataclass(frozen=True)
class ElboOptions:
    """The fit options of ``ImplicitBNN.fit`` (see there); checked on construction."""

    epochs: int = 1
    lr_nodes: float = 0.2
    lr_nodes_final: float = 0.05
    lr_weights: float = 0.0
    momentum: float = 0.9
    weight_decay: float = 0.0
    beta: float = 1.0
    kl_warmup: float = 0.5
    train_samples: int = 2
    batchnorm: str = "train"

    def __post_init__(self) -> None:
        positive_int(self.epochs, "epochs")
        positive_int(self.train_samples, "train_samples")
        ranges = (
            ("lr_nodes", lambda v: v > 0, "> 0"),
            ("lr_nodes_final", lambda v: v > 0, "> 0"),
            ("lr_weights", lambda v: v >= 0, ">= 0 (0 keeps the weights frozen)"),
            ("momentum", lambda v: 0 <= v < 1, "in [0, 1)"),
            ("weight_decay", lambda v: v >= 0, ">= 0"),
            ("beta", lambda v: v >= 0, ">= 0"),
            ("kl_warmup", lambda v: 0 <= v <= 1, "in [0, 1]"),
        )
        for name, valid, described in ranges:
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not number or not valid(value):
                raise ConfigError(f"{name} must be a number {described}, got {value!r}")
        if self.batchnorm not in BATCHNORM_MODES:
            raise ConfigError(f"batchnorm must be one of {BATCHNORM_MODES}, got {self.batchnorm!r}")

    @property
    def kl_weight(self) -> KLSchedule:
        """``beta_t`` over the fraction ``done`` of the steps: rises linearly to ``beta`` over ``kl_warmup``."""
        return KLSchedule("linear", weight=self.beta, warmup=self.kl_warmup)

    def node_lr(self, done: float) -> float:
        """The node learning rate after the fraction ``done`` of the steps (see ``ANNEAL_START``).

        Example:
            >>> from posthoc.methods.ibnn.elbo import ElboOptions
            >>> [ElboOptions(lr_nodes=0.2, lr_nodes_final=0.05).node_lr(t) for t in (0.0, 0.7, 1.0)]
            [0.2, 0.125, 0.05]
        """
        progress = min(1.0, max(0.0, (done - ANNEAL_START) / (ANNEAL_END - ANNEAL_START)))
        return self.lr_nodes + (self.lr_nodes_final - self.lr_nodes) * progress


@contextmanager
def batchnorm_training(model: nn.Module, train: bool) -> Iterator[nn.Module]:
    """Every module in eval mode (dropout off), and BatchNorm layers in train mode if ``train``."""
    with eval_mode(model):
        if train:
            for module in model.modules():
                if isinstance(module, _BatchNorm):
                    module.train()
        yield model


def elbo_terms(
    model: nn.Module, nodes: NodeSet, x: Inputs, y: Tensor, train_samples: int, likelihood: Likelihood | None = None
) -> tuple[Tensor, Tensor]:
    """``(mean NLL over the expanded batch, KL)`` for one batch; marks which layers ran. The NLL is the class one,
    or under a :class:`~posthoc.core.likelihood.Gaussian` ``likelihood`` that of the targets at its fitted noise."""
    with nodes.sampling(routes(batch_size(x), train_samples, nodes.components, nodes.called.device)):
        logits = run_model(model, expand(x, train_samples))
    nodes.mark_called()
    if not bool(nodes.called.any()):
        raise ConfigError(
            f"none of the selected layers {nodes.layer_names[:6]} ran in the forward pass (their weights are "
            "used functionally, e.g. by attention); select other layers with layers=... or stem=True"
        )
    if isinstance(likelihood, Gaussian):
        outputs = model_outputs(logits)
        targets = likelihood.targets(y, outputs[::train_samples]).repeat_interleave(train_samples, 0)
        return likelihood.mean_nll(outputs, targets), nodes.kl()
    log_probs = class_log_probs(logits)
    labels = check_labels(y, log_probs.shape[-1]).to(log_probs.device).repeat_interleave(train_samples)
    return F.nll_loss(log_probs, labels), nodes.kl()


def fit_nodes(
    model: nn.Module,
    nodes: NodeSet,
    train_loader: Iterable,
    options: ElboOptions,
    *,
    progress: bool,
    likelihood: Likelihood | None = None,
) -> None:
    """The whole fit: BatchNorm statistics re-estimated with the nodes on (``batchnorm="train"``), then
    ``NLL + beta_t * KL / N`` minimised (:func:`posthoc.engine.elbo.maximise_elbo`) by SGD with Nesterov momentum,
    dropout off: the node parameters at :meth:`ElboOptions.node_lr` without weight decay, the weights at ``lr_weights``
    (0: frozen); then the statistics re-estimated once more for the fitted nodes (the paper keeps the momentum average
    of the last batches instead). Raises :class:`~posthoc.NumericalError` on a NaN/inf loss (the caller restores what
    changed); the weights' ``requires_grad`` flags are always restored."""
    refresh = options.batchnorm == "train" and bool(batchnorm_layers(model))
    if refresh:
        refresh_batchnorm_sampling(model, nodes, train_loader, options.train_samples, progress=progress)
    node_params = list(nodes.parameters())
    weights = [p for p in model.parameters() if options.lr_weights > 0]
    groups = [{"params": node_params, "lr": options.lr_nodes, "weight_decay": 0.0}]
    if weights:
        groups.append({"params": weights, "lr": options.lr_weights, "weight_decay": options.weight_decay})
    optimizer = torch.optim.SGD(groups, momentum=options.momentum, nesterov=options.momentum > 0)

    def anneal(step: Step) -> None:
        optimizer.param_groups[0]["lr"] = options.node_lr(step.done)

    hint = (
        f"lower lr_nodes (now {options.lr_nodes}) or beta. The checkpoint and this method's state were "
        "left as they were before fit"
    )
    with requires_grad(model, options.lr_weights > 0), batchnorm_training(model, options.batchnorm == "train"):
        # the node variables live outside the model (in hooks), so there is no module for
        # DistributedDataParallel to wrap: the loop averages their gradients the way it would
        engine_elbo.maximise_elbo(
            lambda x, y: elbo_terms(model, nodes, x, y, options.train_samples, likelihood),
            train_loader,
            optimizer=optimizer,
            trained=[*node_params, *weights],
            kl=options.kl_weight,
            epochs=options.epochs,
            device=nodes.called.device,
            desc="ibnn",
            hint=hint,
            progress=progress,
            before_update=anneal,
            what="iBNN fitting",
        )
    if refresh:
        refresh_batchnorm_sampling(model, nodes, train_loader, options.train_samples, progress=progress)


@torch.no_grad()
def refresh_batchnorm_sampling(
    model: nn.Module, nodes: NodeSet, loader: Iterable, train_samples: int, *, progress: bool
) -> None:
    """Recompute the model's BatchNorm statistics over ``loader`` expanded ``train_samples`` times, the nodes sampling."""

    def sampled_batches() -> Iterator[Inputs]:
        for x, _ in iterate(loader, device=nodes.called.device, progress=progress, desc="ibnn BatchNorm refresh"):
            with nodes.sampling(routes(batch_size(x), train_samples, nodes.components, nodes.called.device)):
                yield expand(x, train_samples)

    refresh_batchnorm(model, sampled_batches())
