"""Last-layer Laplace: the head's GGN in closed form and Gaussian logits, no backward pass.

The head's GGN follows from one pass over the training data into one block of the ``hessian`` structure over
``[W, b]``; predictions are its Gaussian logits through the link, in row chunks under the memory budget. A ``"kron"``
head of more than :data:`~posthoc.methods.laplace.structures.MANY_CLASSES` classes is held as ``"kron-diag"``.

Under ``likelihood="regression"`` the predictive is ``N(f(x), J Σ Jᵀ + σ²)`` with
``J Σ Jᵀ = σ² · head_variance(phĩ, δ σ²)`` (as ``(H/σ² + δ)⁻¹ = σ² (H + δσ²)⁻¹``, ``H`` at unit noise); with one
``σ_d`` per output, each output's column at its own noise (the evidence picks ``δ`` at one shared ``σ``). Under ``likelihood="heteroscedastic"``
(docs/regression.md) the GGN uses the Fisher ``diag(e^{-s_n}, ½)`` of the means and log-variances.

Example:
    >>> import posthoc
    >>> from posthoc.methods.laplace.last_layer import LastLayerLaplace
    >>> from posthoc_apps.demo.examples import model, train_loader
    >>> um = posthoc.wrap(model, method="laplace", hessian="diag").fit(train_loader)
    >>> isinstance(um.method, LastLayerLaplace), um.method.split.head_name, type(um.method.blocks[0]).__name__
    (True, '3', 'DiagCurvature')
    >>> import torch
    >>> um.method.row_bytes(0, torch.float32)  # bytes per row in the predictive
    344
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.chunks import current_budget
from posthoc.core.inputs import Inputs, iterate
from posthoc.core.likelihood import Categorical, Gaussian, HeteroscedasticGaussian, linearised_variance
from posthoc.core.method import LogPredictive
from posthoc.core.modules import eval_mode, qualified
from posthoc.core.prediction import RegressionPrediction
from posthoc.engine.head import FeatureSplit
from posthoc.engine.held_out import STRENGTHS, HeldOut
from posthoc.engine.selection import Scores
from posthoc.errors import ConfigError, ExportError
from posthoc.export.modules import Backbone, GaussianOutputs, observation_variance
from posthoc.methods.laplace import glm_predictive as glm
from posthoc.methods.laplace.base import TRAIN_ROWS, Laplace
from posthoc.methods.laplace.curvature import LastLayerGGN, augment
from posthoc.methods.laplace.export import HeadGaussian, head_weights
from posthoc.methods.laplace.ladder import ProbitLadder
from posthoc.methods.laplace.structures import head_structure, structure_class

#: the fewest training rows that stand in for a missing ``val_loader`` however wide the head
MIN_STAND_IN = 512


class LastLayerLaplace(Laplace, scope="last_layer"):
    """``subset="last_layer"`` (see module docs)."""

    likelihoods = (Categorical, Gaussian, HeteroscedasticGaussian)
    per_output_noise = True
    exports = ("classification", "regression")

    def __init__(self, model: nn.Module, options: Laplace.Options) -> None:
        super().__init__(model, options)
        if self.hessian == "kron-mc":
            raise ConfigError(
                "hessian='kron-mc' samples BackPACK's KFAC for deeper subsets; the last-layer GGN is exact and as cheap: use 'kron'"
            )
        if self.pred == "nn":
            raise ConfigError(
                "pred='nn' samples weights through the network, which for the last layer is the same "
                "distribution as the exact logit-space predictive: use pred='glm' with link='mc'"
            )
        self.pred = "glm"
        self.split = FeatureSplit(model, options.head)
        if self.split.head is not None:
            self.hessian = head_structure(self.hessian, self.split.head.out_features)
            self._check_head_memory()
        self.blocks = nn.ModuleList([structure_class(self.hessian)()])
        self._accept_flat_names()

    @property
    def curvature(self) -> nn.Module:
        """The head's fitted block."""
        return self.blocks[0]

    def _fit_curvature(self, train_loader: Iterable, progress: bool) -> tuple[Tensor, list[Tensor]]:
        accumulator = self._accumulate(train_loader, progress)
        self.blocks = nn.ModuleList([accumulator.finalize()])
        self.num_data.fill_(accumulator.num_data)
        head = self.split.head
        return accumulator.loss, [head.weight] + ([head.bias] if head.bias is not None else [])

    def _accumulate(self, train_loader: Iterable, progress: bool) -> LastLayerGGN:
        accumulator: LastLayerGGN | None = None
        device = self.device
        with torch.no_grad(), eval_mode(self.model):
            for x, y in iterate(train_loader, device=device, progress=progress, desc="laplace curvature"):
                phi, logits = self.split(x)
                if accumulator is None:
                    # (N,) logits: a one-output head whose model flattens its output (read from the feature store)
                    if logits.dim() < 2 or logits.shape[1] < self.likelihood.min_outputs:
                        raise ConfigError(
                            "laplace uses the softmax (categorical) likelihood and needs a head with at least 2 "
                            "outputs; this head has 1 (a sigmoid classifier, or a regressor). If the model predicts a "
                            "number, wrap it with posthoc.wrap(model, method='laplace', likelihood='regression'); for a "
                            "binary classifier give the head two outputs [0, z], or use 'temperature' or 'mc-dropout', "
                            "which handle one logit"
                        )
                    self.hessian = head_structure(self.hessian, logits.shape[1])
                    self._check_head_memory()
                    accumulator = LastLayerGGN(
                        self.hessian, phi.shape[1], logits.shape[1], self._has_bias, device, self.likelihood
                    )
                accumulator.update(phi, logits, self.likelihood.targets(y, logits))
        params = self.num_posterior_parameters()
        rank = accumulator.num_data * self.likelihood.hessian_rank(self.split.head.out_features)
        if rank < params:
            warnings.warn(
                f"{accumulator.num_data} training examples determine at most {rank} of the head's "
                f"{params} parameter directions: the curvature is singular and the posterior there is "
                "the prior (kept proper by prior_precision). Fit on more data for a data-driven posterior",
                RuntimeWarning,
                stacklevel=5,
            )
        return accumulator

    def _prepare(self, x: Inputs) -> tuple[Tensor, Tensor]:
        return self.split(x)

    def _stand_in_rows(self) -> int:
        """``TRAIN_ROWS``, fewer for a wide head: the float32 logits of the rows and of their perturbed copies (one per
        fit-time strength) stay within the memory budget, each held once by the choice (at least ``MIN_STAND_IN``).

        Example:
            >>> import posthoc
            >>> from torch import nn
            >>> posthoc.wrap(nn.Sequential(nn.Linear(8, 21_843)), method="laplace").method._stand_in_rows()
            1536
        """
        copies = 1 + len(STRENGTHS)
        fitting = current_budget() // (copies * self.split.head.out_features * 4)
        return int(min(TRAIN_ROWS, max(MIN_STAND_IN, fitting)))

    def _ladder_scores(self, held_out: HeldOut) -> Callable[[float], Scores]:
        """With the probit link, a :class:`~posthoc.methods.laplace.ladder.ProbitLadder` of the held-out rows: each
        rung a product of their variance factors with the prior's table (a predict per rung for the other links)."""
        if self.link != "probit":
            return super()._ladder_scores(held_out)
        self._settle()

        def kept(batches: Iterable[tuple[Inputs, Tensor]]) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
            for x, y in batches:
                phi, logits = self.split(x)
                yield augment(phi, self._has_bias), logits, y

        ladder = ProbitLadder(
            self.curvature,
            kept(held_out.clean()),
            kept(held_out.perturbed()),
            row_bytes=self.row_bytes(0, torch.float32),
        )
        return ladder.scores

    def _predictive(
        self, inputs: tuple[Tensor, Tensor], prior_precision: float, generator: torch.Generator | None, num_samples: int
    ) -> LogPredictive:
        phi, logits = inputs
        dtype = torch.promote_types(phi.dtype, torch.float32)
        phi_aug = augment(phi.to(dtype), self._has_bias)
        gaussian = self.curvature.head_predictor(prior_precision, dtype)
        return glm.chunked_log_predictive(
            phi.shape[0],
            self.row_bytes(num_samples, dtype),
            lambda rows: gaussian(phi_aug[rows], logits[rows]),
            self.link,
            num_samples,
            generator,
        )

    def regression_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> RegressionPrediction:
        """The closed-form GLM predictive over the targets (see module docs)."""
        self._settle()
        phi, outputs = self.split(x)
        dtype = torch.promote_types(phi.dtype, torch.float32)
        phi_aug, delta = augment(phi.to(dtype), self._has_bias), float(self.prior_precision)
        if isinstance(self.likelihood, HeteroscedasticGaussian):
            samples = num_samples or self.num_samples
            return self._predicted_noise_predictive(phi_aug, outputs.to(dtype), delta, generator, samples)
        if self.likelihood.per_output:  # one σ_d per output: each output's block at its own noise
            noises = self.likelihood.variances(outputs.shape[-1], torch.float64, torch.device("cpu"))
            variance = linearised_variance(self._unit_variance, phi_aug, outputs, delta, noises)
        else:
            noise = self.likelihood.dispersion
            variance = noise * self.curvature.head_variance(phi_aug, outputs, delta * noise).variance()
        return self.likelihood.predictive(outputs.to(dtype)[None], variance.to(dtype)[None])

    def _predicted_noise_predictive(
        self,
        phi_aug: Tensor,
        outputs: Tensor,
        prior_precision: float,
        generator: torch.Generator | None,
        num_samples: int,
    ) -> RegressionPrediction:
        """Under ``likelihood="heteroscedastic"``: moment-matched (default) or sampled (``link="mc"``)."""
        gaussian = self.curvature.head_variance(phi_aug, outputs, prior_precision)
        if self.link == "mc":
            return self.likelihood.predictive(gaussian.sample(num_samples, generator))
        return self.likelihood.linearised_predictive(outputs, gaussian.variance())

    def _predicted_noise_nll(self, rows: list[tuple[Tensor, Tensor, Tensor]], prior_precision: float) -> list[Tensor]:
        """Each example's NLL at ``prior_precision`` (``link="mc"``: the same seeded draws at every prior)."""
        generator = torch.Generator(device=self.device).manual_seed(0)
        return [
            -self._predicted_noise_predictive(phi_aug, outputs, prior_precision, generator, self.num_samples)
            .log_prob(targets)
            .double()
            for phi_aug, outputs, targets in rows
        ]

    def _regression_rows(
        self, loader: Iterable, rows: int | None, progress: bool
    ) -> list[tuple[Tensor, Tensor, Tensor]]:
        """``[(phĩ, outputs, targets)]``: ``loader``'s first ``rows`` rows (whole batches) joined into one batch."""
        found, seen = [], 0
        with torch.no_grad(), eval_mode(self.model):
            for x, y in iterate(loader, device=self.device, progress=progress, desc="laplace noise"):
                phi, outputs = self.split(x)
                dtype = torch.promote_types(phi.dtype, torch.float32)
                found.append(
                    (augment(phi.to(dtype), self._has_bias), outputs.to(dtype), self.likelihood.targets(y, outputs))
                )
                seen += phi.shape[0]
                if rows is not None and seen >= rows:
                    break
        return [tuple(torch.cat(parts) for parts in zip(*found))]  # type: ignore[list-item]

    def _unit_variance(self, prepared: Tensor, outputs: Tensor, prior_precision: float) -> Tensor:
        """The head's ``J Σ Jᵀ`` diagonal ``(N, D)`` at unit noise, ``prepared`` the rows' ``phĩ``."""
        return self.curvature.head_variance(prepared, outputs, prior_precision).variance()

    def _noise_search_elements(self, rows: list[tuple[Tensor, Tensor, Tensor]]) -> int:
        return sum(len(r[0]) for r in rows) * self.row_bytes(0, rows[0][0].dtype) // 4

    def target_values(self) -> int:
        return int(self.num_data) * self.split.head.out_features

    def row_bytes(self, num_samples: int, dtype: torch.dtype) -> int:
        """Bytes one input row keeps alive in the predictive: the structure's temporaries and the link's."""
        head, itemsize = self.split.head, torch.finfo(dtype).bits // 8
        width, classes = head.in_features + int(self._has_bias), head.out_features
        return self.curvature.head_row_bytes(classes, width, itemsize) + glm.link_row_bytes(
            self.link, classes, num_samples, itemsize
        )

    def logit_gaussian(
        self, phi_aug: Tensor, logits: Tensor, prior_precision: float | None = None
    ) -> glm.GaussianLogits:
        """The Gaussian over logits for head inputs ``phĩ = [phi, 1]``."""
        self._settle()
        delta = float(self.prior_precision) if prior_precision is None else prior_precision
        return self.curvature.head_variance(phi_aug, logits, delta)

    def to_module(self, export: Any) -> nn.Module:
        """The GLM predictive with the posterior folded into buffers (:mod:`posthoc.methods.laplace.export`)."""
        if self.split.head is None:
            raise ExportError(
                "the head of this model was not found yet: run um.predict on one batch before um.to_module()"
            )
        head, bias = self.split.head, self._has_bias
        self._settle()
        prior_precision = float(self.prior_precision)
        backbone = export.backbone(self.model)
        tap = backbone.add_tap(self.split.head_name, "input")
        if export.regression:
            return self._regression_module(export, backbone, tap, prior_precision)
        if self.link == "mc":
            draws = self.curvature.sample(
                head_weights(head), prior_precision, export.samples_of(self), export.generator()
            ).float()
            return HeadGaussian(backbone, tap, bias, None, "samples", draws)
        if self.link == "bridge" and self.hessian == "full":
            raise ExportError(
                "um.to_module() exports the Laplace bridge for hessian='diag' and 'kron' (hessian='full' needs "
                "each input's C x C covariance); wrap with link='probit' or link='mc' to export it"
            )
        folded = self.curvature.fold_head(prior_precision, head.out_features, head.in_features + int(bias))
        return HeadGaussian(backbone, tap, bias, folded, self.link)

    def _regression_module(self, export: Any, backbone: Backbone, tap: int, prior_precision: float) -> nn.Module:
        noise = observation_variance(self.likelihood)
        if noise is None:
            raise ExportError("last-layer Laplace exports under likelihood='regression' (a fitted noise) only")
        if noise.dim() > 0:
            raise ExportError(
                f"last-layer Laplace exports one observation noise shared by the outputs; this one has a noise "
                f"per output ({noise.numel()} values): export method='none' or an ensemble, or fit with "
                "likelihood=posthoc.Gaussian(noise_std=<one float>)"
            )
        head = self.split.head
        width = head.in_features + int(self._has_bias)
        folded = self.curvature.fold_head(prior_precision * float(noise), head.out_features, width)
        return GaussianOutputs(backbone, noise, HeadGaussian(backbone, tap, self._has_bias, folded, "probit"))

    def posterior_parameters(self) -> list[str]:
        head = self.split.head
        return [
            qualified(self.split.head_name, name)
            for name, value in head.named_parameters(recurse=False)
            if value is not None
        ]

    def load_posterior_state(self, state: dict[str, Tensor]) -> None:
        """As :meth:`Method.load_posterior_state`; a ``"kron"`` head held as ``"kron-diag"`` loads as that."""
        if "blocks.0.out_diagonal" in state and self.hessian == "kron":
            self.hessian = "kron-diag"
            self.blocks = nn.ModuleList([structure_class(self.hessian)()])
        super().load_posterior_state(state)

    def _flat_names(self) -> dict[str, tuple[int, str]]:
        return {field: (0, field) for field in structure_class(self.hessian).fields}

    @property
    def _has_bias(self) -> bool:
        return self.split.head.bias is not None

    def _check_head_memory(self) -> None:
        head = self.split.head
        structure_class(self.hessian).check_head_memory(
            head.out_features, head.in_features + int(head.bias is not None), current_budget()
        )
