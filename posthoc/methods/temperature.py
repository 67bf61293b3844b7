"""``"temperature"``: temperature scaling, alone or on top of another method's predictive.

The inner predictive runs once over the validation loader and is cached; ``log T`` is then
fitted on the cache. On a sampling method each sample is tempered and the samples averaged.

Example:
    >>> um = posthoc.wrap(model, method=["mc-dropout", "temperature"]).fit(train_loader, val_loader)
    >>> float(um.method.temperature) > 0
    True
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from posthoc import distributed
from posthoc.api import register
from posthoc.base import LogPredictive, Method
from posthoc.batches import Inputs, check_labels, iterate
from posthoc.errors import ConfigError
from posthoc.surgery import eval_mode
from posthoc.temperature_fit import fit_temperature, tempered_log_probs

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
        if not isinstance(max_iter, int) or max_iter < 1:
            raise ConfigError(f"max_iter must be a positive integer, got {max_iter!r}")
        self.inner = inner
        self.max_iter = max_iter
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
        return tempered_log_probs(samples, self.temperature), tempered

    def extra_repr(self) -> str:
        return f"temperature={float(self.temperature):.4f}"

