"""What a sampling method fine-tunes on and scores on held-out data, under its likelihood.

SWAG, MultiSWAG, IVON and SGLD train from the checkpoint and choose their spread on held-out data, both under the
method's :class:`~posthoc.core.likelihood.Likelihood`:

- :func:`training_loss`: the mean NLL of a batch. Real targets: ``unit_loss / σ² / N`` at the noise the *plain*
  model has on held-out data (:func:`fit_plain_noise`, fitted first). Dividing by ``σ²`` keeps the loss a
  log-likelihood per example, as the cross-entropy is, so the step sizes and the posterior widths derived from it
  keep their meaning.
- the held-out score of a spread under real targets re-fits ``σ`` on each candidate's sampled outputs
  (:meth:`posthoc.engine.held_out.HeldOut.regression_scores`), as ``fit`` does once the spread is chosen: with the
  plain ``σ`` every spread would only widen an already calibrated Gaussian, and the choice would always shrink.
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

    Class labels: the cross-entropy of the logits (:func:`~posthoc.core.logits.as_class_logits`). Real targets:
    ``unit_loss / dispersion / N`` (module docs); the noise must be fitted first.

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
    for a Gaussian: the ratio of the largest second derivatives of one example's loss (``1/2`` and ``1 / σ²``).

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
    """Fit ``likelihood``'s noise to the plain ``model``'s outputs (on the held-out loader if there is one): the noise
    :func:`training_loss` divides by. Classes or a fixed ``σ`` are left alone.

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
