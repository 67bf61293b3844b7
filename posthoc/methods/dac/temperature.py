"""The density-aware temperature and its fit on cached held-out predictions.

For an example ``x`` with k-th nearest-neighbour distances ``d_l(x)`` at layers ``l = 1 .. L``::

    e_l(x) = relu((log d_l(x) - a_l) / s_l)            excess distance at layer l
    T(x)   = T0 * (1 + sum_l w_l * e_l(x)),  w_l >= 0

``a_l`` is the ``anchor`` quantile (0.9) of ``log d_l`` on the clean held-out examples and ``s_l`` the
spread between it and the median, so ``T(x) = T0`` exactly for every example closer to the training
features than ``anchor`` of the clean ones are, at every layer: in distribution the predictive is
the inner one tempered by one ``T0``; beyond the anchor the temperature grows linearly in the
standardised log-distance, never falls, and each layer's weight ``w_l`` says how much its
distance is worth.

:func:`fit` works on cached held-out predictions. ``T0`` is the maximum-likelihood temperature of
the clean validation batches (the inner predictive temperature-scaled; in distribution DAC is
exactly that). The weights ``w`` then minimise the NLL over the clean batches and their perturbed
copies (:func:`posthoc.engine.held_out.shifted_held_out`) subject to the clean NLL staying within
``tolerance`` (relative) of ``T0``'s alone: the bound enters as a quadratic penalty on the clean
NLL's relative excess, raised from 1e2 to 1e6 over five L-BFGS runs, and if the result is still
outside, all weights shrink by one common factor (bisection) until it holds, so the constraint
always does. Fitting ``T0`` jointly with ``w`` instead lowers it (the bulk sharpened, the tail
softened): on the bundled digits CNN that kept the validation NLL within 1 % but cost 4-6 % on the
clean test digits, so ``T0`` stays the clean one.

Example:
    >>> held = HeldOut(log_probs, excess, labels)
    >>> fitted = fit(held, None, levels=0, tolerance=0.01)
    >>> temperatures(excess, fitted.temperature, fitted.weights).shape
    torch.Size([600])
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from posthoc.core.logits import log_mean_exp
from posthoc.core.threads import single_thread_if
from posthoc.engine.lbfgs import minimise

#: log-probabilities below this are clamped before tempering (an exact 0 probability is -inf)
LOG_PROB_FLOOR = -1e4
#: bounds of log T0
LOG_T0_BOUND = math.log(100.0)
#: bisection steps when the weights are shrunk back into the clean-NLL tolerance
SHRINK_STEPS = 30
#: L-BFGS stops when the largest gradient entry falls below this
TOLERANCE = 1e-9
#: weights of the quadratic penalty on the clean NLL's relative excess over its bound, in turn
PENALTIES = (1e2, 1e3, 1e4, 1e5, 1e6)
#: below this many cached elements a fit runs on one CPU thread (thousands of tiny ops, where threads only wait)
SMALL_FIT = 1 << 20
#: the smallest spread of a layer's clean log-distances (median to anchor)
MIN_SPREAD = 1e-3


def excess(log_distance: Tensor, anchor: Tensor, spread: Tensor) -> Tensor:
    """``relu((log d - a) / s)`` per example and layer, ``(N, L)``."""
    return ((log_distance - anchor.to(log_distance)) / spread.to(log_distance)).clamp_min(0)


def standardisation(log_distance: Tensor, anchor: float) -> tuple[Tensor, Tensor]:
    """``(a, s)`` per layer from clean held-out log-distances ``(N, L)``: the ``anchor`` quantile and its distance to the median."""
    values = log_distance.double()
    median = values.quantile(0.5, dim=0)
    top = values.quantile(anchor, dim=0)
    return top.float(), (top - median).clamp_min(MIN_SPREAD).float()


def temperatures(excess: Tensor, temperature: Tensor | float, weights: Tensor) -> Tensor:
    """``T(x) = T0 (1 + excess @ w)``, ``(N,)``."""
    return temperature * (1 + excess @ weights.to(excess))


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
class HeldOut:
    """Cached held-out predictions: the inner log-probabilities ``(N, C)`` or samples ``(S, N, C)``,
    the excess distances ``(N, L)`` and the labels ``(N,)``."""

    log_probs: Tensor
    excess: Tensor
    labels: Tensor

    def nll(self, log_t0: Tensor, weights: Tensor) -> Tensor:
        """Mean NLL of the labels under the density-aware temperature ``exp(log_t0) (1 + excess @ weights)``."""
        t = temperatures(self.excess.to(weights), log_t0.clamp(-LOG_T0_BOUND, LOG_T0_BOUND).exp(), weights)
        predictive, _ = tempered(self.log_probs.to(weights), t)
        return torch.nn.functional.nll_loss(predictive, self.labels)


@dataclass(frozen=True)
class Fitted:
    """What :func:`fit` chose, and the held-out NLLs that justify it."""

    temperature: float  # T0
    weights: list[float]  # w_l >= 0
    clean_nll: float  # at the choice
    reference_nll: float  # T0 alone, fitted on the clean batches
    combined_nll: float | None  # clean and perturbed together, at the choice (None without perturbed data)
    kept: float  # the fraction of the penalised optimum's weights kept to meet the tolerance (1: all of it)


def _softplus_inverse(value: float) -> float:
    return value + math.log(-math.expm1(-value))


def fit(clean: HeldOut, shifted: HeldOut | None, *, levels: int, tolerance: float, max_iter: int = 100,
        initial_weight: float = 0.1) -> Fitted:
    """``T0`` on ``clean`` alone, then ``w`` minimising the NLL over ``clean`` and ``levels`` perturbed copies
    ``shifted`` (each example counted once) with the clean NLL within ``tolerance`` of ``T0``'s alone (see module docs)."""
    elements = clean.log_probs.numel() + (0 if shifted is None else shifted.log_probs.numel())
    with single_thread_if(clean.log_probs.device.type == "cpu" and elements < SMALL_FIT):
        return _fit(clean, shifted, levels=levels, tolerance=tolerance, max_iter=max_iter, initial_weight=initial_weight)


def _fit(clean: HeldOut, shifted: HeldOut | None, *, levels: int, tolerance: float, max_iter: int,
         initial_weight: float) -> Fitted:
    layers = clean.excess.shape[1]
    options = {"dtype": torch.float64, "device": clean.log_probs.device}
    clean = HeldOut(clean.log_probs.double(), clean.excess.double(), clean.labels)
    shifted = None if shifted is None else HeldOut(shifted.log_probs.double(), shifted.excess.double(), shifted.labels)
    zero = torch.zeros(layers, **options)

    log_t0 = torch.zeros((), **options, requires_grad=True)
    minimise(lambda: clean.nll(log_t0, zero), [log_t0], max_iter=max_iter, tolerance=TOLERANCE)
    log_t0 = log_t0.detach()
    if not bool(log_t0.abs() < 0.99 * LOG_T0_BOUND):
        warnings.warn(f"dac's clean temperature hit its bound ({float(log_t0.clamp(-LOG_T0_BOUND, LOG_T0_BOUND).exp()):.3g}): "
                      "the held-out examples cannot determine it (all classified correctly, or no better than "
                      "chance); keeping T0 = 1. Check the labels or collect more held-out data", RuntimeWarning, stacklevel=3)
        log_t0 = torch.zeros_like(log_t0)
    with torch.no_grad():
        reference = float(clean.nll(log_t0, zero))
    bound = reference * (1 + tolerance)

    def objective(weights: Tensor) -> Tensor:
        if shifted is None:
            return clean.nll(log_t0, weights)
        return (clean.nll(log_t0, weights) + levels * shifted.nll(log_t0, weights)) / (1 + levels)

    raw = torch.full((layers,), _softplus_inverse(initial_weight), **options, requires_grad=True)
    for penalty in PENALTIES:  # the clean-NLL bound as a growing quadratic penalty on its relative excess
        minimise(lambda: objective(torch.nn.functional.softplus(raw))
                  + penalty * torch.relu(clean.nll(log_t0, torch.nn.functional.softplus(raw)) / bound - 1) ** 2,
                  [raw], max_iter=max_iter, tolerance=TOLERANCE)
    found = torch.nn.functional.softplus(raw.detach())

    with torch.no_grad():
        def accepted(kept: float) -> bool:
            value = float(clean.nll(log_t0, kept * found))
            return math.isfinite(value) and value <= bound

        kept = 1.0
        if not accepted(1.0):  # the penalty left it just outside: shrink all weights by one factor until it holds
            low, high = 0.0, 1.0
            for _ in range(SHRINK_STEPS):
                middle = (low + high) / 2
                low, high = (middle, high) if accepted(middle) else (low, middle)
            kept = low
        weights = kept * found
        return Fitted(
            temperature=float(log_t0.clamp(-LOG_T0_BOUND, LOG_T0_BOUND).exp()),
            weights=[float(w) for w in weights],
            clean_nll=float(clean.nll(log_t0, weights)),
            reference_nll=reference,
            combined_nll=None if shifted is None else float(objective(weights)),
            kept=kept,
        )
