"""Estimating the deployment's class priors from held-out predictions and unlabelled deployment predictions.

Under label shift the class-conditional inputs stay the same and only the class priors move, from ``p`` (training,
seen through the labelled held-out set) to ``q`` (deployment). Two estimators of ``q``:

- **BBSE** (black-box shift estimation, Lipton et al. 2018): with the held-out joint confusion matrix
  ``C[i, j] = P(predicted i, label j)`` and the deployment's rate of each prediction ``mu[i]``, the weights
  ``w = q / p`` solve ``C w = mu``; negative weights are clipped to 0 and ``q = w p`` renormalised.
- **EM** (Saerens et al. 2002) on a predictive calibrated with bias-corrected temperature scaling (BCTS: a
  temperature and a bias per class, fitted on the held-out set by NLL; Alexandari et al. 2020): ``q`` is the mean of
  the deployment's posteriors reweighted by ``q / p``, iterated to a fixed point.

The corrected predictive is ``p(y | x) q(y) / p(y)``, renormalised (:func:`shifted_log_probs`).

Example:
    >>> import torch
    >>> from posthoc.methods.label_shift.estimate import em_priors
    >>> probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4]])
    >>> em_priors(probs.log(), torch.tensor([0.5, 0.5])).round(decimals=3)
    tensor([1., 0.], dtype=torch.float64)
"""

from __future__ import annotations

import torch
from torch import Tensor

from posthoc.engine.lbfgs import minimise
from posthoc.errors import InputError

#: the smallest singular value of the held-out confusion matrix (relative to its largest) BBSE inverts
MIN_CONDITION = 1e-6
#: EM stops when no prior moves by more than this
EM_TOLERANCE = 1e-10
EM_MAX_ITER = 10_000


def source_priors(labels: Tensor, classes: int) -> Tensor:
    """The class frequencies of the held-out ``labels`` (float64); every class must occur.

    Example:
        >>> import torch
        >>> from posthoc.methods.label_shift.estimate import source_priors
        >>> source_priors(torch.tensor([0, 1, 1, 2]), 3)
        tensor([0.2500, 0.5000, 0.2500], dtype=torch.float64)
    """
    counts = torch.bincount(labels, minlength=classes).double()
    missing = (counts == 0).nonzero().flatten().tolist()
    if missing:
        raise InputError(
            f"the held-out labels hold no example of class(es) {missing[:10]} (of {classes}): the training priors of "
            "those classes are unknown, so their weight q/p is not defined; use a held-out set with every class"
        )
    return counts / counts.sum()


def bbse_priors(val_log_probs: Tensor, val_labels: Tensor, target_log_probs: Tensor) -> Tensor:
    """Deployment priors by confusion-matrix inversion (module docs); refuses a confusion matrix too close to singular.

    Example:
        >>> import torch
        >>> from posthoc.methods.label_shift.estimate import bbse_priors
        >>> val = torch.eye(2)[torch.tensor([0, 0, 1, 1, 0, 1])].mul(3).log_softmax(-1)
        >>> labels = torch.tensor([0, 0, 1, 1, 1, 0])       # right 4 times out of 6
        >>> target = torch.eye(2)[torch.tensor([0, 0, 0, 1])].mul(3).log_softmax(-1)
        >>> bbse_priors(val, labels, target)
        tensor([1., 0.], dtype=torch.float64)
    """
    classes = val_log_probs.shape[-1]
    prior = source_priors(val_labels, classes)
    predicted = val_log_probs.argmax(-1)
    joint = torch.zeros(classes, classes, dtype=torch.float64, device=val_labels.device)
    joint.index_put_((predicted, val_labels), torch.ones_like(predicted, dtype=torch.float64), accumulate=True)
    joint /= len(val_labels)
    rate = torch.bincount(target_log_probs.argmax(-1), minlength=classes).double().to(joint.device)
    rate /= rate.sum()
    singular = torch.linalg.svdvals(joint)
    if singular[-1] <= MIN_CONDITION * singular[0]:
        never = (joint.sum(1) == 0).nonzero().flatten().tolist()
        why = f"class(es) {never[:10]} are never predicted on it" if never else "some classes are confused as one"
        raise InputError(
            f"BBSE cannot invert the held-out confusion matrix: it is singular ({why}; smallest singular value "
            f"{float(singular[-1]):.2e} of {float(singular[0]):.2e}), so the weights of those classes are not "
            "determined; use estimator='em', or a held-out set where every class is predicted"
        )
    weights = torch.linalg.solve(joint, rate).clamp_min(0)
    priors = weights * prior
    if float(priors.sum()) <= 0:
        raise InputError("BBSE found no positive class weight; the deployment predictions contradict the held-out ones")
    return priors / priors.sum()


def em_priors(target_log_probs: Tensor, priors: Tensor) -> Tensor:
    """Deployment priors by EM from the deployment's calibrated log-posteriors under the training ``priors``
    (Saerens et al. 2002): ``q <- mean_x softmax(log p(y|x) + log q - log p)`` until it stops moving."""
    log_probs, log_source = target_log_probs.double(), priors.double().log()
    estimate = priors.double().clone()
    for _ in range(EM_MAX_ITER):
        updated = torch.softmax(log_probs + estimate.log() - log_source, -1).mean(0)
        if float((updated - estimate).abs().max()) < EM_TOLERANCE:
            return updated
        estimate = updated
    return estimate


def fit_bcts(log_probs: Tensor, labels: Tensor, *, max_iter: int = 200) -> tuple[Tensor, Tensor]:
    """Bias-corrected temperature scaling on held-out log-probabilities: ``(temperature, bias (C))`` minimising the
    NLL of ``log_softmax(log_probs / temperature + bias)``.

    Example:
        >>> import torch
        >>> from posthoc.methods.label_shift.estimate import fit_bcts
        >>> logits = 4 * torch.randn(2000, 3)
        >>> labels = torch.distributions.Categorical(logits=logits / 2).sample()    # twice too sharp
        >>> temperature, bias = fit_bcts(logits.log_softmax(-1), labels)
        >>> round(float(temperature), 1)
        2.0
    """
    inputs = log_probs.detach().double()
    log_temperature = torch.zeros((), dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(inputs.shape[-1], dtype=torch.float64, requires_grad=True)

    def nll() -> Tensor:
        mapped = inputs / log_temperature.exp() + bias
        return torch.nn.functional.cross_entropy(mapped, labels)

    minimise(nll, [log_temperature, bias], max_iter=max_iter)
    return log_temperature.detach().exp(), (bias - bias.mean()).detach()


def shifted_log_probs(log_probs: Tensor, temperature: Tensor, bias: Tensor, log_weights: Tensor) -> Tensor:
    """The label-shift-corrected log-probabilities of log-probabilities ``(..., C)``: calibrated by ``temperature``
    and ``bias``, then weighted by ``exp(log_weights) = q / p`` and renormalised.

    Example:
        >>> import torch
        >>> from posthoc.methods.label_shift.estimate import shifted_log_probs
        >>> uniform = torch.tensor([[0.5, 0.5]]).log()
        >>> shifted_log_probs(uniform, torch.tensor(1.0), torch.zeros(2), torch.tensor([0.9, 0.1]).log()).exp()
        tensor([[0.9000, 0.1000]])
    """
    dtype = log_probs.dtype
    mapped = log_probs / temperature.to(dtype) + bias.to(dtype)
    return torch.log_softmax(torch.log_softmax(mapped, -1) + log_weights.to(dtype), -1)
