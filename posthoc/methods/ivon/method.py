"""``"ivon"``: a short fine-tune with the IVON optimiser, samples from its Gaussian at predict time.

IVON (Shen et al., 2024, "Variational Learning is Effective for Large Deep Networks") is an Adam-like optimiser that
learns a diagonal Gaussian posterior ``N(m, diag(1 / (ess * (h + wd))))``: ``m`` the weights it trains, ``h`` its
running estimate of the loss Hessian's diagonal, ``ess`` the effective sample size and ``wd`` its weight decay. ``fit``
runs it from the checkpoint (the optional ``ivon-opt`` package, ``pip install posthoc[ivon]``) on private copies
(:mod:`posthoc.engine.private_weights`), on every trainable weight (``layers="all"``, the copy's BatchNorm statistics
kept with the posterior) or on the head over the backbone's features (``"head"``, all sampled heads in one batched
matmul). With a ``val_loader`` the spread is chosen on it (:mod:`~posthoc.methods.ivon.scale`). Under
``likelihood="regression"`` the fine-tune minimises the Gaussian NLL at the plain model's held-out noise (IVON starting
from ``hess_init / σ²``). The posterior is plain buffers, so a saved one predicts without ``ivon-opt``; sample ``s`` is
``mean + std * z_s``, ``z_s`` the ``s``-th draw of ``randn(P)`` as ``IVON.sampled_params`` draws.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, train_loader, x
    >>> um = posthoc.wrap(model, method="ivon").fit(train_loader)
    >>> um.predict(x).samples.shape
    torch.Size([20, 8, 3])
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core.checks import fraction, integer, non_negative, positive_int, positive_number
from posthoc.core.inputs import Inputs
from posthoc.core.knob import Knob
from posthoc.core.likelihood import Categorical, Gaussian
from posthoc.core.method import SAMPLES_NETWORKS, LogPredictive, Method
from posthoc.core.modules import eval_mode, parameter_owners
from posthoc.core.options import option
from posthoc.core.registry import register
from posthoc.engine.fine_tune import Step, backward, fine_tune
from posthoc.engine.head import FeatureSplit
from posthoc.engine.objective import fit_plain_noise, fit_sampled_noise
from posthoc.engine.private_weights import PrivateWeights, check_layers, sample_names, trained_names, unflatten
from posthoc.engine.random_draws import randn
from posthoc.engine.weight_samples import head_log_predictive, head_outputs, state_log_predictive, state_outputs
from posthoc.methods.ivon.optimiser import ivon_optimiser
from posthoc.methods.ivon.scale import SCALES

#: the fit options saved in the ``schedule`` buffer, in its order
SCHEDULE = ("epochs", "lr", "ess", "hess_init", "weight_decay", "beta2", "mc_samples", "steps")


@register
class IVON(Method):
    """IVON (Shen et al., 2024): variational fine-tuning from the checkpoint, Gaussian samples at predict. The fit
    options' defaults suit a short fine-tune: IVON's own ``hess_init=1`` costs in-distribution NLL, and its
    ``beta2=0.99999`` averages the Hessian over far more steps than a fine-tune takes."""

    name = "ivon"
    export_refusal = SAMPLES_NETWORKS
    likelihoods = (Categorical, Gaussian)

    @dataclass(frozen=True, kw_only=True)
    class Options(Method.Options):
        layers: str = option("all", "all (every trainable weight) or head (the classifier head only)")
        num_samples: int = option(20, "weight samples per prediction")
        scale: float | None = option(
            None, "multiplies the posterior std at predict; None: chosen on val_loader, else 1 without one"
        )
        head: str | None = option(None, "the head's module name when it cannot be found automatically")
        seed: int = option(0, "seeds the fine-tune and the default predictive generator")

    def __init__(self, model: nn.Module, options: Options) -> None:
        layers, scale = options.layers, options.scale
        super().__init__(model)
        self.layers = check_layers(layers)
        if scale is not None:
            non_negative(scale, "scale")
        #: ``None``: chosen on ``fit``'s ``val_loader`` (:meth:`choose`), else 1 without one
        self.scale_option = None if scale is None else float(scale)
        self.scale = 1.0 if scale is None else float(scale)
        self.num_samples = positive_int(options.num_samples, "num_samples")
        self.seed = integer(options.seed, "seed")
        self.split = FeatureSplit(model, options.head) if layers == "head" else None
        #: the posterior: IVON's weights ``m`` and ``1 / sqrt(ess * (h + wd))``, flat in parameter order
        self.register_buffer("mean", None)
        self.register_buffer("std", None)
        #: the fine-tuned copy's BatchNorm running statistics (``"all"``; empty for the head)
        self.register_buffer("batchnorm", None)
        #: the fine-tune: epochs, lr, ess, hess_init, weight_decay, beta2, mc_samples, steps
        self.register_buffer("schedule", None)
        #: the scale used, and the held-out NLL of the checkpoint and of IVON at it (NaN without a val_loader)
        self.register_buffer("scale_fit", None)

    @dataclass(frozen=True, kw_only=True)
    class FitOptions(Method.FitOptions):
        epochs: int = option(2, "passes over the training data")
        lr: float = option(1e-3, "IVON's learning rate")
        ess: float | None = option(None, "the effective sample size; None: the number of training examples")
        hess_init: float = option(10.0, "the Hessian's start: the sampling noise 1 / sqrt(ess * hess_init) stays small")
        weight_decay: float = option(1e-4, "IVON's weight decay (the prior's precision)")
        beta2: float = option(0.999, "the Hessian estimate's running-average factor")
        mc_samples: int = option(1, "weight samples per step")

    def fit(
        self,
        train_loader: Iterable | None,
        val_loader: Iterable | None = None,
        *,
        progress: bool = True,
        options: FitOptions | None = None,
    ) -> None:
        options = options or self.FitOptions()
        epochs, lr, ess, hess_init = options.epochs, options.lr, options.ess, options.hess_init
        weight_decay, beta2, mc_samples = options.weight_decay, options.beta2, options.mc_samples
        positive_int(epochs, "epochs")
        positive_int(mc_samples, "mc_samples")
        lr, hess_init = positive_number(lr, "lr"), positive_number(hess_init, "hess_init")
        weight_decay = non_negative(weight_decay, "weight_decay")
        fraction(beta2, "beta2")
        loaders = (train_loader, val_loader)
        fit_plain_noise(self.likelihood, self.model, loaders, self.device)
        with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
            weights = PrivateWeights(
                self.model, self.layers, train_loader, split=self.split, likelihood=self.likelihood
            )
            torch.manual_seed(self.seed)  # after the feature pass: a DataLoader draws its base seed from this RNG
            ess = float(weights.size) if ess is None else positive_number(ess, "ess")
            # the loss is the NLL at the likelihood's dispersion (a Gaussian's σ²): its Hessian, and IVON's start, scale by 1/σ²
            optimiser = ivon_optimiser(
                weights.trained,
                lr=lr,
                ess=ess,
                hess_init=hess_init / self.likelihood.dispersion,
                weight_decay=weight_decay,
                beta2=float(beta2),
                mc_samples=mc_samples,
            )
            steps = self._fine_tune(weights, optimiser, epochs=epochs, mc_samples=mc_samples, progress=progress)
        hessian = optimiser.param_groups[0]["hess"].detach().float()
        self.mean = weights.weights_vector()
        self.std = (ess * (hessian + weight_decay)).rsqrt()
        self.batchnorm = weights.buffers_vector()
        self.schedule = torch.tensor(
            [epochs, lr, ess, hess_init, weight_decay, beta2, mc_samples, steps], dtype=torch.float64
        )
        self.scale_fit = torch.tensor([self.scale, math.nan, math.nan], dtype=torch.float64)
        with torch.no_grad(), eval_mode(self.model):
            fit_sampled_noise(self.likelihood, self.sampled_outputs, loaders, self.device)

    def knob(self) -> Knob | None:
        """The scale (``scale=None``) by the selection step (:mod:`~posthoc.methods.ivon.scale`), every scale drawing the
        same random numbers; under regression the noise is then re-fitted at the chosen scale."""
        if self.scale_option is not None:
            return None
        return Knob(
            name="scale",
            candidates=[(f"{scale:g}", scale) for scale in (0.0, *sorted(SCALES))],
            start=sorted(SCALES)[-1],
            score=lambda scale, held_out: self._set_scale(scale) or held_out.sampling_scores(self),
            apply=self._set_scale,
            movable=not self.likelihood.fits_noise,
            fallback=(
                "IVON",
                "the fine-tuned mean alone (scale 0)",
                "Raise tolerance, fit longer, or pass a fixed scale",
            ),
            then=self._chosen_scale,
        )

    def _set_scale(self, scale: float) -> None:
        self.scale = float(scale)

    def _chosen_scale(self, selection: Any, held_out: Any, train_loader: Iterable | None, progress: bool) -> None:
        """Keep the held-out NLLs of the chosen scale and fit the noise at it."""
        self.scale_fit = torch.tensor(
            [self.scale, selection.plain_nll, selection.chosen.clean_nll], dtype=torch.float64
        )
        with torch.no_grad(), eval_mode(self.model):
            fit_sampled_noise(
                self.likelihood, self.sampled_outputs, (train_loader, list(held_out.clean())), self.device
            )

    def _fine_tune(
        self, weights: PrivateWeights, optimiser: Any, *, epochs: int, mc_samples: int, progress: bool
    ) -> int:
        """IVON's training loop (``mc_samples`` sampled-weight gradients per step); returns the steps taken."""
        generator = torch.Generator().manual_seed(self.seed)

        def sampled_loss(batch: tuple[Inputs, Tensor], step: Step) -> Tensor:
            for _ in range(mc_samples):
                with optimiser.sampled_params(train=True):
                    optimiser.zero_grad()
                    loss = weights.loss(*batch)
                    backward(loss, weights.trained)  # averaged over ranks before IVON reads them
            return loss

        return fine_tune(
            lambda epoch: weights.epoch(generator),
            sampled_loss,
            lambda loss, step: optimiser.step(),
            epochs=epochs,
            total=None,
            desc="ivon",
            progress=progress,
            failure=lambda value, step: (
                f"the IVON loss became {value} at step {step.number + 1}; fit again with a lower lr"
            ),
        )

    # ----------------------------------------------------------------- predicting
    def _rows(self, samples: range, generator: torch.Generator) -> Tensor:
        """Weight samples ``mean + std * z_s`` for ``s`` in ``samples`` (the generator's successive draws)."""
        draws = [randn(self.mean.shape, generator=generator, device=self.mean.device) for _ in samples]
        return self.mean + (self.scale * self.std) * torch.stack(draws)

    def _draws(self, generator: torch.Generator | None) -> torch.Generator:
        """A copy of ``generator`` (default: one seeded with ``seed``), so that sample ``s`` is one weight vector for
        every chunk of a prediction."""
        if generator is None:
            return torch.Generator().manual_seed(self.seed)
        return torch.Generator(device=generator.device).set_state(generator.get_state())

    def _through(self, x: Inputs, num_samples: int | None, generator: Any, head_route: Any, state_route: Any) -> Any:
        """The weight samples of a prediction (the fine-tuned mean alone at scale 0) run through ``head_route``
        (``layers="head"``) or ``state_route`` (:mod:`posthoc.engine.weight_samples`)."""
        names = None if self.layers == "head" else sample_names(self.model, self.layers, None)
        if self.scale == 0:
            count, rows = 1, lambda group: self.mean[None]
            mean = None if names is None else unflatten(torch.cat([self.mean, self.batchnorm]), self.model, names)
            states = lambda s: mean
        else:
            count, draws = num_samples or self.num_samples, self._draws(generator)
            rows = lambda group: self._rows(range(group.start, group.stop), draws)
            states = lambda s: unflatten(torch.cat([self._rows(range(1), draws)[0], self.batchnorm]), self.model, names)
        if names is None:
            return head_route(self.split, rows, count, x)
        return state_route(self.model, states, count, x)

    def log_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> LogPredictive:
        """The predictive of the weight samples drawn from a copy of ``generator`` (deterministic at scale 0)."""
        log_probs, samples = self._through(x, num_samples, generator, head_log_predictive, state_log_predictive)
        return log_probs, None if self.scale == 0 else samples

    def sampled_outputs(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> Tensor:
        """``(S, N, D)``: the model's outputs under the weight samples :meth:`log_predictive` draws."""
        return self._through(x, num_samples, generator, head_outputs, state_outputs)

    def load_posterior_state(self, state: dict[str, Tensor]) -> None:
        super().load_posterior_state(state)
        if self.scale_fit is not None:
            self.scale = float(self.scale_fit[0])

    def summary(self) -> dict[str, Any]:
        """The posterior for the model card: weights under it, their mean posterior std and the fine-tune.

        Example:
            >>> import posthoc
            >>> from posthoc_apps.demo.examples import model, train_loader
            >>> card = posthoc.wrap(model, method="ivon").fit(train_loader).method.summary()
            >>> card["random_variables"], card["epochs"]
            (515, 2)
        """
        names = (
            trained_names(self.model, self.layers, self.split)
            if self.split is None or self.split.head is not None
            else []
        )
        schedule = dict(zip(SCHEDULE, [None] * len(SCHEDULE) if self.schedule is None else self.schedule.tolist()))
        return {
            "random_variables": 0 if self.mean is None else self.mean.numel(),
            "layers": list(parameter_owners(self.model, names)),
            "num_samples": self.num_samples,
            "mean_std": None if self.std is None else float(self.std.mean()),
            "scale": self.scale,
            **{
                key: (int(value) if key in ("epochs", "mc_samples", "steps") and value is not None else value)
                for key, value in schedule.items()
            },
        }

    def extra_repr(self) -> str:
        return f"layers={self.layers!r}, num_samples={self.num_samples}, fitted={bool(self.fitted)}"
