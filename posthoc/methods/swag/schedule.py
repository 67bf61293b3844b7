"""SWAG's default schedule: a learning rate relative to the model's own scale, and a scale chosen on held-out NLL.

The fine-tuning that collects the moments moves the weights away from the checkpoint, and that drift, not the sampling,
decides SWAG's quality under shift (docs/methods/swag.md). So the learning rate is set from the model,
``lr = RELATIVE_STEP * |theta| / mean |grad|`` (:func:`relative_lr`): each step moves the weights by about ``1e-4`` of
their norm, whatever the model's parametrisation or loss scale, for 2 epochs. The spread of such iterates suits no one
scale for every model, so with a ``val_loader`` the scale is chosen on held-out data, walking the :data:`LADDER` of
scales by factors of 2 from :data:`START_SCALE`, as Laplace chooses its prior precision.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from posthoc.core.inputs import Inputs, iterate
from posthoc.core.likelihood import Categorical, Likelihood
from posthoc.engine.objective import training_loss
from posthoc.engine.runner import sum_over_ranks
from posthoc.errors import NumericalError

#: the default fine-tuning step, as a fraction of the fine-tuned weights' norm
RELATIVE_STEP = 1e-4
#: the learning rate used when the loss is flat at the checkpoint (the steps are then 0 whatever it is)
FLAT_LOSS_LR = 1e-3
#: mini-batches whose gradient norms set the relative learning rate
GRADIENT_BATCHES = 8
#: the scale the walk starts from (the SWAG paper's), and how far it may go up and down, by factors of 2
START_SCALE, MAX_SCALE, MIN_SCALE = 0.5, 128.0, 1 / 16
#: the scales the walk may visit, from narrow to wide
LADDER = tuple(MIN_SCALE * 2.0**k for k in range(12))


def relative_lr(
    forward: Callable[[Inputs], Tensor],
    trained: list[Tensor],
    loader: Iterable,
    *,
    device: torch.device,
    step: float = RELATIVE_STEP,
    batches: int = GRADIENT_BATCHES,
    likelihood: Likelihood | None = None,
) -> float:
    """``step * |theta| / mean_b |grad_b|``: the learning rate that moves ``trained`` by ``step`` of its norm per step.

    ``grad_b`` is the gradient of the mean NLL of mini-batch ``b`` (the first ``batches`` of ``loader``) under
    ``likelihood`` (``None``: the class cross-entropy), averaged over ``torch.distributed`` ranks. The gradients are
    cleared afterwards (``trained`` must hold none before).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from posthoc.methods.swag.schedule import relative_lr
        >>> net = nn.Linear(4, 3)
        >>> lr = relative_lr(net, list(net.parameters()), [(torch.randn(8, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]))],
        ...                  device=torch.device("cpu"))
        >>> lr > 0
        True
    """
    likelihood = Categorical() if likelihood is None else likelihood
    norms = []
    for index, (x, y) in enumerate(iterate(loader, device=device, progress=False, desc="swag lr")):
        if index == batches:
            break
        loss = training_loss(likelihood, forward(x), y)
        loss.backward()  # not autograd.grad: a DistributedDataParallel replica must see its backward pass
        norms.append(torch.sqrt(sum(t.grad.float().pow(2).sum() for t in trained if t.grad is not None)))
        for t in trained:
            t.grad = None
    weights = torch.sqrt(sum(t.detach().float().pow(2).sum() for t in trained))
    totals = torch.stack([torch.stack(norms).sum(), torch.tensor(float(len(norms)), device=weights.device)]).double()
    totals = sum_over_ranks(totals)
    gradient = float(totals[0] / totals[1])
    if not math.isfinite(gradient):
        raise NumericalError(
            f"the loss gradient at the checkpoint has norm {gradient}; SWAG cannot set its learning rate from it. "
            "Pass lr= to fit"
        )
    if gradient == 0:
        warnings.warn(
            f"the loss gradient at the checkpoint is 0 (a single class, or a loss already at its minimum): SWAG's "
            f"fine-tune cannot move the weights and uses lr={FLAT_LOSS_LR}; pass lr= to fit to choose one",
            RuntimeWarning,
            stacklevel=2,
        )
        return FLAT_LOSS_LR
    return step * float(weights) / gradient
