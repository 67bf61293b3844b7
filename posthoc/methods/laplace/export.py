"""Last-layer Laplace as a plain module: the GLM predictive of the head with its posterior folded into buffers.

:class:`HeadGaussian` reads the head's input ``phĩ`` from the exported network, hands it to the curvature's folded
posterior (``Curvature.fold_head``, the twin of ``head_variance``) and applies the link with the functions
``um.predict`` uses. The ``mc`` link exports head weights drawn once at export: the logits are linear in the weights,
so each input's samples are its Gaussian logits.

Example:
    >>> import posthoc, torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    >>> x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    >>> um = posthoc.wrap(net, method="laplace", prior_precision=1.0).fit([(x, y)], progress=False)
    >>> torch.allclose(um.to_module()(x[:5]), um.predict(x[:5]).probs, atol=1e-5)
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.logits import log_mean_exp
from posthoc.export.modules import Backbone, cast
from posthoc.methods.laplace import glm_predictive as glm
from posthoc.methods.laplace.curvature import augment


class HeadGaussian(nn.Module):
    """Gaussian logits of a linear head, from the ``folded`` posterior through ``link`` (``"probit"``, ``"bridge"``),
    or from ``weight_samples (S, C, D+1)`` drawn at export (``link="samples"``)."""

    def __init__(
        self,
        backbone: Backbone,
        tap: int,
        bias: bool,
        folded: nn.Module | None,
        link: str,
        weight_samples: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.backbone, self.tap, self.bias, self.folded, self.link = backbone, tap, bias, folded, link
        self.register_buffer("weight_samples", weight_samples)

    def augmented(self) -> Tensor:
        """``phĩ`` of the last call, in at least float32."""
        phi = self.backbone.tapped(self.tap)
        return augment(cast(phi, torch.promote_types(phi.dtype, torch.float32)), self.bias)

    def forward(self, x: Any) -> tuple[Tensor, Tensor | None]:
        raw = self.backbone(x)
        phi_aug = self.augmented()
        if self.weight_samples is not None:
            weights = cast(self.weight_samples, phi_aug.dtype)
            samples = torch.log_softmax(torch.einsum("nd,scd->snc", phi_aug, weights), -1)
            return log_mean_exp(samples), samples
        g = self.folded(phi_aug, cast(raw, phi_aug.dtype))
        return (glm.bridge_log_probs(g) if self.link == "bridge" else glm.probit_log_probs(g)), None

    def unit_variance(self, outputs: Tensor) -> Tensor:
        """``J Σ Jᵀ``'s diagonal ``(N, D)`` for the outputs of the last call (a regression head, per unit noise)."""
        return self.folded(cast(self.augmented(), outputs.dtype), outputs).variance()


def head_weights(head: nn.Linear) -> Tensor:
    """The head's ``[W, b]`` ``(C, D+1)`` (``W`` alone without a bias), as Laplace orders its parameters."""
    weight = head.weight.detach().float()
    return weight if head.bias is None else torch.cat([weight, head.bias.detach().float()[:, None]], 1)
