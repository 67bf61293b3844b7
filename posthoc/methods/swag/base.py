"""What every SWAG algorithm shares: its options, and the fine-tuning that collects the moments.

``fit`` fine-tunes private copies of the weights SWAG makes Gaussian with SGD at a constant learning rate
(:mod:`.schedule`) and takes ``collect_per_epoch`` snapshots per epoch into a
:class:`~posthoc.methods.swag.collector.SWAGCollector`; with a ``val_loader`` and no ``scale`` given, the scale is
then chosen on held-out data (:meth:`SWAGBase.knob`). A subclass says what is fine-tuned (:meth:`SWAGBase._tuning`),
what is done once the moments are collected (:meth:`SWAGBase._after_fit`) and how it predicts.

Under ``likelihood="regression"`` the fine-tuning minimises the Gaussian NLL at the plain model's held-out noise, the
scale is chosen on the clean held-out NLL of the mixture of ``N(f_s(x), σ²)`` over the sampled outputs (each scale at
its own best noise; :mod:`posthoc.engine.objective` says why), and the noise is then re-fitted to that mixture.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.checks import fraction, integer, positive_int, positive_number
from posthoc.core.inputs import Inputs
from posthoc.core.knob import Knob
from posthoc.core.likelihood import Categorical, Gaussian
from posthoc.core.method import Method
from posthoc.core.modules import eval_mode, parameter_owners
from posthoc.core.options import option
from posthoc.engine.fine_tune import Step, fine_tune, loader_batches, loader_length
from posthoc.engine.held_out import HeldOut
from posthoc.engine.objective import fit_plain_noise, fit_sampled_noise, training_loss
from posthoc.engine.runner import average_gradients, steps_on_every_rank
from posthoc.engine.selection import Scores
from posthoc.errors import ConfigError, PosteriorFileError
from posthoc.methods.swag.collector import ParameterSource, SWAGCollector
from posthoc.methods.swag.schedule import LADDER, START_SCALE, relative_lr

#: the fit options saved in the ``schedule`` buffer, in its order
SCHEDULE = ("epochs", "lr", "collect_per_epoch", "momentum", "weight_decay")


@dataclass(frozen=True)
class Tuning:
    """What one SWAG fine-tuning trains: ``source`` (snapshots are taken of it), the ``trained``
    tensors, the ``forward`` giving logits, and whether the loop must average the gradients across
    ``torch.distributed`` ranks itself (``False`` where ``forward`` is a DDP replica, which does)."""

    source: ParameterSource
    trained: list[Tensor]
    forward: Callable[[Inputs], Tensor]
    averages_gradients: bool


def collect_steps(steps: int, per_epoch: int) -> set[int]:
    """The step indices (0-based) after which a snapshot is taken, spread evenly over an epoch.

    Example:
        >>> from posthoc.methods.swag.base import collect_steps
        >>> sorted(collect_steps(10, 4))
        [2, 4, 7, 9]
    """
    return {math.ceil((j + 1) * steps / per_epoch) - 1 for j in range(per_epoch)}


class SWAGBase(Method):
    """The options, fine-tuning loop and saved moments of every SWAG algorithm (see module docs)."""

    name = "swag"
    likelihoods = (Categorical, Gaussian)

    @dataclass(frozen=True, kw_only=True)
    class Options(Method.Options):
        subset: str | Sequence[str] = option("all", "all, last_layer, or module name(s) to fine-tune and make Gaussian")
        cov: bool = option(True, "keep the low-rank covariance part (False: SWAG-diagonal)")
        scale: float | None = option(None, "posterior scale, 0: SWA; None: on val_loader, else 0.5 (1 if not cov)")
        num_samples: int = option(20, "weight samples per prediction")
        bn_batches: int | None = option(4, "training batches recomputing BatchNorm statistics per sample (None: all)")
        stats_device: str | torch.device | None = option(None, "where the SWAG statistics live (e.g. cpu)")
        head: str | None = option(None, "the head's module name for last_layer when it cannot be found")
        seed: int = option(0, "seeds the samples (sample s is rebuilt from (seed, s))")

    def __init__(self, model: nn.Module, options: Options) -> None:
        cov, scale = options.cov, options.scale  # ``head``: the last-layer algorithm's
        super().__init__(model)
        if not isinstance(cov, bool):
            raise ConfigError(f"cov must be True or False, got {cov!r}")
        if scale is not None and (
            isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale >= 0 or math.isinf(scale)
        ):
            raise ConfigError(f"scale must be a finite number >= 0 (0 gives SWA) or None, got {scale!r}")
        self.subset = options.subset
        self.cov = cov
        #: ``None``: chosen on ``val_loader`` at fit (see :mod:`.schedule`), else 0.5 with ``cov`` and 1.0 without
        self.scale_option = None if scale is None else float(scale)
        self.scale = self.scale_option if scale is not None else (0.5 if cov else 1.0)
        self.num_samples = positive_int(options.num_samples, "num_samples")
        self.bn_batches = positive_int(options.bn_batches, "bn_batches", none="the whole loader")
        self.stats_device = torch.device(options.stats_device) if options.stats_device is not None else None
        self.seed = integer(options.seed, "seed")
        self.names: list[str] = []
        self.collector: SWAGCollector | None = None
        #: the fine-tuning that collected the moments: epochs, lr, collect_per_epoch, momentum, weight_decay
        self.register_buffer("schedule", None)
        #: the scale used, and the held-out NLL of the checkpoint and of SWAG at it (NaN without a val_loader)
        self.register_buffer("scale_fit", None)

    def _tuning(self, loader: Iterable) -> Tuning:
        """Private copies of the weights to fine-tune; sets ``self.names`` to their qualified names."""
        raise NotImplementedError

    def _collected_tensors(self) -> dict[str, Tensor]:
        """The model's tensors the moments belong to, by qualified name (for loading a posterior)."""
        raise NotImplementedError

    def _after_fit(self, train_loader: Iterable, *, progress: bool) -> None:
        """Work that needs the collected moments (e.g. BatchNorm statistics per sample)."""

    def sampled_outputs(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> Tensor:
        """``(S, N, D)``: the model's outputs under ``S`` weight samples (``(1, N, D)``, the SWA mean's, at scale 0)."""
        raise NotImplementedError

    @dataclass(frozen=True, kw_only=True)
    class FitOptions(Method.FitOptions):
        epochs: int = option(2, "epochs of the fine-tuning")
        lr: float | None = option(None, "its learning rate (None: 1e-4 of the weights' norm per step, see schedule)")
        collect_per_epoch: int = option(4, "snapshots per epoch")
        rank: int = option(20, "deviations kept for the low-rank part")
        momentum: float = option(0.9, "SGD momentum")
        weight_decay: float = option(0.0, "SGD weight decay")
        include_pretrained: bool = option(False, "count the pretrained weights as the first snapshot")

    def fit(
        self,
        train_loader: Iterable | None,
        val_loader: Iterable | None = None,
        *,
        progress: bool = True,
        options: FitOptions | None = None,
    ) -> None:
        options = options or self.FitOptions()
        epochs, lr, collect_per_epoch = options.epochs, options.lr, options.collect_per_epoch
        momentum, weight_decay, include_pretrained = options.momentum, options.weight_decay, options.include_pretrained
        positive_int(epochs, "epochs")
        positive_number(lr, "lr", none="relative to the gradient scale")
        positive_int(collect_per_epoch, "collect_per_epoch")
        fraction(momentum, "momentum")
        if not isinstance(weight_decay, (int, float)) or not weight_decay >= 0:
            raise ConfigError(f"weight_decay must be >= 0, got {weight_decay!r}")
        if not isinstance(include_pretrained, bool):
            raise ConfigError(f"include_pretrained must be True or False, got {include_pretrained!r}")
        loaders = (train_loader, val_loader)
        fit_plain_noise(self.likelihood, self.model, loaders, self.device)
        lr = self._fine_tune(train_loader, options, progress=progress)
        self.schedule = torch.tensor([epochs, lr, collect_per_epoch, momentum, weight_decay], dtype=torch.float64)
        held = self.collector.num_deviations if self.cov else self.collector.num_snapshots
        if (self.scale_option is None or self.scale_option > 0) and held < 2:
            raise ConfigError(
                f"SWAG collected {self.collector.num_snapshots} snapshot(s) but needs at least 2 to sample; "
                "raise epochs or collect_per_epoch, or pass include_pretrained=True"
            )
        self.scale_fit = torch.tensor([self.scale, math.nan, math.nan], dtype=torch.float64)
        self._after_fit(train_loader, progress=progress)
        with torch.no_grad(), eval_mode(self.model):
            fit_sampled_noise(self.likelihood, self.sampled_outputs, loaders, self.device)

    def knob(self) -> Knob | None:
        """The scale (``scale=None``): the selection step (:mod:`posthoc.engine.selection`) over 0 (the SWA mean) and
        :data:`~.schedule.LADDER`, walking from :data:`~.schedule.START_SCALE`; each scale samples its own BatchNorm
        statistics from ``train_loader`` (the fit's when not given)."""
        if self.scale_option is not None:
            return None
        return Knob(
            name="scale",
            candidates=[(f"{scale:g}", scale) for scale in (0.0, *LADDER)],
            start=START_SCALE,
            prepare=lambda held_out, train_loader: (held_out, self._bn_loader(train_loader)),
            score=self._scale_scores,
            apply=lambda scale: setattr(self, "scale", scale),
            fallback=("SWAG", "the SWA mean alone (scale 0)", "Raise tolerance or pass a fixed scale"),
            then=self._chosen_scale,
        )

    def _bn_loader(self, train_loader: Iterable | None) -> Iterable | None:
        """The loader a scale samples its BatchNorm statistics from: ``train_loader``, else the fit's."""
        return train_loader if train_loader is not None else getattr(self, "_train_loader", None)

    def _scale_scores(self, scale: float, prepared: tuple[HeldOut, Iterable | None]) -> Scores:
        held_out, train_loader = prepared
        self.scale = scale
        self._after_fit(train_loader, progress=False)
        with eval_mode(self.model):
            return held_out.sampling_scores(self, own_draws=True)

    def _chosen_scale(self, selection: Any, held_out: HeldOut, train_loader: Iterable | None, progress: bool) -> None:
        """Keep the held-out NLLs of the chosen scale, sample its BatchNorm statistics, fit the noise at it."""
        train_loader = self._bn_loader(train_loader)
        self.scale_fit = torch.tensor(
            [self.scale, selection.plain_nll, selection.chosen.clean_nll], dtype=torch.float64
        )
        self._after_fit(train_loader, progress=progress)
        with torch.no_grad(), eval_mode(self.model):
            fit_sampled_noise(
                self.likelihood, self.sampled_outputs, (train_loader, list(held_out.clean())), self.device
            )

    def _fine_tune(self, loader: Iterable, options: FitOptions, *, progress: bool) -> float:
        """Fine-tune and collect; returns the learning rate used (``lr=None``: :func:`.schedule.relative_lr`)."""
        tuning = self._tuning(loader)
        lr, collect_per_epoch = None if options.lr is None else float(options.lr), options.collect_per_epoch
        if lr is None:
            lr = relative_lr(tuning.forward, tuning.trained, loader, device=self.device, likelihood=self.likelihood)
        self.collector = SWAGCollector(
            tuning.source, names=self.names, rank=options.rank, low_rank=self.cov, stats_device=self.stats_device
        )
        if options.include_pretrained:
            self.collector.update(tuning.source)
        steps = steps_on_every_rank(loader_length(loader), "SWAG fine-tuning")
        if steps is not None and collect_per_epoch > steps:
            warnings.warn(
                f"collect_per_epoch={collect_per_epoch} exceeds the {steps} steps of an epoch; collecting after "
                f"every step instead ({steps} snapshots per epoch)",
                RuntimeWarning,
                stacklevel=4,
            )
            collect_per_epoch = steps
        collect_at = collect_steps(steps, collect_per_epoch) if steps is not None else set()
        momentum, weight_decay = float(options.momentum), float(options.weight_decay)
        optimizer = torch.optim.SGD(tuning.trained, lr=lr, momentum=momentum, weight_decay=weight_decay)
        collector = self.collector

        def loss(batch: tuple[Inputs, Tensor], step: Step) -> Tensor:
            return training_loss(self.likelihood, tuning.forward(batch[0]), batch[1])

        def update(loss: Tensor, step: Step) -> None:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if tuning.averages_gradients:
                average_gradients(tuning.trained)
            optimizer.step()
            if step.index in collect_at:
                collector.update(tuning.source)

        def after_epoch(epoch: int, taken: int) -> None:
            if steps is None and taken:  # a loader without a length: one snapshot at the end of each epoch
                collector.update(tuning.source)

        def failure(value: float, step: Step) -> str:
            return (
                f"the fine-tuning loss became {value} at epoch {step.epoch + 1}, step {step.index + 1} (lr={lr}); "
                f"stopped. The {collector.num_snapshots} snapshot(s) collected before are kept in "
                "um.method.collector; fit again with a lower lr"
            )

        fine_tune(
            lambda epoch: loader_batches(loader, device=self.device, steps=steps, desc="swag fine-tune"),
            loss,
            update,
            epochs=options.epochs,
            total=None if steps is None else options.epochs * steps,
            failure=failure,
            desc="swag fine-tune",
            progress=progress,
            after_epoch=after_epoch,
            postfix=lambda value, step: {"loss": f"{value:.4f}", "snapshots": collector.num_snapshots},
        )
        return lr

    def load_posterior_state(self, state: dict[str, Tensor]) -> None:
        if self.collector is None and "collector.mean" in state:
            tensors = self._collected_tensors()
            self.names = list(tensors)
            rows = state.get("collector.deviation_rows")
            self.collector = SWAGCollector(
                tensors,
                names=self.names,
                rank=2 if rows is None else rows.shape[0],
                low_rank=rows is not None,
            )
            if self.collector.num_parameters != state["collector.mean"].numel():
                raise PosteriorFileError(
                    f"the saved SWAG statistics cover {state['collector.mean'].numel()} weights but subset "
                    f"{self.subset!r} of this model has {self.collector.num_parameters}; check the subset and "
                    "the parameters' requires_grad flags"
                )
        super().load_posterior_state(state)
        if self.scale_fit is not None:
            self.scale = float(self.scale_fit[0])

    def summary(self) -> dict[str, Any]:
        """The posterior for the model card: parameters under it, rank, layers and the fine-tuning that fitted it.

        Example:
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import model, train_loader
            >>> card = posthoc.wrap(model, method="swag").fit(train_loader).method.summary()
            >>> card["random_variables"], card["rank"], card["snapshots"]
            (515, 8, 8)
        """
        collector = self.collector
        schedule = [None] * len(SCHEDULE) if self.schedule is None else self.schedule.tolist()
        fitted = dict(zip(SCHEDULE, schedule))
        return {
            "random_variables": 0 if collector is None else collector.num_parameters,
            "layers": list(parameter_owners(self.model, self.names)) if self.names else [],
            "rank": 0 if collector is None or not self.cov else collector.num_deviations,
            "scale": self.scale,
            "num_samples": self.num_samples,
            "snapshots": 0 if collector is None else collector.num_snapshots,
            "epochs": None if fitted["epochs"] is None else int(fitted["epochs"]),
            "lr": fitted["lr"],
            "collect_per_epoch": None if fitted["collect_per_epoch"] is None else int(fitted["collect_per_epoch"]),
            "momentum": fitted["momentum"],
            "weight_decay": fitted["weight_decay"],
        }

    def extra_repr(self) -> str:
        held = self.collector.num_snapshots if self.collector is not None else 0
        return f"subset={self.subset!r}, cov={self.cov}, scale={self.scale}, snapshots={held}"
