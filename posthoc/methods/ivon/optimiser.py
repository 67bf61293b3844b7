"""The IVON optimiser from the optional ``ivon-opt`` package (``pip install posthoc[ivon]``).

posthoc imports without it: the package is looked up once, here, and only ``fit`` of
``method="ivon"`` needs it (a saved IVON posterior predicts without it).

Example:
    >>> import torch
    >>> from posthoc.methods.ivon.optimiser import ivon_optimiser
    >>> opt = ivon_optimiser([torch.zeros(3, requires_grad=True)], lr=1e-3, ess=100.0, hess_init=1e-3,
    ...                      weight_decay=1e-4, beta2=0.999, mc_samples=1)
    >>> type(opt).__name__
    'IVON'
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from posthoc.errors import ConfigError

try:
    import ivon as _ivon
except ImportError:  # the optional extra is not installed
    _ivon = None

INSTALL_HINT = "pip install posthoc[ivon]  (or: pip install ivon-opt)"


def ivon_optimiser(
    params: list[Tensor], *, lr: float, ess: float, hess_init: float, weight_decay: float, beta2: float, mc_samples: int
) -> Any:
    """``ivon.IVON`` over ``params`` (one parameter group), or a ConfigError naming the extra to install."""
    if _ivon is None:
        raise ConfigError(f"method 'ivon' needs the ivon-opt package to fit, and it is not installed: {INSTALL_HINT}")
    return _ivon.IVON(
        params, lr=lr, ess=ess, hess_init=hess_init, weight_decay=weight_decay, beta2=beta2, mc_samples=mc_samples
    )
