"""``"laplace"``: a Laplace approximation around the checkpoint, with a linearised predictive.

One registered name, two algorithms, chosen at ``wrap()`` by the scope of the posterior (:meth:`Laplace.algorithm`):

- :class:`~posthoc.methods.laplace.last_layer.LastLayerLaplace` (``subset="last_layer"``, the default): the head's
  GGN in closed form from one pass over the training data and Gaussian logits through a link;
- :class:`~posthoc.methods.laplace.subset.SubsetLaplace` (``subset="all"``, module names or ``"lora"``): KFAC or
  diagonal GGN blocks over those layers, with the GLM predictive on Linear layers, else weight samples.

:class:`Laplace` is their common base: the options, the prior precision ``δ``, the evidence, and the fitted
curvature as typed blocks (``blocks``, one :class:`~posthoc.methods.laplace.structure.Curvature` per parameter group).

The prior precision ``δ`` sets how wide the posterior is (docs/methods/laplace.md): ``"auto"`` is ``"val"`` on
``val_loader``, else on up to ``TRAIN_ROWS`` training rows; ``"val"`` is the selection step over
:func:`~posthoc.methods.laplace.prior_search.ladder`; ``"grid"`` the validation-NLL minimiser; ``"marglik"`` the
evidence maximiser (:mod:`~posthoc.methods.laplace.marglik`); a float fixes ``δ``. Under a regression likelihood
``"auto"`` is ``"marglik"`` (prior and noise by the evidence, the noise then re-chosen on held-out NLL), and ``"val"`` /
``"grid"`` score ``N(f(x), J Σ Jᵀ + σ²)`` with each ``δ`` at its own best noise, so a wide posterior is not judged at a
noise fitted for a narrow one (docs/regression.md).

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, train_loader, x
    >>> um = posthoc.wrap(model, method="laplace", hessian="kron").fit(train_loader)
    >>> type(um.method).__name__, float(um.method.prior_precision) > 0
    ('LastLayerLaplace', True)
    >>> um.predict(x).probs.shape
    torch.Size([8, 3])
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from posthoc.core.checks import positive_int
from posthoc.core.inputs import Inputs, batch_size, iterate, slice_inputs
from posthoc.core.knob import Knob
from posthoc.core.likelihood import Likelihood, Rows, linearised_nll, residual_std
from posthoc.core.method import LogPredictive, Method
from posthoc.core.modules import eval_mode, parameter_owners
from posthoc.core.options import option
from posthoc.core.prediction import RegressionPrediction
from posthoc.core.registry import register
from posthoc.engine.held_out import HeldOut, Prepared
from posthoc.engine.runner import gather_rows
from posthoc.engine.selection import Scores, Selection, warn_fallback
from posthoc.errors import ConfigError, InputError
from posthoc.methods.laplace import marglik
from posthoc.methods.laplace.glm_predictive import LINKS
from posthoc.methods.laplace.prior_search import default_grid, grid_search, ladder
from posthoc.methods.laplace.structures import STRUCTURES, VARIANTS
from posthoc.methods.laplace.units import TargetMoments

PRIOR_MODES = ("auto", "val", "grid", "marglik")
HESSIANS = (*STRUCTURES, *VARIANTS)
#: how the fitted prior precision was chosen (the ``prior_source`` buffer holds the index)
PRIOR_SOURCES = ("fixed", "marglik", "val", "grid", "train")
#: rows of the training data the ``"auto"`` rule reads when ``fit`` gets no ``val_loader`` (per process)
TRAIN_ROWS = 4096
#: the class that runs each scope of the posterior, filled by ``class SubsetLaplace(Laplace, scope="subset")``
ALGORITHMS: dict[str, type[Laplace]] = {}


@register
class Laplace(Method, metaclass=abc.ABCMeta):
    """Laplace approximation of a trained model (see module docs); ``Laplace.build(model, **options)`` builds one."""

    name = "laplace"
    #: the fitted curvature, one block per parameter group (made by each algorithm at ``__init__``)
    blocks: nn.ModuleList

    def __init_subclass__(cls, *, scope: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if scope is not None:
            ALGORITHMS[scope] = cls

    def __new__(cls, *args: Any, **kwargs: Any) -> Laplace:  # (model, options); none when copied
        options = args[1] if len(args) > 1 else kwargs.get("options")
        return super().__new__(cls.algorithm(options.as_dict() if options else {}) if cls is Laplace else cls)

    @dataclass(frozen=True, kw_only=True)
    class Options(Method.Options):
        hessian: Literal[HESSIANS] = option(
            "kron",
            "the GGN's structure; deeper subsets: kron = exact KFLR, kron-mc = KFAC; kron-diag: a head's KFAC with a "
            "diagonal output factor (what kron is above 4,096 classes)",
        )
        subset: Literal["last_layer", "all", "lora"] | list[str] = option(
            "last_layer", "the weights under the posterior: module names, or lora (a peft model's adapters)"
        )
        prior_precision: Literal[PRIOR_MODES] | float = option(
            "auto", "auto: val with a val_loader, else on training rows; grid: lowest val NLL; marglik: the evidence"
        )
        link: Literal[LINKS] = option("probit", "the predictive's link: probit (deterministic), mc samples, bridge")
        pred: Literal["glm", "nn"] | None = option(
            None, "glm (linearised; default on Linear layers) or nn (weight samples; default with Conv2d)"
        )
        num_samples: int = option(100, "samples for link='mc' and pred='nn'")
        head: str | None = option(None, "the classifier head's name, if it cannot be found")

        def __post_init__(self) -> None:
            subset, prior_precision = self.subset, self.prior_precision
            if not (
                subset in ("last_layer", "all", "lora")
                or (isinstance(subset, (list, tuple)) and subset and all(isinstance(s, str) for s in subset))
            ):
                raise ConfigError(
                    f"subset must be 'last_layer', 'all', 'lora' or a non-empty list of module names, got {subset!r}"
                )
            if isinstance(prior_precision, str):
                if prior_precision not in PRIOR_MODES:
                    raise ConfigError(
                        f"prior_precision must be a positive float or one of {PRIOR_MODES}, got {prior_precision!r}"
                    )
            elif (
                isinstance(prior_precision, bool)
                or not isinstance(prior_precision, (int, float))
                or not math.isfinite(prior_precision)
                or prior_precision <= 0
            ):
                raise ConfigError(
                    f"prior_precision must be a positive finite float (a Gaussian prior's precision, like "
                    f"weight decay) or one of {PRIOR_MODES}, got {prior_precision!r}"
                )
            if self.pred not in (None, "glm", "nn"):
                raise ConfigError(f"pred must be 'glm' or 'nn', got {self.pred!r}")
            super().__post_init__()  # hessian, link

    def __init__(self, model: nn.Module, options: Options) -> None:
        super().__init__(model)  # ``options.head``: the algorithm's (it finds the head)
        self.hessian, self.subset, self.link, self.pred = options.hessian, options.subset, options.link, options.pred
        prior_precision = options.prior_precision
        self.prior_mode = prior_precision if isinstance(prior_precision, str) else "fixed"
        #: the decade of the targets' spread the prior is searched in, set at fit (:meth:`_target_scale`)
        self._scale = 1.0
        self.num_samples = positive_int(options.num_samples, "num_samples")
        initial = float(prior_precision) if self.prior_mode == "fixed" else 1.0
        self.register_buffer("prior_precision", torch.tensor(initial, dtype=torch.float64))
        self.register_buffer("train_loss", torch.zeros((), dtype=torch.float64))
        self.register_buffer("square_norm", torch.zeros((), dtype=torch.float64))
        self.register_buffer("num_data", torch.zeros((), dtype=torch.int64))
        self.register_buffer(
            "prior_source", torch.tensor(PRIOR_SOURCES.index("fixed") if self.prior_mode == "fixed" else -1)
        )

    def use_likelihood(self, likelihood: Likelihood) -> None:
        """As :meth:`Method.use_likelihood`; under a regression likelihood ``"auto"`` is ``"marglik"``."""
        super().use_likelihood(likelihood)
        if self._predicts_noise:
            if self.link == "bridge":
                raise ConfigError(
                    f"link='bridge' maps Gaussian logits to class probabilities; under likelihood="
                    f"{likelihood.name!r} use link='probit' (the default: the moment-matched Gaussian "
                    "predictive) or link='mc' (the mixture over sampled means and log-variances)"
                )
            if self.prior_mode == "auto":  # a predicted noise: the evidence, as for a fitted one (module docs)
                self.prior_mode = "marglik"
        if likelihood.fits_noise:
            if self.prior_mode in ("val", "grid") and not self.scores_gaussian_held_out:
                raise ConfigError(
                    f"prior_precision={self.prior_mode!r} scores the prior on the held-out NLL of the GLM "
                    f"predictive, which pred={self.pred!r} does not have under likelihood={likelihood.name!r}: "
                    "use pred='glm' (Linear layers) for the held-out rules, or prior_precision='auto' "
                    "(= 'marglik') or a float"
                )
            if self.prior_mode == "auto":
                self.prior_mode = "marglik"

    @property
    def _predicts_noise(self) -> bool:
        """Whether the model predicts its own noise (``likelihood="heteroscedastic"``: real targets, no noise to fit)."""
        return self.likelihood.prediction_type is RegressionPrediction and not self.likelihood.fits_noise

    @property
    def scores_gaussian_held_out(self) -> bool:
        """Whether the predictive is the GLM one, whose Gaussian NLL the held-out choices score under regression."""
        return self.pred == "glm"

    @classmethod
    def algorithm(cls, options: dict[str, Any]) -> type[Laplace]:
        """:class:`LastLayerLaplace` for ``subset="last_layer"`` (the default), else :class:`SubsetLaplace`.

        Example:
            >>> from posthoc.methods.laplace.base import Laplace
            >>> Laplace.algorithm({"subset": "all"}).__name__
            'SubsetLaplace'
        """
        return ALGORITHMS["last_layer" if options.get("subset", "last_layer") == "last_layer" else "subset"]

    def fit(self, train_loader: Iterable | None, val_loader: Iterable | None = None, *, progress: bool = True) -> None:
        """The curvature, and what the training data alone decide; what held-out data decide is the :meth:`knob`'s."""
        if self.prior_mode in ("val", "grid") and val_loader is None:
            raise InputError(
                f"prior_precision={self.prior_mode!r} picks the prior by validation NLL: call "
                "um.fit(train_loader, val_loader) with held-out data, or use prior_precision='auto' "
                "(the training data stands in) or 'marglik'"
            )
        moments = TargetMoments(train_loader) if self.likelihood.fits_noise else None
        loss, weights = self._fit_curvature(train_loader if moments is None else moments, progress)
        self.train_loss.fill_(float(loss))
        self.square_norm.fill_(sum(float(w.detach().double().square().sum()) for w in weights))
        self._scale = self._target_scale(moments)
        source = self._source(val_loader is not None)
        if self.likelihood.fits_noise and source not in ("val", "grid"):
            self._fit_noise_by_evidence(fixed_prior=source == "fixed")
            if (
                val_loader is None
                and not self.likelihood.fixed
                and self.scores_gaussian_held_out
                and self._per_output(self.target_values() // max(int(self.num_data), 1))
            ):
                with torch.no_grad(), eval_mode(self.model):  # no held-out data: one σ_d per output on training rows
                    rows = self._regression_rows(train_loader, TRAIN_ROWS, progress)
                    self.likelihood.set_noise(self._held_out_noise(rows, float(self.prior_precision)), "training")
        elif source == "marglik":
            self.prior_precision.fill_(
                marglik.optimize_prior_precision(self.spectrum(), self.train_loss, self.square_norm)
            )
        self.prior_source.fill_(PRIOR_SOURCES.index(source))

    def _source(self, has_val: bool) -> str:
        """How the prior precision is chosen: ``"auto"`` is ``"val"`` with held-out data, else ``"train"``."""
        return {"auto": "val" if has_val else "train"}.get(self.prior_mode, self.prior_mode)

    def knob(self) -> Knob | None:
        """The prior precision, or under a regression likelihood the noise, chosen on held-out data."""
        if not (
            self.prior_mode in ("val", "grid")
            or (self.prior_mode == "auto" and not self.likelihood.fits_noise)
            or self._chooses_noise
        ):
            return None
        return Knob(
            name="prior_precision",
            choose=self._choose,
            apply=lambda value: self.prior_precision.fill_(float(value)),
            movable=True,
            training_rows=self._training_rows,
        )

    def _training_rows(self, train_loader: Iterable | None) -> Iterable | None:
        """Without a ``val_loader``, ``"auto"`` chooses on the first :meth:`_stand_in_rows` training rows (per process)."""
        if self._source(False) != "train" or self.likelihood.fits_noise or train_loader is None:
            return None
        return first_rows(train_loader, self._stand_in_rows(), self.device)

    def _stand_in_rows(self) -> int:
        """How many training rows stand in for a missing ``val_loader``: ``TRAIN_ROWS``."""
        return TRAIN_ROWS

    @property
    def _chooses_noise(self) -> bool:
        """Whether held-out data re-choose the observation noise (:meth:`_fit_noise_on_held_out`)."""
        return self.likelihood.fits_noise and not self.likelihood.fixed and self.scores_gaussian_held_out

    def _choose(self, held_out: HeldOut, train_loader: Iterable | None, progress: bool) -> Selection | None:
        """The prior precision on ``held_out`` (module docs), or only the noise; the selection made, if any."""
        source = "train" if held_out.from_training_data else self._source(True)
        if self.likelihood.fits_noise and source not in ("val", "grid"):
            if self._chooses_noise:
                with torch.no_grad(), eval_mode(self.model):
                    self._fit_noise_on_held_out(
                        list(held_out.clean()), fixed_prior=source == "fixed", progress=progress
                    )
            return None
        if source not in ("val", "grid", "train") or (self.likelihood.fits_noise and not self.scores_gaussian_held_out):
            return None
        selection = None
        with torch.no_grad(), eval_mode(self.model):
            if self.likelihood.fits_noise:
                rows = self._regression_rows(list(held_out.clean()), None, progress)
                score = lambda delta: Scores(
                    gather_rows(torch.cat(self._gaussian_nll(rows, delta, self._held_out_noise(rows, delta))))
                )
            elif self._predicts_noise:  # the predictive's own NLL
                rows = self._regression_rows(list(held_out.clean()), None, progress)
                score = lambda delta: Scores(gather_rows(torch.cat(self._predicted_noise_nll(rows, delta))))
            else:
                score = self._ladder_scores(held_out)
            if source == "grid":
                self.prior_precision.fill_(grid_search(lambda delta: score(delta).nll, default_grid(scale=self._scale)))
            else:
                candidates = ladder(scale=self._scale)
                selection = held_out.select(
                    [(f"{delta:.3g}", delta) for delta in candidates],
                    lambda index: score(candidates[index]),
                    knob="prior_precision",
                    walk=True,
                )
                warn_fallback(
                    selection,
                    method="Laplace",
                    fallback=f"the narrowest posterior (prior precision {candidates[0]:g}, nearly the checkpoint)",
                    advice="Raise tolerance, or pass a fixed prior_precision",
                    stacklevel=5,
                )
                self.prior_precision.fill_(selection.value)
            if self.likelihood.fits_noise and not self.likelihood.fixed:
                self.likelihood.set_noise(self._held_out_noise(rows, float(self.prior_precision)), "held-out")
        self.prior_source.fill_(PRIOR_SOURCES.index(source))
        return selection

    def _ladder_scores(self, held_out: HeldOut) -> Callable[[float], Scores]:
        """``δ -> Scores`` of the class predictive on ``held_out``: a predict per rung, from prepared batches."""
        prepared = held_out.prepared(self._prepare)
        return lambda delta: self._scores(prepared, delta)

    def _scores(self, prepared: Prepared, prior_precision: float) -> Scores:
        """The held-out :class:`Scores` of the class predictive at ``prior_precision`` (MC links: the same draws at every δ)."""
        return prepared.scores(
            lambda inputs, generator: self._predictive(inputs, prior_precision, generator, self.num_samples)[0],
            device=self.device,
        )

    def _target_scale(self, moments: TargetMoments | None) -> float:
        """The decade of the training targets' spread the prior is searched in (1 for class labels)."""
        if moments is None:
            return 1.0
        if not self.likelihood.fixed and not float(self.train_loss) > 0:
            raise InputError(
                "the model predicts every training target exactly, so the observation noise is 0; fix it "
                "with likelihood=posthoc.Gaussian(noise_std=...) or fit on data the model was not trained on"
            )
        return moments.decade()

    def _evidence_optimum(self, prior_precision: float | None, noise_std: float | None) -> tuple[float, float]:
        """``(δ, σ)`` maximising the evidence, a given one kept."""
        self._settle()
        return marglik.optimize_noise_and_prior(
            torch.cat([block.spectrum() for block in self.blocks]),
            float(self.train_loss),
            self.target_values(),
            float(self.square_norm),
            prior_precision=prior_precision,
            noise_std=noise_std,
            scale=self._scale,
        )

    def _fit_noise_by_evidence(self, fixed_prior: bool) -> None:
        """The noise and the prior precision (each unless fixed) maximising the evidence."""
        likelihood = self.likelihood
        delta, std = self._evidence_optimum(
            float(self.prior_precision) if fixed_prior else None, self._evidence_noise() if likelihood.fixed else None
        )
        self.prior_precision.fill_(delta)
        if not likelihood.fixed:
            likelihood.set_noise(std, "marglik")

    def _evidence_noise(self) -> float:
        """The fixed ``σ`` the evidence reads: one shared, or the root mean square of a fixed noise per output."""
        stds = self.likelihood.fitted_stds()
        return float(stds.square().mean().sqrt()) if stds.dim() else float(stds)

    def _fit_noise_on_held_out(self, val_loader: Iterable, *, fixed_prior: bool, progress: bool) -> None:
        """The prior maximising the evidence at the held-out residuals' ``σ`` (unless fixed), then the ``σ`` of
        lowest held-out NLL of the GLM predictive at that prior: the evidence reads only the training data, which a
        trained network fits more closely than new data, and so under-states ``σ``."""
        if not self.scores_gaussian_held_out:
            return
        rows = self._regression_rows(val_loader, TRAIN_ROWS, progress)
        self._settle()
        if not fixed_prior:
            self.prior_precision.fill_(self._evidence_optimum(None, residual_std(rows))[0])
        self.likelihood.set_noise(self._held_out_noise(rows, float(self.prior_precision)), "held-out")

    def _regression_rows(self, loader: Iterable, rows: int | None, progress: bool) -> Rows:
        """``(prepared, outputs (N, D), targets (N, D))`` batches of ``loader``'s first ``rows`` rows."""
        raise ConfigError(f"{type(self).__name__} does not score a Gaussian predictive on held-out data")

    def _unit_variance(self, prepared: Any, outputs: Tensor, prior_precision: float) -> Tensor:
        """``(N, D)``: the diagonal of ``J Σ Jᵀ`` at unit noise and prior precision ``prior_precision`` (so at noise
        ``σ`` and prior ``δ`` the model variance is ``σ²`` times it at ``δ σ²``, as ``(G/σ² + δ)⁻¹ = σ² (G + δσ²)⁻¹``)."""
        raise ConfigError(f"{type(self).__name__} does not score a Gaussian predictive on held-out data")

    def _predicted_noise_nll(self, rows: Rows, prior_precision: float) -> list[Tensor]:
        """Per batch of ``rows``, the per-example NLL at ``prior_precision`` under ``"heteroscedastic"``."""
        raise ConfigError(f"{type(self).__name__} does not score a heteroscedastic predictive on held-out data")

    def _noise_search_elements(self, rows: Rows) -> int | None:
        """Float32 elements one step of the noise search holds where it is small dense work, else ``None``."""
        return None

    def _per_output(self, outputs: int) -> bool:
        """Whether the noise is one ``σ_d`` per output: an algorithm with :attr:`per_output_noise` and several outputs."""
        return self.per_output_noise and outputs > 1 and self.likelihood.fits_noise

    def _held_out_noise(self, rows: Rows, prior_precision: float) -> float | Tensor:
        """The likelihood's held-out noise under the GLM predictive at ``prior_precision``."""
        return self.likelihood.held_out_noise(
            rows,
            self._unit_variance,
            prior_precision,
            per_output=self._per_output(rows[0][1].shape[-1]),
            elements=self._noise_search_elements(rows),
        )

    def _gaussian_nll(self, rows: Rows, prior_precision: float, std: float | Tensor) -> list[Tensor]:
        """Per batch of ``rows``, the per-example NLL of ``N(f(x), J Σ Jᵀ + σ²)`` at ``δ``, ``σ``."""
        return linearised_nll(rows, self._unit_variance, prior_precision, std)

    def target_values(self) -> int:
        """How many target values the fit saw (examples times outputs): a Gaussian NLL's normaliser counts them."""
        return int(self.num_data)

    @abc.abstractmethod
    def _fit_curvature(self, train_loader: Iterable, progress: bool) -> tuple[Tensor, list[Tensor]]:
        """Fit ``blocks`` and ``num_data``; return the summed training NLL and the weights under the prior."""

    def log_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> LogPredictive:
        """The predictive of ``x`` at the fitted prior precision (its chunks planned under the runner's budget)."""
        self._settle()
        return self._predictive(
            self._prepare(x), float(self.prior_precision), generator, num_samples or self.num_samples
        )

    @abc.abstractmethod
    def _prepare(self, x: Inputs) -> Any:
        """What the predictive needs of inputs ``x`` at any prior precision (cached by the grid search)."""

    @abc.abstractmethod
    def _predictive(
        self, inputs: Any, prior_precision: float, generator: torch.Generator | None, num_samples: int
    ) -> LogPredictive:
        """The predictive of prepared ``inputs`` under ``prior_precision``, in chunks under the memory budget."""

    def _settle(self) -> None:
        """Move curvature loaded under flat buffer names (``p0_diagonal``) into its block, on the model's device."""
        for key, (index, field) in self._flat_names().items():
            if self._buffers.get(key) is not None:
                setattr(self.blocks[index], field, self._buffers[key])
                self._buffers[key] = None
        device = self.device
        for block in self.blocks:
            for name, value in block._buffers.items():
                if value is not None and value.device != device:
                    block._buffers[name] = value.to(device)

    def _flat_names(self) -> dict[str, tuple[int, str]]:
        """The flat buffer names that saved posteriors may hold the curvature under: ``name -> (block, field)``."""
        return {}

    def _accept_flat_names(self) -> None:
        """Empty buffers under :meth:`_flat_names`, so that a file holding them loads (see :meth:`_settle`)."""
        for key in self._flat_names():
            self.register_buffer(key, None)

    def spectrum(self) -> Tensor:
        """Eigenvalues of the fitted (approximate) GGN, flattened (divided by the likelihood's dispersion, a Gaussian's ``σ²``)."""
        self._settle()
        spectrum = torch.cat([block.spectrum() for block in self.blocks])
        return spectrum if not self.likelihood.fits_noise else spectrum / self.likelihood.dispersion

    def log_marginal_likelihood(self, prior_precision: float | None = None) -> float:
        """The Laplace log evidence of the fitted posterior at ``prior_precision`` (default: the fitted one)."""
        delta = float(self.prior_precision) if prior_precision is None else prior_precision
        loss = self.train_loss
        if self.likelihood.fits_noise:
            loss = marglik.gaussian_nll(float(self.train_loss), self.target_values(), self.likelihood.fitted_std())
        return float(marglik.log_marginal_likelihood(self.spectrum(), loss, self.square_norm, delta))

    def summary(self) -> dict[str, Any]:
        """The posterior for the model card: parameters under it, curvature, layers, δ and how it was chosen.

        Example:
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import model, train_loader, val_loader
            >>> card = posthoc.wrap(model, method="laplace").fit(train_loader, val_loader).method.summary()
            >>> card["random_variables"], card["hessian"], card["prior_fit"]
            (195, 'kron', 'val')
        """
        source = int(self.prior_source)
        return {
            "random_variables": self.num_posterior_parameters(),
            "layers": self.posterior_layers(),
            "hessian": self.hessian,
            "predictive": self.pred,
            "link": self.link if self.link == "mc" or not self._predicts_noise else "moment-matched",
            "prior_precision": float(self.prior_precision),
            "prior_fit": PRIOR_SOURCES[source] if source >= 0 else "not recorded",
            "fit_examples": int(self.num_data),
        }

    @abc.abstractmethod
    def posterior_parameters(self) -> list[str]:
        """Qualified names of the parameters the Gaussian posterior covers."""

    def num_posterior_parameters(self) -> int:
        """How many parameters the Gaussian posterior covers."""
        params = dict(self.model.named_parameters())
        return sum(params[name].numel() for name in self.posterior_parameters())

    def posterior_layers(self) -> list[str]:
        """Names of the modules whose parameters the posterior covers."""
        return list(parameter_owners(self.model, self.posterior_parameters()))

    def extra_repr(self) -> str:
        return f"hessian={self.hessian!r}, link={self.link!r}, prior_precision={float(self.prior_precision):.4g}"


def first_rows(loader: Iterable, rows: int, device: torch.device) -> list[tuple[Inputs, Tensor]]:
    """The first batches of ``loader`` holding ``rows`` examples (the last one cut to fit), labelled.

    Example:
        >>> import torch
        >>> from posthoc.methods.laplace.base import first_rows
        >>> [len(y) for _, y in first_rows([(torch.zeros(3, 2), torch.zeros(3))] * 3, 5, torch.device("cpu"))]
        [3, 2]
    """
    kept, seen = [], 0
    for x, y in iterate(loader, device=device, progress=False, desc="laplace prior"):
        take = min(batch_size(x), rows - seen)
        kept.append((slice_inputs(x, 0, take), y[:take]))
        seen += take
        if seen >= rows:
            break
    return kept
