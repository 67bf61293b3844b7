"""The density-aware temperature and its fit on cached held-out predictions.

For an example ``x`` with k-th nearest-neighbour distances ``d_l(x)`` at layers ``l = 1 .. L``::

    e_l(x) = relu((log d_l(x) - a_l) / s_l)            excess distance at layer l
    T(x)   = T0 * (1 + sum_l w_l * e_l(x)),  w_l >= 0

``a_l`` is the ``anchor`` quantile (e.g. 0.9) of ``log d_l`` on the clean held-out examples and ``s_l`` the spread
between it and the median, so ``T(x) = T0`` exactly for every example closer to the training features than ``anchor`` of
the clean ones are, at every layer; beyond, the temperature grows linearly in the standardised log-distance.

:func:`fit` works on cached held-out predictions: ``T0`` is the maximum-likelihood temperature of the clean batches (or
1), then the weights minimise ``NLL_clean(w) + strength · NLL_perturbed(w)``. ``T0`` is not fitted jointly with ``w``:
that sharpens the bulk and costs NLL on clean test data (docs/methods/dac.md).

Example:
    >>> import torch
    >>> from posthoc.methods.dac.temperature import Cached, excess, fit, standardisation, temperatures
    >>> from posthoc_apps.demo.examples import train_loader, val_loader, val_logits, val_labels
    >>> train_x, val_x = train_loader.dataset.tensors[0], val_loader.dataset.tensors[0]
    >>> log_d = torch.cdist(val_x, train_x).topk(5, largest=False).values[:, -1:].log()   # 5-NN distance, one layer
    >>> held = Cached(val_logits.log_softmax(-1), excess(log_d, *standardisation(log_d, 0.9)), val_labels)
    >>> fitted = fit(held, None, strength=1.0)
    >>> fitted       # T0 of the clean examples; the weight of the one layer
    Fitted(temperature=2.01, weights=[5.15])
    >>> temperatures(held.excess, fitted.temperature, torch.tensor(fitted.weights)).shape
    torch.Size([128])
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from posthoc.core.logits import LOG_PROB_FLOOR, log_mean_exp
from posthoc.engine.lbfgs import minimise
from posthoc.engine.runner import small_fit
from posthoc.export.modules import cast

#: distances below this are taken as this before the log (a query equal to its k-th neighbour)
MIN_DISTANCE = 1e-6
#: bounds of log T0
LOG_T0_BOUND = math.log(100.0)
#: L-BFGS stops when the largest gradient entry falls below this (the NLL moves by far less than its noise by then)
TOLERANCE = 1e-6
#: the smallest spread of a layer's clean log-distances (median to anchor)
MIN_SPREAD = 1e-3


def excess(log_distance: Tensor, anchor: Tensor, spread: Tensor) -> Tensor:
    """``relu((log d - a) / s)`` per example and layer, ``(N, L)``."""
    return ((log_distance - cast(anchor, log_distance.dtype)) / cast(spread, log_distance.dtype)).clamp_min(0)


def standardisation(log_distance: Tensor, anchor: float) -> tuple[Tensor, Tensor]:
    """``(a, s)`` per layer from clean held-out log-distances ``(N, L)``: the ``anchor`` quantile and its distance to the median."""
    values = log_distance.double()
    median = values.quantile(0.5, dim=0)
    top = values.quantile(anchor, dim=0)
    return top.float(), (top - median).clamp_min(MIN_SPREAD).float()


def temperatures(excess: Tensor, temperature: Tensor | float, weights: Tensor) -> Tensor:
    """``T(x) = T0 (1 + excess @ w)``, ``(N,)``."""
    return temperature * (1 + excess @ cast(weights, excess.dtype))


def tempered(log_probs: Tensor, temperature: Tensor) -> tuple[Tensor, Tensor | None]:
    """``(log_probs (N, C), samples (S, N, C) or None)`` with example ``i`` tempered by ``temperature[i]``.

    Samples ``(S, N, C)`` are tempered one by one and averaged (the predictive of tempered samples).
    """
    log_probs = log_probs.clamp_min(LOG_PROB_FLOOR)
    if log_probs.dim() == 3:
        samples = torch.log_softmax(log_probs / temperature.to(log_probs).view(1, -1, 1), dim=-1)
        return log_mean_exp(samples), samples
    return torch.log_softmax(log_probs / temperature.to(log_probs).view(-1, 1), dim=-1), None


@dataclass
class Cached:
    """Cached held-out predictions: the inner log-probabilities ``(N, C)`` or samples ``(S, N, C)``,
    the excess distances ``(N, L)`` and the labels ``(N,)``."""

    log_probs: Tensor
    excess: Tensor
    labels: Tensor

    #: what ``T0`` scales, and why the clean examples may fail to determine it (for :func:`clean_temperature`'s warning)
    scale_name = "temperature"
    undetermined = "all classified correctly, or no better than chance"

    @property
    def values(self) -> Tensor:
        """The inner predictions (what sizes the fit: :func:`posthoc.engine.runner.small_fit`)."""
        return self.log_probs

    def double(self) -> Cached:
        """The same in float64 (the fit's precision)."""
        return Cached(self.log_probs.double(), self.excess.double(), self.labels)

    def nll(self, log_t0: Tensor, weights: Tensor) -> Tensor:
        """Mean NLL of the labels under the density-aware temperature ``exp(log_t0) (1 + excess @ weights)``."""
        t = temperatures(self.excess.to(weights), log_t0.clamp(-LOG_T0_BOUND, LOG_T0_BOUND).exp(), weights)
        predictive, _ = tempered(self.log_probs.to(weights), t)
        return torch.nn.functional.nll_loss(predictive, self.labels)


@dataclass(frozen=True)
class Fitted:
    """What :func:`fit` chose: ``T0`` and the weights ``w_l >= 0``."""

    temperature: float
    weights: list[float]


def _softplus_inverse(value: float) -> float:
    return value + math.log(-math.expm1(-value))


def fit(
    clean: Cached,
    shifted: Cached | None,
    *,
    strength: float,
    max_iter: int = 100,
    initial_weight: float = 0.1,
    weights: bool = True,
    fit_temperature: bool = True,
    warn: bool = True,
) -> Fitted:
    """``T0`` on ``clean`` alone (``fit_temperature=False``: ``T0 = 1``), then (with ``weights``) ``w`` minimising
    ``NLL(clean) + strength · NLL(shifted)`` (module docs; without ``shifted`` the clean NLL alone). ``weights=False``
    keeps ``w = 0`` (temperature scaling). A regressor's :class:`~posthoc.methods.dac.variance.Spread` is fitted alike
    (``T0`` is then its variance scale).
    """
    with small_fit(clean.values, None if shifted is None else shifted.values):
        layers = clean.excess.shape[1]
        options = {"dtype": torch.float64, "device": clean.values.device}
        log_t0 = (
            clean_temperature(clean, max_iter=max_iter, warn=warn) if fit_temperature else torch.zeros((), **options)
        )
        temperature = float(log_t0.clamp(-LOG_T0_BOUND, LOG_T0_BOUND).exp())
        if not weights:
            return Fitted(temperature, [0.0] * layers)
        clean = clean.double()
        shifted = None if shifted is None else shifted.double()

        def objective(w: Tensor) -> Tensor:
            if shifted is None:
                return clean.nll(log_t0, w)
            return clean.nll(log_t0, w) + strength * shifted.nll(log_t0, w)

        raw = torch.full((layers,), _softplus_inverse(initial_weight), **options, requires_grad=True)
        minimise(lambda: objective(torch.nn.functional.softplus(raw)), [raw], max_iter=max_iter, tolerance=TOLERANCE)
        return Fitted(temperature, [float(w) for w in torch.nn.functional.softplus(raw.detach())])


def clean_temperature(clean: Cached, *, max_iter: int = 100, warn: bool = True) -> Tensor:
    """``log T0``: the maximum-likelihood temperature of the clean examples with no weights (0 where it hits its bound)."""
    clean = clean.double()
    zero = torch.zeros(clean.excess.shape[1], dtype=torch.float64, device=clean.values.device)
    log_t0 = torch.zeros((), dtype=torch.float64, device=clean.values.device, requires_grad=True)
    minimise(lambda: clean.nll(log_t0, zero), [log_t0], max_iter=max_iter, tolerance=TOLERANCE)
    log_t0 = log_t0.detach()
    if not bool(log_t0.abs() < 0.99 * LOG_T0_BOUND):
        if warn:
            warnings.warn(
                f"dac's clean {clean.scale_name} hit its bound "
                f"({float(log_t0.clamp(-LOG_T0_BOUND, LOG_T0_BOUND).exp()):.3g}): the held-out examples cannot "
                f"determine it ({clean.undetermined}); keeping T0 = 1. Check the labels or collect more "
                "held-out data",
                RuntimeWarning,
                stacklevel=3,
            )
        log_t0 = torch.zeros_like(log_t0)
    return log_t0
