"""Last-layer SWAG: a Gaussian over the head's weights, sampled in logit space.

``fit`` fine-tunes a private copy of the head's weight (and bias) on the backbone's features. The
head is linear, so with Gaussian weights the logits are Gaussian too: one backbone pass gives the
features ``phi`` and all samples are drawn in logit space in batched ops (no weight samples). Under
``likelihood="regression"`` the same draws are the head's sampled outputs.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, train_loader, x
    >>> um = posthoc.wrap(model, method="swag", subset="last_layer")
    >>> type(um.method).__name__
    'LastLayerSWAG'
    >>> um.fit(train_loader, epochs=3, lr=1e-2).predict(x).samples.shape
    torch.Size([20, 8, 3])
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posthoc.core.chunks import chunks
from posthoc.core.inputs import Inputs, iterate
from posthoc.core.logits import class_log_probs, log_mean_exp
from posthoc.core.method import LogPredictive
from posthoc.core.modules import eval_mode, qualified
from posthoc.engine.head import FeatureSplit
from posthoc.engine.random_draws import randn
from posthoc.errors import ConfigError, NotFittedError, NumericalError
from posthoc.export.modules import HeadSamples
from posthoc.methods.swag.base import SWAGBase, Tuning


class LastLayerSWAG(SWAGBase):
    """SWAG over the head's weight and bias, predicting with Gaussian logits (see module docs). The head is found at
    wrap, else by the first training batch at fit (``head=`` names it)."""

    exports = ("classification",)

    def __init__(self, model: nn.Module, options: SWAGBase.Options) -> None:
        super().__init__(model, options)
        self.split = FeatureSplit(model, options.head)

    def to_module(self, export: Any) -> nn.Module:
        """``S`` head weights drawn once at export from the SWAG Gaussian (mean, diagonal, low-rank deviations), the
        same draws for every input."""
        collector = self.collector
        if collector is None:
            raise NotFittedError("swag is not fitted: call um.fit(train_loader) first")
        mean, variance = collector.mean.float().cpu(), collector.variance.float().cpu()
        deviations = collector.held_deviations.float().cpu() if self.cov else None
        scale, head = float(self.scale), self.split.head
        count = export.samples_of(self) if scale > 0 else 1
        generator = export.generator()
        noise = torch.randn(count, mean.numel(), generator=generator) * variance.clamp_min(0).sqrt()
        if deviations is not None and scale > 0:
            low_rank = torch.randn(count, deviations.shape[0], generator=generator) @ deviations
            noise = noise + low_rank / math.sqrt(deviations.shape[0] - 1)
        flat = mean + math.sqrt(scale) * noise
        size = head.out_features * head.in_features
        weights = flat[:, :size].reshape(count, head.out_features, head.in_features)
        if flat.shape[1] > size:
            biases = flat[:, size:]
        else:
            biases = None if head.bias is None else head.bias.detach().float().cpu().expand(count, -1).clone()
        backbone = export.backbone(self.model)
        return HeadSamples(backbone, backbone.add_tap(self.split.head_name, "input"), weights.clone(), biases)

    def _collected_tensors(self, x: Inputs | None = None) -> dict[str, Tensor]:
        """The head's trainable weight (and bias) by qualified name; ``x`` finds the head if needed."""
        if self.split.head is None:
            if x is None:
                raise ConfigError("the head of this model cannot be found without an input; pass head='module name'")
            with torch.no_grad(), eval_mode(self.model):
                self.split(x)
        head, prefix = self.split.head, self.split.head_name
        if not head.weight.requires_grad:
            raise ConfigError(
                f"the head '{prefix}' is frozen (requires_grad=False); last-layer SWAG has nothing to fine-tune"
            )
        tensors = {f"{prefix}.weight": head.weight}
        if head.bias is not None and head.bias.requires_grad:
            tensors[f"{prefix}.bias"] = head.bias
        return tensors

    def _tuning(self, loader: Iterable) -> Tuning:
        first_x, _ = next(iter(iterate(loader, device=self.device, progress=False, desc="swag")))
        copies = {n: t.detach().clone().requires_grad_(True) for n, t in self._collected_tensors(first_x).items()}
        self.names = list(copies)
        weight = copies[qualified(self.split.head_name, "weight")]
        bias = copies.get(qualified(self.split.head_name, "bias"), self.split.head.bias)

        def forward(x: Inputs) -> Tensor:
            with torch.no_grad(), eval_mode(self.model):
                phi, _ = self.split(x)
            return F.linear(phi, weight, bias)

        return Tuning(copies, list(copies.values()), forward, averages_gradients=True)

    def _head_logits(self, flat: Tensor, features: Tensor) -> Tensor:
        """Apply head rows ``[W.flatten(), b]`` of shape ``(..., P)`` to ``features (N, D)``: ``(..., N, C)``."""
        head = self.split.head
        size = head.out_features * head.in_features
        weight = flat[..., :size].unflatten(-1, (head.out_features, head.in_features))
        out = features @ weight.transpose(-1, -2)
        return out + flat[..., size:].unsqueeze(-2) if flat.shape[-1] > size else out

    def _mean_logits(self, phi: Tensor) -> Tensor:
        """``(N, C)``: the head at the SWA mean on features ``phi``."""
        head, collector = self.split.head, self.collector
        logits = self._head_logits(collector.mean.float().to(phi.device), phi)
        if head.bias is not None and collector.num_parameters == head.out_features * head.in_features:
            logits = logits + head.bias.float()  # a bias the user froze stays as it is
        return logits

    def _sampled_logits(
        self, phi: Tensor, logits: Tensor, count: int, generator: torch.Generator | None
    ) -> Iterator[tuple[slice, Tensor]]:
        """``(rows, samples (S, n, C))`` per chunk of examples: Gaussian logits around ``logits`` on features ``phi``,
        drawn from ``generator`` (default: one seeded with ``seed``). A chunk's samples are overwritten by the next."""
        collector = self.collector
        if collector.num_snapshots < 2:
            raise NumericalError(
                f"SWAG needs at least 2 snapshots to sample, it holds {collector.num_snapshots}; fit with more"
            )
        generator = generator if generator is not None else torch.Generator(device=phi.device).manual_seed(self.seed)
        # the diagonal part makes the logits independent per class, with variance sum_d sigma_cd^2 phi_d^2
        std = self._head_logits(collector.variance.float().to(phi.device), phi**2).clamp_min(0).sqrt()
        deviations = (
            collector.held_deviations.to(phi.device) if self.cov else phi.new_zeros(0, collector.num_parameters)
        )
        n, classes = logits.shape
        # per row alive at once: the noise and its scaled copy (then log_mean_exp's shifted copy), the low-rank projection
        row_bytes = 4 * classes * (2 * count + 2 * deviations.shape[0])
        z = None  # the low-rank weights of each sample, shared by every example (drawn after the first chunk's noise)
        for rows in chunks(n, row_bytes):
            samples = (
                randn((count, rows.stop - rows.start, classes), generator=generator, device=phi.device) * std[rows]
            )
            if self.cov:  # the low-rank part: sum_k z_k (D_k phi) / sqrt(K - 1), shared across classes
                projected = self._head_logits(deviations, phi[rows]).flatten(1)  # (K, n * C)
                if z is None:
                    z = randn((count, deviations.shape[0]), generator=generator, device=phi.device)
                samples.view(count, -1).addmm_(z, projected, alpha=1 / math.sqrt(deviations.shape[0] - 1))
                del projected
            samples.mul_(math.sqrt(self.scale)).add_(logits[rows])
            yield rows, samples
            del samples  # before the next chunk's noise is drawn

    def log_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> LogPredictive:
        """Logit samples drawn from ``generator`` (default: one seeded with ``seed``)."""
        count = num_samples or self.num_samples
        phi, _ = self.split(x)
        phi = phi.float()
        logits = self._mean_logits(phi)
        if self.scale == 0:
            return class_log_probs(logits), None
        n, classes = logits.shape
        log_probs, sample_log_probs = logits.new_empty(n, classes), logits.new_empty(count, n, classes)
        for rows, samples in self._sampled_logits(phi, logits, count, generator):
            samples.sub_(torch.logsumexp(samples, dim=-1, keepdim=True))
            log_probs[rows], sample_log_probs[:, rows] = log_mean_exp(samples), samples
        return log_probs, sample_log_probs

    def sampled_outputs(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> Tensor:
        """``(S, N, D)`` Gaussian head outputs, the same draws as :meth:`log_predictive` takes for logits."""
        phi, _ = self.split(x)
        phi = phi.float()
        outputs = self._mean_logits(phi)
        if self.scale == 0:
            return outputs[None]
        count = num_samples or self.num_samples
        draws = self._sampled_logits(phi, outputs, count, generator)
        return torch.cat([samples.clone() for _, samples in draws], dim=1)
