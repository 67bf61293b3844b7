"""SWAG over a subset of layers, or the whole network: weight samples run through the network.

``fit`` fine-tunes a private copy of the model (only the chosen parameters train). Each weight sample is rebuilt lazily
from its own seed and run with :func:`~posthoc.core.inputs.run_model_with` (no model copies); BatchNorm layers called
after the first sampled weight get their statistics recomputed exactly for each sample, once, at fit, and stored. Where
every sampled weight belongs to a Linear layer and no such BatchNorm layer exists, the prefix before the first sampled
layer runs once and the suffix samples in one expanded pass.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, train_loader, x
    >>> um = posthoc.wrap(model, method="swag", subset=["0", "3"])          # both linear layers
    >>> type(um.method).__name__
    'SubsetSWAG'
    >>> um.fit(train_loader, epochs=1).predict(x).samples.shape
    torch.Size([20, 8, 3])
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from posthoc.core.chunks import chunks
from posthoc.core.inputs import Inputs, iterate, run_model, run_model_with
from posthoc.core.likelihood import model_outputs
from posthoc.core.logits import class_log_probs, log_mean_exp
from posthoc.core.method import LogPredictive
from posthoc.core.modules import eval_mode, parameter_owners
from posthoc.core.progress import progress_bar
from posthoc.engine.bn_refresh import batchnorm_layers, batchnorm_statistics
from posthoc.engine.hooks import called_in_order
from posthoc.engine.runner import replica
from posthoc.engine.suffix import SuffixRunner
from posthoc.errors import ConfigError, PosteriorFileError
from posthoc.methods.swag.base import SWAGBase, Tuning
from posthoc.methods.swag.sampled_linears import sampled_linears

SUBSETS = ("all", "last_layer")


def subset_names(model: nn.Module, subset: str | Sequence[str]) -> list[str]:
    """The trainable parameters ``subset`` names: every one (``"all"``) or those of the named modules.

    Example:
        >>> from torch import nn
        >>> from posthoc.methods.swag.subset import subset_names
        >>> subset_names(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2)), ["2"])
        ['2.weight', '2.bias']
    """
    if subset == "all":
        names = [name for name, p in model.named_parameters() if p.requires_grad]
    else:
        modules = [subset] if isinstance(subset, str) else list(subset)
        if not modules or not all(isinstance(m, str) for m in modules):
            raise ConfigError(f"subset must be 'all', 'last_layer' or module name(s), got {subset!r}")
        available = [n for n, _ in model.named_modules() if n]
        names = []
        for module_name in modules:
            if module_name not in available:
                shown = ", ".join(available[:30]) + (" ..." if len(available) > 30 else "")
                raise ConfigError(
                    f"subset names no module '{module_name}'; valid: {', '.join(SUBSETS)}, or modules: {shown}"
                )
            module = model.get_submodule(module_name)
            names += [f"{module_name}.{n}" for n, p in module.named_parameters() if p.requires_grad]
        names = list(dict.fromkeys(names))
    if not names:
        raise ConfigError(f"subset {subset!r} has no trainable parameter: all are frozen (requires_grad=False)")
    return names


@dataclass(frozen=True)
class Placement:
    """Where the sampled weights sit in a forward pass: the BatchNorm layers called after the first
    of them (their statistics are recomputed per sample) and, where that is exact, the runner that
    samples the suffix from the first sampled layer on in one expanded pass."""

    refreshed: list[str]
    runner: SuffixRunner | None


def trace_placement(model: nn.Module, names: Sequence[str], x: Inputs) -> Placement:
    """Trace one forward pass of ``x`` to find the :class:`Placement` of the weights ``names``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from posthoc.methods.swag.subset import trace_placement
        >>> net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
        >>> trace_placement(net, ["0.weight"], torch.randn(2, 4)).refreshed
        ['1']
        >>> trace_placement(net, ["3.weight"], torch.randn(2, 4)).runner.start
        '3'
    """
    owners = parameter_owners(model, names)
    layers = batchnorm_layers(model)
    with eval_mode(model):
        order = called_in_order(model, {**layers, **owners}, x)
    first = next((i for i, name in enumerate(order) if name in owners), len(order))
    refreshed = [name for name in layers if name in set(order[first:])]
    linear = first < len(order) and all(isinstance(module, nn.Linear) for module in owners.values())
    return Placement(refreshed, SuffixRunner(model, order[first]) if linear and not refreshed else None)


class SubsetSWAG(SWAGBase):
    """SWAG over the parameters ``subset`` names (``"all"``: every trainable one); see module docs.

    Weight samples are a fixed ensemble drawn from ``seed`` (sample ``s`` is rebuilt from ``(seed, s)``), each with its
    own stored BatchNorm statistics.
    """

    export_refusal = (
        "SWAG over named layers samples whole networks (and their BatchNorm statistics); use subset='last_layer' to "
        "export it with weight draws fixed at export"
    )

    def __init__(self, model: nn.Module, options: SWAGBase.Options) -> None:
        super().__init__(model, options)
        self.names = subset_names(model, self.subset)
        self.register_buffer("bn_cache", None)
        #: traced at fit (a posterior loaded from a file holds no trace: its first prediction makes it)
        self.placement: Placement | None = None
        self._train_loader: Iterable | None = None

    def _collected_tensors(self) -> dict[str, Tensor]:
        tensors = dict(self.model.named_parameters())
        return {name: tensors[name] for name in self.names}

    def _tuning(self, loader: Iterable) -> Tuning:
        work = copy.deepcopy(self.model)
        keep = set(self.names)
        for name, p in work.named_parameters():
            p.requires_grad_(name in keep)
        work.train()
        replicated = replica(work)  # under torch.distributed its backward averages the gradients over ranks
        trained = [p for name, p in work.named_parameters() if name in keep]
        return Tuning(work, trained, lambda x: run_model(replicated, x), averages_gradients=False)

    def _after_fit(self, train_loader: Iterable, *, progress: bool) -> None:
        self._train_loader, self.bn_cache = train_loader, None
        batches = self._bn_inputs()
        self.placement = trace_placement(self.model, self.names, batches[0])
        self._extend_bn_cache(1 if self.scale == 0 else self.num_samples, batches=batches, progress=progress)

    def _bn_inputs(self) -> list[Inputs]:
        batches = []
        for x, _ in iterate(
            self._train_loader, device=self.device, progress=False, desc="swag batchnorm", require_labels=False
        ):
            batches.append(x)
            if self.bn_batches is not None and len(batches) == self.bn_batches:
                break
        return batches

    def _extend_bn_cache(self, count: int, *, batches: list[Inputs] | None = None, progress: bool = False) -> None:
        """Make sure the BatchNorm statistics of samples ``0 .. count-1`` are stored."""
        have = 0 if self.bn_cache is None else self.bn_cache.shape[0]
        layers = self.placement.refreshed
        if count <= have or not layers:
            return
        if self._train_loader is None:
            raise ConfigError(
                f"BatchNorm statistics were stored for {have} sample(s) at fit; predict with num_samples <= {have}, "
                "or fit again to draw more"
            )
        batches = batches if batches is not None else self._bn_inputs()
        rows = []
        for s in progress_bar(range(have, count), desc="swag batchnorm", progress=progress, unit="samples"):
            stats = batchnorm_statistics(self.model, batches, parameters=self._sample_parameters(s), layers=layers)
            rows.append(
                torch.cat(
                    [stats[f"{n}.{b}"].float().reshape(-1) for n in layers for b in ("running_mean", "running_var")]
                )
            )
        new = torch.stack(rows)
        self.bn_cache = new if self.bn_cache is None else torch.cat([self.bn_cache, new.to(self.bn_cache.device)])

    def _bn_state(self, s: int) -> dict[str, Tensor]:
        if self.bn_cache is None:
            return {}
        layers = self.placement.refreshed
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

    def _sample_parameters(self, s: int) -> dict[str, Tensor]:
        """Weight sample ``s`` (rebuilt from its seed) as ``{name: tensor}`` on the model's device."""
        generator = torch.Generator(device=self.collector.mean.device).manual_seed(self.seed * 1_000_003 + s)
        theta = self.collector.sample(scale=self.scale, generator=generator, low_rank=self.cov)
        return self.collector.unflatten(theta, like=self.model)

    def _suffix_outputs(
        self, x: Inputs, count: int, runner: SuffixRunner, transform: Callable[[Tensor], Tensor]
    ) -> Tensor:
        """Per-sample ``transform``-ed outputs ``(S, N, ...)``, the prefix once per group of stacked weight samples."""
        element = self.model.get_parameter(self.names[0]).element_size()
        row_bytes = 2 * self.collector.num_parameters * element  # a sample's draw and its row of the stacked weights
        groups = []
        for group in chunks(count, row_bytes):
            draws = [self._sample_parameters(s) for s in range(group.start, group.stop)]
            weights = {name: torch.stack([draw[name] for draw in draws]) for name in self.names}
            groups.append(runner(x, len(draws), stochastic=partial(sampled_linears, self.model, weights, runner)))
        outputs = torch.cat(groups)
        rows = outputs.shape[0] * outputs.shape[1]
        return transform(outputs.reshape(rows, *outputs.shape[2:])).float().reshape(*outputs.shape[:2], -1)

    def _per_sample(self, x: Inputs, count: int, transform: Callable[[Tensor], Tensor]) -> Tensor:
        """``(S, N, ...)``: ``transform`` of the model's outputs under weight samples ``0 .. count-1`` (the SWA mean's
        alone at scale 0)."""
        if self.placement is None:
            self.placement = trace_placement(self.model, self.names, x)
        self._extend_bn_cache(count)
        if self.scale > 0 and self.placement.runner is not None:
            return self._suffix_outputs(x, count, self.placement.runner, transform)
        return torch.stack(
            [
                transform(run_model_with(self.model, {**self._sample_parameters(s), **self._bn_state(s)}, x)).float()
                for s in range(count)
            ]
        )

    def log_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> LogPredictive:
        """``generator`` is not used: the weight samples are the fixed ensemble drawn from ``seed``."""
        count = 1 if self.scale == 0 else (num_samples or self.num_samples)
        sample_log_probs = self._per_sample(x, count, class_log_probs)
        if self.scale == 0:
            return sample_log_probs[0], None
        return log_mean_exp(sample_log_probs), sample_log_probs

    def sampled_outputs(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> Tensor:
        """``(S, N, D)`` outputs of the weight samples (``generator`` is not used, as in :meth:`log_predictive`)."""
        count = 1 if self.scale == 0 else (num_samples or self.num_samples)
        return self._per_sample(x, count, model_outputs)
