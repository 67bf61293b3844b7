"""``"sparse-vd"``: sparse variational dropout on a trained network, and pruning by its ``log alpha``.

Molchanov, Ashukha and Vetrov, "Variational Dropout Sparsifies Deep Neural Networks" (ICML 2017), applied post hoc:
every weight of the chosen Linear / Conv2d layers gets a Gaussian ``N(theta, alpha theta^2)`` with the log-uniform
prior (:mod:`~posthoc.methods.sparse_vd.log_alpha`), ``theta`` starting at the checkpoint's weights; ``fit`` maximises
the ELBO (fit options as ``"vi"``'s) with local reparameterisation. Weights whose ``log alpha`` grows past a threshold
carry no information: ``um.sparsity()`` tells how many per layer, ``um.prune()`` returns the pruned plain model
(:mod:`~posthoc.methods.sparse_vd.pruning`). On a small data set the prior's KL outweighs the data and prunes most
weights, at a cost in-distribution; a smaller ``kl_weight`` trades sparsity back for fit (docs/methods/sparse-vd.md).

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, train_loader, x
    >>> um = posthoc.wrap(model, method="sparse-vd").fit(train_loader, epochs=10)
    >>> 0 <= um.sparsity()["total"] <= 1
    True
    >>> small = um.prune(threshold=3.0)                  # a plain nn.Module with those weights at zero
    >>> control = um.prune(random=True, seed=0)          # as many weights per layer, at random
    >>> with um.method.pruned(threshold=3.0):
    ...     pred = um.predict(x, num_samples=200)        # the posterior without the pruned weights
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from posthoc.core.options import option
from posthoc.core.registry import register
from posthoc.engine.variational_method import VariationalMethod
from posthoc.errors import ConfigError
from posthoc.methods.sparse_vd.log_alpha import LogAlphaLayer
from posthoc.methods.sparse_vd.pruning import check_threshold, pruned_copy, removed_weights, restricted, sparsity


@register
class SparseVariationalDropout(VariationalMethod):
    """Sparse variational dropout (Molchanov et al. 2017) with pruning (see module docs)."""

    name = "sparse-vd"
    tools = ("sparsity", "prune")

    @dataclass(frozen=True, kw_only=True)
    class Options(VariationalMethod.Options):
        layers: str | Sequence[str] = option("all", "all (every Linear and Conv2d), head, or module names")
        head: str | None = option(None, "the head's module name for layers='head' where it cannot be found")
        init_log_alpha: float = option(-4.0, "every weight's log alpha at the start (noise std 0.14)")
        threshold: float = option(3.0, "the log alpha above which a weight counts as pruned (the paper's)")
        num_samples: int = option(20, "samples per prediction")
        seed: int = option(0, "seeds the predictive's draws when predict gets no generator")

    def __init__(self, model: nn.Module, options: Options) -> None:
        layers, head, init_log_alpha = options.layers, options.head, options.init_log_alpha
        threshold, num_samples, seed = options.threshold, options.num_samples, options.seed
        if (
            isinstance(init_log_alpha, bool)
            or not isinstance(init_log_alpha, (int, float))
            or not math.isfinite(init_log_alpha)
        ):
            raise ConfigError(f"init_log_alpha must be a finite number (e.g. -4.0), got {init_log_alpha!r}")
        self.init_log_alpha, self.threshold = float(init_log_alpha), check_threshold(threshold)
        super().__init__(model, layers=layers, head=head, num_samples=num_samples, seed=seed)

    def _posterior(self, layer: nn.Module) -> LogAlphaLayer:
        return LogAlphaLayer(layer, init_log_alpha=self.init_log_alpha)

    def sparsity(self, threshold: float | None = None) -> dict[str, Any]:
        """The fraction of weights with ``log alpha > threshold`` (default: the ``threshold`` option),
        per layer and in total, with the counts."""
        self.check_fitted("um.sparsity()")
        return sparsity(removed_weights(self.layers, self.threshold if threshold is None else threshold))

    def prune(
        self, threshold: float | None = None, *, random: bool = False, seed: int = 0, sparse: bool = False
    ) -> nn.Module:
        """A plain ``nn.Module`` copy of the model with the posterior means and the weights over ``threshold`` at zero
        (``random=True``: as many per layer at random, from ``seed``; ``sparse``: :func:`.pruning.pruned_copy`)."""
        self.check_fitted("um.prune()")
        removed = removed_weights(
            self.layers, self.threshold if threshold is None else threshold, random=random, seed=seed
        )
        return pruned_copy(self.model, self.layers, removed, sparse=sparse)

    @contextmanager
    def pruned(self, threshold: float | None = None, *, random: bool = False, seed: int = 0) -> Iterator[None]:
        """Within the context, predictions sample the posterior with the pruned weights removed (as :meth:`prune` picks them)."""
        self.check_fitted("um.method.pruned()")
        removed = removed_weights(
            self.layers, self.threshold if threshold is None else threshold, random=random, seed=seed
        )
        with restricted(self.layers, removed):
            yield

    def summary(self) -> dict[str, Any]:
        """The common card (:meth:`VariationalMethod.summary`) with the threshold and the sparsity at it."""
        return {
            **super().summary(),
            "init_log_alpha": self.init_log_alpha,
            "threshold": self.threshold,
            "sparsity": self.sparsity()["total"],
        }
