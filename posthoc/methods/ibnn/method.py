"""``"ibnn"``: node-based Bayesian neural network on a pretrained model (Trinh et al., 2020 / 2022).

Multiplicative latent variables ``z`` sit on the inputs of the model's ``Conv2d`` / ``Linear`` layers, one per input
channel / feature (the paper's Table 1 placement with ``recipe="paper"`` or ``stem=True``;
:func:`~posthoc.methods.ibnn.nodes.count_nodes` counts them). Their posterior is a mixture
``q(z) = 1/K sum_k N(mu_k, sigma_k^2)`` with prior ``N(1, s^2)`` (:mod:`posthoc.methods.ibnn.nodes`). ``fit``
maximises the ELBO as the paper does (:mod:`posthoc.methods.ibnn.elbo`) on iBNN's own copy of the model
(``copies_model``): the user's model is never modified. Predictions average ``K x S`` samples (sample ``r`` from
component ``r mod K``) in one forward pass over a batch expanded ``K * S`` times, chunked under a memory budget.
The two recipes, ``"posthoc"`` (the default) and ``"paper"``, are in :mod:`posthoc.methods.ibnn.recipes`.

Under ``likelihood="regression"`` the ELBO's data term is the Gaussian NLL at the plain model's noise, the recipe's
learning rates are scaled by ``σ² / 2`` (:func:`~posthoc.engine.objective.step_scale`), and the noise is re-fitted
to the sampled mixture at the chosen scale.

References: T. Trinh, S. Kaski, M. Heinonen, "Scalable Bayesian neural networks by layer-wise
input augmentation" (arXiv:2010.13498); T. Trinh, M. Heinonen, L. Acerbi, S. Kaski, "Tackling
covariate shift with node-based Bayesian neural networks", ICML 2022.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, train_loader, x
    >>> um = posthoc.wrap(model, method="ibnn").fit(train_loader)
    >>> um.predict(x).samples.shape      # (K * S, N, C)
    torch.Size([10, 8, 3])
    >>> paper = posthoc.wrap(model, method="ibnn", recipe="paper", init_mean_std=0.75).fit(train_loader)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.checks import non_negative, positive_int
from posthoc.core.chunks import rows_per_chunk
from posthoc.core.inputs import Inputs, batch_size, run_model, slice_inputs
from posthoc.core.knob import Knob
from posthoc.core.likelihood import Categorical, Gaussian, fit_noise_on, model_outputs
from posthoc.core.logits import class_log_probs, log_mean_exp
from posthoc.core.method import SAMPLES_NETWORKS, LogPredictive, Method
from posthoc.core.modules import eval_mode
from posthoc.core.options import option
from posthoc.core.registry import register
from posthoc.engine.bn_refresh import batchnorm_layers
from posthoc.engine.objective import fit_plain_noise, step_scale
from posthoc.errors import ConfigError
from posthoc.methods.ibnn.elbo import ElboOptions, expand, fit_nodes, routes
from posthoc.methods.ibnn.nodes import NodeSet
from posthoc.methods.ibnn.recipes import NODE_SETTINGS, resolve
from posthoc.methods.ibnn.recipes import recipe as recipe_named

#: the fit settings the model card reports, in the order of the ``fit_settings`` buffer
FIT_RECORD = ("epochs", "train_samples", "lr_nodes", "lr_nodes_final", "lr_weights", "beta", "kl_warmup", "batchnorm")
#: copies of an expanded row's largest layer input alive at once (input, its product with the nodes, output, batch)
ACTIVATION_COPIES = 4
#: the node-noise scales the held-out choice may take, from narrow to wide (factors of 2 around the fitted posterior)
SCALES = (0.0625, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0)
#: copies of an expanded row's class scores alive at once: the logits and their log-softmax
LOG_PROB_COPIES = 2


@register
class ImplicitBNN(Method):
    """Node posteriors on a pretrained network (see module docs). An option left at ``None`` takes the recipe's value
    (posthoc's default in brackets, the paper's after it)."""

    name = "ibnn"
    export_refusal = SAMPLES_NETWORKS
    copies_model = True
    likelihoods = (Categorical, Gaussian)

    @dataclass(frozen=True, kw_only=True)
    class Options(Method.Options):
        recipe: str = option("posthoc", "posthoc or paper: the defaults of every None option")
        components: int | None = option(None, "K, mixture components [2; paper 4]")
        prior_std: float | None = option(None, "s of the prior N(1, s^2) [0.1; paper 0.3]")
        init_mean_std: float | None = option(None, "component means start at N(1, init_mean_std^2) [0.05; paper 0.5]")
        init_std: float | None = option(None, "component stds start at abs(N(init_std, init_std_spread^2)) [0.05]")
        init_std_spread: float | None = option(None, "see init_std [0.02]")
        layers: Sequence[str] | None = option(None, "module names whose Conv/Linear layers get nodes (None: all)")
        stem: bool | None = option(None, "nodes on the first Conv/Linear layer [no; paper yes]")
        head: bool = option(True, "nodes on the classifier head")
        num_samples: int = option(5, "S, samples per component at prediction (K * S in all)")
        seed: int = option(0, "seeds the initial means and standard deviations")
        scale: float | None = option(None, "noise scale (1: the fitted posterior); None: chosen on val_loader, else 1")

    def __init__(self, model: nn.Module, options: Options) -> None:
        super().__init__(model)
        self.recipe_name, self.recipe = options.recipe, recipe_named(options.recipe)
        chosen = resolve(self.recipe, {name: getattr(options, name) for name in NODE_SETTINGS})
        self._stem = bool(chosen.pop("stem"))
        layers = None if options.layers is None else list(options.layers)
        self._node_options = {**chosen, "layers": layers, "head": options.head, "seed": options.seed}
        self.nodes = NodeSet(model, stem=self._stem, **self._node_options)
        #: the fit's settings (``FIT_RECORD`` order; zeros before fit), saved with the posterior for the model card
        self.register_buffer("fit_settings", torch.zeros(len(FIT_RECORD), dtype=torch.float64))
        self.num_samples = positive_int(options.num_samples, "num_samples")
        self.scale_option = None if options.scale is None else non_negative(options.scale, "scale")
        #: the scale chosen on held-out data and the held-out NLLs of the checkpoint and of iBNN at it (None until then)
        self.register_buffer("scale_fit", None)
        #: bytes one expanded row keeps alive at the peak of a forward, per input shape (measured once)
        self._expanded_row_bytes: dict[tuple, int] = {}

    @property
    def components(self) -> int:
        return self.nodes.components

    @dataclass(frozen=True, kw_only=True)
    class FitOptions(Method.FitOptions):
        epochs: int | None = option(None, "passes over train_loader [2]")
        lr_nodes: float | None = option(None, "the node learning rate, constant for half the steps [0.2]")
        lr_nodes_final: float | None = option(None, "the node learning rate reached at 90 % of the steps [0.05]")
        lr_weights: float | None = option(None, "the weights' learning rate; 0 keeps them frozen [1e-3; paper 1e-4]")
        momentum: float | None = option(None, "Nesterov momentum of nodes and weights [0.9]")
        weight_decay: float | None = option(None, "the weights' weight decay [0]")
        beta: float | None = option(None, "final KL weight [1]")
        kl_warmup: float | None = option(None, "fraction of the steps over which the KL weight rises from 0 [0.5]")
        train_samples: int | None = option(None, "copies of each example per step, copy i on component i mod K [2]")
        batchnorm: str | None = option(
            None, "train: BatchNorm statistics re-estimated with the nodes on; frozen: the checkpoint's [train]"
        )

    def fit(
        self,
        train_loader: Iterable | None,
        val_loader: Iterable | None = None,
        *,
        progress: bool = True,
        options: FitOptions | None = None,
    ) -> None:
        """Fit the node posterior (and the weights unless ``lr_weights=0``) by maximising the ELBO
        ``mean NLL + beta_t * KL / N`` (:func:`~posthoc.methods.ibnn.elbo.fit_nodes`). On a NaN/inf ELBO the fit
        stops with :class:`~posthoc.NumericalError` and every tensor is restored to its state before ``fit``."""
        options = options or self.FitOptions()
        if options.batchnorm == "train" and not batchnorm_layers(self.model):
            raise ConfigError(
                f"batchnorm='train' re-estimates BatchNorm statistics, but {type(self.model).__name__} has no BatchNorm "
                "layer (transformers normalise with LayerNorm, which keeps no statistics); leave batchnorm unset or "
                "pass batchnorm='frozen'"
            )
        loaders = (train_loader, val_loader)
        fit_plain_noise(self.likelihood, self.model, loaders, self.device)  # the ELBO reads the plain model's noise
        given = {field.name: getattr(options, field.name) for field in fields(ElboOptions)}
        # the recipe's rates are set for class labels: under a Gaussian they are scaled to the same stability
        for name in ("lr_nodes", "lr_nodes_final", "lr_weights"):
            if given[name] is None:
                given[name] = getattr(self.recipe, name) * step_scale(self.likelihood)
        options = ElboOptions(**resolve(self.recipe, given))
        changing = self if options.lr_weights > 0 or options.batchnorm == "train" else self.nodes
        before = {k: v.detach().clone() for k, v in changing.state_dict().items()}
        try:
            fit_nodes(self.model, self.nodes, train_loader, options, progress=progress, likelihood=self.likelihood)
        except BaseException:
            changing.load_state_dict(before)
            raise
        record = {**asdict(options), "batchnorm": float(options.batchnorm == "train")}
        self.fit_settings.copy_(torch.tensor([float(record[name]) for name in FIT_RECORD], dtype=torch.float64))
        self._refit_noise(loaders)
        self._expanded_row_bytes.clear()  # as after a choice: a loaded posterior plans its chunks alike

    def _refit_noise(self, loaders: tuple[Iterable | None, Iterable | None]) -> None:
        """Under a likelihood with a noise to fit, fit it again to the sampled predictive at the scale in use."""
        if self.likelihood.fits_noise:
            generator = torch.Generator(device=self.device).manual_seed(0)
            with torch.no_grad(), eval_mode(self.model):
                fit_noise_on(
                    self.likelihood,
                    loaders,
                    self.device,
                    lambda x: (self._samples(x, None, generator, model_outputs), None),
                )

    @property
    def scale(self) -> float:
        """The node noise's scale at prediction (see the ``scale`` option)."""
        if self.scale_fit is not None:
            return float(self.scale_fit[0])
        return 1.0 if self.scale_option is None else self.scale_option

    def knob(self) -> Knob | None:
        """The scale (``scale=None``): the selection step (:mod:`posthoc.engine.selection`) over 0 (the component means)
        and :data:`SCALES`, walking from 1; every scale draws the same random numbers."""
        if self.scale_option is not None:
            return None
        return Knob(
            name="scale",
            candidates=[(f"{scale:g}", scale) for scale in (0.0, *SCALES)],
            start=1.0,
            score=lambda scale, held_out: self._set_scale(scale) or held_out.sampling_scores(self),
            apply=self._set_scale,
            movable=not self.likelihood.fits_noise,
            fallback=("iBNN", "the component means alone (scale 0)", "Raise tolerance, or pass a fixed scale"),
            then=self._chosen_scale,
        )

    def _set_scale(self, value: float, nlls: tuple[float, float] = (math.nan, math.nan)) -> None:
        """Set the node noise's scale to ``value`` (with the plain model's and its held-out NLL, once chosen)."""
        self.scale_fit = torch.tensor([float(value), *nlls], dtype=torch.float64, device=self.fit_settings.device)

    def _chosen_scale(self, selection: Any, held_out: Any, train_loader: Iterable | None, progress: bool) -> None:
        """Keep the held-out NLLs of the chosen scale and fit the noise at it."""
        self._set_scale(selection.value, (selection.plain_nll, selection.chosen.clean_nll))
        self._refit_noise((train_loader, list(held_out.clean())))
        # forget the row sizes measured on held-out batches: the first predict of a shape then runs a row alone
        # (it sizes the chunks) as it does on a loaded posterior, so both draw in the same order
        self._expanded_row_bytes.clear()

    def summary(self) -> dict[str, Any]:
        """The node posterior for the model card: ``random_variables`` is the node variables per mixture component
        (the paper's Table 1 count); the fit's settings are ``None`` for files saved before they were recorded.

        Example:
            >>> import torchvision
            >>> import posthoc
            >>> posthoc.wrap(torchvision.models.resnet50(weights=None), method="ibnn").method.summary()["random_variables"]
            24576
        """
        settings = dict(zip(FIT_RECORD, self.fit_settings.tolist()))
        scale_fit = "default" if self.scale_fit is None else "val"
        recorded = settings["epochs"] > 0
        fit: dict[str, Any] = {name: (value if recorded else None) for name, value in settings.items()}
        if recorded:
            fit.update(
                epochs=int(settings["epochs"]),
                train_samples=int(settings["train_samples"]),
                batchnorm="train" if settings["batchnorm"] else "frozen",
            )
        return {
            "random_variables": self.nodes.nodes_per_component,
            "layers": list(self.nodes.layer_names),
            "recipe": self.recipe_name,
            "components": self.components,
            "variational_parameters": 2 * self.components * self.nodes.nodes_per_component,
            "prior_std": self.nodes.prior_std,
            "init_mean_std": float(self._node_options["init_mean_std"]),
            "init_std": float(self._node_options["init_std"]),
            "samples_per_component": self.num_samples,
            "scale": self.scale,
            "scale_fit": "fixed" if self.scale_option is not None else scale_fit,
            "test_samples": self.components * self.num_samples,
            **fit,
        }

    def load_posterior_state(self, state: dict[str, Tensor]) -> None:
        """Load a saved posterior, its mixture shaped as saved (older files: K=4, no nodes on the stem)."""
        saved = [key for key in state if key.startswith("nodes.groups.") and key.endswith(".mean")]
        components = state[saved[0]].shape[0] if saved else self.components
        stem = self._stem and len(saved) == len(self.nodes.groups)
        if components != self.components or stem != self._stem:
            self._node_options["components"], self._stem = components, stem
            self.nodes = NodeSet(self.model, stem=stem, **self._node_options)
        super().load_posterior_state(state)

    def log_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> LogPredictive:
        """``K * S`` samples in one expanded forward per chunk; sample ``r`` uses component ``r mod K`` (:meth:`_samples`)."""
        samples = self._samples(x, num_samples, generator, class_log_probs)
        return log_mean_exp(samples), samples

    def sampled_outputs(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> Tensor:
        """``(K * S, N, O)``: the sampled networks' outputs (their likelihood's mixture is the regression predictive)."""
        return self._samples(x, num_samples, generator, model_outputs)

    def _samples(
        self, x: Inputs, num_samples: int | None, generator: torch.Generator | None, transform: Callable[[Any], Tensor]
    ) -> Tensor:
        """``(K * S, N, C)``: ``transform`` (the class log-probabilities, or the outputs) of the sampled networks.

        ``num_samples`` overrides ``S``. The first input of a shape runs one example alone, which measures the bytes of
        an expanded row; the rest runs in chunks of :func:`~posthoc.core.chunks.rows_per_chunk` examples.
        """
        repeats = self.components * (num_samples or self.num_samples)
        total, key = batch_size(x), _shape_key(x)
        samples, start = None, 0
        while start < total:
            rows = 1 if key not in self._expanded_row_bytes else rows_per_chunk(repeats * self._expanded_row_bytes[key])
            part = self._expanded(slice_inputs(x, start, start + rows), repeats, generator, key, transform)
            if samples is None:
                samples = part.new_empty(repeats, total, part.shape[-1])
            samples[:, start : start + rows] = part
            start += rows
        return samples

    def _expanded(
        self, x: Inputs, repeats: int, generator: torch.Generator | None, key: tuple, transform: Callable[[Any], Tensor]
    ) -> Tensor:
        """``(repeats, n, C)`` ``transform`` of ``x``'s outputs expanded ``repeats`` times."""
        n = batch_size(x)
        with self.nodes.sampling(
            routes(n, repeats, self.components, self.nodes.called.device), generator=generator, scale=self.scale
        ):
            log_probs = transform(run_model(self.model, expand(x, repeats)))
        if key not in self._expanded_row_bytes:
            self._expanded_row_bytes[key] = (
                ACTIVATION_COPIES * self.nodes.largest_input_bytes
                + LOG_PROB_COPIES * log_probs[0].numel() * log_probs.element_size()
            )
        return log_probs.reshape(n, repeats, -1).transpose(0, 1)

    def extra_repr(self) -> str:
        return f"components={self.components}, num_samples={self.num_samples}"


def _shape_key(x: Inputs) -> tuple:
    if isinstance(x, Mapping):
        return tuple((k, tuple(v.shape[1:])) for k, v in sorted(x.items()) if isinstance(v, Tensor))
    return tuple(x.shape[1:])
