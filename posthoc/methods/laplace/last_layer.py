"""Last-layer Laplace: the head's GGN in closed form and Gaussian logits, no backward pass.

The GGN of a linear head follows from the features and probabilities of ONE pass over the
training data (:class:`~posthoc.methods.laplace.curvature.LastLayerGGN`); predictions are Gaussian
in logit space (:mod:`posthoc.methods.laplace.glm_predictive`), computed in row chunks planned by
:mod:`posthoc.core.chunks`.

Example:
    >>> um = posthoc.wrap(model, method="laplace", hessian="diag").fit(train_loader)
    >>> isinstance(um.method, LastLayerLaplace), um.method.split.head_name
    (True, 'fc')
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core import settings
from posthoc.core.errors import ConfigError
from posthoc.core.inputs import Inputs, iterate
from posthoc.core.method import LogPredictive
from posthoc.core.modules import eval_mode
from posthoc.engine.head import FeatureSplit
from posthoc.methods.laplace import glm_predictive as glm
from posthoc.methods.laplace.base import Laplace, class_labels
from posthoc.methods.laplace.curvature import LastLayerCurvature, LastLayerGGN, augment, check_memory, ggn_spectrum, num_params

#: buffers that hold each structure's fitted curvature
CURVATURE_BUFFERS = {
    "kron": ("out_eigvals", "out_eigvecs", "in_eigvals", "in_eigvecs"),
    "full": ("eigvals", "eigvecs"),
    "diag": ("diagonal",),
}


class LastLayerLaplace(Laplace):
    """``subset="last_layer"``: closed-form GGN of the head and the logit-space GLM predictive (see module docs)."""

    last_layer_only = True

    def __init__(self, model: nn.Module, **options: Any) -> None:
        super().__init__(model, **options)
        if self.hessian == "kron-mc":
            raise ConfigError("hessian='kron-mc' samples BackPACK's KFAC for deeper subsets; the last-layer GGN is exact and as cheap: use 'kron'")
        if self.pred == "nn":
            raise ConfigError(
                "pred='nn' samples weights through the network, which for the last layer is the same "
                "distribution as the exact logit-space predictive: use pred='glm' with link='mc'"
            )
        self.pred = "glm"
        self.split = FeatureSplit(model, options.get("head"))
        if self.split.head is not None:
            self._check_head_memory()
        for name in CURVATURE_BUFFERS[self.hessian]:
            self.register_buffer(name, None)

    def _fit_curvature(self, train_loader: Iterable, progress: bool) -> tuple[Tensor, list[Tensor]]:
        curvature = self._accumulate(train_loader, progress)
        for name in CURVATURE_BUFFERS[self.hessian]:
            setattr(self, name, getattr(curvature, name))
        self.num_data.fill_(curvature.num_data)
        head = self.split.head
        return curvature.loss, [head.weight] + ([head.bias] if head.bias is not None else [])

    def _accumulate(self, train_loader: Iterable, progress: bool) -> LastLayerCurvature:
        accumulator: LastLayerGGN | None = None
        device = self.device
        with torch.no_grad(), eval_mode(self.model):
            for x, y in iterate(train_loader, device=device, progress=progress, desc="laplace curvature"):
                phi, logits = self.split(x)
                if accumulator is None:
                    if logits.shape[1] < 2:
                        raise ConfigError(
                            "laplace uses the softmax (categorical) likelihood and needs a head with at least 2 "
                            "outputs; this head has 1 (a sigmoid classifier). Give the head two outputs "
                            "[0, z], or use 'temperature' or 'mc-dropout', which handle one logit"
                        )
                    self._check_head_memory()
                    accumulator = LastLayerGGN(self.hessian, phi.shape[1], logits.shape[1], self._has_bias, device)
                accumulator.update(phi, logits, class_labels(y, *logits.shape))
        head = self.split.head
        params = num_params(head.in_features, head.out_features, self._has_bias)
        rank = accumulator.num_data * (head.out_features - 1)
        if rank < params:
            warnings.warn(
                f"{accumulator.num_data} training examples determine at most {rank} of the head's "
                f"{params} parameter directions: the curvature is singular and the posterior there is "
                "the prior (kept proper by prior_precision). Fit on more data for a data-driven posterior",
                RuntimeWarning,
                stacklevel=5,
            )
        return accumulator.finalize()

    def _prepare(self, x: Inputs) -> tuple[Tensor, Tensor]:
        return self.split(x)

    def _map_log_probs(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        return torch.log_softmax(inputs[1].double(), dim=-1)

    def _predictive(self, inputs: tuple[Tensor, Tensor], prior_precision: float, generator: torch.Generator | None, num_samples: int) -> LogPredictive:
        phi, logits = inputs
        dtype = torch.promote_types(phi.dtype, torch.float32)
        phi_aug = augment(phi.to(dtype), self._has_bias)
        row_bytes = glm.bytes_per_row(self.hessian, self.link, logits.shape[1], phi_aug.shape[1], num_samples, dtype)
        return glm.chunked_log_predictive(
            phi.shape[0], row_bytes, lambda rows: self.logit_gaussian(phi_aug[rows], logits[rows], prior_precision),
            self.link, num_samples, generator, max_memory=self.max_memory,
        )

    def logit_gaussian(self, phi_aug: Tensor, logits: Tensor, prior_precision: float | None = None) -> glm.LogitGaussian:
        """The Gaussian over logits for head inputs ``phĩ = [phi, 1]`` (see :mod:`posthoc.methods.laplace.glm_predictive`)."""
        delta = float(self.prior_precision) if prior_precision is None else prior_precision
        if self.hessian == "kron":
            return glm.kron_logits(phi_aug, logits, self.out_eigvals, self.out_eigvecs, self.in_eigvals, self.in_eigvecs, delta)
        if self.hessian == "diag":
            return glm.diag_logits(phi_aug, logits, self.diagonal, delta)
        return glm.full_logits(phi_aug, logits, self.eigvals, self.eigvecs, delta)

    def spectrum(self) -> Tensor:
        return ggn_spectrum(
            self.hessian,
            getattr(self, "out_eigvals", None),
            getattr(self, "in_eigvals", None),
            getattr(self, "eigvals", None),
            getattr(self, "diagonal", None),
        )

    def num_posterior_parameters(self) -> int:
        head = self.split.head
        return num_params(head.in_features, head.out_features, self._has_bias)

    def posterior_layers(self) -> list[str]:
        return [self.split.head_name]

    @property
    def _has_bias(self) -> bool:
        return self.split.head.bias is not None

    def _check_head_memory(self) -> None:
        head = self.split.head
        check_memory(self.hessian, head.in_features, head.out_features, head.bias is not None, settings.memory_budget(self.max_memory))
