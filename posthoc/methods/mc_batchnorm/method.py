"""``"mc-batchnorm"``: Monte Carlo Batch Normalisation (Teye, Azizpour & Smith, ICML 2018).

A network trained with BatchNorm saw the statistics of a random mini-batch at every step. Predicting with those of
``S`` random training mini-batches of size ``b`` draws ``S`` networks: sample ``s`` normalises each BatchNorm input
with the per-channel mean and unbiased variance of that layer's input over mini-batch ``s`` (torch-uncertainty's
``MCBatchNorm`` rule). Smaller batches spread the samples more: ``b`` is chosen on held-out data by the selection step
among :data:`BATCH_SIZES` and the plain model. No weight changes.

Example:
    >>> from torch import nn
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import train_loader, x
    >>> bn_model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).eval()
    >>> um = posthoc.wrap(bn_model, method="mc-batchnorm", num_samples=4, batch_size=16).fit(train_loader)
    >>> um.predict(x).samples.shape[0]
    4
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from posthoc.core.checks import positive_int
from posthoc.core.inputs import Inputs, run_model, split_batch, to_device
from posthoc.core.knob import Knob
from posthoc.core.logits import class_log_probs, log_mean_exp
from posthoc.core.method import LogPredictive, Method
from posthoc.core.options import option
from posthoc.core.registry import register
from posthoc.engine.bn_refresh import batchnorm_layers, normalise_groups, per_batch_statistics
from posthoc.engine.hooks import hooked
from posthoc.engine.suffix import SuffixRunner
from posthoc.errors import ConfigError, InputError

#: mini-batch sizes the selection step tries, from the narrowest spread (the largest batch) to the widest
BATCH_SIZES = (128, 64, 32, 16)


@register
class MCBatchNorm(Method):
    """Monte Carlo BatchNorm (Teye et al. 2018) on a classifier with BatchNorm layers."""

    name = "mc-batchnorm"

    @dataclass(frozen=True, kw_only=True)
    class Options(Method.Options):
        num_samples: int = option(16, "S, the training mini-batches drawn (one network each)")
        batch_size: int | Literal["auto"] = option("auto", "b, the mini-batch size ('auto': chosen, else 32)")
        seed: int = option(0, "the seed of the mini-batch draws")

        def __post_init__(self) -> None:
            positive_int(self.num_samples, "num_samples")
            if self.batch_size != "auto" and (not isinstance(self.batch_size, int) or self.batch_size < 2):
                raise ConfigError(f"batch_size must be an integer of at least 2 or 'auto', got {self.batch_size!r}")

    def __init__(self, model: nn.Module, options: Options) -> None:
        super().__init__(model)
        self.num_samples, self.seed, batch_size = options.num_samples, int(options.seed), options.batch_size
        self.sizes = BATCH_SIZES if batch_size == "auto" else (batch_size,)
        self.layers = list(batchnorm_layers(model).values())
        if not self.layers:
            raise ConfigError(
                "mc-batchnorm samples the statistics of BatchNorm layers and this model has none: use "
                "method='mc-dropout', 'laplace' or 'auto' instead"
            )
        channels = sum(layer.num_features for layer in self.layers)
        self.register_buffer("means", torch.zeros(len(self.sizes), self.num_samples, channels))
        self.register_buffer("variances", torch.ones(len(self.sizes), self.num_samples, channels))
        self.register_buffer("chosen", torch.tensor(-1 if batch_size == "auto" else 0))  # -1: the plain model
        self.runner = SuffixRunner(model, next(n for n, m in model.named_modules() if m is self.layers[0]))

    def fit(self, train_loader: Iterable | None, val_loader: Iterable | None = None, *, progress: bool = True) -> None:
        """Draw ``S`` mini-batches of each candidate size from the training data and keep their statistics."""
        rows = []
        for batch in train_loader:  # enough rows for S mini-batches of the largest size
            rows.append(split_batch(batch, require_labels=False)[0])
            if sum(map(len, rows)) >= self.num_samples * max(self.sizes):
                break
        if len(pool := torch.cat(rows)) < min(self.sizes):
            raise InputError(f"mc-batchnorm needs at least {min(self.sizes)} training examples, got {len(pool)}")
        generator = torch.Generator().manual_seed(self.seed)
        for k, size in enumerate(self.sizes):
            draws = [torch.randperm(len(pool), generator=generator)[:size] for _ in range(self.num_samples)]
            means, variances = per_batch_statistics(self.model, [to_device(pool[i], self.device) for i in draws])
            self.means[k], self.variances[k] = means, variances
        if self.chosen < 0:
            self.chosen.fill_(self.sizes.index(32))  # until (or without) a held-out choice
        super().fit(train_loader, val_loader, progress=progress)

    def knob(self) -> Knob | None:
        """``batch_size="auto"``: the mini-batch size, from the plain model (the running statistics) to the smallest."""
        if len(self.sizes) == 1:
            return None
        sampled = lambda k, held_out: held_out.scores(lambda x, g: self._sampled(x, k, self.num_samples)[0])  # noqa: E731
        return Knob(
            name="mini-batch size",
            candidates=[("plain", -1), *[(f"b={size}", k) for k, size in enumerate(self.sizes)]],
            score=lambda k, held_out: held_out.plain if k < 0 else sampled(k, held_out),
            apply=self.chosen.fill_,
        )

    def log_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> LogPredictive:
        if int(self.chosen) < 0:
            return class_log_probs(run_model(self.model, x)), None
        return self._sampled(x, int(self.chosen), num_samples or self.num_samples)

    def _sampled(self, x: Inputs, k: int, num_samples: int) -> LogPredictive:
        logits = self.runner(x, num_samples, stochastic=lambda: self._normalising(k))  # (S, N, C)
        samples = class_log_probs(logits.flatten(0, 1)).unflatten(0, logits.shape[:2])
        return log_mean_exp(samples, 0), samples

    @contextmanager
    def _normalising(self, k: int) -> Iterator[None]:
        """BatchNorm layers normalise each sample's rows with that sample's statistics (samples are sample-major)."""
        ends = torch.tensor([layer.num_features for layer in self.layers]).cumsum(0).tolist()
        spans = {layer: slice(end - layer.num_features, end) for layer, end in zip(self.layers, ends)}

        def hook(layer: _BatchNorm, args: tuple, output: Tensor) -> Tensor:
            layout, channels = self.runner.layout, spans[layer]
            picks = torch.arange(layout.first, layout.first + layout.samples) % self.num_samples
            z = args[0].unflatten(0, (layout.samples, -1))
            return normalise_groups(
                layer, z, self.means[k, picks, channels], self.variances[k, picks, channels]
            ).flatten(0, 1)

        with hooked([(layer, "output", hook) for layer in self.layers]):
            yield

    def summary(self) -> dict:
        """The samples, the chosen mini-batch size (``None``: the plain model) and the BatchNorm layers sampled."""
        batch_size = None if int(self.chosen) < 0 else self.sizes[int(self.chosen)]
        return {"num_samples": self.num_samples, "batch_size": batch_size, "batchnorm_layers": len(self.layers)}
