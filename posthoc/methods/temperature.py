"""``"temperature"``: temperature scaling, alone or on top of another method's predictive.

The inner predictive runs once over the validation loader and is cached; ``log T`` is then
fitted on the cache. On a sampling method each sample is tempered and the samples averaged.

Example:
    >>> um = posthoc.wrap(model, method=["mc-dropout", "temperature"]).fit(train_loader, val_loader)
    >>> float(um.method.temperature) > 0
    True
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import torch
from torch import Tensor

from posthoc.core import distributed
from posthoc.core.checks import positive_int
from posthoc.core.inputs import Inputs, check_labels, iterate
from posthoc.core.logits import log_mean_exp
from posthoc.core.method import LogPredictive, Method
from posthoc.core.modules import eval_mode
from posthoc.core.registry import register

MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-2, 1e2


def tempered_log_probs(log_probs: Tensor, temperature: Tensor | float) -> Tensor:
    """Apply ``T`` to log-probabilities ``(N, C)`` or samples ``(S, N, C)`` (then averaged); returns ``(N, C)``.

    Example:
        >>> tempered_log_probs(torch.log(torch.tensor([[0.8, 0.2]])), 2.0).exp()
        tensor([[0.6667, 0.3333]])
    """
    tempered = torch.log_softmax(log_probs / temperature, dim=-1)
    return log_mean_exp(tempered) if log_probs.dim() == 3 else tempered


def fit_temperature(log_probs: Tensor, labels: Tensor, *, max_iter: int = 100) -> float:
    """The temperature minimising the NLL of ``labels`` under the tempered predictive."""
    log_probs = log_probs.detach().double().clamp_min(-1e4)
    labels = labels.to(log_probs.device)
    log_t = torch.zeros((), dtype=torch.float64, device=log_probs.device, requires_grad=True)
    bound = math.log(MAX_TEMPERATURE)
    optimizer = torch.optim.LBFGS([log_t], lr=0.5, max_iter=max_iter, line_search_fn="strong_wolfe")

    def nll() -> Tensor:
        optimizer.zero_grad()
        temperature = log_t.clamp(-bound, bound).exp()
        loss = torch.nn.functional.nll_loss(tempered_log_probs(log_probs, temperature), labels)
        loss.backward()
        return loss

    optimizer.step(nll)
    value = float(log_t.detach().clamp(-bound, bound).exp())
    if not math.isfinite(value):
        value = 1.0
    if value <= MIN_TEMPERATURE * 1.01 or value >= MAX_TEMPERATURE * 0.99:
        warnings.warn(
            f"the fitted temperature hit its bound ({value:.3g}); the held-out data may be too small, "
            "mislabelled, or perfectly separated",
            RuntimeWarning,
            stacklevel=2,
        )
    return value


#: at most this many bytes of cached per-sample log-probabilities; beyond it, examples are subsampled
CACHE_BYTES = 1 << 30


@register
class TemperatureScaling(Method):
    """Divide the (inner) log-probabilities by a temperature fitted on held-out data by NLL."""

    name = "temperature"
    needs_val = True
    stacks = True
    demo_configs = (("temperature", {}),)

    def __init__(self, inner: Method, *, max_iter: int = 100) -> None:
        super().__init__(inner.base_model)
        self.inner = inner
        self.max_iter = positive_int(max_iter, "max_iter")
        self.register_buffer("temperature", torch.ones(()))

    @property
    def base_model(self) -> torch.nn.Module:
        return self.inner.base_model

    def fit(self, train_loader: Iterable | None, val_loader: Iterable | None = None, *, progress: bool = True) -> None:
        cached, labels = [], []
        generator = torch.Generator(device=self.device).manual_seed(0)
        with torch.no_grad(), eval_mode(self.inner):
            for x, y in iterate(val_loader, device=self.device, progress=progress, desc="temperature"):
                log_probs, samples = self.inner.log_predictive(x, generator=generator)
                cached.append((log_probs if samples is None else samples).float())
                labels.append(check_labels(y, log_probs.shape[-1]))
        dim = 0 if cached[0].dim() == 2 else 1
        cache = distributed.gather_cat(torch.cat(cached, dim), dim)
        targets = distributed.gather_cat(torch.cat(labels))
        if cache.element_size() * cache.numel() > CACHE_BYTES:
            keep = torch.randperm(targets.numel(), generator=torch.Generator().manual_seed(0))
            keep = keep[: max(1, targets.numel() * CACHE_BYTES // (cache.element_size() * cache.numel()))]
            cache, targets = cache.index_select(dim, keep.to(cache.device)), targets[keep.to(targets.device)]
        self.temperature.fill_(fit_temperature(cache, targets, max_iter=self.max_iter))

    def log_predictive(self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None) -> LogPredictive:
        log_probs, samples = self.inner.log_predictive(x, num_samples=num_samples, generator=generator)
        if samples is None:
            return tempered_log_probs(log_probs, self.temperature), None
        tempered = torch.log_softmax(samples / self.temperature, dim=-1)
        return log_mean_exp(tempered), tempered

    def extra_repr(self) -> str:
        return f"temperature={float(self.temperature):.4f}"

