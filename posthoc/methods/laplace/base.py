"""``"laplace"``: a Laplace approximation around the checkpoint, with a linearised predictive.

One registered name, two algorithms, chosen at ``wrap()`` by :meth:`Laplace.algorithm`:

- :class:`~posthoc.methods.laplace.last_layer.LastLayerLaplace` (``subset="last_layer"``, the
  default): the head's GGN in closed form from ONE pass over the training data (see
  :mod:`posthoc.methods.laplace.curvature`) and Gaussian logits (:mod:`posthoc.methods.laplace.glm_predictive`):
  ``probit`` (default), ``mc`` samples or the Laplace ``bridge``;
- :class:`~posthoc.methods.laplace.subset.SubsetLaplace` (``subset="all"`` or a list of module
  names): KFAC/diagonal GGN from BackPACK and, when every covered layer is Linear, the same
  logit-space predictive (:mod:`posthoc.methods.laplace.subset_glm`); otherwise, or with
  ``pred="nn"``, weight samples run through the network.

:class:`Laplace` is their common base: the options, the prior precision (tuned by the marginal
likelihood from the GGN spectrum, :mod:`posthoc.methods.laplace.marglik`, or by a validation grid)
and the evidence.

Example:
    >>> um = posthoc.wrap(model, method="laplace", hessian="kron").fit(train_loader)
    >>> type(um.method).__name__, float(um.method.prior_precision) > 0
    ('LastLayerLaplace', True)
    >>> um.predict(x).probs.shape
    torch.Size([8, 10])
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from posthoc.core import distributed
from posthoc.core.checks import memory_bytes, positive_int
from posthoc.core.errors import ConfigError, InputError
from posthoc.core.inputs import Inputs, check_labels, iterate
from posthoc.core.method import LogPredictive, Method
from posthoc.core.modules import eval_mode
from posthoc.core.registry import register
from posthoc.methods.laplace.curvature import STRUCTURES
from posthoc.methods.laplace.glm_predictive import LINKS
from posthoc.methods.laplace.marglik import grid_search, log_marginal_likelihood, optimize_prior_precision

PRIOR_MODES = ("marglik", "grid")
HESSIANS = (*STRUCTURES, "kron-mc")


@register
class Laplace(Method):
    """Laplace approximation of a trained classifier (see module docs).

    Options:
        hessian: ``"kron"`` (KFAC, default), ``"full"`` or ``"diag"`` GGN; for deeper subsets
            ``"kron"`` is BackPACK's exact KFLR, ``"kron-mc"`` its MC-sampled KFAC, ``"diag"`` DiagGGN.
        subset: ``"last_layer"`` (default), ``"all"``, or a list of module names (BackPACK KFAC).
        prior_precision: ``"marglik"`` (default: maximise the Laplace evidence), ``"grid"``
            (lowest validation NLL on a log grid; needs ``val_loader``), or a positive float.
        link: ``"probit"`` (default, deterministic), ``"mc"`` (logit samples) or ``"bridge"``.
        pred: ``"glm"`` (linearised; the default for the last layer and for subsets of Linear
            layers) or ``"nn"`` (weight samples through the network; the default for subsets
            with Conv2d layers).
        num_samples: samples for ``link="mc"`` and ``pred="nn"``.
        head: name of the classifier head, if it cannot be found automatically.
        max_memory: bytes for the posterior matrices and for one chunk of the predictive's
            temporaries (``None``: ``posthoc.settings.max_memory`` at call time).
    """

    name = "laplace"
    demo_configs = (
        ("LLLA kron", {"hessian": "kron"}),
        ("LLLA full", {"hessian": "full"}),
        ("LLLA diag", {"hessian": "diag"}),
    )
    #: set by each algorithm: whether it is the one for ``subset="last_layer"``
    last_layer_only: ClassVar[bool]

    def __init__(
        self,
        model: nn.Module,
        *,
        hessian: str = "kron",
        subset: str | list[str] = "last_layer",
        prior_precision: str | float = "marglik",
        link: str = "probit",
        pred: str | None = None,
        num_samples: int = 100,
        head: str | None = None,
        max_memory: int | None = None,
    ) -> None:
        super().__init__(model)
        _check_options(hessian, subset, prior_precision, link, pred)
        self.hessian, self.subset, self.link, self.pred = hessian, subset, link, pred
        self.prior_mode = prior_precision if isinstance(prior_precision, str) else "fixed"
        self.num_samples = positive_int(num_samples, "num_samples")
        self.max_memory = memory_bytes(max_memory)
        initial = float(prior_precision) if self.prior_mode == "fixed" else 1.0
        self.register_buffer("prior_precision", torch.tensor(initial, dtype=torch.float64))
        self.register_buffer("train_loss", torch.zeros((), dtype=torch.float64))
        self.register_buffer("square_norm", torch.zeros((), dtype=torch.float64))

    @classmethod
    def algorithm(cls, options: dict[str, Any]) -> type[Laplace]:
        """:class:`LastLayerLaplace` for ``subset="last_layer"`` (the default), else :class:`SubsetLaplace`.

        Example:
            >>> Laplace.algorithm({"subset": "all"}).__name__
            'SubsetLaplace'
        """
        last_layer_only = options.get("subset", "last_layer") == "last_layer"
        return next(algorithm for algorithm in Laplace.__subclasses__() if algorithm.last_layer_only == last_layer_only)

    # ----------------------------------------------------------------------------------- fit
    def fit(self, train_loader: Iterable | None, val_loader: Iterable | None = None, *, progress: bool = True) -> None:
        if self.prior_mode == "grid" and val_loader is None:
            raise InputError(
                "prior_precision='grid' picks the prior by validation NLL: call "
                "um.fit(train_loader, val_loader) with held-out data, or use prior_precision='marglik'"
            )
        loss, weights = self._fit_curvature(train_loader, progress)
        self.train_loss.fill_(float(loss))
        self.square_norm.fill_(sum(float(w.detach().double().square().sum()) for w in weights))
        if self.prior_mode == "marglik":
            self.prior_precision.fill_(optimize_prior_precision(self.spectrum(), self.train_loss, self.square_norm))
        elif self.prior_mode == "grid":
            self.prior_precision.fill_(self._grid_prior_precision(val_loader, progress))

    def _fit_curvature(self, train_loader: Iterable, progress: bool) -> tuple[Tensor, list[Tensor]]:
        """Fit the curvature buffers; return the summed training NLL and the weights under the prior."""
        raise NotImplementedError

    def _grid_prior_precision(self, val_loader: Iterable, progress: bool) -> float:
        with torch.no_grad(), eval_mode(self.model):
            cached = [(self._prepare(x), y) for x, y in iterate(val_loader, device=self.device, progress=progress, desc="laplace grid")]

            def validation_nll(prior_precision: float) -> float:
                total, count = 0.0, 0
                generator = torch.Generator(device=self.device).manual_seed(0)
                for inputs, y in cached:
                    log_probs, _ = self._predictive(inputs, prior_precision, generator, self.num_samples)
                    labels = class_labels(y, *log_probs.shape)
                    total += float(torch.nn.functional.nll_loss(log_probs, labels, reduction="sum"))
                    count += labels.numel()
                total, count = distributed.all_reduce_sum(torch.tensor([total, count], dtype=torch.float64)).tolist()
                return total / count

            return grid_search(validation_nll)

    # ------------------------------------------------------------------------------ predict
    def log_predictive(self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None) -> LogPredictive:
        return self._predictive(self._prepare(x), float(self.prior_precision), generator, num_samples or self.num_samples)

    def _prepare(self, x: Inputs) -> Any:
        """What the predictive needs of inputs ``x`` at any prior precision (cached by the grid search)."""
        raise NotImplementedError

    def _predictive(self, inputs: Any, prior_precision: float, generator: torch.Generator | None, num_samples: int) -> LogPredictive:
        """The predictive of prepared ``inputs`` under ``prior_precision``."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------ evidence
    def spectrum(self) -> Tensor:
        """Eigenvalues of the fitted (approximate) GGN, flattened."""
        raise NotImplementedError

    def log_marginal_likelihood(self, prior_precision: float | None = None) -> float:
        """The Laplace log evidence of the fitted posterior at ``prior_precision`` (default: the fitted one)."""
        delta = float(self.prior_precision) if prior_precision is None else prior_precision
        return float(log_marginal_likelihood(self.spectrum(), self.train_loss, self.square_norm, delta))

    def extra_repr(self) -> str:
        return f"hessian={self.hessian!r}, link={self.link!r}, prior_precision={float(self.prior_precision):.4g}"


def class_labels(y: Tensor | None, rows: int, classes: int) -> Tensor:
    """Labels ``y`` validated as ``rows`` class indices in ``[0, classes)``.

    Example:
        >>> class_labels(torch.tensor([2, 0]), 2, 3)
        tensor([2, 0])
    """
    if isinstance(y, Tensor) and y.dim() > 1 and y.shape[1] > 1:
        raise InputError(
            f"labels have shape {tuple(y.shape)}: this looks like regression or one-hot targets, but "
            "the Laplace fit here is for classifiers; pass integer class indices of shape (N,)"
        )
    labels = check_labels(y, classes)
    if labels.numel() != rows:
        raise InputError(f"got {labels.numel()} labels for {rows} inputs; pass one class index per input")
    return labels


def _check_options(hessian: str, subset: str | list[str], prior_precision: str | float, link: str, pred: str | None) -> None:
    if hessian not in HESSIANS:
        raise ConfigError(f"hessian must be one of {HESSIANS}, got {hessian!r}")
    if not (subset in ("last_layer", "all") or (isinstance(subset, (list, tuple)) and subset and all(isinstance(s, str) for s in subset))):
        raise ConfigError(f"subset must be 'last_layer', 'all' or a non-empty list of module names, got {subset!r}")
    if isinstance(prior_precision, str):
        if prior_precision not in PRIOR_MODES:
            raise ConfigError(f"prior_precision must be a positive float or one of {PRIOR_MODES}, got {prior_precision!r}")
    elif isinstance(prior_precision, bool) or not isinstance(prior_precision, (int, float)) or not math.isfinite(prior_precision) or prior_precision <= 0:
        raise ConfigError(
            f"prior_precision must be a positive finite float (a Gaussian prior's precision, like "
            f"weight decay) or one of {PRIOR_MODES}, got {prior_precision!r}"
        )
    if link not in LINKS:
        raise ConfigError(f"link must be one of {LINKS}, got {link!r}")
    if pred not in (None, "glm", "nn"):
        raise ConfigError(f"pred must be 'glm' or 'nn', got {pred!r}")
