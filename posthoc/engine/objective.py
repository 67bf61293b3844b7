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
- the held-out score of a spread (a scale, a rate) under real targets is the NLL of the mixture of
  ``N(f_s(x), σ²)`` over the sampled outputs ``f_s`` with ``σ`` re-fitted on those held-out outputs (a fixed
  ``σ`` stays; :meth:`posthoc.engine.held_out.HeldOut.regression_scores`): ``fit`` re-fits the noise on the
  sampled predictive once the spread is chosen, so each candidate is scored by the predictive it would
  give. With the plain ``σ`` instead, every spread would only add width to an already calibrated Gaussian
  and the choice would always shrink towards the mean. The perturbed held-out copies grade the model's
  *accuracy*, which real targets do not have, so under regression the choice uses the clean held-out data.

Example:
    >>> import torch
    >>> from posthoc.core.likelihood import Categorical
    >>> from posthoc.engine.objective import step_scale, training_loss
    >>> loss = training_loss(Categorical(), torch.randn(4, 3), torch.tensor([0, 2, 1, 0]))
    >>> step_scale(Categorical())
    1.0
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posthoc.core.inputs import Inputs, check_labels, run_model
from posthoc.core.likelihood import Categorical, Likelihood, fit_noise_on, model_outputs
from posthoc.core.logits import as_class_logits
from posthoc.core.modules import eval_mode

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
        >>> import torch
        >>> from posthoc.engine.objective import training_loss
        >>> from posthoc.core.likelihood import Gaussian
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
        >>> from posthoc.engine.objective import step_scale
        >>> from posthoc.core.likelihood import Categorical, Gaussian
        >>> step_scale(Categorical()), step_scale(Gaussian(noise_std=0.1))
        (1.0, 0.005000000000000001)
    """
    return 1.0 if predicts_classes(likelihood) else likelihood.dispersion / 2


def fit_plain_noise(
    likelihood: Likelihood, model: nn.Module, loaders: tuple[Iterable | None, Iterable | None], device: torch.device
) -> None:
    """Fit ``likelihood``'s noise to the plain ``model``'s outputs, on the held-out loader if there is one
    (:func:`~posthoc.core.likelihood.fit_noise_on`): the noise :func:`training_loss` divides by. A likelihood
    without a noise to fit (classes, a fixed ``σ``) is left alone.

    Example:
        >>> import torch
        >>> from posthoc.engine.objective import fit_plain_noise
        >>> from posthoc_apps.demo.examples import regressor, reg_train_loader, reg_val_loader
        >>> from posthoc.core.likelihood import Gaussian
        >>> gaussian = Gaussian()
        >>> fit_plain_noise(gaussian, regressor, (reg_train_loader, reg_val_loader), torch.device("cpu"))
        >>> float(gaussian.noise_std) > 0
        True
    """
    with eval_mode(model):
        fit_noise_on(likelihood, loaders, device, lambda x: (model_outputs(run_model(model, x))[None], None))


def fit_sampled_noise(
    likelihood: Likelihood,
    outputs: SampledOutputs,
    loaders: tuple[Iterable | None, Iterable | None],
    device: torch.device,
) -> None:
    """Re-fit ``likelihood``'s noise to a fitted predictive's sampled ``outputs(x)`` ``(S, N, D)`` (module docs).

    Example:
        >>> import torch
        >>> from posthoc.engine.objective import fit_sampled_noise
        >>> from posthoc_apps.demo.examples import regressor, reg_train_loader, reg_val_loader
        >>> from posthoc.core.likelihood import Gaussian
        >>> gaussian = Gaussian()
        >>> outputs = lambda x: torch.stack([regressor(x), regressor(x) + 0.1])    # two sampled outputs (2, N, 1)
        >>> fit_sampled_noise(gaussian, outputs, (reg_train_loader, reg_val_loader), torch.device("cpu"))
        >>> float(gaussian.noise_std) > 0
        True
    """
    fit_noise_on(likelihood, loaders, device, lambda x: (outputs(x), None))
