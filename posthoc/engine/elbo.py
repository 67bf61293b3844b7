"""The annealed ELBO and its fine-tuning loop, shared by ``"vi"``, ``"sparse-vd"`` and ``"ibnn"``.

The loss of one batch is ``mean NLL + beta_t * KL / N``: the method gives the NLL and the KL (:data:`ElboTerms`),
``beta_t`` follows a :class:`~posthoc.engine.kl_schedule.KLSchedule` (the KL warm-up), and ``N`` is the number of
training examples over all ranks (estimated from the first batch without a sized dataset). :func:`maximise_elbo` runs
it in :func:`~posthoc.engine.fine_tune.fine_tune`.

Example:
    >>> import torch
    >>> from torch.nn import functional as F
    >>> from posthoc.engine.elbo import maximise_elbo
    >>> from posthoc.engine.kl_schedule import KLSchedule
    >>> from posthoc_apps.demo.examples import model, train_loader
    >>> from posthoc.engine.variational_layers import VariationalLayers
    >>> from posthoc.methods.vi.gaussian import GaussianLayer
    >>> layers = VariationalLayers(model, {"3": GaussianLayer(model[3], init_std=0.01, prior_std=1.0, prior_mean="zero")})
    >>> def terms(x, y):
    ...     with layers.sampling():
    ...         return F.nll_loss(model(x).log_softmax(-1), y), layers.kl()
    >>> optimizer = torch.optim.Adam(layers.parameters(), lr=1e-3)
    >>> maximise_elbo(terms, train_loader, optimizer=optimizer, trained=list(layers.parameters()),
    ...               kl=KLSchedule("linear"), epochs=3, device="cpu", desc="vi", hint="lower lr", progress=False)
    12
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from posthoc.core.fit_record import dataset_size
from posthoc.core.inputs import Inputs, batch_size
from posthoc.engine.fine_tune import Step, backward, fine_tune, loader_batches, loader_length
from posthoc.engine.kl_schedule import KLSchedule
from posthoc.engine.runner import examples_over_ranks, steps_on_every_rank

#: ``(x, y) -> (mean NLL of the batch, KL of the posterior)``
ElboTerms = Callable[[Inputs, Tensor], tuple[Tensor, Tensor]]


class Elbo:
    """``mean NLL + beta_t * KL / N`` of one batch (module docs); keeps the last step's terms for messages.

    Example:
        >>> import torch
        >>> from posthoc.engine.elbo import Elbo
        >>> from posthoc.engine.kl_schedule import KLSchedule
        >>> from posthoc_apps.demo.examples import x, y
        >>> from posthoc.engine.fine_tune import Step
        >>> elbo = Elbo(lambda x, y: (torch.tensor(0.7), torch.tensor(50.0)), KLSchedule("linear", warmup=0.5),
        ...             size=1000, steps_per_epoch=10)
        >>> loss = elbo((x, y), Step(epoch=1, index=0, number=4, epochs=2, total=8))   # half way: beta = 1
        >>> float(loss), elbo.beta       # 0.7 + 1 * 50 / 1000
        (0.75, 1.0)
    """

    def __init__(
        self, terms: ElboTerms, schedule: KLSchedule, *, size: int | None, steps_per_epoch: int | None
    ) -> None:
        self.terms, self.schedule = terms, schedule
        self.size, self.steps_per_epoch = size, steps_per_epoch
        self.nll = self.kl = torch.zeros(())
        self.beta = 0.0

    def __call__(self, batch: tuple[Inputs, Tensor], step: Step) -> Tensor:
        x, y = batch
        self.size = self.size or batch_size(x) * (self.steps_per_epoch or 1)
        self.beta = self.schedule(step.done)
        nll, kl = self.terms(x, y)
        self.nll, self.kl = nll.detach(), kl.detach()
        return nll + self.beta * kl / self.size

    def failure(self, value: float, step: Step, hint: str) -> str:
        """The message of a NaN/inf ELBO at ``step``, ending with the method's ``hint``."""
        return (
            f"the ELBO became {value} at epoch {step.epoch + 1}, step {step.number + 1} "
            f"(nll={float(self.nll):.4g}, kl={float(self.kl):.4g}); {hint}"
        )

    def postfix(self, value: float, step: Step) -> dict[str, Any]:
        """The progress bar's fields: epoch, NLL, KL and ``beta_t``."""
        return {
            "epoch": step.epoch + 1,
            "nll": f"{float(self.nll):.4f}",
            "kl": f"{float(self.kl):.1f}",
            "beta": f"{self.beta:.2f}",
        }


def maximise_elbo(
    terms: ElboTerms,
    loader: Iterable,
    *,
    optimizer: torch.optim.Optimizer | None,
    trained: list[Tensor],
    kl: KLSchedule,
    epochs: int,
    device: torch.device | str,
    desc: str,
    hint: str,
    progress: bool,
    before_update: Callable[[Step], None] | None = None,
    what: str = "ELBO fitting",
) -> int:
    """Minimise the annealed negative ELBO over ``loader`` for ``epochs`` (module docs); returns the steps taken.

    Args:
        optimizer: moves ``trained`` (``None``: nothing is trained, the loss is still checked).
        hint: ends the message of a NaN/inf loss.
        before_update: called before each optimizer step (e.g. a learning-rate schedule).
        what: names the fit in the message refusing a loader without a length under torch.distributed.
    """
    steps_per_epoch = steps_on_every_rank(loader_length(loader), what)
    size = dataset_size(loader)
    if size is not None:  # the KL is scaled by the size of all shards together
        size = examples_over_ranks(size)
    elbo = Elbo(terms, kl, size=size, steps_per_epoch=steps_per_epoch)

    def update(loss: Tensor, step: Step) -> None:
        if before_update is not None:
            before_update(step)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
            backward(loss, trained)
            optimizer.step()

    return fine_tune(
        lambda epoch: loader_batches(loader, device=device, steps=steps_per_epoch, desc=desc),
        elbo,
        update,
        epochs=epochs,
        total=None if steps_per_epoch is None else epochs * steps_per_epoch,
        failure=lambda value, step: elbo.failure(value, step, hint),
        desc=desc,
        progress=progress,
        postfix=elbo.postfix,
    )
