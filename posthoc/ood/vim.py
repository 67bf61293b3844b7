"""``"vim"``: virtual-logit matching (Wang et al., CVPR 2022).

The features are centred at ``u = -W^+ b`` (``W``, ``b``: the linear head), their principal space
of dimension ``dim`` is found from ``Sigma = mean_i (phi_i - u)(phi_i - u)^T``, and the norm of the
residual (the part of ``phi - u`` outside that space), scaled by ``alpha``, is a virtual logit. The
score is ``alpha ||(phi - u)^{P-perp}|| - log sum_c exp f_c(x)``, the virtual logit minus the
energy's log-sum-exp, as pytorch-ood's ``ViM`` computes it (larger = more OOD).

``alpha = mean_i max_c f_c(x_i) / mean_i ||(phi_i - u)^{P-perp}||`` over the training data. Fit
streams the training loader twice, keeping running sums only (float64): the Gram matrix ``(D, D)``
and the mean largest logit on the first pass, the mean residual norm on the second; under
``torch.distributed`` each is summed over ranks.

``dim=None`` follows the ViM repository: 1000 for ``D >= 2048``, 512 for ``D >= 768``, else
``D // 2`` (pytorch-ood takes ``d`` explicitly).

Example:
    >>> score = ViM(dim=32)
    >>> for p in range(2): score.update(outputs, None, p); score.finish(p)
    >>> score(outputs).shape
    torch.Size([64])
"""

from __future__ import annotations

import torch
from torch import Tensor

from posthoc.core import distributed
from posthoc.core.checks import positive_int
from posthoc.core.errors import ConfigError
from posthoc.ood.base import Outputs, Score


def default_dim(width: int) -> int:
    """The ViM repository's principal dimension for features of width ``width``."""
    return 1000 if width >= 2048 else 512 if width >= 768 else width // 2


class ViM(Score):
    """Virtual logit from the residual of the features outside their principal space.

    Args:
        dim: dimension of the principal space, below the feature width (``None``: :func:`default_dim`).
    """

    name, uses, fit_passes = "vim", frozenset({"features", "logits"}), 2

    def __init__(self, *, dim: int | None = None) -> None:
        self.dim = positive_int(dim, "dim", none="the ViM repository's rule from the feature width")
        super().__init__()

    def reset(self) -> None:
        super().reset()
        self._origin: Tensor | None = None
        self._sums: dict[str, Tensor] = {}

    def _add(self, name: str, value: Tensor) -> None:
        self._sums[name] = self._sums[name] + value if name in self._sums else value

    def update(self, outputs: Outputs, labels: Tensor | None, pass_index: int) -> None:
        features = outputs.features.detach().double()
        if self._origin is None:
            weight = outputs.head.weight.detach().double()
            bias = outputs.head.bias
            bias = weight.new_zeros(weight.shape[0]) if bias is None else bias.detach().double()
            self._origin = -torch.linalg.pinv(weight) @ bias
        centred = features - self._origin
        if pass_index == 0:
            self._add("gram", centred.T @ centred)
            self._add("count", features.new_tensor(float(features.shape[0])))
            self._add("max_logit", outputs.logits.detach().double().max(-1).values.sum())
        else:
            self._add("residual_norm", (centred @ self.residual_space).norm(dim=-1).sum())

    def finish(self, pass_index: int) -> None:
        sums = {name: distributed.all_reduce_sum(value) for name, value in self._sums.items()}
        if pass_index == 0:
            width = sums["gram"].shape[0]
            dim = default_dim(width) if self.dim is None else self.dim
            if not 0 < dim < width:
                raise ConfigError(f"ViM's principal space needs 0 < dim < the feature width {width}, got dim={dim}; "
                                  f"pass dim= below {width}")
            _, vectors = torch.linalg.eigh(sums["gram"] / sums["count"])
            self.residual_space = vectors[:, : width - dim]
            self._mean_max_logit = sums["max_logit"] / sums["count"]
            self._count = sums["count"]
        else:
            self.alpha = self._mean_max_logit / (sums["residual_norm"] / self._count)
            self.fitted = True
        self._sums = {}

    def __call__(self, outputs: Outputs) -> Tensor:
        self.check_fitted()
        residual = (outputs.features.double() - self._origin) @ self.residual_space
        virtual = self.alpha * residual.norm(dim=-1)
        return (virtual - torch.logsumexp(outputs.logits.double(), dim=-1)).to(outputs.logits.dtype)
