"""What the variational methods share (``"vi"``, ``"sparse-vd"``): a factorised posterior over some
Linear / Conv2d layers of a trained model, fitted by the annealed ELBO, predicted by local
reparameterisation draws.

The posterior's parameters are the method's own, initialised from the checkpoint (the user's model is never changed);
a subclass says what the posterior of one layer is (:meth:`VariationalMethod._posterior`). With ``layers="head"`` the
backbone runs once and the head's Gaussian logits are drawn directly; otherwise the batch is expanded ``S`` times at
the first variational layer the forward pass reaches (:class:`~posthoc.engine.suffix.SuffixRunner`).

Example:
    >>> from posthoc.engine.variational_method import VariationalMethod
    >>> class Mine(VariationalMethod):
    ...     name = "mine"
    ...     def _posterior(self, layer): return MyLayerPosterior(layer)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posthoc.core.checks import integer, non_negative, positive_int
from posthoc.core.chunks import chunks
from posthoc.core.inputs import Inputs, batch_size, check_labels, iterate, run_model
from posthoc.core.likelihood import Categorical, Gaussian, fit_noise_on, model_outputs
from posthoc.core.logits import class_log_probs, log_mean_exp
from posthoc.core.method import SAMPLES_NETWORKS, LogPredictive, Method
from posthoc.core.modules import eval_mode, requires_grad
from posthoc.core.options import option
from posthoc.engine.elbo import maximise_elbo
from posthoc.engine.head import FeatureSplit
from posthoc.engine.hooks import called_in_order
from posthoc.engine.kl_schedule import SCHEDULES, KLSchedule
from posthoc.engine.suffix import SuffixRunner
from posthoc.engine.variational_layers import (
    LayerPosterior,
    VariationalLayers,
    layer_name,
    sample_output,
    select_layers,
)
from posthoc.errors import ConfigError
from posthoc.export.modules import HeadSamples


@dataclass(frozen=True)
class ElboFit:
    """The settings of one ELBO fit of a variational method; checked on construction."""

    epochs: int = 3
    lr: float = 1e-3
    lr_scale: float = 1e-2
    kl: KLSchedule = KLSchedule()

    def __post_init__(self) -> None:
        positive_int(self.epochs, "epochs")
        for name in ("lr", "lr_scale"):
            non_negative(getattr(self, name), name, why="0 keeps those parameters fixed")


#: the fit settings the model card reports, in the order of the ``fit_settings`` buffer
FIT_RECORD = ("epochs", "lr", "lr_scale", "kl_weight", "kl_warmup", "kl_cycles", "kl_schedule")
#: copies of a row's ``(S, C)`` logit draws alive at once in the head path: the noise, the draw, its log-softmax
HEAD_DRAW_COPIES = 3


class VariationalMethod(Method):
    """Options, fit, predictive and persistence of a variational method (see module docs).

    Args:
        layers: ``"head"``, ``"all"`` (every Linear and Conv2d) or module names (containers included).
        head: the head's module name, where it cannot be found automatically.
        seed: seeds the predictive's draws when ``predict`` gets no generator.
    """

    copies_model = False
    likelihoods = (Categorical, Gaussian)
    exports = ("classification",)
    export_refusal = SAMPLES_NETWORKS

    def export_blocker(self, *, regression: bool = False) -> str | None:
        """Layers inside the network (``layers`` other than ``"head"``) sample whole networks: no exported form."""
        return self.export_refusal if self.split is None else super().export_blocker(regression=regression)

    def to_module(self, export: Any) -> nn.Module:
        """The head's mean-field Gaussian as ``S`` head weights drawn once at export, the same for every input."""
        name = self.split.head_name
        moments = self.layers[name].moments()
        weight_mean, weight_var, bias_mean, bias_var = (
            None if t is None else t.detach().float().cpu() for t in moments
        )
        count, generator = export.samples_of(self), export.generator()
        weights = weight_mean + weight_var.clamp_min(0).sqrt() * torch.randn(
            count, *weight_mean.shape, generator=generator
        )
        biases = None
        if bias_mean is not None:
            biases = bias_mean.expand(count, -1).clone()
            if bias_var is not None:
                biases = biases + bias_var.clamp_min(0).sqrt() * torch.randn(
                    count, *bias_mean.shape, generator=generator
                )
        backbone = export.backbone(self.model)
        return HeadSamples(backbone, backbone.add_tap(name, "input"), weights, biases)

    def __init__(
        self, model: nn.Module, *, layers: str | Sequence[str], head: str | None, num_samples: int, seed: int
    ) -> None:
        super().__init__(model)
        if not (layers in ("head", "all") or (isinstance(layers, Sequence) and not isinstance(layers, str))):
            raise ConfigError(f"layers must be 'head', 'all' or a list of module names, got {layers!r}")
        if head is not None and not isinstance(head, str):
            raise ConfigError(f"head must be a module name, got {head!r}")
        self.layer_option = layers if isinstance(layers, str) else list(layers)
        self.num_samples = positive_int(num_samples, "num_samples")
        self.seed = integer(seed, "seed")
        #: the fit's settings (``FIT_RECORD`` order; zeros before fit), saved for the model card
        self.register_buffer("fit_settings", torch.zeros(len(FIT_RECORD), dtype=torch.float64))
        #: index in ``layers.names`` of the first variational layer the forward pass reaches (set at fit)
        self.register_buffer("expansion", torch.tensor(-1))
        self.split = FeatureSplit(model, head) if layers == "head" else None
        self.layers: VariationalLayers | None = None
        self._runner: SuffixRunner | None = None
        names = self._layer_names()
        if names is not None:
            self._build(names)

    # ----------------------------------------------------------------- what a subclass says
    def _posterior(self, layer: nn.Module) -> LayerPosterior:
        """The posterior of one selected layer, initialised from its weights."""
        raise NotImplementedError

    # ----------------------------------------------------------------- structure
    def _layer_names(self) -> list[str] | None:
        """The selected layers' names; ``None`` while the head is still to be found from an input."""
        if self.split is not None:
            return None if self.split.head_name is None else [self.split.head_name]
        return select_layers(self.model, self.layer_option)

    def _build(self, names: list[str]) -> None:
        self.layers = VariationalLayers(
            self.model, {name: self._posterior(self.model.get_submodule(name)) for name in names}
        )
        self.layers.to(self.device)
        self._runner = None

    def _follow_device(self) -> None:
        if self.layers is not None and next(self.layers.parameters()).device != self.device:
            self.layers.to(self.device)

    # ----------------------------------------------------------------- fit
    @dataclass(frozen=True, kw_only=True)
    class FitOptions(Method.FitOptions):
        epochs: int = option(3, "passes over the training data")
        lr: float = option(1e-3, "Adam's step size for the posterior means")
        lr_scale: float = option(1e-2, "Adam's step size for the log standard deviations (0 keeps them fixed)")
        kl_weight: float = option(1.0, "the final weight of the KL term (1 is the ELBO)")
        kl_schedule: Literal[SCHEDULES] = option("linear", "how the KL weight rises over the steps")
        kl_warmup: float = option(0.5, "the fraction of the steps (of each cycle) over which the KL weight rises")
        kl_cycles: int = option(4, "the number of cycles of the 'cyclical' schedule")

    def fit(
        self,
        train_loader: Iterable | None,
        val_loader: Iterable | None = None,
        *,
        progress: bool = True,
        options: FitOptions | None = None,
    ) -> None:
        """Maximise the ELBO on ``train_loader`` (the options are :attr:`FitOptions`, described in the subclass's
        docs); ``val_loader`` is read only under a regression likelihood, for the observation noise."""
        options = options or self.FitOptions()
        kl = KLSchedule(
            options.kl_schedule, weight=options.kl_weight, warmup=options.kl_warmup, cycles=options.kl_cycles
        )
        fit = ElboFit(epochs=options.epochs, lr=options.lr, lr_scale=options.lr_scale, kl=kl)
        self._fit(train_loader, fit, progress=progress, val_loader=val_loader)

    def _fit(
        self, train_loader: Iterable, options: ElboFit, *, progress: bool, val_loader: Iterable | None = None
    ) -> None:
        """Find the structure from the first batch, then maximise the ELBO (on failure the posterior is restored).
        A Gaussian's noise is fitted to the plain model before, and re-fitted to the posterior's samples after."""
        first, _ = next(iter(iterate(train_loader, device=self.device, progress=False, desc=self.name)))
        with torch.no_grad(), eval_mode(self.model):
            if self.layers is None:
                self.split(first)
                self._build([self.split.head_name])
            order = called_in_order(self.model, self.layers.targets, first, at="input")
        if not order:
            raise ConfigError(
                f"none of the selected layers {self.layers.names[:6]} ran in the forward pass (their weights are used "
                "functionally, e.g. by attention); select other layers with layers=[...]"
            )
        self._follow_device()
        loaders = (train_loader, val_loader)
        with eval_mode(self.model):
            fit_noise_on(
                self.likelihood, loaders, self.device, lambda x: (model_outputs(run_model(self.model, x))[None], None)
            )
        before = {k: v.detach().clone() for k, v in self.layers.state_dict().items()}
        try:
            self._maximise_elbo(train_loader, options, progress=progress)
        except BaseException:
            self.layers.load_state_dict(before)
            raise
        self.expansion.fill_(self.layers.names.index(order[0]))
        self._runner = None
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        with eval_mode(self.model):
            fit_noise_on(
                self.likelihood, loaders, self.device, lambda x: (self.sampled_outputs(x, generator=generator), None)
            )
        kl = options.kl
        record = (
            options.epochs,
            options.lr,
            options.lr_scale,
            kl.weight,
            kl.warmup,
            kl.cycles,
            SCHEDULES.index(kl.kind),
        )
        self.fit_settings.copy_(torch.tensor(record, dtype=torch.float64))

    def _maximise_elbo(self, train_loader: Iterable, options: ElboFit, *, progress: bool) -> None:
        """:func:`~posthoc.engine.elbo.maximise_elbo` with the model in eval mode and frozen: Adam moves the
        posterior's locations at ``lr`` and its scales at ``lr_scale``."""
        layers = self.layers
        locations, scales = layers.parameter_groups()
        groups = [
            {"params": params, "lr": lr}
            for params, lr in ((locations, options.lr), (scales, options.lr_scale))
            if params and lr > 0
        ]

        def terms(x: Inputs, y: Tensor) -> tuple[Tensor, Tensor]:
            with layers.sampling():
                outputs = run_model(self.model, x)
            return self._mean_nll(outputs, y), layers.kl()

        hint = (
            f"lower lr (now {options.lr}) or lr_scale (now {options.lr_scale}). "
            "The posterior was left as it was before fit"
        )
        with requires_grad(self.model, False), eval_mode(self.model):
            maximise_elbo(
                terms,
                train_loader,
                optimizer=torch.optim.Adam(groups) if groups else None,
                trained=[*locations, *scales],
                kl=options.kl,
                epochs=options.epochs,
                device=self.device,
                desc=self.name,
                hint=hint,
                progress=progress,
            )

    def _mean_nll(self, outputs: Tensor, y: Tensor) -> Tensor:
        """The ELBO's data term: the mean NLL of a batch, of its labels or of its targets under the fitted noise."""
        if isinstance(self.likelihood, Categorical):
            log_probs = class_log_probs(outputs)
            return F.nll_loss(log_probs, check_labels(y, log_probs.shape[-1]).to(log_probs.device))
        outputs = model_outputs(outputs)
        return self.likelihood.mean_nll(outputs, self.likelihood.targets(y, outputs))

    # ----------------------------------------------------------------- predict
    def sampled_outputs(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> Tensor:
        """``(S, N, D)`` raw outputs of ``S`` draws of the posterior (local reparameterisation)."""
        self._follow_device()
        count = num_samples or self.num_samples
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(self.seed)
        if self.split is not None:
            return self._head_samples(x, count, generator, transform=model_outputs)
        outputs = self._suffix_outputs(x, count, generator)
        return model_outputs(outputs.flatten(0, 1)).unflatten(0, (count, batch_size(x)))

    def _suffix_outputs(self, x: Inputs, count: int, generator: torch.Generator) -> Tensor:
        if self._runner is None:
            self._runner = SuffixRunner(self.model, self.layers.names[int(self.expansion)], at="input")
        return self._runner(x, count, stochastic=lambda: self.layers.sampling(generator))

    def log_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> LogPredictive:
        """``S`` local-reparameterisation draws per example (``generator`` defaults to one seeded with ``seed``)."""
        self._follow_device()
        count = num_samples or self.num_samples
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(self.seed)
        if self.split is not None:
            samples = self._head_samples(x, count, generator)
        else:
            logits = self._suffix_outputs(x, count, generator)
            samples = class_log_probs(logits.flatten(0, 1)).unflatten(0, (count, batch_size(x)))
        return log_mean_exp(samples), samples

    def _head_samples(
        self, x: Inputs, count: int, generator: torch.Generator, transform: Callable[[Tensor], Tensor] = class_log_probs
    ) -> Tensor:
        """``(S, N, C)`` draws of the Gaussian head outputs through ``transform``, the backbone run once."""
        phi, _ = self.split(x)
        mean, var = self.layers[self.split.head_name].output_moments(phi)
        n, classes = mean.shape[0], transform(mean[:1]).shape[-1]
        samples = mean.new_empty(count, n, classes)
        for rows in chunks(n, 4 * HEAD_DRAW_COPIES * count * classes):
            draws = sample_output(mean[rows].expand(count, -1, -1), var[rows].expand(count, -1, -1), generator)
            samples[:, rows] = transform(draws.flatten(0, 1)).unflatten(0, (count, rows.stop - rows.start))
        return samples

    # ----------------------------------------------------------------- card and file
    def summary(self) -> dict[str, Any]:
        """``random_variables``, ``layers``, the predictive's samples and the fit's settings (``FIT_RECORD``)."""
        settings = dict(zip(FIT_RECORD, self.fit_settings.tolist()))
        fit: dict[str, Any] = dict(
            settings,
            epochs=int(settings["epochs"]),
            kl_cycles=int(settings["kl_cycles"]),
            kl_schedule=SCHEDULES[int(settings["kl_schedule"])],
        )
        return {
            "random_variables": self.layers.num_variables,
            "layers": list(self.layers.names),
            "test_samples": self.num_samples,
            **fit,
        }

    def load_posterior_state(self, state: dict[str, Tensor]) -> None:
        """Load a saved posterior; a head found at fit from an input is rebuilt from the file's names."""
        if self.layers is None:
            prefix = "layers.posteriors."
            names = list(
                dict.fromkeys(
                    layer_name(key[len(prefix) :].rpartition(".")[0]) for key in state if key.startswith(prefix)
                )
            )
            self.split = FeatureSplit(self.model, names[0])
            self._build(names)
        super().load_posterior_state(state)

    def extra_repr(self) -> str:
        return f"layers={self.layer_option!r}, num_samples={self.num_samples}"
