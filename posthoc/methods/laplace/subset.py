"""Laplace over a subset of layers: BackPACK's KFAC or diagonal GGN, GLM or weight-sample predictive.

``subset="lora"`` covers a ``peft`` model's LoRA adapter weights only (LoRA-Laplace, Yang et al.
2024): their KFAC-reduce or diagonal GGN comes from hooks (:mod:`~posthoc.methods.laplace.hooked_kfac`,
BackPACK cannot run transformers), the predictive is the GLM one over the adapters' per-token
Jacobians; memory grows with the adapters' width, never with the frozen model's.

Every parameter of the covered Linear/Conv2d layers gets its own block (Kronecker eigen-factors,
or a diagonal), fitted by :func:`~posthoc.methods.laplace.curvature.backpack_ggn` (or, for
``subset="lora"``, :func:`~posthoc.methods.laplace.hooked_kfac.hooked_ggn`) and saved as
``p{index}_{field}`` buffers. Predictions are the linearised (GLM) logit Gaussian when every
covered layer is Linear (:mod:`posthoc.methods.laplace.subset_glm`, in row chunks planned by
:mod:`posthoc.core.chunks`), else (or with ``pred="nn"``) ``S`` weight draws run through the network.

Example:
    >>> um = posthoc.wrap(model, method="laplace", subset=["classifier.1", "classifier.4"]).fit(train_loader)
    >>> isinstance(um.method, SubsetLaplace), um.method.pred
    (True, 'glm')
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core import distributed
from posthoc.core.errors import ConfigError, InputError
from posthoc.core.inputs import Inputs, batch_size, iterate, run_model, run_model_with, slice_inputs
from posthoc.core.logits import class_log_probs, log_mean_exp
from posthoc.core.method import LogPredictive
from posthoc.core.modules import eval_mode, parameter_owners
from posthoc.methods.laplace import glm_predictive as glm
from posthoc.methods.laplace import subset_glm
from posthoc.methods.laplace.base import Laplace, class_labels
from posthoc.methods.laplace.curvature import SUBSET_STRUCTURES, ParamCurvature, backpack_ggn, sample_weights, subset_parameters
from posthoc.methods.laplace.hooked_kfac import HOOKED_STRUCTURES, hooked_ggn

#: per-parameter buffers, named ``p{index}_{field}``
BLOCK_FIELDS = {
    "kron": ("out_eigvals", "out_eigvecs", "in_eigvals", "in_eigvecs"),
    "kron-mc": ("out_eigvals", "out_eigvecs", "in_eigvals", "in_eigvecs"),
    "diag": ("diagonal",),
}


class SubsetLaplace(Laplace):
    """``subset="all"`` or a list of module names: BackPACK KFAC/diagonal blocks over those layers (see module docs)."""

    last_layer_only = False

    def __init__(self, model: nn.Module, **options: Any) -> None:
        super().__init__(model, **options)
        if self.subset == "lora" and self.hessian not in HOOKED_STRUCTURES:
            raise ConfigError(f"subset='lora' offers hessian in {HOOKED_STRUCTURES} (KFAC-reduce or diagonal GGN), got {self.hessian!r}")
        if self.hessian not in SUBSET_STRUCTURES:
            raise ConfigError(
                f"hessian={self.hessian!r} over several layers is not offered (a dense GGN of many layers does not "
                f"fit in memory); use one of {tuple(SUBSET_STRUCTURES)}"
            )
        self.param_names = subset_parameters(model, self.subset)
        all_linear = all(isinstance(m, nn.Linear) for m in parameter_owners(model, self.param_names).values())
        self.pred = self.pred or ("glm" if all_linear else "nn")
        self.glm_layers = subset_glm.covered_linear_layers(model, self.param_names) if self.pred == "glm" else {}
        for index in range(len(self.param_names)):
            for field in BLOCK_FIELDS[self.hessian]:
                self.register_buffer(f"p{index}_{field}", None)

    def _fit_curvature(self, train_loader: Iterable, progress: bool) -> tuple[Tensor, list[Tensor]]:
        self.num_data.zero_()
        if self.subset == "lora":
            blocks, loss = hooked_ggn(self.model, self.param_names, self.hessian,
                                      self._labelled_batches(train_loader, progress, "laplace curvature (LoRA, hooks)"))
        else:
            blocks, loss = backpack_ggn(self.model, self.param_names, self.hessian, self._labelled_batches(train_loader, progress))
        self.num_data.copy_(distributed.all_reduce_sum(self.num_data))
        for index, block in enumerate(blocks):
            for field in BLOCK_FIELDS[self.hessian]:
                setattr(self, f"p{index}_{field}", getattr(block, field))
        params = dict(self.model.named_parameters())
        return loss, [params[name] for name in self.param_names]

    def _labelled_batches(self, train_loader: Iterable, progress: bool,
                          desc: str = "laplace curvature (BackPACK)") -> Iterator[tuple[Inputs, Tensor]]:
        classes = None
        for x, y in iterate(train_loader, device=self.device, progress=progress, desc=desc):
            if not isinstance(x, Tensor) and self.subset != "lora":
                raise InputError(
                    "subset Laplace over named layers (BackPACK) needs tensor inputs, not a dict; for a peft model "
                    "use subset='lora', otherwise subset='last_layer'"
                )
            classes = classes or _num_classes(self.model, x)
            self.num_data += batch_size(x)
            yield x, class_labels(y, batch_size(x), classes)

    def _blocks(self) -> list[ParamCurvature]:
        return [
            ParamCurvature(name, **{field: getattr(self, f"p{index}_{field}") for field in BLOCK_FIELDS[self.hessian]})
            for index, name in enumerate(self.param_names)
        ]

    def _prepare(self, x: Inputs) -> Inputs:
        return x

    def _map_log_probs(self, x: Inputs) -> Tensor:
        return class_log_probs(run_model(self.model, x)).double()

    def _predictive(self, x: Inputs, prior_precision: float, generator: torch.Generator | None, num_samples: int) -> LogPredictive:
        if self.pred == "nn":
            return self._weight_space_predictive(x, prior_precision, generator, num_samples)
        blocks = self._blocks()
        positions = subset_glm.positions_per_row(self.model, self.glm_layers, slice_inputs(x, 0, 1))
        row_bytes = subset_glm.bytes_per_row(self.glm_layers, _num_classes(self.model, x), num_samples if self.link == "mc" else 0, positions)
        return glm.chunked_log_predictive(
            batch_size(x), row_bytes,
            lambda rows: subset_glm.logit_gaussian(self.model, self.glm_layers, blocks, slice_inputs(x, rows.start, rows.stop), prior_precision),
            self.link, num_samples, generator, max_memory=self.max_memory,
        )

    def _weight_space_predictive(self, x: Inputs, prior_precision: float, generator: torch.Generator | None, num_samples: int) -> LogPredictive:
        """``pred="nn"``: run the network with ``S`` weight draws of the covered layers (others fixed)."""
        params = dict(self.model.named_parameters())
        draws = {b.name: sample_weights(params[b.name].detach(), b, prior_precision, num_samples, generator) for b in self._blocks()}
        sample_log_probs = torch.stack([
            class_log_probs(run_model_with(self.model, {name: draw[s] for name, draw in draws.items()}, x))
            for s in range(num_samples)
        ])
        return log_mean_exp(sample_log_probs), sample_log_probs

    def spectrum(self) -> Tensor:
        return torch.cat([block.spectrum() for block in self._blocks()])

    def num_posterior_parameters(self) -> int:
        params = dict(self.model.named_parameters())
        return sum(params[name].numel() for name in self.param_names)

    def posterior_layers(self) -> list[str]:
        return list(parameter_owners(self.model, self.param_names))


def _num_classes(model: nn.Module, x: Inputs) -> int:
    """The model's number of outputs, from one row (no model structure tells it in general)."""
    with torch.no_grad(), eval_mode(model):
        return run_model(model, slice_inputs(x, 0, 1)).shape[-1]
