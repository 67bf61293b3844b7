"""``"sgld"``: stochastic-gradient Langevin dynamics from the checkpoint, plain or cyclical.

``fit`` runs a Langevin chain (:mod:`~posthoc.methods.sgld.langevin`) from the trained weights on private copies
(:mod:`posthoc.engine.private_weights`), targeting ``p(D | theta)^(1/T) N(theta; theta_0, 1/lambda)^(1/T)`` with
``theta_0`` the checkpoint or zero, and keeps ``num_samples`` of its iterates. With ``layers="all"`` (the default: the
head-only chain drifts towards a more confident head and does not lower the NLL under shift, docs/methods/sgld.md)
each kept sample is a state of every trainable weight and the BatchNorm statistics, as many as the memory budget
holds; with ``layers="head"`` it is the head's weight and bias, all run in one batched matmul on the features.

Under ``likelihood="regression"`` the chain's loss is the Gaussian NLL at the plain model's held-out noise, the default
learning rates are scaled by ``σ² / 2`` (:func:`~posthoc.engine.objective.step_scale`), and the noise is re-fitted on
the kept samples' mixture of ``N(f_s(x), σ²)``.

Example:
    >>> import posthoc
    >>> from posthoc_apps.demo.examples import model, train_loader, x
    >>> um = posthoc.wrap(model, method="sgld", cycles=4).fit(train_loader, epochs=10)
    >>> um.predict(x).samples.shape          # one sample per cycle
    torch.Size([4, 8, 3])
    >>> um.method.summary()["kept"]
    4
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from posthoc import settings
from posthoc.core.checks import fraction, integer, non_negative, positive_int, positive_number
from posthoc.core.inputs import Inputs
from posthoc.core.likelihood import Categorical, Gaussian
from posthoc.core.method import SAMPLES_NETWORKS, LogPredictive, Method
from posthoc.core.modules import eval_mode, parameter_owners
from posthoc.core.options import option
from posthoc.core.registry import register
from posthoc.engine.fine_tune import Step, backward, fine_tune
from posthoc.engine.head import FeatureSplit
from posthoc.engine.objective import fit_plain_noise, fit_sampled_noise, step_scale
from posthoc.engine.private_weights import PrivateWeights, check_layers, sample_names, unflatten
from posthoc.engine.runner import sum_over_ranks
from posthoc.engine.weight_samples import head_log_predictive, head_outputs, state_log_predictive, state_outputs
from posthoc.errors import ConfigError
from posthoc.methods.sgld.langevin import Langevin, adds_noise, check_schedule, kept_steps, step_size

PRIORS = ("checkpoint", "zero")
#: the fit options saved in the ``schedule`` buffer, in its order (``cycles`` 0 for plain SGLD)
SCHEDULE = ("epochs", "lr", "cycles", "burn_in", "exploration", "steps")
#: how to keep more ``"all"`` states
MORE_MEMORY = "raise the memory budget, posthoc.wrap(..., max_memory=...)"


@register
class SGLD(Method):
    """Stochastic-gradient Langevin dynamics (Welling and Teh, 2011), cyclical SG-MCMC (Zhang et al., 2020)."""

    name = "sgld"
    export_refusal = SAMPLES_NETWORKS
    likelihoods = (Categorical, Gaussian)

    @dataclass(frozen=True, kw_only=True)
    class Options(Method.Options):
        layers: str = option(
            "all", "all (every trainable weight) or head (the classifier head; the backbone runs once)"
        )
        cycles: int | None = option(None, "None: plain SGLD (constant step, burn_in discarded); else cosine cycles")
        num_samples: int = option(20, "samples kept at fit and used per prediction")
        temperature: float = option(1.0, "T: the chain targets the posterior to the power 1/T (0: SGD, no noise)")
        prior: Literal[PRIORS] = option("checkpoint", "a Gaussian prior centred on the trained weights, or on zero")
        prior_precision: float = option(1.0, "lambda, the prior's precision per weight")
        head: str | None = option(None, "the head's module name when it cannot be found automatically")
        seed: int = option(0, "seeds the chain's noise and its mini-batch order")

    def __init__(self, model: nn.Module, options: Options) -> None:
        super().__init__(model)
        self.layers = check_layers(options.layers)
        self.cycles = positive_int(options.cycles, "cycles", none="plain SGLD, a constant step")
        self.num_samples = positive_int(options.num_samples, "num_samples")
        self.temperature = non_negative(options.temperature, "temperature")
        if math.isinf(self.temperature):
            raise ConfigError("temperature must be finite")
        self.prior = options.prior
        self.prior_precision = non_negative(options.prior_precision, "prior_precision")
        self.seed = integer(options.seed, "seed")
        self.split = FeatureSplit(model, options.head) if options.layers == "head" else None
        #: the kept samples, one row each (head rows, or an "all" state's weights and BatchNorm statistics)
        self.register_buffer("samples", None)
        #: epochs, lr, cycles (0: plain), burn_in, exploration, steps of the chain that made them
        self.register_buffer("schedule", None)

    # ----------------------------------------------------------------- fitting
    @dataclass(frozen=True, kw_only=True)
    class FitOptions(Method.FitOptions):
        epochs: int = option(2, "passes over the training data")
        lr: float | None = option(
            None, "the step on the mean loss; None: 1 / mean |[phi, 1]|^2 over the head's features, 1e-3 for all"
        )
        burn_in: float = option(0.5, "plain SGLD: the fraction of steps discarded")
        exploration: float = option(0.8, "cyclical: the fraction of each cycle run as SGD before sampling")

    def fit(
        self,
        train_loader: Iterable | None,
        val_loader: Iterable | None = None,
        *,
        progress: bool = True,
        options: FitOptions | None = None,
    ) -> None:
        options = options or self.FitOptions()
        epochs, lr, burn_in, exploration = options.epochs, options.lr, options.burn_in, options.exploration
        positive_int(epochs, "epochs")
        positive_number(lr, "lr", none="set from the features")
        burn_in, exploration = fraction(burn_in, "burn_in"), fraction(exploration, "exploration")
        loaders = (train_loader, val_loader)
        fit_plain_noise(self.likelihood, self.model, loaders, self.device)
        with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
            torch.manual_seed(self.seed)  # the loader's shuffling and the copy's dropout, for "all"
            self._run_chain(
                train_loader, epochs=epochs, lr=lr, burn_in=burn_in, exploration=exploration, progress=progress
            )
        with torch.no_grad(), eval_mode(self.model):
            fit_sampled_noise(self.likelihood, self.sampled_outputs, loaders, self.device)

    def _run_chain(
        self,
        train_loader: Iterable,
        *,
        epochs: int,
        lr: float | None,
        burn_in: float,
        exploration: float,
        progress: bool,
    ) -> None:
        """The chain of :meth:`fit`: sets ``samples`` and ``schedule``."""
        generator = torch.Generator().manual_seed(self.seed)  # the chain's noise: alike on every rank
        order = torch.Generator().manual_seed(self.seed + 1)  # the order of cached batches: shards differ in length
        weights = PrivateWeights(self.model, self.layers, train_loader, split=self.split, likelihood=self.likelihood)
        lr = float(lr) if lr is not None else self._default_lr(weights)
        centre = [t.detach().clone() for t in weights.trained] if self.prior == "checkpoint" else None
        chain = Langevin(
            weights.trained,
            size=weights.size,
            prior_precision=self.prior_precision,
            temperature=self.temperature,
            centre=centre,
            generator=generator,
        )
        total = epochs * weights.steps_per_epoch
        check_schedule(total, self.cycles, exploration, steps_per_epoch=weights.steps_per_epoch)
        wanted = self._keep_count(weights)
        kept = set(kept_steps(total, wanted, cycles=self.cycles, burn_in=burn_in, exploration=exploration))
        if len(kept) < wanted:
            warnings.warn(
                f"the chain's {total} steps leave {len(kept)} step(s) to sample from ({self.cycles or 'no'} cycles, "
                f"burn_in={burn_in}, exploration={exploration}); keeping {len(kept)} of {wanted} samples. "
                "Raise epochs, or lower burn_in / exploration / cycles",
                RuntimeWarning,
                stacklevel=3,
            )
        rows: list[Tensor] = []

        def update(loss: Tensor, step: Step) -> None:
            for t in weights.trained:
                t.grad = None
            backward(loss, weights.trained)  # the noise is seeded alike on every rank
            noise = self.temperature > 0 and adds_noise(step.number, total, cycles=self.cycles, exploration=exploration)
            chain.step(step_size(step.number, total, lr, cycles=self.cycles), noise=noise)

        def keep(step: Step) -> None:
            if step.number in kept:
                rows.append(torch.cat([weights.weights_vector(), weights.buffers_vector()]))

        fine_tune(
            lambda epoch: weights.epoch(order),
            lambda batch, step: weights.loss(*batch),
            update,
            epochs=epochs,
            total=total,
            desc="sgld",
            progress=progress,
            after_step=keep,
            failure=lambda value, step: (
                f"the SGLD loss became {value} at step {step.number + 1} (lr={lr:.3g}); fit again with a lower lr"
            ),
        )
        self.samples = torch.stack(rows)
        self.schedule = torch.tensor([epochs, lr, self.cycles or 0, burn_in, exploration, total], dtype=torch.float64)

    def _default_lr(self, weights: PrivateWeights) -> float:
        """``1 / mean |[phi, 1]|^2`` over the head's features (module docs), ``1e-3`` for ``"all"``; times
        :func:`~posthoc.engine.objective.step_scale` of the likelihood (1 for class labels)."""
        if self.layers == "all":
            return 1e-3 * step_scale(self.likelihood)
        squares = torch.stack(
            [phi.pow(2).sum(-1).mean() + 1 for phi, _ in weights.epoch(torch.Generator().manual_seed(0))]
        )
        totals = torch.stack([squares.sum(), torch.tensor(float(len(squares)), device=squares.device)]).double()
        totals = sum_over_ranks(totals)  # one lr on every rank
        return float(totals[1] / totals[0]) * step_scale(self.likelihood)

    def _keep_count(self, weights: PrivateWeights) -> int:
        """``num_samples``, or as many ``"all"`` states as fit in the memory budget (with a warning)."""
        row_bytes = 4 * (weights.num_weights + weights.buffers_vector().numel())
        budget = settings.memory_budget()
        fits = budget // row_bytes
        if fits >= self.num_samples:
            return self.num_samples
        if fits < 1:
            raise ConfigError(
                f"one SGLD state needs {row_bytes} bytes, over the memory budget of {budget}; "
                f"{MORE_MEMORY} or use layers='head'"
            )
        warnings.warn(
            f"{self.num_samples} SGLD states of {row_bytes / 2**20:.1f} MiB exceed the memory budget; keeping {fits}, "
            f"spread over the chain ({MORE_MEMORY} to keep more)",
            RuntimeWarning,
            stacklevel=4,
        )
        return int(fits)

    # ----------------------------------------------------------------- predicting
    def _names(self, x: Inputs | None = None) -> list[str]:
        if self.split is not None and self.split.head is None and x is not None:
            self.split(x)
        return sample_names(self.model, self.layers, self.split)

    def _chosen(self, num_samples: int | None) -> Tensor:
        """The indices of the kept samples a prediction of ``num_samples`` uses, spread over the chain."""
        kept = self.samples.shape[0]
        count = num_samples or min(self.num_samples, kept)
        if count > kept:
            raise ConfigError(f"SGLD kept {kept} samples at fit; predict with num_samples <= {kept}, or fit with more")
        return torch.linspace(0, kept - 1, count).round().long().to(self.samples.device)

    def _through(self, x: Inputs, num_samples: int | None, *, head_route: Any, state_route: Any) -> Any:
        """The kept samples a prediction uses, run through ``head_route`` (``layers="head"``) or ``state_route``
        (:mod:`posthoc.engine.weight_samples`: the log-predictive or the raw outputs)."""
        chosen = self._chosen(num_samples)
        if self.layers == "head":
            return head_route(self.split, lambda group: self.samples[chosen[group]], len(chosen), x)
        names = self._names(x)
        return state_route(self.model, lambda s: unflatten(self.samples[chosen[s]], self.model, names), len(chosen), x)

    def log_predictive(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> LogPredictive:
        """The kept samples' predictive; ``generator`` is not used (the samples are fixed at fit)."""
        return self._through(x, num_samples, head_route=head_log_predictive, state_route=state_log_predictive)

    def sampled_outputs(
        self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> Tensor:
        """``(S, N, D)``: the model's outputs under the kept samples :meth:`log_predictive` uses."""
        return self._through(x, num_samples, head_route=head_outputs, state_route=state_outputs)

    def summary(self) -> dict[str, Any]:
        """The chain for the model card: weights sampled, samples kept, prior, temperature and schedule."""
        names = trained = []
        if self.split is None or self.split.head is not None:
            names = self._names()
            trained = [n for n in names if not n.endswith(("running_mean", "running_var"))]
        tensors = dict(self.model.named_parameters())
        schedule = dict(zip(SCHEDULE, [None] * len(SCHEDULE) if self.schedule is None else self.schedule.tolist()))
        return {
            "random_variables": sum(tensors[n].numel() for n in trained),
            "layers": list(parameter_owners(self.model, trained)),
            "kept": 0 if self.samples is None else self.samples.shape[0],
            "cycles": self.cycles,
            "temperature": self.temperature,
            "prior": self.prior,
            "prior_precision": self.prior_precision,
            "epochs": None if schedule["epochs"] is None else int(schedule["epochs"]),
            "lr": schedule["lr"],
            "steps": None if schedule["steps"] is None else int(schedule["steps"]),
        }

    def extra_repr(self) -> str:
        kept = 0 if self.samples is None else self.samples.shape[0]
        return f"layers={self.layers!r}, cycles={self.cycles}, temperature={self.temperature}, kept={kept}"
