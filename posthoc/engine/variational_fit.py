"""Fitting :class:`~posthoc.engine.variational_layers.VariationalLayers` by the ELBO, the KL annealed in.

The loss per step is ``mean NLL of the batch (one local-reparameterisation draw per example) +
beta_t * KL / N`` with ``N`` the training examples and ``beta_t`` from a
:class:`~posthoc.engine.kl_schedule.KLSchedule`; Adam moves the posterior's locations at ``lr``
and its scales (log standard deviations, log variances) at ``lr_scale``. The model runs in eval mode
(dropout off, BatchNorm on its running statistics) with its own parameters frozen: only the
posterior's parameters change, and the model's ``requires_grad`` flags are restored afterwards.
Under ``torch.distributed`` every rank fits on its own shard: ``N`` is the size of all shards together,
every rank takes as many steps as the shortest shard has batches, and the posterior's gradients are
averaged over ranks before each step (as DistributedDataParallel would), so every rank ends with the same
posterior.

Example:
    >>> options = ElboFit(epochs=2, lr=1e-3, lr_scale=1e-2, kl=KLSchedule("cosine"))
    >>> fit_elbo(model, layers, train_loader, options, progress=False)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from posthoc.core import distributed
from posthoc.core.checks import positive_int
from posthoc.core.errors import ConfigError, NumericalError
from posthoc.core.fit_record import dataset_size
from posthoc.core.inputs import batch_size, check_labels, iterate, run_model
from posthoc.core.logits import class_log_probs
from posthoc.core.modules import eval_mode
from posthoc.engine.kl_schedule import KLSchedule
from posthoc.engine.variational_layers import VariationalLayers


@dataclass(frozen=True)
class ElboFit:
    """The settings of one ELBO fit; checked on construction."""

    epochs: int = 3
    lr: float = 1e-3
    lr_scale: float = 1e-2
    kl: KLSchedule = KLSchedule()

    def __post_init__(self) -> None:
        positive_int(self.epochs, "epochs")
        for name in ("lr", "lr_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0 (0 keeps those parameters fixed), got {value!r}")


def fit_elbo(model: nn.Module, layers: VariationalLayers, train_loader: Iterable, options: ElboFit, *, progress: bool,
             desc: str = "elbo") -> None:
    """Maximise the ELBO over ``train_loader`` (see module docs); raises :class:`~posthoc.NumericalError`
    on a NaN/inf loss (the caller restores the posterior it saved before)."""
    device = next((p.device for p in layers.parameters()), torch.device("cpu"))
    locations, scales = layers.parameter_groups()
    groups = [{"params": params, "lr": lr} for params, lr in ((locations, options.lr), (scales, options.lr_scale)) if params and lr > 0]
    optimizer = torch.optim.Adam(groups) if groups else None
    try:
        steps_per_epoch = len(train_loader)  # type: ignore[arg-type]
    except TypeError:
        steps_per_epoch = None
    steps_per_epoch = distributed.common_length(steps_per_epoch, "ELBO fitting")
    total = None if steps_per_epoch is None else options.epochs * steps_per_epoch
    size = dataset_size(train_loader)
    if size is not None:  # the KL is scaled by the size of all shards together
        size = distributed.total_examples(size)
    flags = [(p, p.requires_grad) for p in model.parameters()]
    bar = tqdm(total=total, desc=desc, disable=not progress, leave=False)
    step = 0
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        with eval_mode(model):
            for epoch in range(options.epochs):
                for index, (x, y) in enumerate(iterate(train_loader, device=device, progress=False, desc=desc)):
                    if steps_per_epoch is not None and index >= steps_per_epoch:
                        break  # under torch.distributed: every rank takes the same number of steps
                    size = size or batch_size(x) * (steps_per_epoch or 1)
                    kl_weight = options.kl(step / total if total else epoch / options.epochs)
                    with layers.sampling():
                        log_probs = class_log_probs(run_model(model, x))
                    nll = F.nll_loss(log_probs, check_labels(y, log_probs.shape[-1]).to(log_probs.device))
                    kl = layers.kl()
                    loss = nll + kl_weight * kl / size
                    if not torch.isfinite(loss.detach()):
                        raise NumericalError(
                            f"the ELBO became {float(loss.detach())} at epoch {epoch + 1}, step {step + 1} "
                            f"(nll={float(nll.detach()):.4g}, kl={float(kl.detach()):.4g}); lower lr (now {options.lr}) or "
                            f"lr_scale (now {options.lr_scale}). The posterior was left as it was before fit"
                        )
                    if optimizer is not None:
                        optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                        distributed.average_gradients([*locations, *scales])
                        optimizer.step()
                    step += 1
                    bar.update(1)
                    bar.set_postfix(epoch=epoch + 1, nll=f"{float(nll.detach()):.4f}", kl=f"{float(kl.detach()):.1f}", beta=f"{kl_weight:.2f}")
    finally:
        bar.close()
        for p, flag in flags:
            p.requires_grad_(flag)
