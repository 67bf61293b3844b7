"""The Langevin update and its step-size schedules: plain SGLD and cyclical SG-MCMC (Zhang et al., 2020).

The target is the tempered posterior ``exp(-U / T)``, ``U(theta) = N * mean_i loss_i(theta) + (lambda / 2)
|theta - theta_0|^2`` (a Gaussian prior centred on the checkpoint or zero). With a learning rate ``eta`` on the *mean*
mini-batch loss, one step is

    theta <- theta - eta * (grad mean_batch loss + (lambda / N) (theta - theta_0)) + sqrt(2 eta T / N) * xi,

``xi ~ N(0, I)``: SGLD (Welling and Teh, 2011) with step ``epsilon = 2 eta / N`` on ``U / T``. ``T = 1`` is the Bayes
posterior, ``T < 1`` a cold one, ``T = 0`` plain SGD with weight decay ``lambda / N`` towards ``theta_0``.

Schedules over ``K`` steps (:func:`step_size`, :func:`kept_steps`): plain (``cycles=None``), a constant ``eta``, the
first ``burn_in`` fraction discarded and ``S`` samples kept evenly over the rest; cyclical (``cycles=M``),
``eta_k = eta / 2 * (cos(pi * r_k) + 1)`` with ``r_k`` the position in the current cycle of ``ceil(K / M)`` steps,
plain SGD while ``r_k < exploration`` (exploring a new mode), then Langevin steps of which the cycle's share of the
``S`` samples is kept, ending with the cycle's last step.

Example:
    >>> from posthoc.methods.sgld.langevin import kept_steps, step_size
    >>> [round(step_size(k, 8, 0.1, cycles=2), 3) for k in range(8)]
    [0.1, 0.085, 0.05, 0.015, 0.1, 0.085, 0.05, 0.015]
    >>> kept_steps(8, 4, cycles=2, burn_in=0.5, exploration=0.5)
    [2, 3, 6, 7]
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posthoc.engine.random_draws import randn
from posthoc.errors import ConfigError


def cycle_length(total: int, cycles: int) -> int:
    """Steps per cycle: ``ceil(total / cycles)`` (the last cycle may be shorter)."""
    return math.ceil(total / cycles)


def step_size(step: int, total: int, lr: float, *, cycles: int | None) -> float:
    """The learning rate of step ``step`` (0-based) of ``total``: ``lr``, or its cosine cycle."""
    if cycles is None:
        return lr
    period = cycle_length(total, cycles)
    return lr / 2 * (math.cos(math.pi * (step % period) / period) + 1)


def adds_noise(step: int, total: int, *, cycles: int | None, exploration: float) -> bool:
    """Whether step ``step`` is a Langevin step (always for plain SGLD; in the sampling phase of a cycle)."""
    if cycles is None:
        return True
    period = cycle_length(total, cycles)
    return (step % period) / period >= exploration


def silent_cycles(total: int, cycles: int, exploration: float) -> int:
    """How many of the ``cycles`` cycles over ``total`` steps have no step in the sampling phase.

    Example:
        >>> from posthoc.methods.sgld.langevin import silent_cycles
        >>> silent_cycles(16, 4, 0.8), silent_cycles(20, 4, 0.8)
        (4, 0)
    """
    period = cycle_length(total, cycles)
    lengths = [period] * (total // period) + ([total % period] if total % period else [])
    samples = sum((length - 1) / period >= exploration for length in lengths)
    return cycles - samples


def check_schedule(total: int, cycles: int | None, exploration: float, *, steps_per_epoch: int) -> None:
    """Refuse a cyclical schedule in which some cycle never reaches its sampling phase (its samples would be SGD
    iterates).

    Example:
        >>> from posthoc.methods.sgld.langevin import check_schedule
        >>> check_schedule(16, 4, 0.8, steps_per_epoch=8)
        Traceback (most recent call last):
        posthoc.errors.ConfigError: cyclical SGLD with cycles=4 over 16 steps...
    """
    if cycles is None:
        return
    silent = silent_cycles(total, cycles, exploration)
    if not silent:
        return
    needed = 1
    while (needed - 1) / needed < exploration:
        needed += 1
    most = max((count for count in range(1, total + 1) if not silent_cycles(total, count, exploration)), default=0)
    advice = f"use cycles <= {most}" if most else f"train for at least {needed} steps"
    raise ConfigError(
        f"cyclical SGLD with cycles={cycles} over {total} steps ({total // steps_per_epoch} epoch(s) of "
        f"{steps_per_epoch}) has cycles of {cycle_length(total, cycles)} step(s); with exploration={exploration} "
        f"{silent} of the {cycles} cycles never reach the sampling phase (a cycle needs at least {needed} steps) and "
        f"would keep plain SGD iterates as samples: {advice}, more epochs, or a lower exploration"
    )


def kept_steps(total: int, count: int, *, cycles: int | None, burn_in: float, exploration: float) -> list[int]:
    """The steps after which a sample is kept, ``count`` in all (fewer if there are fewer candidate steps)."""
    if cycles is None:
        return _spread(math.floor(burn_in * total), total, count)
    period, kept = cycle_length(total, cycles), []
    for cycle in range(cycles):
        start, stop = cycle * period, min(total, (cycle + 1) * period)
        share = count // cycles + (1 if cycle < count % cycles else 0)
        if stop > start and share:
            kept += _spread(start + math.ceil(exploration * period), stop, share)
    return kept


def _spread(start: int, stop: int, count: int) -> list[int]:
    """``count`` steps evenly spread over ``[start, stop)``, the last one ``stop - 1``, without repeats."""
    start = min(start, stop - 1)
    span = stop - start
    return sorted({start + math.ceil((j + 1) * span / count) - 1 for j in range(min(count, span))})


class Langevin:
    """SGLD steps, in place, on ``params`` whose ``.grad`` holds the gradient of the mean mini-batch loss (module
    docs: ``size`` is ``N``, ``centre`` the prior's mean per tensor, ``None`` for zero).

    Example:
        >>> import torch
        >>> from posthoc.methods.sgld.langevin import Langevin
        >>> theta = torch.zeros(3, requires_grad=True)
        >>> chain = Langevin([theta], size=100, prior_precision=1.0, temperature=1.0)
        >>> theta.grad = torch.ones(3)
        >>> chain.step(0.01, noise=False)
        >>> theta
        tensor([-0.0100, -0.0100, -0.0100], requires_grad=True)
    """

    def __init__(
        self,
        params: list[Tensor],
        *,
        size: int,
        prior_precision: float,
        temperature: float,
        centre: list[Tensor] | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.params, self.size = params, size
        self.decay, self.temperature = prior_precision / size, temperature
        self.centre = centre
        self.generator = generator

    @torch.no_grad()
    def step(self, lr: float, *, noise: bool = True) -> None:
        """One update with learning rate ``lr``; without ``noise`` it is an SGD step with the prior's decay."""
        scale = math.sqrt(2 * lr * self.temperature / self.size) if noise else 0.0
        for index, p in enumerate(self.params):
            drift = p - self.centre[index] if self.centre is not None else p
            p.sub_(drift, alpha=lr * self.decay)
            if p.grad is not None:
                p.sub_(p.grad, alpha=lr)
            if scale > 0:
                p.add_(randn(p.shape, generator=self.generator, device=p.device, dtype=p.dtype), alpha=scale)
