"""``"ibnn"``: node-based Bayesian neural network on a pretrained model (Trinh et al., 2020 / 2022).

Multiplicative latent variables ``z`` sit on the inputs of the model's ``Conv2d`` / ``Linear``
layers, one per input channel / feature: the paper's Table 1 placement with ``recipe="paper"`` or
``stem=True`` (ResNet-50: 24,579 nodes, AlexNet 18,307, VGG-16 36,995; :func:`~posthoc.methods.ibnn.nodes.count_nodes`
counts them without fitting). Their posterior is a mixture ``q(z) = 1/K sum_k N(mu_k, sigma_k^2)``
with prior ``N(1, s^2)`` (:mod:`posthoc.methods.ibnn.nodes`). ``fit`` maximises the ELBO as the
paper does (:mod:`posthoc.methods.ibnn.elbo`): BatchNorm statistics re-estimated with the nodes on,
then SGD in BatchNorm train mode with a large, annealed learning rate for the node parameters and a
small one for the deterministic weights, ``S`` training samples per example (independent of ``K``),
and a KL weight warmed up from 0. The weights and statistics change only on iBNN's own copy of the
model (``copies_model``): the user's model is never modified. Predictions average ``K x S``
samples (``S`` per component, sample ``r`` drawn from component ``r mod K``, the official code's
``test.py -n 5`` per component), computed in one forward pass over a batch expanded ``K * S``
times, chunked under a memory budget.

Two recipes (:mod:`posthoc.methods.ibnn.recipes`): ``"posthoc"`` (the default) and ``"paper"``.
They share everything above and differ where the paper's values were worse on the bundled
checkpoints: no nodes on the stem (the first layer's input channels), K=2 instead of 4, means
initialised at ``N(1, 0.05^2)`` instead of ``N(1, 0.5^2)``, prior std 0.1 instead of 0.3, weights' learning rate 1e-3
instead of 1e-4 (reasons in the recipes module; measured: docs/methods/ibnn.md). Every setting can also be given by name.

Under ``likelihood="regression"`` the ELBO's data term is the Gaussian NLL at the plain model's
noise (fitted on its held-out residuals, the training ones without a ``val_loader``), the recipe's
learning rates (those not given) are scaled by ``σ² / 2`` (:func:`~posthoc.engine.objective.step_scale`:
the Gaussian NLL's curvature is ``1/σ²`` where the softmax's is at most ``1/2``), the scale is
chosen by the same selection step on the held-out Gaussian NLL of the sampled mixture, each scale at its
own best noise (:func:`~posthoc.core.likelihood.best_noise_nlls`; the checkpoint's ``N(f(x), σ_plain²)``
with ``σ_plain`` fitted on the same rows), and the noise is then re-fitted to the mixture of
``N(f_s(x), σ²)`` around the ``K x S`` sampled outputs at that scale. No perturbed copies there (they
are graded on class accuracy).

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
from dataclasses import asdict, dataclass
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
from posthoc.core.registry import register
from posthoc.engine.bn_refresh import batchnorm_layers
from posthoc.engine.objective import fit_plain_noise, step_scale
from posthoc.errors import ConfigError
from posthoc.methods.ibnn.elbo import ElboOptions, expand, fit_nodes, routes
from posthoc.methods.ibnn.nodes import NodeSet
from posthoc.methods.ibnn.recipes import recipe as recipe_named
from posthoc.methods.ibnn.recipes import resolve

#: the fit settings the model card reports, in the order of the ``fit_settings`` buffer
FIT_RECORD = ("epochs", "train_samples", "lr_nodes", "lr_nodes_final", "lr_weights", "beta", "kl_warmup", "batchnorm")
#: copies of the largest layer input of an expanded row alive at once in its forward (the input,
#: its product with the nodes, the layer's output, the expanded batch)
ACTIVATION_COPIES = 4
#: the node-noise scales the held-out choice may take, from narrow to wide (factors of 2 around the fitted posterior)
SCALES = (0.0625, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0)
#: copies of an expanded row's class scores alive at once: the logits and their log-softmax
LOG_PROB_COPIES = 2


@register
class ImplicitBNN(Method):
    """Node posteriors on a pretrained network (see module docs).

    Options (``None``: the recipe's value; posthoc's default in brackets, the paper's after it):
        recipe: ``"posthoc"`` or ``"paper"`` (:mod:`posthoc.methods.ibnn.recipes`).
        components: ``K``, mixture components [2; paper 4].
        prior_std: ``s`` of the prior ``N(1, s^2)`` [0.1; paper 0.3].
        init_mean_std: ``sigma0``: component means start at ``N(1, sigma0^2)`` [0.05; paper 0.5, tuned
            between 0.5 and 0.75 in the paper].
        init_std, init_std_spread: component standard deviations start at ``|N(init_std, init_std_spread^2)|``
            (kept positive by a softplus) [0.05, 0.02 in both].
        layers: module names whose Conv/Linear layers get nodes (default: all of them).
        stem, head: include the first Conv/Linear and the classifier head [head only; paper: both, as in
            its Table 1]. The stem's few nodes (one per image channel) act as a global input scale whose
            fit is volatile (see :mod:`posthoc.methods.ibnn.recipes`).
        num_samples: ``S``, samples per component at prediction (``K * S`` in total) [5].
        scale: the node noise's scale at prediction (``z = mu_k + scale * sigma_k * eps``; 1 is the fitted
            posterior). ``None``: chosen on ``fit``'s ``val_loader`` among 0 (the component means) and
            :data:`SCALES` by the selection step (:mod:`posthoc.engine.selection`: confidently within
            ``fit(..., tolerance=...)`` of the checkpoint's held-out NLL, then the lowest NLL on perturbed
            copies; the walk starts at 1), else 1 without one.
        seed: seeds the initial means and standard deviations.
    """

    name = "ibnn"
    export_refusal = SAMPLES_NETWORKS
    copies_model = True
    likelihoods = (Categorical, Gaussian)

    @dataclass(frozen=True, kw_only=True)
    class Options(Method.Options):
        recipe: str = "posthoc"
        components: int | None = None
        prior_std: float | None = None
        init_mean_std: float | None = None
        init_std: float | None = None
        init_std_spread: float | None = None
        layers: Sequence[str] | None = None
        stem: bool | None = None
        head: bool = True
        num_samples: int = 5
        seed: int = 0
        scale: float | None = None

    def __init__(self, model: nn.Module, options: Options) -> None:
        recipe, components, prior_std = options.recipe, options.components, options.prior_std
        init_mean_std, init_std, init_std_spread = options.init_mean_std, options.init_std, options.init_std_spread
        layers, stem, head, num_samples = options.layers, options.stem, options.head, options.num_samples
        seed, scale = options.seed, options.scale
        super().__init__(model)
        self.recipe_name, self.recipe = recipe, recipe_named(recipe)
        chosen = resolve(
            self.recipe,
            {
                "components": components,
                "prior_std": prior_std,
                "init_mean_std": init_mean_std,
                "init_std": init_std,
                "init_std_spread": init_std_spread,
                "stem": stem,
            },
        )
        self._stem = bool(chosen.pop("stem"))
        self._node_options = {**chosen, "layers": None if layers is None else list(layers), "head": head, "seed": seed}
        self.nodes = NodeSet(model, stem=self._stem, **self._node_options)
        #: the fit's settings (``FIT_RECORD`` order; zeros before fit), saved with the posterior for the model card
        self.register_buffer("fit_settings", torch.zeros(len(FIT_RECORD), dtype=torch.float64))
        self.num_samples = positive_int(num_samples, "num_samples")
        #: ``None``: the scale is chosen on ``fit``'s ``val_loader``
        self.scale_option = None if scale is None else non_negative(scale, "scale")
        #: the scale chosen on held-out data, and the held-out NLL of the checkpoint and of iBNN at it
        #: (``None`` until chosen)
        self.register_buffer("scale_fit", None)
        #: bytes one expanded row keeps alive at the peak of a forward, per input shape (measured once)
        self._expanded_row_bytes: dict[tuple, int] = {}

    @property
    def components(self) -> int:
        return self.nodes.components

    @dataclass(frozen=True, kw_only=True)
    class FitOptions(Method.FitOptions):
        epochs: int | None = None
        lr_nodes: float | None = None
        lr_nodes_final: float | None = None
        lr_weights: float | None = None
        momentum: float | None = None
        weight_decay: float | None = None
        beta: float | None = None
        kl_warmup: float | None = None
        train_samples: int | None = None
        batchnorm: str | None = None

    def fit(
        self,
        train_loader: Iterable | None,
        val_loader: Iterable | None = None,
        *,
        progress: bool = True,
        options: FitOptions | None = None,
    ) -> None:
        """Fine-tune the node posterior (and optionally the weights) by maximising the ELBO.

        The loss per step is ``mean NLL over the expanded batch + beta_t * KL / N`` (``N`` training
        examples, ``beta_t`` rising linearly from 0 to ``beta`` over the first ``kl_warmup`` fraction
        of the steps), minimised by SGD with Nesterov momentum (:func:`~posthoc.methods.ibnn.elbo.maximise_elbo`).
        On a NaN/inf ELBO the fit stops with :class:`~posthoc.NumericalError` and every tensor is
        restored to its state before ``fit``. Every option left at ``None`` takes the value of the
        recipe chosen at ``wrap`` (:mod:`posthoc.methods.ibnn.recipes`; posthoc's default in brackets).

        Args:
            epochs: passes over ``train_loader`` [2].
            lr_nodes, lr_nodes_final: the node parameters' learning rate, constant for the first half of
                the steps, then annealed linearly to ``lr_nodes_final`` at 90 % of them [0.2, 0.05].
            lr_weights, weight_decay: the deterministic weights' learning rate (0 keeps them frozen) and
                weight decay [1e-3 (paper: 1e-4), 0].
            momentum: Nesterov momentum of both [0.9].
            beta: final KL weight [1].
            kl_warmup: fraction of the steps over which the KL weight rises from 0 to ``beta`` [0.5].
            train_samples: ``S``, copies of each example per step, copy ``i`` routed to component ``i mod K`` [2].
            batchnorm: ``"train"``: BatchNorm statistics re-estimated with the nodes sampling before the fit,
                batch statistics during it, and re-estimated after it; ``"frozen"``: the checkpoint's
                statistics throughout (eval mode) ["train"]. Dropout is off during the fit either way.

        With ``scale=None`` and a ``val_loader`` the scale is then chosen on held-out data (:meth:`choose`).
        """
        options = options or self.FitOptions()
        epochs, lr_nodes, lr_nodes_final = options.epochs, options.lr_nodes, options.lr_nodes_final
        lr_weights, momentum, weight_decay = options.lr_weights, options.momentum, options.weight_decay
        beta, kl_warmup, train_samples = options.beta, options.kl_warmup, options.train_samples
        batchnorm = options.batchnorm
        if batchnorm == "train" and not batchnorm_layers(self.model):
            raise ConfigError(
                f"batchnorm='train' re-estimates BatchNorm statistics, but {type(self.model).__name__} has no BatchNorm "
                "layer (transformers normalise with LayerNorm, which keeps no statistics); leave batchnorm unset or "
                "pass batchnorm='frozen'"
            )
        loaders = (train_loader, val_loader)
        fit_plain_noise(self.likelihood, self.model, loaders, self.device)  # the ELBO reads the plain model's noise
        rates = {"lr_nodes": lr_nodes, "lr_nodes_final": lr_nodes_final, "lr_weights": lr_weights}
        # the recipe's rates are set for class labels: under a Gaussian they are scaled to the same stability
        rates = {
            name: getattr(self.recipe, name) * step_scale(self.likelihood) if value is None else value
            for name, value in rates.items()
        }
        options = ElboOptions(
            **resolve(
                self.recipe,
                {
                    "epochs": epochs,
                    **rates,
                    "momentum": momentum,
                    "weight_decay": weight_decay,
                    "beta": beta,
                    "kl_warmup": kl_warmup,
                    "train_samples": train_samples,
                    "batchnorm": batchnorm,
                },
            )
        )
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
        and :data:`SCALES`, walking from 1 (wider while admissible, else narrower); every scale draws the same random
        numbers. Under regression each scale is scored at its own best noise, and the noise is then re-fitted."""
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
        """The node posterior for the model card: ``random_variables`` is the number of node variables per
        mixture component (the paper's Table 1 count), then the mixture, its prior and initialisation, the
        predictive's samples and the fit's settings (``None`` for files saved before they were recorded).

        Example:
            >>> import torchvision
            >>> import posthoc
            >>> posthoc.wrap(torchvision.models.resnet50(weights=None), method="ibnn").method.summary()["random_variables"]
            24576
        """
        settings = dict(zip(FIT_RECORD, self.fit_settings.tolist()))
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
            "scale_fit": "fixed"
            if self.scale_option is not None
            else ("val" if self.scale_fit is not None else "default"),
            "test_samples": self.components * self.num_samples,
            **fit,
        }

    def load_posterior_state(self, state: dict[str, Tensor]) -> None:
        """Load a saved posterior, its mixture shaped as saved: files written before the current defaults
        (format 1 without explicit options: K=4, no nodes on the stem) hold four components and one node
        group fewer, and load as they were fitted."""
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

        ``num_samples`` overrides ``S``, the number of samples per component. The first input of a
        shape runs one example alone, which measures the bytes of an expanded row; the rest runs in
        chunks of :func:`~posthoc.core.chunks.rows_per_chunk` examples, written into one ``(K * S, N, C)``.
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
