"""``"vim"``: virtual-logit matching (Wang et al., CVPR 2022).

The features are centred at ``u = -W^+ b`` (``W``, ``b``: the linear head), their principal space
of dimension ``dim`` is found from ``Sigma = mean_i (phi_i - u)(phi_i - u)^T``, and the norm of the
residual (the part of ``phi - u`` outside that space), scaled by ``alpha``, is a virtual logit. The
score is ``alpha ||(phi - u)^{P-perp}|| - log sum_c exp f_c(x)``, the virtual logit minus the
energy's log-sum-exp, as pytorch-ood's ``ViM`` computes it (larger = more OOD).

``alpha = mean_i max_c f_c(x_i) / mean_i ||(phi_i - u)^{P-perp}||`` over the training data. Fit streams the training
loader once, keeping float64 running sums and, while they fit in ``max_memory``, the features themselves, whose
residual norms follow once the principal space is known; beyond that budget a second pass sums the residual norms.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from posthoc.ood.base import Outputs
    >>> from posthoc.ood.vim import ViM
    >>> head = nn.Linear(64, 3)
    >>> features = torch.randn(64, 64)
    >>> outputs = Outputs(features=features, logits=head(features).detach(), head=head)   # one batch of the model
    >>> score = ViM(dim=32)
    >>> score.update(outputs, None, 0); score.finish(0)
    >>> score(outputs).shape
    torch.Size([64])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posthoc import settings
from posthoc.core import distributed
from posthoc.core.checks import memory_bytes, positive_int
from posthoc.core.options import option
from posthoc.errors import ConfigError
from posthoc.ood.base import Outputs, Score


def default_dim(width: int) -> int:
    """The ViM repository's principal dimension for features of width ``width``."""
    return 1000 if width >= 2048 else 512 if width >= 768 else width // 2


class ViM(Score):
    """Virtual logit from the residual of the features outside their principal space."""

    name, uses, fit_passes = "vim", frozenset({"features", "logits"}), 2

    @dataclass(frozen=True, kw_only=True)
    class Options(Score.Options):
        dim: int | None = option(None, "dimension of the principal space (None: the ViM repository's rule)")
        max_memory: int | None = option(None, "bytes of training features kept to spare a second pass")

    def __init__(self, *, dim: int | None = None, max_memory: int | None = None) -> None:
        self.dim = positive_int(dim, "dim", none="the ViM repository's rule from the feature width")
        self.max_memory = memory_bytes(max_memory)
        super().__init__()

    def reset(self) -> None:
        super().reset()
        self._origin: Tensor | None = None
        self._sums: dict[str, Tensor] = {}
        #: the first pass's features while they fit in max_memory (None once they do not)
        self._kept: list[Tensor] | None = []
        self._kept_bytes = 0

    def _keep(self, features: Tensor) -> None:
        if self._kept is None:
            return
        self._kept_bytes += features.numel() * features.element_size()
        self._kept = None if self._kept_bytes > settings.memory_budget(self.max_memory) else [*self._kept, features]

    def _residual_norms(self, features: Tensor) -> Tensor:
        return ((features.double() - self._origin) @ self.residual_space).norm(dim=-1)

    def _add(self, name: str, value: Tensor) -> None:
        self._sums[name] = self._sums[name] + value if name in self._sums else value

    def update(self, outputs: Outputs, labels: Tensor | None, pass_index: int) -> None:
        features = outputs.features.detach()
        if self._origin is None:
            weight = outputs.head.weight.detach().double()
            bias = outputs.head.bias
            bias = weight.new_zeros(weight.shape[0]) if bias is None else bias.detach().double()
            self._origin = -torch.linalg.pinv(weight) @ bias
        if pass_index == 0:
            centred = features.double() - self._origin
            self._add("gram", centred.T @ centred)
            self._add("count", centred.new_tensor(float(features.shape[0])))
            self._add("max_logit", outputs.logits.detach().double().max(-1).values.sum())
            self._keep(features)
        else:
            self._add("residual_norm", self._residual_norms(features).sum())

    def finish(self, pass_index: int) -> None:
        sums = {name: distributed.all_reduce_sum(value) for name, value in self._sums.items()}
        if pass_index == 0:
            width = sums["gram"].shape[0]
            dim = default_dim(width) if self.dim is None else self.dim
            if not 0 < dim < width:
                raise ConfigError(
                    f"ViM's principal space needs 0 < dim < the feature width {width}, got dim={dim}; "
                    f"pass dim= below {width}"
                )
            _, vectors = torch.linalg.eigh(sums["gram"] / sums["count"])
            self.residual_space = vectors[:, : width - dim]
            self._mean_max_logit = sums["max_logit"] / sums["count"]
            self._count = sums["count"]
            overflowed = distributed.all_reduce_sum(torch.tensor(float(self._kept is None)))
            if overflowed == 0:
                kept_norms = sum(self._residual_norms(features).sum() for features in self._kept)
                self._set_alpha(distributed.all_reduce_sum(kept_norms))
        else:
            self._set_alpha(sums["residual_norm"])
        self._sums, self._kept = {}, None

    def _set_alpha(self, residual_norm_sum: Tensor) -> None:
        self.alpha = self._mean_max_logit / (residual_norm_sum / self._count)
        self.fitted = True

    def __call__(self, outputs: Outputs) -> Tensor:
        self.check_fitted()
        residual = (outputs.features.double() - self._origin) @ self.residual_space
        virtual = self.alpha * residual.norm(dim=-1)
        return (virtual - torch.logsumexp(outputs.logits.double(), dim=-1)).to(outputs.logits.dtype)
