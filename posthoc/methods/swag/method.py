"""``"swag"``: SWAG collected during a short fine-tuning of the trained checkpoint.

``fit`` fine-tunes a copy of the model with SGD (momentum 0.9, constant learning rate) and takes
``collect_per_epoch`` snapshots per epoch into a :class:`~posthoc.methods.swag.collector.SWAGCollector`
(mean, diagonal variance, last ``rank`` deviations). The posterior is the Gaussian
``theta = mu + sqrt(scale) * (sigma * z1 + D^T z2 / sqrt(K - 1))`` (``scale=0``: SWA).

- ``subset="all"`` (or module names): each sample is rebuilt lazily from its own seed and run
  with ``torch.func.functional_call`` (no model copies); BatchNorm statistics are recomputed
  exactly for each sample on ``bn_batches`` training batches once, at fit, and stored.
- ``subset="last_layer"``: the head's weights are Gaussian, so the logits are Gaussian too; one
  backbone pass gives the features and all samples are drawn in logit space in batched ops.

The user's model is never changed: fine-tuning runs on a private copy, and the wrapped copy keeps
the pretrained weights (samples are passed to it functionally).

Example:
    >>> um = posthoc.wrap(model, method="swag", subset="last_layer")
    >>> um.fit(train_loader, epochs=3, lr=1e-2)
    >>> um.predict(x).samples.shape
    torch.Size([20, 8, 10])
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from posthoc.core import distributed, settings
from posthoc.core.registry import register
from posthoc.core.method import LogPredictive, Method
from posthoc.core.inputs import Inputs, check_labels, iterate, run_model
from posthoc.engine.bn_refresh import batchnorm_layers, batchnorm_statistics
from posthoc.core.errors import ConfigError, NumericalError, PosteriorFileError
from posthoc.core.logits import class_log_probs
from posthoc.engine.random_draws import randn
from posthoc.methods.swag.sampled_linears import sampled_linears
from posthoc.engine.suffix import SuffixRunner
from posthoc.engine.head import FeatureSplit
from posthoc.core.modules import eval_mode, parameter_owners
from posthoc.methods.swag.collector import SWAGCollector

SUBSETS = ("all", "last_layer")


def _call(model: nn.Module, state: Mapping[str, Tensor], x: Inputs) -> Tensor:
    """``model(x)`` with some parameters/buffers replaced by ``state`` (the model is not changed)."""
    return run_model(lambda *args, **kwargs: torch.func.functional_call(model, dict(state), args, kwargs), x)


def _collect_steps(steps: int, per_epoch: int) -> set[int]:
    """The step indices (0-based) after which a snapshot is taken, spread evenly over an epoch."""
    return {math.ceil((j + 1) * steps / per_epoch) - 1 for j in range(per_epoch)}


@register
class SWAG(Method):
    """SWAG (Maddox et al., 2019) fitted by a short fine-tuning of the trained model.

    Options:
        subset: ``"all"``, ``"last_layer"``, or module name(s) whose parameters are fine-tuned and
            made Gaussian. Parameters the user froze (``requires_grad=False``) stay fixed.
        cov: keep the low-rank covariance part (``False``: SWAG-diagonal).
        scale: posterior scale; ``None`` means 0.5 with ``cov`` and 1.0 without; 0 gives SWA.
        num_samples: weight samples per prediction.
        bn_batches: training batches used to recompute BatchNorm statistics per sample
            (``None``: the whole loader).
        stats_device: where SWAG statistics live (e.g. ``"cpu"`` for a large model on a GPU).
        head: the head's module name for ``"last_layer"`` when it cannot be found automatically.
        seed: seeds the samples (sample ``s`` is rebuilt from ``(seed, s)``).

    Fit options: ``epochs``, ``lr`` (ImageNet reference 1e-3), ``collect_per_epoch`` (snapshots per
    epoch, 4), ``rank`` (deviations kept, 20), ``momentum`` (0.9), ``weight_decay``,
    ``include_pretrained`` (count the pretrained weights as the first snapshot).
    """

    name = "swag"
    copies_model = False  # fine-tunes a private copy inside fit; the wrapped model keeps the checkpoint
    demo_configs = (
        ("SWAG", {"epochs": 2, "lr": 0.05, "collect_per_epoch": 4, "num_samples": 8}),
        ("SWAG last-layer", {"subset": "last_layer", "epochs": 3, "lr": 0.05, "collect_per_epoch": 4}),
    )

    def __init__(
        self,
        model: nn.Module,
        *,
        subset: str | Sequence[str] = "all",
        cov: bool = True,
        scale: float | None = None,
        num_samples: int = 20,
        bn_batches: int | None = 4,
        stats_device: str | torch.device | None = None,
        head: str | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(model)
        if not isinstance(cov, bool):
            raise ConfigError(f"cov must be True or False, got {cov!r}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale >= 0 or math.isinf(scale)):
            raise ConfigError(f"scale must be a finite number >= 0 (0 gives SWA) or None, got {scale!r}")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ConfigError(f"num_samples must be a positive integer, got {num_samples!r}")
        if bn_batches is not None and (isinstance(bn_batches, bool) or not isinstance(bn_batches, int) or bn_batches < 1):
            raise ConfigError(f"bn_batches must be a positive integer or None (the whole loader), got {bn_batches!r}")
        if not isinstance(seed, int):
            raise ConfigError(f"seed must be an integer, got {seed!r}")
        self.subset = subset
        self.cov = cov
        self.scale = float(scale) if scale is not None else (0.5 if cov else 1.0)
        self.num_samples = num_samples
        self.bn_batches = bn_batches
        self.stats_device = torch.device(stats_device) if stats_device is not None else None
        self.seed = seed
        self.last_layer = subset == "last_layer"
        self.split = FeatureSplit(model, head) if self.last_layer else None
        if not self.last_layer:
            self.names = self._subset_names(subset)
        self.collector: SWAGCollector | None = None
        self.register_buffer("bn_cache", None)
        self._bn_layers: list[str] | None = None
        self._order: list[str] | None = None
        self._runner: SuffixRunner | None = None
        self._train_loader: Iterable | None = None

    # ----------------------------------------------------------------- which parameters
    def _subset_names(self, subset: str | Sequence[str]) -> list[str]:
        if subset == "all":
            names = [name for name, p in self.model.named_parameters() if p.requires_grad]
        else:
            modules = [subset] if isinstance(subset, str) else list(subset)
            if not modules or not all(isinstance(m, str) for m in modules):
                raise ConfigError(f"subset must be 'all', 'last_layer' or module name(s), got {subset!r}")
            names = []
            available = [n for n, _ in self.model.named_modules() if n]
            for module_name in modules:
                if module_name not in available:
                    shown = ", ".join(available[:30]) + (" ..." if len(available) > 30 else "")
                    raise ConfigError(f"subset names no module '{module_name}'; valid: {', '.join(SUBSETS)}, or modules: {shown}")
                module = self.model.get_submodule(module_name)
                names += [f"{module_name}.{n}" for n, p in module.named_parameters() if p.requires_grad]
            names = list(dict.fromkeys(names))
        if not names:
            raise ConfigError(f"subset {subset!r} has no trainable parameter: all are frozen (requires_grad=False)")
        return names

    def _head_tensors(self, x: Inputs | None = None) -> dict[str, Tensor]:
        """The head's trainable weight (and bias) by qualified name; resolves the head if needed."""
        if self.split.head is None:
            if x is None:
                raise ConfigError("the head of this model cannot be found without an input; pass head='module name'")
            self.split(x)
        head, prefix = self.split.head, self.split.head_name
        if not head.weight.requires_grad:
            raise ConfigError(f"the head '{prefix}' is frozen (requires_grad=False); last-layer SWAG has nothing to fine-tune")
        tensors = {f"{prefix}.weight": head.weight}
        if head.bias is not None and head.bias.requires_grad:
            tensors[f"{prefix}.bias"] = head.bias
        return tensors

    # ----------------------------------------------------------------- fitting
    def fit(
        self,
        train_loader: Iterable | None,
        val_loader: Iterable | None = None,
        *,
        progress: bool = True,
        epochs: int = 1,
        lr: float = 1e-3,
        collect_per_epoch: int = 4,
        rank: int = 20,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        include_pretrained: bool = False,
    ) -> None:
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ConfigError(f"epochs must be a positive integer, got {epochs!r}")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
            raise ConfigError(f"lr must be a positive finite number (ImageNet reference: 1e-3), got {lr!r}")
        if isinstance(collect_per_epoch, bool) or not isinstance(collect_per_epoch, int) or collect_per_epoch < 1:
            raise ConfigError(f"collect_per_epoch must be a positive integer, got {collect_per_epoch!r}")
        if not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ConfigError(f"momentum must lie in [0, 1), got {momentum!r}")
        if not isinstance(weight_decay, (int, float)) or not weight_decay >= 0:
            raise ConfigError(f"weight_decay must be >= 0, got {weight_decay!r}")
        if not isinstance(include_pretrained, bool):
            raise ConfigError(f"include_pretrained must be True or False, got {include_pretrained!r}")
        self._train_loader = train_loader
        self.bn_cache = None
        self._bn_layers, self._order, self._runner = None, None, None
        self._fine_tune(
            train_loader, epochs=epochs, lr=float(lr), collect_per_epoch=collect_per_epoch, rank=rank,
            momentum=float(momentum), weight_decay=float(weight_decay), include_pretrained=include_pretrained,
            progress=progress,
        )
        held = self.collector.num_deviations if self.cov else self.collector.num_snapshots
        if self.scale > 0 and held < 2:
            raise ConfigError(
                f"SWAG collected {self.collector.num_snapshots} snapshot(s) but needs at least 2 to sample; "
                "raise epochs or collect_per_epoch, or pass include_pretrained=True"
            )
        if not self.last_layer:
            batches = self._bn_inputs()
            self._extend_bn_cache(1 if self.scale == 0 else self.num_samples, batches[0], batches=batches, progress=progress)

    def _fine_tune(
        self, loader: Iterable, *, epochs: int, lr: float, collect_per_epoch: int, rank: int, momentum: float,
        weight_decay: float, include_pretrained: bool, progress: bool,
    ) -> None:
        device = self.device
        if self.last_layer:
            first_x, _ = next(iter(iterate(loader, device=device, progress=False, desc="swag")))
            with torch.no_grad(), eval_mode(self.model):
                self.names = list(self._head_tensors(first_x))
            source = {n: t.detach().clone().requires_grad_(True) for n, t in self._head_tensors().items()}
            trained = list(source.values())
            head = self.split.head
            bias_name = f"{self.split.head_name}.bias"

            def forward(x: Inputs) -> Tensor:
                with torch.no_grad(), eval_mode(self.model):
                    phi, _ = self.split(x)
                bias = source.get(bias_name, head.bias)
                return F.linear(phi, source[f"{self.split.head_name}.weight"], bias)
        else:
            work = copy.deepcopy(self.model)
            keep = set(self.names)
            for n, p in work.named_parameters():
                p.requires_grad_(n in keep)
            work.train()
            source, trained = work, [p for n, p in work.named_parameters() if n in keep]

            replica = DistributedDataParallel(work) if distributed.active() else work

            def forward(x: Inputs) -> Tensor:
                return run_model(replica, x)

        self.collector = SWAGCollector(source, names=self.names, rank=rank, low_rank=self.cov, stats_device=self.stats_device)
        optimizer = torch.optim.SGD(trained, lr=lr, momentum=momentum, weight_decay=weight_decay)
        if include_pretrained:
            self.collector.update(source)
        try:
            steps = len(loader)  # type: ignore[arg-type]
        except TypeError:
            steps = None
        steps = distributed.common_length(steps, "SWAG fine-tuning")
        if steps is not None and collect_per_epoch > steps:
            warnings.warn(
                f"collect_per_epoch={collect_per_epoch} exceeds the {steps} steps of an epoch; collecting after "
                f"every step instead ({steps} snapshots per epoch)",
                RuntimeWarning,
                stacklevel=4,
            )
            collect_per_epoch = steps
        collect_at = _collect_steps(steps, collect_per_epoch) if steps is not None else set()
        bar = tqdm(total=None if steps is None else epochs * steps, desc="swag fine-tune", disable=not progress, leave=False)
        try:
            for epoch in range(epochs):
                step = -1
                for step, (x, y) in enumerate(iterate(loader, device=device, progress=False, desc="swag fine-tune")):
                    if steps is not None and step >= steps:
                        break  # under torch.distributed: every rank takes the same number of steps
                    logits = forward(x)
                    loss = F.cross_entropy(logits.float(), check_labels(y, logits.shape[-1]))
                    value = float(loss.detach())
                    if not math.isfinite(value):
                        raise NumericalError(
                            f"the fine-tuning loss became {value} at epoch {epoch + 1}, step {step + 1} (lr={lr}); "
                            f"stopped. The {self.collector.num_snapshots} snapshot(s) collected before are kept in "
                            "um.method.collector; fit again with a lower lr"
                        )
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    if self.last_layer:
                        distributed.average_gradients(trained)  # a module's gradients are averaged by DDP
                    optimizer.step()
                    if step in collect_at:
                        self.collector.update(source)
                    bar.update(1)
                    bar.set_postfix(loss=f"{value:.4f}", snapshots=self.collector.num_snapshots)
                if steps is None and step >= 0:
                    self.collector.update(source)
        finally:
            bar.close()

    # ----------------------------------------------------------------- BatchNorm per sample
    @property
    def _owners(self) -> dict[str, nn.Module]:
        """The modules that own a sampled weight, by name."""
        return parameter_owners(self.model, self.names)

    def _call_order(self, x: Inputs) -> list[str]:
        """The sampled weights' modules and the BatchNorm layers, in the order a forward pass calls them (traced once)."""
        if self._order is None:
            watched = set(self._owners) | set(batchnorm_layers(self.model))
            order: list[str] = []
            hooks = [
                module.register_forward_pre_hook(lambda mod, args, n=name: order.append(n))
                for name, module in self.model.named_modules()
                if name in watched
            ]
            try:
                with torch.no_grad(), eval_mode(self.model):
                    run_model(self.model, x)
            finally:
                for hook in hooks:
                    hook.remove()
            self._order = order
        return self._order

    def _refreshed_layers(self, x: Inputs) -> list[str]:
        """BatchNorm layers called after the first module that owns a sampled weight."""
        if self._bn_layers is None:
            layers = batchnorm_layers(self.model)
            order, owners = (self._call_order(x) if layers else []), self._owners
            first = next((i for i, n in enumerate(order) if n in owners), len(order))
            after = set(order[first:])
            self._bn_layers = [name for name in layers if name in after]
        return self._bn_layers

    def _batched_suffix(self, x: Inputs, count: int) -> SuffixRunner | None:
        """A runner that samples the suffix from the first sampled layer on in one expanded pass, where
        that is exact: every sampled weight belongs to a Linear layer, no BatchNorm layer after it
        needs refreshed statistics, and ``count`` stacked weight samples fit half the memory budget."""
        owners = self._owners
        if self._refreshed_layers(x) or not all(isinstance(module, nn.Linear) for module in owners.values()):
            return None
        element = next(iter(self.model.parameters())).element_size()
        if count * self.collector.num_parameters * element > settings.memory_budget(None) // 2:
            return None
        first = next(name for name in self._call_order(x) if name in owners)
        if self._runner is None or self._runner.start != first:
            self._runner = SuffixRunner(self.model, first)
        return self._runner

    def _bn_inputs(self) -> list[Inputs]:
        batches = []
        for x, _ in iterate(self._train_loader, device=self.device, progress=False, desc="swag batchnorm", require_labels=False):
            batches.append(x)
            if self.bn_batches is not None and len(batches) == self.bn_batches:
                break
        return batches

    def _extend_bn_cache(self, count: int, x: Inputs, *, batches: list[Inputs] | None = None, progress: bool = False) -> None:
        """Make sure the BatchNorm statistics of samples ``0 .. count-1`` are stored."""
        have = 0 if self.bn_cache is None else self.bn_cache.shape[0]
        layers = self._refreshed_layers(x)
        if count <= have or not layers:
            return
        if self._train_loader is None:
            raise ConfigError(
                f"BatchNorm statistics were stored for {have} sample(s) at fit; predict with num_samples <= {have}, "
                "or fit again to draw more"
            )
        batches = batches if batches is not None else self._bn_inputs()
        rows = []
        for s in tqdm(range(have, count), desc="swag batchnorm", disable=not progress, leave=False):
            stats = batchnorm_statistics(self.model, batches, parameters=self._sample_parameters(s), layers=layers)
            rows.append(torch.cat([stats[f"{n}.{b}"].float().reshape(-1) for n in layers for b in ("running_mean", "running_var")]))
        new = torch.stack(rows)
        self.bn_cache = new if self.bn_cache is None else torch.cat([self.bn_cache, new.to(self.bn_cache.device)])

    def _bn_state(self, s: int, x: Inputs) -> dict[str, Tensor]:
        if self.bn_cache is None:
            return {}
        layers = self._refreshed_layers(x)
        modules = dict(self.model.named_modules())
        sizes = [modules[n].running_mean.numel() for n in layers for _ in range(2)]
        if sum(sizes) != self.bn_cache.shape[1]:
            raise PosteriorFileError("the stored BatchNorm statistics do not match this model's BatchNorm layers")
        parts = self.bn_cache[s].split(sizes)
        state = {}
        for i, n in enumerate(layers):
            buffer = modules[n].running_mean
            state[f"{n}.running_mean"] = parts[2 * i].to(buffer.device, buffer.dtype)
            state[f"{n}.running_var"] = parts[2 * i + 1].to(buffer.device, buffer.dtype)
        return state

    # ----------------------------------------------------------------- sampling
    def _generator(self, s: int) -> torch.Generator:
        return torch.Generator(device=self.collector.mean.device).manual_seed(self.seed * 1_000_003 + s)

    def _sample_parameters(self, s: int) -> dict[str, Tensor]:
        """Weight sample ``s`` (rebuilt from its seed) as ``{name: tensor}`` on the model's device."""
        theta = self.collector.sample(scale=self.scale, generator=self._generator(s), low_rank=self.cov)
        return self.collector.unflatten(theta, like=self.model)

    def log_predictive(self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None) -> LogPredictive:
        """Weight-space samples are a fixed ensemble drawn from ``seed`` (each has its own stored
        BatchNorm statistics), so ``generator`` only affects last-layer SWAG, which samples logits."""
        count = num_samples or self.num_samples
        if self.last_layer:
            return self._last_layer_predictive(x, count, generator)
        if self.scale == 0:
            count = 1
        self._extend_bn_cache(count, x)
        runner = self._batched_suffix(x, count) if self.scale > 0 else None
        if runner is not None:
            draws = [self._sample_parameters(s) for s in range(count)]
            weights = {name: torch.stack([draw[name] for draw in draws]) for name in self.names}
            logits = runner(x, count, stochastic=lambda: sampled_linears(self.model, weights, runner))
            rows = logits.shape[0] * logits.shape[1]
            sample_log_probs = class_log_probs(logits.reshape(rows, *logits.shape[2:])).float().reshape(*logits.shape[:2], -1)
        else:
            sample_log_probs = torch.stack([
                class_log_probs(_call(self.model, {**self._sample_parameters(s), **self._bn_state(s, x)}, x)).float()
                for s in range(count)
            ])
        if self.scale == 0:
            return sample_log_probs[0], None
        return torch.logsumexp(sample_log_probs, 0) - math.log(count), sample_log_probs

    # ----------------------------------------------------------------- last layer in logit space
    def _head_logits(self, flat: Tensor, features: Tensor) -> Tensor:
        """Apply head rows ``[W.flatten(), b]`` of shape ``(..., P)`` to ``features (N, D)``: ``(..., N, C)``."""
        head = self.split.head
        size = head.out_features * head.in_features
        weight = flat[..., :size].unflatten(-1, (head.out_features, head.in_features))
        out = features @ weight.transpose(-1, -2)
        return out + flat[..., size:].unsqueeze(-2) if flat.shape[-1] > size else out

    def _last_layer_predictive(self, x: Inputs, count: int, generator: torch.Generator | None) -> LogPredictive:
        phi, _ = self.split(x)
        phi, head, collector = phi.float(), self.split.head, self.collector
        logits = self._head_logits(collector.mean.float().to(phi.device), phi)
        if head.bias is not None and collector.num_parameters == head.out_features * head.in_features:
            logits = logits + head.bias.float()  # a bias the user froze stays as it is
        if self.scale == 0:
            return class_log_probs(logits), None
        if collector.num_snapshots < 2:
            raise NumericalError(f"SWAG needs at least 2 snapshots to sample, it holds {collector.num_snapshots}; fit with more")
        generator = generator if generator is not None else torch.Generator(device=phi.device).manual_seed(self.seed)
        # the diagonal part makes the logits independent per class, with variance sum_d sigma_cd^2 phi_d^2
        std = self._head_logits(collector.variance.float().to(phi.device), phi**2).clamp_min(0).sqrt()
        noise = randn((count, *logits.shape), generator=generator, device=phi.device)
        spread = std * noise
        if self.cov:  # the low-rank part: sum_k z_k (D_k phi) / sqrt(K - 1), shared across classes
            rows = collector.held_deviations.to(phi.device)
            projected = self._head_logits(rows, phi).flatten(1)  # (K, N * C)
            z = randn((count, rows.shape[0]), generator=generator, device=phi.device)
            spread = spread + (z @ projected).view_as(spread) / math.sqrt(rows.shape[0] - 1)
        sample_log_probs = torch.log_softmax(logits + math.sqrt(self.scale) * spread, dim=-1)
        return torch.logsumexp(sample_log_probs, 0) - math.log(count), sample_log_probs

    # ----------------------------------------------------------------- saving and loading
    def load_posterior_state(self, state: dict[str, Tensor]) -> None:
        if self.collector is None and "collector.mean" in state:
            if self.last_layer:
                self.names = list(self._head_tensors())
            tensors = dict(self.model.named_parameters())
            rows = state.get("collector.deviation_rows")
            self.collector = SWAGCollector(
                {n: tensors[n] for n in self.names}, names=self.names, rank=2 if rows is None else rows.shape[0],
                low_rank=rows is not None,
            )
            if self.collector.num_parameters != state["collector.mean"].numel():
                raise PosteriorFileError(
                    f"the saved SWAG statistics cover {state['collector.mean'].numel()} weights but subset "
                    f"{self.subset!r} of this model has {self.collector.num_parameters}; check the subset and "
                    "the parameters' requires_grad flags"
                )
        super().load_posterior_state(state)

    def extra_repr(self) -> str:
        held = self.collector.num_snapshots if self.collector is not None else 0
        return f"subset={self.subset!r}, cov={self.cov}, scale={self.scale}, snapshots={held}"
