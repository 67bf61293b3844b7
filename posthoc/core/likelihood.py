"""The likelihood seam: one object per likelihood, which every method asks instead of comparing names.

``likelihood=`` takes ``"classification"`` (:class:`Categorical`, the default), ``"regression"`` (:class:`Gaussian`,
an observation noise fitted by maximum likelihood, or fixed with ``Gaussian(noise_std=0.1)``) or ``"heteroscedastic"``
(:class:`HeteroscedasticGaussian`, a model returning a mean and a log-variance per output). Each owns its targets, its
loss and loss Hessian in the model's outputs for the GGN (at unit dispersion; a Gaussian's GGN is then divided by
:attr:`Likelihood.dispersion` ``σ²``), the link to its predictive and that predictive's NLL.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import torch
from torch import Tensor, nn

from posthoc.core.inputs import Inputs, check_labels, iterate, real_values
from posthoc.core.logits import logits_of
from posthoc.core.options import Options as BaseOptions
from posthoc.core.options import build, option
from posthoc.core.prediction import Prediction, RegressionPrediction
from posthoc.core.threads import SMALL_WORK_BYTES, single_thread_if
from posthoc.errors import ConfigError, InputError, NotFittedError

#: how a fitted noise was chosen (the ``noise_source`` buffer holds the index)
NOISE_SOURCES = ("fixed", "held-out", "training", "marglik")
#: golden-section steps of the noise fit in ``log σ`` (the bracket shrinks by 0.618^80, below float64 resolution)
GOLDEN_STEPS = 80
#: golden-section steps of :func:`best_noise_nll` (its ``log σ`` bracket, 9.2 wide, shrinks to 4e-8)
BEST_NOISE_STEPS = 40


class SoftmaxHessian:
    """The softmax cross-entropy's Hessian in the logits, ``H_n = diag(p_n) - p_n p_nᵀ``, per example."""

    def __init__(self, probs: Tensor) -> None:
        self.probs = probs

    def diagonal(self) -> Tensor:
        """``(n, C)``: the diagonal of every ``H_n``."""
        return self.probs * (1 - self.probs)

    def summed(self) -> Tensor:
        """``(C, C)``: ``Σ_n H_n``."""
        return torch.diag(self.probs.sum(0)) - self.probs.T @ self.probs

    def parts(self) -> tuple[Tensor, Tensor | None]:
        """``(d, u)``, each ``(n, C)``, with ``H_n = diag(d_n) - u_n u_nᵀ``."""
        return self.probs, self.probs


class IdentityHessian:
    """A Gaussian likelihood's Hessian in its means at unit noise, ``H_n = I`` (``(1/σ²) I`` after the dispersion)."""

    def __init__(self, rows: int, outputs: int, dtype: torch.dtype, device: torch.device) -> None:
        self.ones = torch.ones(rows, outputs, dtype=dtype, device=device)

    def diagonal(self) -> Tensor:
        return self.ones

    def summed(self) -> Tensor:
        return torch.diag(self.ones.sum(0))

    def parts(self) -> tuple[Tensor, Tensor | None]:
        return self.ones, None


LossHessian = Union[SoftmaxHessian, IdentityHessian, "HeteroscedasticHessian"]


class Likelihood(nn.Module):
    """The likelihood of the targets given the model's outputs (see module docs); subclasses set :attr:`name`."""

    #: the ``likelihood=`` name
    name: ClassVar[str] = ""
    #: what ``um.predict`` returns under this likelihood
    prediction_type: ClassVar[type] = Prediction
    #: whether the likelihood has an observation noise that ``fit`` chooses
    fits_noise: ClassVar[bool] = False
    #: the fewest outputs a model needs under this likelihood (a softmax needs two classes)
    min_outputs: ClassVar[int] = 1
    #: its options (none by default), which ``__init__`` takes as keywords with the same defaults
    Options: ClassVar[type[BaseOptions]] = BaseOptions

    @property
    def dispersion(self) -> float:
        """The GGN is the unit-dispersion one (:meth:`loss_hessian`) divided by this (a Gaussian's ``σ²``)."""
        return 1.0

    def targets(self, y: Tensor | None, outputs: Tensor) -> Tensor:
        """``y`` validated against the model's ``outputs`` for this likelihood."""
        raise NotImplementedError

    def check_width(self, outputs: int) -> None:
        """Refuse (at ``wrap``) a model of ``outputs`` outputs per example that this likelihood cannot read."""

    def hessian_rank(self, outputs: int) -> int:
        """The rank of one example's loss Hessian in ``outputs`` model outputs (the softmax's loses one: ``C - 1``)."""
        return outputs

    def unit_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """The summed negative log-likelihood at unit dispersion, float64 (without a Gaussian's normaliser)."""
        raise NotImplementedError

    def loss_hessian(self, outputs: Tensor) -> LossHessian:
        """The per-example Hessian of the loss in the outputs, at unit dispersion (float64)."""
        raise NotImplementedError

    def nll(self, prediction: Any, y: Tensor) -> Tensor:
        """``(N,)``: the negative log-likelihood of targets ``y`` under ``prediction``."""
        raise NotImplementedError

    def point(self, prediction: Any) -> Tensor:
        """What ``um(x)`` returns: the probabilities, or the predictive mean."""
        raise NotImplementedError

    def config(self) -> dict[str, Any] | None:
        """What the saved spec records to rebuild this likelihood (``None``: classification, recorded by absence)."""
        return {"name": self.name}

    def summary(self) -> dict[str, Any]:
        """What ``fit`` chose, for the model card (``{}`` when nothing)."""
        return {}


class Categorical(Likelihood):
    """The softmax likelihood of class labels: every classification method's, the default."""

    name = "classification"
    min_outputs = 2

    def targets(self, y: Tensor | None, outputs: Tensor) -> Tensor:
        """Class indices ``(N,)`` in ``[0, C)``, one per row of ``outputs`` ``(N, C)``."""
        if isinstance(y, Tensor) and y.dim() > 1 and y.shape[1] > 1:
            raise InputError(
                f"labels have shape {tuple(y.shape)}: this looks like regression or one-hot targets, but the model is "
                "wrapped as a classifier; pass integer class indices of shape (N,), or wrap it with likelihood='regression'"
            )
        labels = check_labels(y, outputs.shape[-1])
        if labels.numel() != outputs.shape[0]:
            raise InputError(
                f"got {labels.numel()} labels for {outputs.shape[0]} inputs; pass one class index per input"
            )
        return labels

    def hessian_rank(self, outputs: int) -> int:
        return outputs - 1

    def unit_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return torch.nn.functional.cross_entropy(outputs.to(torch.float64), targets, reduction="sum")

    def loss_hessian(self, outputs: Tensor) -> SoftmaxHessian:
        return SoftmaxHessian(torch.softmax(outputs.to(torch.float64), dim=-1))

    def nll(self, prediction: Prediction, y: Tensor) -> Tensor:
        labels = check_labels(y, prediction.num_classes).to(prediction.probs.device)
        return -prediction.probs.gather(1, labels[:, None]).squeeze(1).clamp_min(1e-12).log()

    def point(self, prediction: Prediction) -> Tensor:
        return prediction.probs

    def config(self) -> None:
        return None


def real_targets(y: Tensor | None, means: Tensor) -> Tensor:
    """Targets ``(N,)`` or ``(N, D)`` for predicted ``means`` ``(N, D)``, as float64 ``(N, D)`` on their device."""
    if y is None:
        raise InputError("regression needs targets: pass a loader of (x, y) batches with real-valued y")
    y = real_values(y).to(means.device)
    rows, width = means.shape[0], means.shape[-1]
    if y.dim() == 1 and width == 1:
        y = y[:, None]
    if tuple(y.shape) != (rows, width):
        raise InputError(
            f"targets have shape {tuple(y.shape)} but the model predicts {width} output(s) for {rows} inputs; "
            f"pass targets of shape ({rows},) or ({rows}, {width})"
        )
    return y.to(torch.float64)


class RealTargets(Likelihood):
    """What the Gaussian likelihoods share: real targets ``(N,)`` or ``(N, D)``, a :class:`RegressionPrediction`."""

    prediction_type = RegressionPrediction

    def means(self, outputs: Tensor) -> Tensor:
        """The predicted means ``(..., D)`` in the model's ``outputs``."""
        return outputs

    def targets(self, y: Tensor | None, outputs: Tensor) -> Tensor:
        return real_targets(y, self.means(outputs))

    def nll(self, prediction: RegressionPrediction, y: Tensor) -> Tensor:
        return -prediction.log_prob(y)

    def point(self, prediction: RegressionPrediction) -> Tensor:
        return prediction.mean


class Gaussian(RealTargets):
    """A Gaussian observation noise: one standard deviation ``σ`` for every output, or one ``σ_d`` per output.

    The methods with :attr:`posthoc.core.method.Method.per_output_noise` fit one ``σ_d`` per output of a multi-output
    model; the others fit one ``σ`` shared by the outputs (their training loss is scaled by it).

    Example:
        >>> from posthoc.core.likelihood import Gaussian
        >>> Gaussian(noise_std=[0.1, 2.0]).noise_std       # one per output
        tensor([0.1000, 2.0000], dtype=torch.float64)
    """

    name = "regression"
    fits_noise = True

    @dataclass(frozen=True, kw_only=True)
    class Options(BaseOptions):
        noise_std: float | list[float] | tuple[float, ...] | None = option(
            None, "a fixed σ > 0, or one per output; None fits it at fit (Laplace: by the marginal likelihood)"
        )

    def __init__(self, noise_std: float | list[float] | tuple[float, ...] | None = None) -> None:
        super().__init__()
        values = _noise_values(noise_std)
        self.fixed = noise_std is not None
        self.register_buffer("noise_std", torch.tensor(math.nan if values is None else values, dtype=torch.float64))
        self.register_buffer("noise_source", torch.tensor(NOISE_SOURCES.index("fixed") if self.fixed else -1))

    @property
    def per_output(self) -> bool:
        """Whether the noise is a vector of one ``σ_d`` per output (else one ``σ`` for all)."""
        return self.noise_std.dim() > 0

    def check_width(self, outputs: int) -> None:
        """A noise per output needs as many as the model has outputs."""
        if self.per_output and self.noise_std.numel() != outputs:
            raise ConfigError(
                f"noise_std has {self.noise_std.numel()} value(s), one per output, but the model returns "
                f"{outputs} output(s) per example; pass {outputs} values or one float shared by the outputs"
            )

    @property
    def dispersion(self) -> float:
        """``σ²``, the one noise variance of every output (a noise per output with different values is refused)."""
        if self.per_output:
            stds = self.fitted_stds()
            if bool((stds != stds[0]).any()):
                raise ConfigError(
                    f"this computation uses one observation noise for all outputs, but the noise is per "
                    f"output (σ = {[round(v, 4) for v in stds.tolist()]}); fix one shared noise with "
                    "likelihood=posthoc.Gaussian(noise_std=<float>), or use a method that predicts with a "
                    "noise per output (none, last-layer laplace, mc-dropout, ensembles)"
                )
            return float(stds[0]) ** 2
        return self.fitted_std() ** 2

    def fitted_std(self) -> float:
        """``σ``, refusing before it was fitted (a noise per output: its one value, where all are equal)."""
        if self.per_output:
            return math.sqrt(self.dispersion)
        value = float(self.noise_std)
        if math.isnan(value):
            raise NotFittedError(
                "the observation noise of likelihood='regression' is not fitted yet: call "
                "um.fit(train_loader, val_loader) (or fix it with likelihood=posthoc.Gaussian(noise_std=...))"
            )
        return value

    def fitted_stds(self) -> Tensor:
        """``σ`` float64, ``()`` shared or ``(D,)`` per output, refusing before it was fitted."""
        if not bool(torch.isfinite(self.noise_std).all()):
            raise NotFittedError(
                "the observation noise of likelihood='regression' is not fitted yet: call "
                "um.fit(train_loader, val_loader) (or fix it with likelihood=posthoc.Gaussian(noise_std=...))"
            )
        return self.noise_std

    def variances(self, outputs: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The noise variances ``σ²`` broadcasting to ``(..., outputs)``: ``()`` shared, ``(D,)`` per output."""
        if not self.per_output:
            return torch.tensor(self.dispersion, dtype=dtype, device=device)
        stds = self.fitted_stds()
        if stds.numel() != outputs:
            raise InputError(
                f"the observation noise has {stds.numel()} value(s), one per output, but the model predicts "
                f"{outputs} output(s); fit (or fix) the noise for this model's outputs"
            )
        return stds.square().to(device=device, dtype=dtype)

    def unit_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return 0.5 * (outputs.to(torch.float64) - targets).square().sum()

    def loss_hessian(self, outputs: Tensor) -> IdentityHessian:
        return IdentityHessian(outputs.shape[0], outputs.shape[-1], torch.float64, outputs.device)

    def predictive(self, outputs: Tensor, model_variances: Tensor | None = None) -> RegressionPrediction:
        """The predictive of ``K`` components' outputs ``(K, N, D)`` with their model variances (``None``: points)."""
        noise = self.variances(outputs.shape[-1], outputs.dtype, outputs.device)
        return RegressionPrediction.from_components(outputs, model_variances, noise)

    def mean_nll(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """The mean over rows of ``-log N(targets; outputs, σ²)`` (summed over the outputs), differentiable in
        ``outputs`` ``(N, D)``: an ELBO's data term.

        Example:
            >>> import torch
            >>> from posthoc.core.likelihood import Gaussian
            >>> Gaussian(noise_std=1.0).mean_nll(torch.zeros(2, 1), torch.zeros(2, 1))
            tensor(0.9189)
        """
        targets = targets.to(outputs.device, outputs.dtype)
        if self.per_output:
            variances = self.variances(outputs.shape[-1], outputs.dtype, outputs.device)
            return (0.5 * ((targets - outputs).square() / variances).sum(-1)).mean() + 0.5 * (
                2 * math.pi * variances
            ).log().sum()
        variance = self.dispersion
        return (0.5 * (targets - outputs).square().sum(-1) / variance).mean() + 0.5 * targets.shape[-1] * math.log(
            2 * math.pi * variance
        )

    def set_noise(self, std: float | Tensor, source: str) -> None:
        """Record ``σ`` (a float, or one ``σ_d`` per output) and how it was chosen (one of :data:`NOISE_SOURCES`)."""
        if isinstance(std, Tensor) and std.dim() > 0:
            self.noise_std = std.detach().to(device=self.noise_std.device, dtype=torch.float64).clone()
        else:
            if self.per_output:
                self.noise_std = torch.tensor(math.nan, dtype=torch.float64, device=self.noise_std.device)
            self.noise_std.fill_(float(std))
        self.noise_source.fill_(NOISE_SOURCES.index(source))

    def fit_noise(
        self,
        outputs: Tensor,
        model_variances: Tensor | None,
        targets: Tensor,
        source: str = "held-out",
        *,
        per_output: bool = False,
    ) -> None:
        """``σ`` maximising the predictive likelihood of ``targets`` ``(N, D)`` under components ``(K, N, D)``
        (a fixed ``σ`` stays): ``σ² = mean r²`` for one point per example, else a golden-section search in ``log σ``
        on the exact mixture likelihood. ``per_output`` (``D > 1``): each ``σ_d`` fitted on its output's column.

        Example:
            >>> import torch
            >>> from posthoc.core.likelihood import Gaussian
            >>> gaussian, targets = Gaussian(), torch.tensor([[1.0, 3.0], [-1.0, -3.0]])
            >>> gaussian.fit_noise(torch.zeros(1, 2, 2), None, targets, per_output=True)
            >>> gaussian.noise_std
            tensor([1., 3.], dtype=torch.float64)
        """
        if self.fixed:
            return
        if per_output and outputs.shape[-1] > 1:
            with single_thread_if(outputs.device.type == "cpu" and 8 * outputs[..., 0].numel() <= SMALL_WORK_BYTES):
                stds = [
                    self._fitted(
                        outputs[..., d : d + 1],
                        None if model_variances is None else model_variances[..., d : d + 1],
                        targets[..., d : d + 1],
                    )
                    for d in range(outputs.shape[-1])
                ]
            self.set_noise(torch.tensor(stds, dtype=torch.float64), source)
        else:
            self.set_noise(self._fitted(outputs, model_variances, targets), source)

    @staticmethod
    def _fitted(outputs: Tensor, model_variances: Tensor | None, targets: Tensor) -> float:
        """The shared maximum-likelihood ``σ`` of :meth:`fit_noise`, refusing a zero noise."""
        outputs, targets = outputs.to(torch.float64), targets.to(torch.float64)
        residual = (targets - outputs.mean(0)).square().mean().sqrt().item()
        if outputs.shape[0] == 1 and model_variances is None:
            std = residual
        else:
            model = torch.zeros_like(outputs) if model_variances is None else model_variances.to(torch.float64)

            def nll(log_std: float) -> float:
                noise = torch.tensor(math.exp(2 * log_std), dtype=torch.float64, device=outputs.device)
                return -float(RegressionPrediction.from_components(outputs, model, noise).log_prob(targets).sum())

            std = math.exp(
                golden_minimum(
                    nll, math.log(max(residual, 1e-12)) - math.log(1e3), math.log(max(residual, 1e-12)) + math.log(10)
                )
            )
        if not std > 0:
            raise InputError(
                "the model predicts every target exactly, so the observation noise is 0; fix it with "
                "likelihood=posthoc.Gaussian(noise_std=...) or fit on held-out data"
            )
        return std

    def held_out_noise(
        self,
        rows: Rows,
        unit_variance: UnitVariance,
        prior_precision: float,
        *,
        per_output: bool = False,
        elements: int | None = None,
    ) -> float | Tensor:
        """The ``σ`` minimising the NLL of a linearised predictive ``N(f(x), J Σ Jᵀ + σ²)`` on held-out ``rows`` (a
        fixed ``σ`` stays), by golden-section search in ``log σ`` from a tenth to twice the residual RMS. The model
        variance at ``σ`` is ``σ²`` times ``unit_variance`` at prior ``δσ²`` (``(G/σ² + δ)⁻¹ = σ² (G + δσ²)⁻¹``), so
        one posterior serves every ``σ``. ``per_output``: one ``σ_d`` per output, each on its own column.
        ``elements``: the float32 elements one step holds (small work runs on one thread). The likelihood is unchanged.

        Example:
            >>> import torch
            >>> from posthoc.core.likelihood import Gaussian
            >>> rows = [(None, torch.zeros(4, 1), torch.tensor([[1.0], [-1.0], [1.0], [-1.0]]))]
            >>> no_posterior = lambda prepared, outputs, prior: torch.zeros_like(outputs)
            >>> round(Gaussian().held_out_noise(rows, no_posterior, 1.0), 4)          # the residual RMS
            1.0
        """
        if self.fixed:
            return self.fitted_stds() if self.per_output else self.fitted_std()
        small = contextlib.nullcontext if elements is None else _small_work(elements, rows[0][1].device)
        if per_output:
            stds = []
            for d in range(rows[0][1].shape[-1]):
                log_residual = math.log(
                    residual_std([(None, outputs[:, d : d + 1], targets[:, d : d + 1]) for _, outputs, targets in rows])
                )

                def nll(log_std: float, d: int = d) -> float:
                    noise = math.exp(2 * log_std)
                    return sum(
                        float(
                            normal_nll(
                                outputs[:, d : d + 1],
                                noise * unit_variance(prepared, outputs, prior_precision * noise)[:, d : d + 1].double()
                                + noise,
                                targets[:, d : d + 1],
                            ).sum()
                        )
                        for prepared, outputs, targets in rows
                    )

                with small():
                    stds.append(
                        math.exp(
                            golden_minimum(
                                nll, log_residual - math.log(10.0), log_residual + math.log(2.0), steps=NOISE_STEPS
                            )
                        )
                    )
            return torch.tensor(stds, dtype=torch.float64)
        log_residual = math.log(residual_std(rows))
        with small():
            log_std = golden_minimum(
                lambda log_std: sum(
                    float(n.sum()) for n in linearised_nll(rows, unit_variance, prior_precision, math.exp(log_std))
                ),
                log_residual - math.log(10.0),
                log_residual + math.log(2.0),
                steps=NOISE_STEPS,
            )
        return math.exp(log_std)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """A saved noise of another shape (a vector per output, or an older file's one ``σ``) replaces the buffer."""
        saved = state_dict.get(prefix + "noise_std")
        if isinstance(saved, Tensor) and saved.shape != self.noise_std.shape:
            self.noise_std = torch.empty(saved.shape, dtype=torch.float64, device=self.noise_std.device)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def config(self) -> dict[str, Any]:
        if not self.fixed:
            return {"name": self.name, "noise_std": None}
        return {"name": self.name, "noise_std": self.noise_std.tolist() if self.per_output else float(self.noise_std)}

    def summary(self) -> dict[str, Any]:
        source = int(self.noise_source)
        if bool(torch.isnan(self.noise_std).any()):
            return {}
        return {
            "noise_std": self.noise_std.tolist() if self.per_output else float(self.noise_std),
            "noise_fit": NOISE_SOURCES[source] if source >= 0 else "not recorded",
        }


def _noise_values(noise_std: Any) -> float | list[float] | None:
    """``noise_std=`` checked: ``None``, a positive finite float, or a non-empty sequence of them (one per output)."""
    if noise_std is None:
        return None

    def valid(value: Any) -> bool:
        return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf

    if isinstance(noise_std, (list, tuple)) and noise_std and all(valid(v) for v in noise_std):
        return [float(v) for v in noise_std]
    if valid(noise_std):
        return float(noise_std)
    raise ConfigError(
        f"noise_std must be a positive finite float (the observation noise's standard deviation), a list of "
        f"them (one per output) or None to fit it, got {noise_std!r}"
    )


class HeteroscedasticHessian:
    """The Fisher of a Gaussian NLL in its mean ``m`` and log-variance ``s``, per example: ``diag(e^{-s}, ½)``.

    The exact Hessian in ``(m, s)`` has determinant ``-½ r² e^{-2s} < 0`` wherever ``r = y - m ≠ 0``, so a GGN built
    from it need not be PSD; its expectation under ``y ~ N(m, e^s)`` is the Fisher: positive definite and free of the
    targets. Outputs ``(n, 2D)`` (means then log-variances) give the diagonal ``[e^{-s_1} .. e^{-s_D}, ½ .. ½]``.

    Example:
        >>> import torch
        >>> from posthoc.core.likelihood import HeteroscedasticHessian
        >>> HeteroscedasticHessian(torch.tensor([[0.0, 0.0]])).diagonal()
        tensor([[1.0000, 0.5000]], dtype=torch.float64)
    """

    def __init__(self, outputs: Tensor) -> None:
        log_variance = outputs.to(torch.float64)[:, outputs.shape[-1] // 2 :]
        self.weights = torch.cat([(-log_variance).exp(), torch.full_like(log_variance, 0.5)], dim=-1)

    def diagonal(self) -> Tensor:
        """``(n, 2D)``: every ``H_n``, which is diagonal."""
        return self.weights

    def summed(self) -> Tensor:
        """``(2D, 2D)``: ``Σ_n H_n``."""
        return torch.diag(self.weights.sum(0))

    def parts(self) -> tuple[Tensor, Tensor | None]:
        """``(d, None)``: ``H_n = diag(d_n)``, no low-rank part."""
        return self.weights, None


class HeteroscedasticGaussian(RealTargets):
    """A Gaussian whose variance the model predicts: outputs ``(N, 2D)``, means then log-variances per output."""

    name = "heteroscedastic"

    def check_width(self, outputs: int) -> None:
        """An odd number of outputs has no means-then-log-variances split."""
        if outputs % 2:
            raise ConfigError(
                f"likelihood='heteroscedastic' reads outputs (N, 2D), D means then D log-variances; this model "
                f"returns {outputs} output(s) per example. Give it an even number, or use "
                "likelihood='regression' (a fitted noise)"
            )

    def split(self, outputs: Tensor) -> tuple[Tensor, Tensor]:
        """``(means, variances)`` of outputs ``(..., 2D)``."""
        if outputs.shape[-1] % 2:
            raise InputError(
                f"likelihood='heteroscedastic' reads outputs (N, 2D), D means then D log-variances; the model "
                f"returns {outputs.shape[-1]} outputs. Give it an even number, or use likelihood='regression'"
            )
        width = outputs.shape[-1] // 2
        return outputs[..., :width], outputs[..., width:].exp()

    def means(self, outputs: Tensor) -> Tensor:
        return self.split(outputs)[0]

    def unit_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """The summed ``-log N(y; m, e^s) = ½ Σ (s + (y - m)² e^{-s} + log 2π)``, float64 (nothing to divide by).

        Example:
            >>> import torch
            >>> from posthoc.core.likelihood import HeteroscedasticGaussian
            >>> HeteroscedasticGaussian().unit_loss(torch.zeros(2, 2), torch.zeros(2, 1))
            tensor(1.8379, dtype=torch.float64)
        """
        outputs = outputs.to(torch.float64)
        width = outputs.shape[-1] // 2
        means, log_variances = outputs[..., :width], outputs[..., width:]
        return 0.5 * (log_variances + (targets - means).square() * (-log_variances).exp() + math.log(2 * math.pi)).sum()

    def loss_hessian(self, outputs: Tensor) -> HeteroscedasticHessian:
        """The Fisher ``diag(e^{-s}, ½)`` per example (why not the exact Hessian: :class:`HeteroscedasticHessian`)."""
        return HeteroscedasticHessian(outputs)

    def predictive(self, outputs: Tensor, model_variances: Tensor | None = None) -> RegressionPrediction:
        """The predictive of ``K`` components' outputs ``(K, N, 2D)``, each with its own predicted noise."""
        means, noise = self.split(outputs)
        return RegressionPrediction.from_components(means, model_variances, noise)

    def linearised_predictive(self, outputs: Tensor, variances: Tensor) -> RegressionPrediction:
        """The Gaussian matching the moments of ``y`` when the outputs ``(m, s)`` are Gaussian around ``outputs``
        ``(N, 2D)`` with variances ``variances`` ``(N, 2D)`` (the diagonal of a posterior's ``J Σ Jᵀ``).

        ``y = m + e^{s/2} ε`` has mean ``E m`` and variance ``Var m`` (epistemic) ``+ E e^s`` (aleatoric), with
        ``E e^s = exp(s̄ + Var s / 2)`` (the log-normal mean).

        Example:
            >>> import torch
            >>> from posthoc.core.likelihood import HeteroscedasticGaussian
            >>> pred = HeteroscedasticGaussian().linearised_predictive(torch.zeros(1, 2), torch.tensor([[0.5, 2.0]]))
            >>> pred.epistemic, pred.aleatoric           # Var m, exp(0 + 2 / 2)
            (tensor([[0.5000]]), tensor([[2.7183]]))
        """
        means, _ = self.split(outputs)
        width = means.shape[-1]
        log_variances, variances = outputs[..., width:], variances.to(outputs.dtype)
        noise = (log_variances + variances[..., width:] / 2).exp()
        return RegressionPrediction.from_components(means[None], variances[None, ..., :width], noise[None])

    def fit_noise(
        self, outputs: Tensor, model_variances: Tensor | None, targets: Tensor, source: str = "held-out"
    ) -> None:
        """Nothing to fit: the model predicts its noise."""


#: the ``likelihood=`` names
LIKELIHOODS: dict[str, type[Likelihood]] = {cls.name: cls for cls in (Categorical, Gaussian, HeteroscedasticGaussian)}


def make_likelihood(value: str | Likelihood | dict[str, Any] | None) -> Likelihood:
    """A fresh likelihood from a ``likelihood=`` name, an instance (unfitted), or a saved configuration (``None``:
    classification).

    Example:
        >>> from posthoc.core.likelihood import make_likelihood
        >>> make_likelihood("regression").name, make_likelihood({"name": "regression", "noise_std": 0.5}).noise_std
        ('regression', tensor(0.5000, dtype=torch.float64))
    """
    if value is None:
        return Categorical()
    if isinstance(value, Likelihood):
        value = value.config() or {"name": value.name}
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, dict) or value.get("name") not in LIKELIHOODS:
        named = value.get("name") if isinstance(value, dict) else value
        raise ConfigError(
            f"likelihood must be one of {list(LIKELIHOODS)} (or posthoc.Gaussian(noise_std=...)), got {named!r}"
        )
    cls = LIKELIHOODS[value["name"]]
    return build(cls, {key: item for key, item in value.items() if key != "name"}, f"likelihood {value['name']!r}")


#: golden-section steps of :meth:`Gaussian.held_out_noise` (its ``log σ`` bracket, 3.0 wide, shrinks to 3e-5)
NOISE_STEPS = 24

#: held-out batches ``(prepared inputs, outputs (N, D), targets (N, D))`` that a linearised predictive is scored on
Rows = list[tuple[Any, Tensor, Tensor]]

#: the diagonal ``(N, D)`` of a linearised predictive's ``J Σ Jᵀ`` at unit noise: ``(prepared, outputs, prior) -> variance``
UnitVariance = Callable[[Any, Tensor, float], Tensor]


def residual_std(rows: Rows) -> float:
    """The root mean square of ``targets - outputs`` over ``(prepared, outputs, targets)`` rows (at least 1e-12)."""
    squares = sum(float((targets.double() - outputs.double()).square().sum()) for _, outputs, targets in rows)
    values = sum(targets.numel() for _, _, targets in rows)
    return math.sqrt(max(squares / max(values, 1), 1e-24))


def normal_nll(means: Tensor, variances: Tensor, targets: Tensor) -> Tensor:
    """``(N,)``: the float64 NLL of ``targets`` under independent normals per output ``(N, D)``, summed over them."""
    variances = variances.double()
    return 0.5 * ((targets.double() - means.double()).square() / variances + (2 * math.pi * variances).log()).sum(-1)


def linearised_variance(
    unit_variance: UnitVariance, prepared: Any, outputs: Tensor, prior_precision: float, noises: Tensor
) -> Tensor:
    """``(N, D)``: the diagonal of ``J Σ Jᵀ`` under one noise variance ``σ_d²`` per output ``noises`` ``(D,)``.

    The head's GGN ``Λ ⊗ A`` (``Λ = diag(1/σ_d²)``) has output ``d``'s posterior block
    ``(A/σ_d² + δ)⁻¹ = σ_d² (A + δσ_d²)⁻¹``: ``σ_d²`` times the unit-noise one at prior ``δσ_d²``.

    Example:
        >>> import torch
        >>> from posthoc.core.likelihood import linearised_variance
        >>> unit = lambda prepared, outputs, prior: torch.ones_like(outputs) / (1 + prior)
        >>> linearised_variance(unit, None, torch.zeros(1, 2), 1.0, torch.tensor([1.0, 3.0]))
        tensor([[0.5000, 0.7500]], dtype=torch.float64)
    """
    variance = torch.empty_like(outputs, dtype=torch.float64)
    for noise in torch.unique(noises).tolist():
        columns = (noises == noise).nonzero().flatten().to(outputs.device)
        unit = unit_variance(prepared, outputs, prior_precision * noise).double()
        variance[:, columns] = noise * unit[:, columns]
    return variance


def linearised_nll(
    rows: Rows, unit_variance: UnitVariance, prior_precision: float, std: float | Tensor
) -> list[Tensor]:
    """Per batch of ``rows``, the per-example NLL of ``N(f(x), J Σ Jᵀ + σ²)`` (joint over the outputs) at prior ``δ``
    and noise ``σ`` (a float, or one ``σ_d`` per output ``(D,)``; :func:`linearised_variance`)."""
    if isinstance(std, Tensor) and std.dim() > 0:
        return [
            normal_nll(
                outputs,
                linearised_variance(unit_variance, prepared, outputs, prior_precision, std.square()).double()
                + std.square().to(outputs.device),
                targets,
            )
            for prepared, outputs, targets in rows
        ]
    noise = std * std
    return [
        normal_nll(outputs, noise * unit_variance(prepared, outputs, prior_precision * noise).double() + noise, targets)
        for prepared, outputs, targets in rows
    ]


def _small_work(elements: int, device: torch.device) -> Callable[[], Any]:
    """A context on one thread for a block of ``elements`` float32 temporaries, when that is small work on the CPU."""
    return lambda: single_thread_if(device.type == "cpu" and 4 * elements <= SMALL_WORK_BYTES)


def golden_minimum(function: Callable[[float], float], low: float, high: float, steps: int = GOLDEN_STEPS) -> float:
    """The minimiser of a unimodal ``function`` on ``[low, high]`` by golden-section search.

    Example:
        >>> from posthoc.core.likelihood import golden_minimum
        >>> round(golden_minimum(lambda t: (t - 1.0) ** 2, -3.0, 4.0), 6)
        1.0
    """
    ratio = (math.sqrt(5) - 1) / 2
    a, b = low, high
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = function(c), function(d)
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = function(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = function(d)
    return (a + b) / 2


def best_noise_nll(likelihood: Likelihood, outputs: Tensor, targets: Tensor) -> float:
    """The mean of :func:`best_noise_nlls`.

    Example:
        >>> import torch
        >>> from posthoc.core.likelihood import Gaussian, best_noise_nll
        >>> round(best_noise_nll(Gaussian(), torch.zeros(1, 2, 1), torch.tensor([[1.0], [-1.0]])), 4)  # σ = 1
        1.4189
    """
    return float(best_noise_nlls(likelihood, outputs, targets).mean())


def best_noise_nlls(likelihood: Likelihood, outputs: Tensor, targets: Tensor) -> Tensor:
    """Each example's NLL ``(N,)`` under the mixture of ``likelihood``'s Gaussians around ``outputs`` ``(S, N, D)`` at
    the noise ``σ`` of maximum likelihood on ``targets`` ``(N, D)`` (a fixed or predicted noise stays; ``likelihood``
    is unchanged): the held-out score of a sampled predictive's spread, each spread judged at its own best noise."""
    if not isinstance(likelihood, Gaussian) or likelihood.fixed:
        scorer = make_likelihood(likelihood)
        scorer.fit_noise(outputs, None, targets)
        return -scorer.predictive(outputs).log_prob(targets).double()
    squares = (targets.to(torch.float64) - outputs.to(torch.float64)).square()  # (S, N, D)
    width, log_count = squares.shape[2], math.log(squares.shape[0])
    squares = squares.sum(-1)  # (S, N): each component is joint over the D outputs

    def nlls(log_std: float) -> Tensor:
        log_density = (
            torch.logsumexp(-squares / (2 * math.exp(2 * log_std)), dim=0) - log_count
        )  # (N,), without the normaliser
        return -log_density + width * (0.5 * math.log(2 * math.pi) + log_std)

    residual = math.log(
        max(float((targets.to(torch.float64) - outputs.to(torch.float64).mean(0)).square().mean().sqrt()), 1e-12)
    )
    if squares.shape[0] == 1:
        return nlls(residual)
    with single_thread_if(squares.device.type == "cpu" and 8 * squares.numel() <= SMALL_WORK_BYTES):
        return nlls(
            golden_minimum(
                lambda log_std: float(nlls(log_std).mean()),
                residual - math.log(1e3),
                residual + math.log(10),
                steps=BEST_NOISE_STEPS,
            )
        )


def fit_noise_on(
    likelihood: Likelihood,
    loaders: tuple[Iterable | None, Iterable | None],
    device: torch.device,
    components: Callable[[Inputs], tuple[Tensor, Tensor | None]],
    *,
    progress: bool = False,
    per_output: bool = False,
) -> None:
    """Fit ``likelihood``'s noise (if it has one to fit) on the held-out loader, else the training loader:
    ``components(x)`` gives a batch's outputs ``(K, n, D)`` and model variances.

    Example:
        >>> import torch
        >>> from posthoc.core.likelihood import Gaussian, fit_noise_on
        >>> from posthoc_apps.demo.examples import reg_train_loader, reg_val_loader, regressor
        >>> gaussian = Gaussian()
        >>> fit_noise_on(gaussian, (reg_train_loader, reg_val_loader), torch.device("cpu"),
        ...              lambda x: (regressor(x)[None], None))       # the plain regressor: one output, no variance
        >>> float(gaussian.noise_std) > 0
        True
    """
    if not likelihood.fits_noise or likelihood.fixed:
        return
    train_loader, val_loader = loaders
    loader, source = (val_loader, "held-out") if val_loader is not None else (train_loader, "training")
    if loader is None:
        raise InputError(
            "likelihood='regression' fits the observation noise on data: call um.fit(train_loader, val_loader) "
            "(held-out data is best), or fix it with likelihood=posthoc.Gaussian(noise_std=...)"
        )
    outputs, variances, targets = [], [], []
    with torch.no_grad():
        for x, y in iterate(loader, device=device, progress=progress, desc="observation noise"):
            out, variance = components(x)
            targets.append(likelihood.targets(y, out[0]))
            outputs.append(out)
            variances.append(variance)
    model = None if any(v is None for v in variances) else torch.cat(variances, dim=1)
    likelihood.fit_noise(
        torch.cat(outputs, dim=1), model, torch.cat(targets), source, **({"per_output": True} if per_output else {})
    )


def model_outputs(raw: Any) -> Tensor:
    """A regression model's output as ``(N, D)`` (a ``(N,)`` output is one target per example)."""
    outputs = logits_of(raw)
    return outputs[:, None] if outputs.dim() == 1 else outputs
