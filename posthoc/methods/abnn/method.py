"""``"abnn"``: Adaptable Bayesian Neural Network (Franchi, Laurent, Leguéry, Bursuc, Pilzer & Yao, CVPR 2024,
"Make me a BNN: a simple strategy for estimating Bayesian uncertainty from pre-trained models").

The BatchNorm layers of a trained network become Bayesian normalisation layers (:mod:`~posthoc.methods.abnn.layers`:
``γ x̂ (1 + α ε) + β``, fresh noise ``ε`` at every forward pass). ``fit`` fine-tunes ``M`` modes from the checkpoint on
private copies (:mod:`posthoc.engine.private_weights`), each a few epochs of SGD on every weight with the noise on and
its own random class weights in the loss (:mod:`~posthoc.methods.abnn.loss`), after torch-uncertainty's
``optim_abnn`` recipe. The predictive mixes ``M`` modes x ``S`` noise draws, each mode run once up to its first
BatchNorm layer and the rest on all draws at once (:class:`~posthoc.engine.suffix.SuffixRunner`). The noise at
prediction is ``scale * α``, ``scale`` chosen on ``val_loader`` by the selection step among the plain model, the
noiseless modes (0) and :data:`SCALES`, so that the fine-tuned modes must beat the checkpoint itself; so
``fit(train_loader)`` alone is refused unless ``scale=`` is given.

Unlike torch-uncertainty's ``ABNN``, the checkpoint is not one of the modes, every BatchNorm layer with running
statistics becomes a BNL (not ``BatchNorm2d`` only), and the class weights are drawn from the method's ``seed``.

Example:
    >>> from torch import nn
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import train_loader, val_loader, x
    >>> bn_model = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)).eval()
    >>> um = posthoc.wrap(bn_model, method="abnn", modes=2, num_samples=3).fit(train_loader, val_loader, epochs=1)
    >>> um.predict(x).samples.shape          # M x S samples
    torch.Size([6, 8, 3])
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from posthoc import settings
from posthoc.core.checks import integer, non_negative, positive_int, positive_number
from posthoc.core.inputs import Inputs, check_labels, run_model
from posthoc.core.knob import Knob
from posthoc.core.logits import as_class_logits, class_log_probs, log_mean_exp
from posthoc.core.method import LogPredictive, Method
from posthoc.core.options import option
from posthoc.core.registry import register
from posthoc.engine.bn_refresh import batchnorm_layers
from posthoc.engine.fine_tune import Step, backward, fine_tune
from posthoc.engine.private_weights import PrivateWeights, sample_names, unflatten
from posthoc.engine.suffix import SuffixRunner
from posthoc.errors import ConfigError, InputError
from posthoc.methods.abnn.layers import noisy
from posthoc.methods.abnn.loss import abnn_loss, random_class_weights

#: the noise scales (times ``α``) the selection step may take after the plain model and the noiseless modes (0)
SCALES = (0.25, 0.5, 1.0, 2.0, 4.0)
#: epochs after which the learning rate is divided by :data:`LR_DECAY` (torch-uncertainty's ``optim_abnn``)
LR_MILESTONES = (1, 4)
LR_DECAY = 0.1
#: the ``schedule`` buffer's fields, in order
SCHEDULE = ("epochs", "lr", "momentum", "weight_decay", "steps")
#: the value of ``chosen_scale`` meaning the plain model
PLAIN = -1.0


class _UnderState(nn.Module):
    """``net`` run with a mode's tensors in place of its own (``torch.func.functional_call``), so that the suffix
    runner's hooks on ``net``'s modules see the mode's weights. Not a submodule of the method: nothing saved twice."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.state: dict[str, Tensor] = {}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(self.net, self.state, args, kwargs)


@register
class ABNN(Method):
    """ABNN on a classifier with BatchNorm layers (see module docs)."""

    name = "abnn"

    @dataclass(frozen=True, kw_only=True)
    class Options(Method.Options):
        modes: int = option(3, "M, the modes fine-tuned from the checkpoint")
        num_samples: int = option(5, "S, noise draws per mode at prediction (M * S samples)")
        alpha: float = option(0.1, "the std of the Bayesian normalisation layers' multiplicative noise")
        random_prior: float = option(2.0, "the weight of the ⌊√C⌋ classes each mode favours in its loss (1: none)")
        scale: float | None = option(None, "the noise at prediction is scale * alpha; None: chosen on val_loader")
        seed: int = option(0, "seeds the class weights, the fine-tunes' noise and their loader order")

    def __init__(self, model: nn.Module, options: Options) -> None:
        scale = options.scale
        super().__init__(model)
        self.num_modes = positive_int(options.modes, "modes")
        self.num_samples = positive_int(options.num_samples, "num_samples")
        self.alpha = positive_number(options.alpha, "alpha")
        self.random_prior = non_negative(options.random_prior, "random_prior")
        self.scale_option = None if scale is None else non_negative(scale, "scale")
        self.seed = integer(options.seed, "seed")
        self.layer_names = list(batchnorm_layers(model))
        if not self.layer_names:
            raise ConfigError(
                "abnn turns BatchNorm layers into Bayesian normalisation layers and this model has none: "
                "use method='mc-dropout', 'laplace', 'ibnn' or 'auto' instead"
            )
        #: the modes, one row each: every trained weight, then the BatchNorm running statistics (``sample_names``)
        self.register_buffer("mode_rows", None)
        #: each mode's class weights ``(M, C)``
        self.register_buffer("class_weights", None)
        #: epochs, lr, momentum, weight_decay and steps per mode of the fit (``SCHEDULE``)
        self.register_buffer("schedule", None)
        #: the noise scale at prediction (``-1``: the plain model)
        self.register_buffer("chosen_scale", torch.tensor(1.0 if scale is None else float(scale), dtype=torch.float64))
        self.__dict__["_under"] = _UnderState(model)  # not a submodule: the model is saved (or not) once
        self.runner = SuffixRunner(self._under, f"net.{self.layer_names[0]}")
        self.__dict__["_names"] = None

    @property
    def needs_val(self) -> bool:  # type: ignore[override]  # scale=None is chosen on val_loader
        return self.scale_option is None

    # ----------------------------------------------------------------- fitting
    @dataclass(frozen=True, kw_only=True)
    class FitOptions(Method.FitOptions):
        epochs: int = option(2, "epochs per mode")
        lr: float = option(1e-3, "SGD's initial learning rate")
        momentum: float = option(0.9, "Nesterov momentum")
        weight_decay: float = option(1e-4, "the Gaussian prior's precision λ")

    def fit(
        self,
        train_loader: Iterable | None,
        val_loader: Iterable | None = None,
        *,
        progress: bool = True,
        options: FitOptions | None = None,
    ) -> None:
        """Fine-tune the ``M`` modes from the checkpoint, one after the other (see module docs)."""
        if train_loader is None:
            raise InputError("'abnn' fine-tunes its modes on the training data: call um.fit(train_loader, val_loader)")
        options = options or self.FitOptions()
        epochs, lr, momentum, weight_decay = options.epochs, options.lr, options.momentum, options.weight_decay
        positive_int(epochs, "epochs")
        lr, weight_decay = positive_number(lr, "lr"), non_negative(weight_decay, "weight_decay")
        if not 0 <= non_negative(momentum, "momentum") < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {momentum!r}")
        rows, weights, steps = [], [], 0
        for mode in range(self.num_modes):
            row, class_weights, steps = self._fine_tune(
                mode,
                train_loader,
                epochs=epochs,
                lr=lr,
                momentum=momentum,
                weight_decay=weight_decay,
                progress=progress,
            )
            rows.append(row)
            weights.append(class_weights)
        self.mode_rows, self.class_weights = torch.stack(rows), torch.stack(weights).to(self.device)
        self.schedule = torch.tensor(
            [epochs, lr, momentum, weight_decay, steps], dtype=torch.float64, device=self.device
        )
        super().fit(train_loader, val_loader, progress=progress)

    def _fine_tune(
        self,
        mode: int,
        train_loader: Iterable,
        *,
        epochs: int,
        lr: float,
        momentum: float,
        weight_decay: float,
        progress: bool,
    ) -> tuple[Tensor, Tensor, int]:
        """One mode: its row (weights and running statistics), its class weights and the steps it took."""
        with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
            weights = PrivateWeights(self.model, "all", train_loader)
            self._check_memory(weights)
            torch.manual_seed(self.seed * 7919 + mode)  # the loader's order and the noise: alike on every rank
            drawn = torch.Generator().manual_seed(self.seed * 7919 + mode)
            class_weights: list[Tensor] = []
            optimiser = torch.optim.SGD(weights.trained, lr=lr, momentum=momentum, nesterov=momentum > 0)
            layers = list(batchnorm_layers(weights.copy).values())

            def loss(batch: tuple[Inputs, Tensor], step: Step) -> Tensor:
                x, y = batch
                with noisy(layers, self.alpha):
                    logits = as_class_logits(weights.forward(x))
                if not class_weights:  # the number of classes is known from the first batch
                    class_weights.append(random_class_weights(logits.shape[-1], self.random_prior, drawn))
                return abnn_loss(
                    logits,
                    check_labels(y, logits.shape[-1]),
                    class_weights[0],
                    weights.trained,
                    weight_decay=weight_decay,
                )

            def update(value: Tensor, step: Step) -> None:
                for group in optimiser.param_groups:
                    group["lr"] = lr * LR_DECAY ** sum(step.epoch >= milestone for milestone in LR_MILESTONES)
                optimiser.zero_grad()
                backward(value, weights.trained)
                optimiser.step()

            steps = fine_tune(
                lambda epoch: weights.epoch(drawn),
                loss,
                update,
                epochs=epochs,
                total=epochs * weights.steps_per_epoch,
                desc=f"abnn mode {mode + 1}/{self.num_modes}",
                progress=progress,
                failure=lambda value, step: (
                    f"the ABNN loss of mode {mode + 1} became {value} at step {step.number + 1} "
                    f"(lr={lr:g}); fit again with a lower lr"
                ),
            )
            return torch.cat([weights.weights_vector(), weights.buffers_vector()]), class_weights[0], steps

    def _check_memory(self, weights: PrivateWeights) -> None:
        """Refuse ``M`` modes whose rows would not fit in the memory budget."""
        row_bytes = 4 * (weights.num_weights + weights.buffers_vector().numel())
        if self.num_modes * row_bytes > (budget := settings.memory_budget()):
            raise ConfigError(
                f"{self.num_modes} ABNN modes of {row_bytes / 2**20:.1f} MiB each exceed the memory budget "
                f"of {budget / 2**20:.0f} MiB: raise it (posthoc.settings.max_memory) or use fewer modes"
            )

    # ----------------------------------------------------------------- choosing
    def knob(self) -> Knob | None:
        """The noise scale by the selection step: the plain model, the noiseless modes (0), then :data:`SCALES` of
        ``α``, walked from 1 (wider while admissible, else narrower, down to the plain model)."""
        if self.scale_option is not None:
            return None
        sampled = lambda value, held_out: held_out.scores(  # noqa: E731
            lambda x, generator: self._sampled(x, value, self.num_samples, generator)[0]
        )
        return Knob(
            name="noise scale",
            candidates=[("plain", PLAIN), ("0", 0.0), *[(f"{s:g}", s) for s in SCALES]],
            start=1.0,
            score=lambda value, held_out: held_out.plain if value == PLAIN else sampled(value, held_out),
            apply=lambda value: self.chosen_scale.fill_(float(value)),
        )

    # ----------------------------------------------------------------- predicting
    def log_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> LogPredictive:
        scale = float(self.chosen_scale)
        if scale == PLAIN:
            return class_log_probs(run_model(self.model, x)), None
        return self._sampled(x, scale, num_samples or self.num_samples, generator)

    def _sampled(self, x: Inputs, scale: float, num_samples: int, generator: torch.Generator | None) -> LogPredictive:
        """``M * S`` samples, mode-major: per mode, its tensors in the model and ``S`` draws of the noise."""
        if self.__dict__["_names"] is None:
            self.__dict__["_names"] = sample_names(self.model, "all", None)
        layers = [self.model.get_submodule(name) for name in self.layer_names]
        parts = []
        for row in self.mode_rows:
            self._under.state = unflatten(row, self.model, self.__dict__["_names"])
            logits = self.runner(
                x, num_samples, stochastic=lambda: noisy(layers, scale * self.alpha, generator=generator)
            )
            parts.append(class_log_probs(logits.flatten(0, 1)).unflatten(0, logits.shape[:2]))
        self._under.state = {}
        samples = torch.cat(parts)
        return log_mean_exp(samples, 0), samples

    def summary(self) -> dict[str, Any]:
        """The modes, the noise and the fit: ``random_variables`` counts the BatchNorm channels whose scale is noisy
        (``ε`` is drawn per channel and position, so the count per example grows with the input's size)."""
        scale = float(self.chosen_scale)
        fit = dict(zip(SCHEDULE, self.schedule.tolist())) if self.schedule is not None else {}
        if fit:
            fit["epochs"], fit["steps"] = int(fit["epochs"]), int(fit["steps"])
        layers = batchnorm_layers(self.model)
        return {
            "random_variables": sum(layer.num_features for layer in layers.values()),
            "layers": list(self.layer_names),
            "modes": self.num_modes,
            "samples_per_mode": self.num_samples,
            "alpha": self.alpha,
            "random_prior": self.random_prior,
            "scale": None if scale == PLAIN else scale,
            "scale_fit": "fixed"
            if self.scale_option is not None
            else ("val" if self.selection_record is not None else "default"),
            **fit,
        }

    def extra_repr(self) -> str:
        return f"modes={self.num_modes}, num_samples={self.num_samples}, alpha={self.alpha}"
