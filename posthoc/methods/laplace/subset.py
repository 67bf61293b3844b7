"""Laplace over a subset of layers: BackPACK's KFAC or diagonal GGN, GLM or weight-sample predictive.

Every parameter of the covered Linear/Conv2d layers gets its own block, fitted by BackPACK
(:func:`~posthoc.methods.laplace.curvature.backpack_ggn`) or, for ``subset="lora"`` (a ``peft`` model's adapters,
LoRA-Laplace, Yang et al. 2024), by hooks (:mod:`~posthoc.methods.laplace.hooked_kfac`): memory grows with the
adapters' width, never with the frozen model's. Predictions are the GLM logit Gaussian
(:mod:`~posthoc.methods.laplace.subset_glm`) when every covered layer is Linear, else (or with ``pred="nn"``) weight
draws run through the network. Under ``likelihood="regression"`` (not ``"lora"``) the curvature is the squared error's
GGN at unit noise over ``σ²``, as in the last layer; ``pred="nn"`` keeps the evidence's ``σ``.

Example:
    >>> import posthoc
    >>> from posthoc.methods.laplace.subset import SubsetLaplace
    >>> from posthoc_apps.demo.examples import model, train_loader
    >>> um = posthoc.wrap(model, method="laplace", subset=["0", "3"]).fit(train_loader)
    >>> isinstance(um.method, SubsetLaplace), um.method.pred
    (True, 'glm')
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.inputs import (
    Inputs,
    batch_size,
    iterate,
    run_model,
    run_model_with,
    slice_inputs,
)
from posthoc.core.likelihood import Categorical, Gaussian, Likelihood, model_outputs
from posthoc.core.logits import class_log_probs, log_mean_exp
from posthoc.core.method import LogPredictive
from posthoc.core.modules import eval_mode, parameter_owners
from posthoc.core.prediction import RegressionPrediction
from posthoc.engine.runner import sum_over_ranks
from posthoc.errors import ConfigError, InputError
from posthoc.methods.laplace import glm_predictive as glm
from posthoc.methods.laplace import subset_glm
from posthoc.methods.laplace.base import Laplace
from posthoc.methods.laplace.curvature import (
    SUBSET_STRUCTURES,
    backpack_ggn,
    subset_parameters,
)
from posthoc.methods.laplace.hooked_kfac import HOOKED_STRUCTURES, hooked_ggn
from posthoc.methods.laplace.structures import structure_class


class SubsetLaplace(Laplace, scope="subset"):
    """``subset="all"``, module names or ``"lora"`` (see module docs)."""

    likelihoods = (Categorical, Gaussian)
    export_refusal = (
        "Laplace over layers inside the network linearises the whole network in those layers (a Jacobian per "
        "input), which is no fixed tensor program; refit with subset='last_layer' to export it"
    )

    def __init__(self, model: nn.Module, options: Laplace.Options) -> None:
        super().__init__(model, options)
        if self.subset == "lora" and self.hessian not in HOOKED_STRUCTURES:
            raise ConfigError(
                f"subset='lora' offers hessian in {HOOKED_STRUCTURES} (KFAC-reduce or diagonal GGN), got {self.hessian!r}"
            )
        if self.hessian not in SUBSET_STRUCTURES:
            raise ConfigError(
                f"hessian={self.hessian!r} over several layers is not offered (a dense GGN of many layers does not "
                f"fit in memory); use one of {tuple(SUBSET_STRUCTURES)}"
            )
        self.param_names = subset_parameters(model, self.subset)
        all_linear = all(isinstance(m, nn.Linear) for m in parameter_owners(model, self.param_names).values())
        self.pred = self.pred or ("glm" if all_linear else "nn")
        self.glm_layers = subset_glm.covered_linear_layers(model, self.param_names) if self.pred == "glm" else {}
        self.blocks = nn.ModuleList([structure_class(self.hessian)(name) for name in self.param_names])
        self._accept_flat_names()
        #: seen at fit: the model's outputs, the most positions (tokens, patches) an example feeds a
        #: covered layer, and the elements of that example's inputs (0: not seen)
        for name in ("num_classes", "positions", "example_size"):
            self.register_buffer(name, torch.zeros((), dtype=torch.int64))

    def use_likelihood(self, likelihood: Likelihood) -> None:
        """As :meth:`Laplace.use_likelihood`; ``subset="lora"`` stays with the softmax (its hooks square-root it)."""
        if self.subset == "lora" and likelihood.fits_noise:
            raise ConfigError(
                f"subset='lora' fits its curvature from hooks with the softmax's loss Hessian and does not do "
                f"likelihood={likelihood.name!r} yet; name Linear layers with subset=[...] (BackPACK), or use "
                "subset='last_layer'"
            )
        super().use_likelihood(likelihood)

    def _fit_curvature(self, train_loader: Iterable, progress: bool) -> tuple[Tensor, list[Tensor]]:
        self.num_data.zero_()
        if self.subset == "lora":
            batches = self._labelled_batches(train_loader, progress, "laplace curvature (LoRA, hooks)")
            blocks, loss = hooked_ggn(self.model, self.param_names, self.hessian, batches)
        else:
            batches = self._labelled_batches(train_loader, progress)
            blocks, loss = backpack_ggn(self.model, self.param_names, self.hessian, batches, self.likelihood)
        self.num_data.copy_(sum_over_ranks(self.num_data))
        self.blocks = nn.ModuleList(blocks)
        params = dict(self.model.named_parameters())
        return loss, [params[name] for name in self.param_names]

    def _labelled_batches(
        self, train_loader: Iterable, progress: bool, desc: str = "laplace curvature (BackPACK)"
    ) -> Iterator[tuple[Inputs, Tensor]]:
        classes = None
        for x, y in iterate(train_loader, device=self.device, progress=progress, desc=desc):
            if not isinstance(x, Tensor) and self.subset != "lora":
                raise InputError(
                    "subset Laplace over named layers (BackPACK) needs tensor inputs, not a dict; for a peft model "
                    "use subset='lora', otherwise subset='last_layer'"
                )
            if classes is None:
                classes = self._record_shapes(x)
            self.num_data += batch_size(x)
            yield x, self.likelihood.targets(y, torch.empty(batch_size(x), classes, device=self.device))

    def _record_shapes(self, x: Inputs) -> int:
        """Record the class count and the positions per example from one row of ``x``; return the class count."""
        row = slice_inputs(x, 0, 1)
        with torch.no_grad(), eval_mode(self.model):
            self.num_classes.fill_(run_model(self.model, row).shape[-1])
            if self.glm_layers:
                self.positions.fill_(subset_glm.positions_per_row(self.model, self.glm_layers, row))
        self.example_size.fill_(_example_size(x))
        return int(self.num_classes)

    def _positions(self, x: Inputs) -> int:
        """Positions an example of ``x`` feeds the covered layers: those seen at fit, scaled by the example's size."""
        seen = max(1, int(self.positions))
        return seen if seen == 1 else max(1, math.ceil(seen * _example_size(x) / max(1, int(self.example_size))))

    def _prepare(self, x: Inputs) -> Inputs:
        return x

    def _predictive(
        self, x: Inputs, prior_precision: float, generator: torch.Generator | None, num_samples: int
    ) -> LogPredictive:
        if self.pred == "nn":
            return self._weight_space_predictive(x, prior_precision, generator, num_samples)
        if int(self.num_classes) == 0:  # a posterior saved without its shapes
            self._record_shapes(x)
        blocks = list(self.blocks)
        row_bytes = subset_glm.bytes_per_row(
            self.glm_layers, int(self.num_classes), num_samples if self.link == "mc" else 0, self._positions(x)
        )
        return glm.chunked_log_predictive(
            batch_size(x),
            row_bytes,
            lambda rows: subset_glm.logit_gaussian(
                self.model, self.glm_layers, blocks, slice_inputs(x, rows.start, rows.stop), prior_precision
            ),
            self.link,
            num_samples,
            generator,
        )

    def _weight_space_predictive(
        self, x: Inputs, prior_precision: float, generator: torch.Generator | None, num_samples: int
    ) -> LogPredictive:
        """``pred="nn"``: run the network with ``S`` weight draws of the covered layers (others fixed)."""
        params = dict(self.model.named_parameters())
        draws = {
            b.name: b.sample(params[b.name].detach(), prior_precision, num_samples, generator) for b in self.blocks
        }
        sample_log_probs = self._run_draws(x, draws, num_samples, class_log_probs)
        return log_mean_exp(sample_log_probs), sample_log_probs

    def _run_draws(self, x: Inputs, draws: dict[str, Tensor], num_samples: int, read: Any) -> Tensor:
        """``read`` of the network's outputs under each weight draw of the covered parameters, stacked."""
        return torch.stack(
            [
                read(run_model_with(self.model, {name: draw[s] for name, draw in draws.items()}, x))
                for s in range(num_samples)
            ]
        )

    def regression_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> RegressionPrediction:
        """Under a Gaussian likelihood (see module docs)."""
        self._settle()
        noise, delta = self.likelihood.dispersion, float(self.prior_precision)
        if self.pred == "nn":
            num_samples = num_samples or self.num_samples
            params = dict(self.model.named_parameters())
            draws = {b.name: self._draws(b, params[b.name].detach(), num_samples, generator) for b in self.blocks}
            return self.likelihood.predictive(self._run_draws(x, draws, num_samples, model_outputs))
        outputs, factors = subset_glm.jacobian_factors(self.model, self.glm_layers, x)
        variance = noise * subset_glm.jacobian_covariance(factors, list(self.blocks), delta * noise).diagonal(
            dim1=1, dim2=2
        )
        dtype = outputs.dtype if outputs.dtype in (torch.float32, torch.float64) else torch.float32
        return self.likelihood.predictive(outputs.to(dtype)[None], variance.to(dtype)[None])

    def _draws(self, block: Any, mean: Tensor, num_samples: int, generator: torch.Generator | None) -> Tensor:
        """``num_samples`` draws of one block's weights from ``N(θ, σ² (G + δ σ²)⁻¹)``, the posterior at noise ``σ``
        (``G`` the unit-noise GGN), as ``σ`` times a draw of the unit-noise posterior at prior ``δ σ²``."""
        noise = self.likelihood.dispersion
        return mean + math.sqrt(noise) * block.sample(
            torch.zeros_like(mean), float(self.prior_precision) * noise, num_samples, generator
        )

    def _regression_rows(self, loader: Iterable, rows: int | None, progress: bool) -> list[tuple[Any, Tensor, Tensor]]:
        """``[(Jacobian factors, outputs, targets)]`` of ``loader``'s first ``rows`` rows, one batch where possible."""
        found, seen = [], 0
        with eval_mode(self.model):
            for x, y in iterate(loader, device=self.device, progress=progress, desc="laplace noise"):
                outputs, factors = subset_glm.jacobian_factors(self.model, self.glm_layers, x)
                found.append((factors, outputs, self.likelihood.targets(y, outputs)))
                seen += batch_size(x)
                if rows is not None and seen >= rows:
                    break
        first = found[0][0]
        if any(f[name][k].shape[1:] != first[name][k].shape[1:] for f, _, _ in found for name in first for k in (0, 1)):
            return found  # sequences of several lengths: kept per batch
        factors = {name: tuple(torch.cat(parts) for parts in zip(*(f[name] for f, _, _ in found))) for name in first}
        return [(factors, torch.cat([o for _, o, _ in found]), torch.cat([t for _, _, t in found]))]

    def _unit_variance(
        self, prepared: dict[str, tuple[Tensor, Tensor]], outputs: Tensor, prior_precision: float
    ) -> Tensor:
        """The diagonal of ``Σ_blocks J Σ_block Jᵀ`` ``(N, D)`` at unit noise from a batch's Jacobian factors."""
        return subset_glm.jacobian_covariance(prepared, list(self.blocks), prior_precision).diagonal(dim1=1, dim2=2)

    def target_values(self) -> int:
        return int(self.num_data) * max(1, int(self.num_classes))

    def posterior_parameters(self) -> list[str]:
        return list(self.param_names)

    def _flat_names(self) -> dict[str, tuple[int, str]]:
        fields = structure_class(self.hessian).fields
        return {f"p{index}_{field}": (index, field) for index in range(len(self.param_names)) for field in fields}


def _example_size(x: Inputs) -> int:
    """Elements of one example's inputs (of every tensor, for a dict of them)."""
    tensors = x.values() if isinstance(x, Mapping) else [x]
    return sum(value[0].numel() for value in tensors if isinstance(value, Tensor) and value.dim() > 0)
