"""What a sampling method fine-tunes on and scores on held-out data, under its likelihood.

SWAG, MultiSWAG, IVON and SGLD train from the checkpoint and choose their spread on held-out data. Both
steps ask the method's :class:`~posthoc.core.likelihood.Likelihood`:

- :func:`training_loss`: the mean negative log-likelihood of a batch. Class labels: the cross-entropy of
  the logits, as before. Real targets under a Gaussian: ``unit_loss / σ² / N``, the mean Gaussian NLL
  (without its constant) at the noise the *plain* model has on held-out data (:func:`fit_plain_noise`,
  fitted first, as the variational methods do). Dividing by ``σ²`` keeps the meaning of the step sizes
  and of the posterior widths these methods derive from the loss (SWAG's relative learning rate, IVON's
  Hessian and effective sample size, SGLD's Langevin noise ``sqrt(2 η T / N)``): the loss is a
  log-likelihood per example, as the cross-entropy is.
- :func:`held_out_score`: the held-out NLL of the method's predictive. For real targets it is the NLL
  of the mixture of ``N(f_s(x), σ²)`` over the sampled outputs ``f_s`` with ``σ`` re-fitted on those
  held-out outputs (a fixed ``σ`` stays): ``fit`` re-fits the noise on the sampled predictive on the same
  data once the spread is chosen, so each candidate is scored by the predictive it would give. With the
  plain ``σ`` instead, every spread would only add width to an already calibrated Gaussian and the
  choice would always shrink towards the mean.
- :func:`nll_limit`: the held-out NLL a wider spread may cost. Class NLL is at least 0, and the methods'
  tolerances are fractions of it. A Gaussian NLL has no zero (it shifts by ``log`` of the targets' unit),
  so there the tolerance is in nats per example: ``best + tolerance``.
- :func:`held_out_shift`: the shift-aware held-out perturbations grade the model's *accuracy* on
  perturbed inputs, which real targets do not have; under regression the choice uses the clean held-out
  data only (``shift=None``).

Example:
    >>> loss = training_loss(Categorical(), torch.randn(4, 3), torch.tensor([0, 2, 1, 0]))
    >>> nll_limit(Gaussian(), best=-1.2, tolerance=0.02)
    -1.18
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posthoc.core.inputs import Inputs, check_labels, iterate, run_model
from posthoc.core.likelihood import Categorical, Likelihood, best_noise_nll, fit_noise_on, model_outputs
from posthoc.core.logits import as_class_logits, class_log_probs
from posthoc.core.modules import eval_mode
from posthoc.engine.held_out import held_out_nll

#: ``outputs(x)``: a predictive's sampled model outputs ``(S, N, D)`` on a batch
SampledOutputs = Callable[[Inputs], Tensor]


def predicts_classes(likelihood: Likelihood) -> bool:
    """Whether ``likelihood`` is over class labels (the cross-entropy and the class NLL), not real targets."""
    return isinstance(likelihood, Categorical)


def training_loss(likelihood: Likelihood, outputs: Tensor, y: Tensor) -> Tensor:
    """The mean negative log-likelihood of one batch's targets ``y`` given the model's ``outputs``, in float32.

    Class labels: the cross-entropy of the logits, a binary classifier's single logit ``z`` (``(N,)`` or ``(N, 1)``)
    read as the two classes ``[0, z]``, as every predictive reads it (:func:`~posthoc.core.logits.as_class_logits`).
    Real targets: ``unit_loss / dispersion / N`` (module docs); the noise must be fitted first.

    Example:
        >>> gaussian = Gaussian(noise_std=0.5)
        >>> float(training_loss(gaussian, torch.zeros(2, 1), torch.tensor([1.0, 1.0])))   # 0.5 * 1 / 0.25
        2.0
    """
    if predicts_classes(likelihood):
        logits = as_class_logits(outputs).float()
        return F.cross_entropy(logits, check_labels(y, logits.shape[-1]))
    outputs = model_outputs(outputs)
    targets = likelihood.targets(y, outputs).to(outputs.device)
    return (likelihood.unit_loss(outputs, targets) / (likelihood.dispersion * outputs.shape[0])).float()


def step_scale(likelihood: Likelihood) -> float:
    """What a learning rate set for class labels is multiplied by under ``likelihood``: ``1`` for classes, ``σ² / 2``
    for a Gaussian. The largest second derivative of one example's loss in one output is ``1/2`` for the softmax
    and ``1 / σ²`` for the Gaussian NLL, so a step that is stable for one is as stable for the other at this ratio.

    Example:
        >>> step_scale(Categorical()), step_scale(Gaussian(noise_std=0.1))
        (1.0, 0.005000000000000001)
    """
    return 1.0 if predicts_classes(likelihood) else likelihood.dispersion / 2


def fit_plain_noise(likelihood: Likelihood, model: nn.Module, loaders: tuple[Iterable | None, Iterable | None],
                    device: torch.device) -> None:
    """Fit ``likelihood``'s noise to the plain ``model``'s outputs, on the held-out loader if there is one
    (:func:`~posthoc.core.likelihood.fit_noise_on`): the noise :func:`training_loss` divides by. A likelihood
    without a noise to fit (classes, a fixed ``σ``) is left alone.

    Example:
        >>> fit_plain_noise(method.likelihood, method.model, (train_loader, val_loader), method.device)
    """
    with eval_mode(model):
        fit_noise_on(likelihood, loaders, device, lambda x: (model_outputs(run_model(model, x))[None], None))


def fit_sampled_noise(likelihood: Likelihood, outputs: SampledOutputs, loaders: tuple[Iterable | None, Iterable | None],
                      device: torch.device) -> None:
    """Re-fit ``likelihood``'s noise to a fitted predictive's sampled ``outputs(x)`` ``(S, N, D)`` (module docs).

    Example:
        >>> fit_sampled_noise(method.likelihood, method.sampled_outputs, (train_loader, val_loader), method.device)
    """
    fit_noise_on(likelihood, loaders, device, lambda x: (outputs(x), None))


@torch.no_grad()
def sampled_outputs_nll(likelihood: Likelihood, outputs: SampledOutputs, loader: Iterable, *, device: torch.device) -> float:
    """The mean NLL of ``loader``'s real targets under the mixture of ``N(outputs(x)_s, σ²)`` at its own best ``σ``
    (a fixed ``σ`` stays; :func:`~posthoc.core.likelihood.best_noise_nll`), from one pass over ``loader``;
    ``likelihood`` itself is not changed.

    Example:
        >>> sampled_outputs_nll(Gaussian(), lambda x: model(x)[None], val_loader, device="cpu")
        -1.32
    """
    samples, targets = [], []
    for x, y in iterate(loader, device=device, progress=False, desc="held-out NLL"):
        drawn = outputs(x)
        samples.append(drawn)
        targets.append(likelihood.targets(y, drawn[0]))
    return best_noise_nll(likelihood, torch.cat(samples, dim=1), torch.cat(targets))


def held_out_score(likelihood: Likelihood, loader: Iterable, *, device: torch.device,
                   log_probs: Callable[[Inputs], Tensor], outputs: SampledOutputs) -> float:
    """The held-out NLL of a predictive: of ``log_probs(x)`` ``(N, C)`` for class labels
    (:func:`~posthoc.engine.held_out.held_out_nll`), of the mixture around ``outputs(x)`` ``(S, N, D)`` for real
    targets (:func:`sampled_outputs_nll`). Only the one the likelihood needs is called.

    Example:
        >>> held_out_score(method.likelihood, val_loader, device="cpu", log_probs=lambda x: method.log_predictive(x)[0],
        ...                outputs=method.sampled_outputs)
    """
    if predicts_classes(likelihood):
        return held_out_nll(log_probs, loader, device=device)
    return sampled_outputs_nll(likelihood, outputs, loader, device=device)


def plain_held_out_score(likelihood: Likelihood, model: nn.Module, loader: Iterable, *, device: torch.device) -> float:
    """:func:`held_out_score` of the plain ``model`` (the checkpoint's own predictive), in eval mode.

    Example:
        >>> plain_held_out_score(method.likelihood, method.model, val_loader, device="cpu")
    """
    with eval_mode(model):
        return held_out_score(likelihood, loader, device=device, log_probs=lambda x: class_log_probs(run_model(model, x)),
                              outputs=lambda x: model_outputs(run_model(model, x))[None])


def nll_limit(likelihood: Likelihood, *, best: float, tolerance: float) -> float:
    """The held-out NLL a spread may reach and still count as within ``tolerance`` of ``best`` (module docs):
    ``(1 + tolerance) * best`` for class labels, ``best + tolerance`` nats for real targets.

    Example:
        >>> nll_limit(Categorical(), best=0.5, tolerance=0.02), nll_limit(Gaussian(), best=0.5, tolerance=0.02)
        (0.51, 0.52)
    """
    return (1 + tolerance) * best if predicts_classes(likelihood) else best + tolerance


def held_out_shift(likelihood: Likelihood, shift: Any) -> Any:
    """``shift`` for a held-out choice under ``likelihood``: as given for class labels, ``None`` for real targets
    (the perturbations are graded on accuracy; module docs).

    Example:
        >>> held_out_shift(Gaussian(), "auto") is None
        True
    """
    return shift if predicts_classes(likelihood) else None
