"""The two iBNN recipes: posthoc's default, and the paper's as published (``recipe="paper"``).

Both fit with BatchNorm statistics re-estimated with the nodes on, ``S = 2`` training samples per example, the KL
weight warmed up from 0 to 1 and the node learning rate annealed 0.2 -> 0.05. Posthoc's differs where the paper's
values were worse on the bundled checkpoints (the reasons and figures: docs/methods/ibnn.md): K=2 instead of 4,
``init_mean_std`` 0.05 instead of 0.5 (a short post-hoc fit cannot pull widely spread means back to the
checkpoint's function), ``prior_std`` 0.1 instead of 0.3, ``lr_weights`` 1e-3 instead of 1e-4, and no nodes on the
stem (the first layer's few input channels act as a global input scale whose fit is volatile).

Example:
    >>> from posthoc.methods.ibnn.recipes import RECIPES
    >>> RECIPES["paper"].init_mean_std
    0.5
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from posthoc.errors import ConfigError


@dataclass(frozen=True)
class Recipe:
    """The node and fit settings of one recipe; any of them can be overridden by name in ``wrap`` / ``fit``."""

    components: int
    prior_std: float
    init_mean_std: float
    init_std: float
    init_std_spread: float
    stem: bool
    epochs: int
    lr_nodes: float
    lr_nodes_final: float
    lr_weights: float
    momentum: float
    weight_decay: float
    beta: float
    kl_warmup: float
    train_samples: int
    batchnorm: str


NODE_SETTINGS = ("components", "prior_std", "init_mean_std", "init_std", "init_std_spread", "stem")

POSTHOC = Recipe(
    components=2,
    prior_std=0.1,
    init_mean_std=0.05,
    init_std=0.05,
    init_std_spread=0.02,
    stem=False,
    epochs=2,
    lr_nodes=0.2,
    lr_nodes_final=0.05,
    lr_weights=1e-3,
    momentum=0.9,
    weight_decay=0.0,
    beta=1.0,
    kl_warmup=0.5,
    train_samples=2,
    batchnorm="train",
)
RECIPES = {
    "posthoc": POSTHOC,
    "paper": replace(POSTHOC, components=4, prior_std=0.3, init_mean_std=0.5, stem=True, lr_weights=1e-4),
}


def recipe(name: str) -> Recipe:
    """The recipe called ``name``, or a :class:`~posthoc.ConfigError` listing them."""
    if name not in RECIPES:
        raise ConfigError(f"recipe must be one of {sorted(RECIPES)}, got {name!r}")
    return RECIPES[name]


def resolve(chosen: Recipe, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with every ``None`` replaced by the recipe's value of that setting.

    Example:
        >>> from posthoc.methods.ibnn.recipes import RECIPES, resolve
        >>> resolve(RECIPES["paper"], {"components": None, "epochs": 5})
        {'components': 4, 'epochs': 5}
    """
    return {name: getattr(chosen, name) if value is None else value for name, value in given.items()}
