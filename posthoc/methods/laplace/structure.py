"""The contract of a fitted curvature block: :class:`Curvature`, one subclass per Hessian structure.

A block is the generalised Gauss-Newton (GGN) of one group of parameters in its structure's factored form; with a
prior precision ``δ`` it is the posterior ``N(θ, (GGN + δ I)⁻¹)``: its spectrum (all the evidence needs), weight draws,
a head's Gaussian logits, ``J Σ Jᵀ`` inside a network, and the last-layer GGN batch by batch. Parameters are ordered as
``W.reshape(-1)``; a head's block covers ``[W, b]`` over ``phĩ = [phi, 1]``. A new structure is one subclass and one
entry in :data:`posthoc.methods.laplace.structures.STRUCTURES`.

Example:
    >>> import torch
    >>> from posthoc.methods.laplace.diag import DiagCurvature
    >>> block = DiagCurvature.from_diagonal(torch.ones(3, 5))
    >>> block.spectrum().shape, block.head_variance(torch.ones(2, 5), torch.zeros(2, 3), 1.0).variance()
    (torch.Size([15]), tensor([[2.5000, 2.5000, 2.5000], [2.5000, 2.5000, 2.5000]]))
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor, nn

from posthoc.core.likelihood import LossHessian
from posthoc.engine.random_draws import randn
from posthoc.engine.runner import eigh
from posthoc.errors import NumericalError
from posthoc.methods.laplace.glm_predictive import GaussianLogits

FLOAT64 = torch.float64


class Curvature(nn.Module, metaclass=abc.ABCMeta):
    """A fitted GGN block: buffers named in :attr:`fields` (``None`` until fitted), ``name`` the parameter it covers."""

    #: the buffers holding the fitted state, in the order a saved posterior lists them
    fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str = "") -> None:
        super().__init__()
        self.name = name
        for field in self.fields:
            self.register_buffer(field, None)

    @classmethod
    @abc.abstractmethod
    def from_sums(cls, sums: list[Tensor], count: int, name: str = "") -> Curvature:
        """The block from what BackPACK or hooks summed over ``count`` examples (``[G, Σ_n A_n]``, ...)."""

    @abc.abstractmethod
    def spectrum(self) -> Tensor:
        """All eigenvalues of the (approximate) GGN, flattened (float64)."""

    def sample(
        self, value: Tensor, prior_precision: float, num_samples: int, generator: torch.Generator | None
    ) -> Tensor:
        """``num_samples`` draws ``(S, *value.shape)`` from ``N(value, (GGN + δ I)⁻¹)``, in ``value``'s dtype."""
        dtype = torch.promote_types(value.dtype, torch.float32)
        shape = (num_samples, *value.shape)
        noise = randn(shape, generator=generator, device=value.device, dtype=dtype)
        return (value.to(dtype) + self.correlate(noise, prior_precision).reshape(shape)).to(value.dtype)

    @abc.abstractmethod
    def correlate(self, noise: Tensor, prior_precision: float) -> Tensor:
        """``Σ^½ ε`` for standard normal ``noise`` ``(S, *parameter shape)``: draws of ``N(0, (GGN + δ I)⁻¹)``."""

    def fold_head(self, prior_precision: float, classes: int, width: int) -> nn.Module:
        """The head's posterior folded into buffers: a module giving what :meth:`head_variance` gives."""
        raise NotImplementedError

    @abc.abstractmethod
    def head_variance(self, phi_aug: Tensor, mean: Tensor, prior_precision: float) -> GaussianLogits:
        """The Gaussian logits ``N(mean, J Σ Jᵀ)`` of a linear head with inputs ``phĩ`` ``(n, in)`` (``J = I ⊗ phĩᵀ``)."""

    def head_predictor(self, prior_precision: float, dtype: torch.dtype) -> Callable[[Tensor, Tensor], GaussianLogits]:
        """:meth:`head_variance` at one prior precision for inputs of ``dtype``, called once per row chunk: a structure
        whose prior-dependent factors cost a pass over ``C`` makes them once here."""
        return lambda phi_aug, mean: self.head_variance(phi_aug, mean, prior_precision)

    def head_factors(self, phi_aug: Tensor) -> Tensor:
        """What the logits' variances need of head inputs ``phĩ`` at every prior precision, ``(n, K)``: the inputs
        themselves here; a structure whose variances are ``factors @ table(δ)`` keeps only the factors
        (:meth:`head_spread`), so a ladder of priors costs one small matmul per rung."""
        return phi_aug

    def head_spread(self, prior_precision: float, dtype: torch.dtype) -> Callable[[Tensor, Tensor], Tensor]:
        """``(factors, mean) -> (n, C)``: the diagonal of the logits' covariance at ``prior_precision`` from
        :meth:`head_factors` of inputs of ``dtype``, what the probit link reads of :meth:`head_variance`."""
        predictor = self.head_predictor(prior_precision, dtype)
        return lambda factors, mean: predictor(factors, mean).variance()

    @abc.abstractmethod
    def jacobian_variance(self, g: Tensor, a: Tensor | None, prior_precision: float) -> Tensor:
        """``J Σ Jᵀ`` ``(n, C, C)`` inside a network from the logits' gradients in the layer's output ``g``
        ``(n, C, [T,] out)`` and its inputs ``a`` ``(n, [T,] in)`` (``None`` for a bias): ``J = Σ_t g_c,t a_tᵀ``."""

    @abc.abstractmethod
    def dense(self) -> Tensor:
        """The (approximate) GGN as a dense ``(P, P)`` matrix."""

    @classmethod
    @abc.abstractmethod
    def head_statistics(cls, num_classes: int, width: int, device: torch.device | str) -> dict[str, Tensor]:
        """Zeroed float64 sums that :meth:`accumulate` adds one batch to (``width`` is that of ``phĩ``)."""

    @classmethod
    @abc.abstractmethod
    def accumulate(cls, statistics: dict[str, Tensor], phi_aug: Tensor, hessian: LossHessian) -> None:
        """Add one batch, head inputs ``phĩ`` ``(n, width)`` and the float64 loss Hessians in the outputs, in place."""

    @classmethod
    @abc.abstractmethod
    def from_head_statistics(cls, statistics: dict[str, Tensor], num_data: int, bias: bool) -> Curvature:
        """The fitted block of a head from the summed statistics of ``num_data`` examples."""

    @classmethod
    def check_head_memory(cls, num_classes: int, width: int, budget_bytes: float) -> None:
        """Refuse, before allocating, a head whose block would not fit in ``budget_bytes``."""

    @classmethod
    @abc.abstractmethod
    def head_row_bytes(cls, num_classes: int, width: int, itemsize: int) -> int:
        """Bytes one input row keeps alive at the peak of :meth:`head_variance` (the link's own are apart)."""

    def extra_repr(self) -> str:
        shapes = {
            field: None if getattr(self, field) is None else tuple(getattr(self, field).shape) for field in self.fields
        }
        return ", ".join(f"{field}={shape}" for field, shape in shapes.items())


def non_finite_curvature(what: str) -> NumericalError:
    """The error for a curvature with NaN or inf in it, saying what to try."""
    return NumericalError(
        f"the {what} contains NaN or inf although the inputs are finite: the model's features or logits "
        "overflow, or its weights hold NaN. Check torch.isfinite on model.parameters() and on the model's "
        "output for a training batch; if the model runs in float16/bfloat16, fit in float32 (model.float()); "
        "if the features are huge, normalise the inputs as in training"
    )


def symmetric_eig(matrix: Tensor, what: str) -> tuple[Tensor, Tensor]:
    """Eigenvalues (clamped at 0) and eigenvectors of a PSD matrix; warns on clearly negative curvature."""
    if not torch.isfinite(matrix).all():
        raise non_finite_curvature(what)
    matrix = (matrix + matrix.T) / 2
    try:
        values, vectors = eigh(matrix)
    except RuntimeError:  # eigh did not converge: add and remove a jitter
        jitter = 1e-8 * float(matrix.diagonal().abs().max().clamp_min(1.0))
        values, vectors = eigh(matrix + jitter * torch.eye(matrix.shape[0], dtype=matrix.dtype, device=matrix.device))
        values = values - jitter
    return clamp_curvature(values, what), vectors


def clamp_curvature(values: Tensor, what: str) -> Tensor:
    """Clamp eigenvalues/diagonal entries of a GGN at 0, warning when they were clearly negative."""
    if not torch.isfinite(values).all():
        raise non_finite_curvature(what)
    scale = float(values.abs().max()) if values.numel() else 0.0
    if values.numel() and float(values.min()) < -1e-4 * max(scale, 1e-30):
        warnings.warn(
            f"the {what} has negative curvature (min {float(values.min()):.3g}); a GGN is positive "
            "semi-definite, so this is round-off from ill-conditioned features: clamped to 0",
            RuntimeWarning,
            stacklevel=3,
        )
    return values.clamp_min(0.0)
