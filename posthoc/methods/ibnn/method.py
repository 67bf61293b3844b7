"""``"ibnn"``: implicit Bayesian neural network with node posteriors (Trinh et al., 2022).

Multiplicative latent variables ``z`` sit on the inputs of the model's ``Conv2d`` / ``Linear``
layers (one per input channel / feature, see :mod:`posthoc.methods.ibnn.nodes`), with a mixture posterior
``q(z) = 1/K sum_k N(mu_k, sigma_k^2)`` and prior ``N(1, s^2)``. The weights stay those of the
checkpoint (frozen by default); ``fit`` maximises the ELBO over the node parameters, starting
from means close to 1 so the pretrained function is kept. Predictions average ``K x S``
samples (``S`` per component) computed in one forward pass over a batch expanded ``K * S``
times, chunked under a memory budget.

Reference: T. Trinh, S. Kaski, M. Heinonen, "Scalable Bayesian neural networks by layer-wise
input augmentation" (arXiv:2010.13498); published as "Tackling covariate shift with node-based
Bayesian neural networks", ICML 2022.

Example:
    >>> um = posthoc.wrap(model, method="ibnn", components=4).fit(train_loader, epochs=1)
    >>> um.predict(x).samples.shape      # (K * S, N, C)
    torch.Size([20, 8, 10])
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from posthoc.core import distributed, settings
from posthoc.core.registry import register
from posthoc.core.method import LogPredictive, Method
from posthoc.core.inputs import Inputs, batch_size, check_labels, iterate, run_model
from posthoc.core.errors import ConfigError, NumericalError
from posthoc.core.logits import class_log_probs
from posthoc.methods.ibnn.nodes import NodeSet
from posthoc.core.modules import eval_mode


def expand(x: Inputs, repeats: int) -> Inputs:
    """Repeat every example ``repeats`` times, batch-major (rows ``i*repeats ... i*repeats + repeats - 1``)."""
    if isinstance(x, Mapping):
        return {k: v.repeat_interleave(repeats, 0) if isinstance(v, Tensor) else v for k, v in x.items()}
    return x.repeat_interleave(repeats, 0)


def _rows(x: Inputs, start: int, stop: int) -> Inputs:
    if isinstance(x, Mapping):
        return {k: v[start:stop] if isinstance(v, Tensor) else v for k, v in x.items()}
    return x[start:stop]


@register
class ImplicitBNN(Method):
    """Node posteriors on a pretrained network (see module docs).

    Options:
        components: ``K``, mixture components (each expanded example ``i`` uses component ``i mod K``).
        prior_std: ``s`` of the prior ``N(1, s^2)``.
        init_mean_std: component means start at ``1 + N(0, init_mean_std^2)``.
        init_std: component standard deviations start here (kept positive by a softplus).
        layers: module names whose Conv/Linear layers get nodes (default: all of them).
        stem, head: include the first Conv/Linear and the classifier head. The stem is left out by
            default: its few nodes (one per image channel) act as a global input scale that a short
            fine-tune inflates (on the digits CNN its mean drifted to 1.2 in one epoch), making the
            model more confident, not less.
        num_samples: ``S``, samples per component at prediction (``K * S`` in total).
        max_memory: bytes for one expanded forward pass (``None``: ``posthoc.settings.max_memory``);
            larger inputs run in chunks.
        seed: seeds the initial means.
    """

    name = "ibnn"
    copies_model = True
    demo_configs = (("iBNN (K=4)", {"components": 4, "init_std": 0.1, "init_mean_std": 0.1, "epochs": 1, "lr_nodes": 0.5,
                                  "beta": 10.0, "train_samples": 2, "num_samples": 1}),)

    def __init__(self, model: nn.Module, *, components: int = 4, prior_std: float = 0.1, init_mean_std: float = 0.05,
                 init_std: float = 0.05, layers: Sequence[str] | None = None, stem: bool = False, head: bool = True,
                 num_samples: int = 5, max_memory: int | None = None, seed: int = 0) -> None:
        super().__init__(model)
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ConfigError(f"num_samples (samples per component) must be an integer >= 1, got {num_samples!r}")
        if max_memory is not None and (not isinstance(max_memory, int) or max_memory < 1):
            raise ConfigError(f"max_memory must be a positive number of bytes (or None), got {max_memory!r}")
        self.nodes = NodeSet(model, components=components, prior_std=prior_std, init_mean_std=init_mean_std,
                             init_std=init_std, layers=None if layers is None else list(layers), stem=stem,
                             head=head, seed=seed)
        self.num_samples = num_samples
        self.max_memory = max_memory
        self._row_bytes: dict[tuple, int] = {}

    @property
    def components(self) -> int:
        return self.nodes.components

    def fit(self, train_loader: Iterable | None, val_loader: Iterable | None = None, *, progress: bool = True,
            epochs: int = 1, lr_nodes: float = 0.5, lr_weights: float = 0.0, momentum: float = 0.9,
            weight_decay: float = 0.0, beta: float = 1.0, kl_warmup: float = 0.5, train_samples: int | None = None,
            refresh_bn: bool = False) -> None:
        """Fine-tune the node posterior (and optionally the weights) by maximising the ELBO.

        The loss per step is ``mean NLL over the expanded batch + beta_t * KL / N`` (``N`` training
        examples, ``beta_t`` rising linearly from 0 to ``beta`` over the first ``kl_warmup`` fraction
        of the steps), minimised by SGD with Nesterov momentum: a high constant ``lr_nodes`` without
        weight decay for the node parameters, ``lr_weights`` (0 = frozen) with ``weight_decay`` for
        the weights. The model stays in eval mode (pretrained BatchNorm statistics, no dropout);
        ``refresh_bn=True`` re-estimates the BatchNorm statistics afterwards with the nodes sampling
        (this changes the saved weights' buffers). On a NaN/inf ELBO the fit stops with
        :class:`~posthoc.NumericalError` and every tensor is restored to its state before ``fit``.

        Args:
            epochs: passes over ``train_loader``.
            lr_nodes, lr_weights, momentum, weight_decay: optimiser settings (see above).
            beta: final KL weight.
            kl_warmup: fraction of the steps over which the KL weight rises from 0 to ``beta``.
            train_samples: copies of each example per step (default ``K``: every component once).
            refresh_bn: re-estimate BatchNorm running statistics after fine-tuning.
        """
        train_samples = self.components if train_samples is None else train_samples
        _check_fit_options(epochs, lr_nodes, lr_weights, momentum, weight_decay, beta, kl_warmup, train_samples)
        device = self.nodes.called.device
        size = _dataset_size(train_loader)
        if size is not None and distributed.active():  # the KL is scaled by the size of all shards together
            size = int(distributed.all_reduce_sum(torch.tensor(float(size), dtype=torch.float64)).item())
        steps_per_epoch = distributed.common_length(_length(train_loader), "iBNN fitting")
        total = None if steps_per_epoch is None else epochs * steps_per_epoch

        node_params = list(self.nodes.parameters())
        weights = [p for p in self.model.parameters() if lr_weights > 0]
        groups = [{"params": node_params, "lr": lr_nodes, "weight_decay": 0.0}]
        if weights:
            groups.append({"params": weights, "lr": lr_weights, "weight_decay": weight_decay})
        optimizer = torch.optim.SGD(groups, momentum=momentum, nesterov=momentum > 0)
        changing = self if lr_weights > 0 or refresh_bn else self.nodes
        before = {k: v.detach().clone() for k, v in changing.state_dict().items()}
        flags = [(p, p.requires_grad) for p in self.model.parameters()]
        for p in self.model.parameters():
            p.requires_grad_(lr_weights > 0)
        bar = tqdm(total=total, desc="ibnn", disable=not progress, leave=False)
        step = 0
        try:
            with eval_mode(self.model):
                for epoch in range(epochs):
                    for index, (x, y) in enumerate(iterate(train_loader, device=device, progress=False, desc="ibnn fit")):
                        if steps_per_epoch is not None and index >= steps_per_epoch:
                            break  # under torch.distributed: every rank takes the same number of steps
                        n = batch_size(x)
                        size = size or n * (steps_per_epoch or 1)
                        done = step / total if total else epoch / epochs
                        kl_weight = beta * min(1.0, done / kl_warmup) if kl_warmup > 0 else beta
                        nll, kl = self._elbo_terms(x, y, train_samples)
                        loss = nll + kl_weight * kl / size
                        nll, kl = nll.detach(), kl.detach()
                        if not torch.isfinite(loss.detach()):
                            raise NumericalError(
                                f"the ELBO became {float(loss.detach())} at epoch {epoch + 1}, step {step + 1} (nll={float(nll):.4g}, "
                                f"kl={float(kl):.4g}); lower lr_nodes (now {lr_nodes}) or beta. The checkpoint and "
                                "this method's state were left as they were before fit"
                            )
                        optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                        # the node variables live outside the model (in hooks), so there is no module for
                        # DistributedDataParallel to wrap: average their gradients the way it would
                        distributed.average_gradients([*node_params, *weights])
                        optimizer.step()
                        step += 1
                        bar.update(1)
                        bar.set_postfix(epoch=epoch + 1, nll=f"{float(nll):.4f}", kl=f"{float(kl):.1f}", beta=f"{kl_weight:.2f}")
            if refresh_bn:
                self._refresh_batchnorm(train_loader, device, train_samples, progress)
        except BaseException:
            changing.load_state_dict(before)
            raise
        finally:
            bar.close()
            for p, flag in flags:
                p.requires_grad_(flag)

    def _elbo_terms(self, x: Inputs, y: Tensor, train_samples: int) -> tuple[Tensor, Tensor]:
        """``(mean NLL over the expanded batch, KL)`` for one batch; marks which layers ran."""
        n = batch_size(x)
        route = torch.arange(n * train_samples, device=self.nodes.called.device) % self.components
        with self.nodes.sampling(route):
            logits = run_model(self.model, expand(x, train_samples))
        self.nodes.mark_called()
        if not bool(self.nodes.called.any()):
            raise ConfigError(
                f"none of the selected layers {self.nodes.layer_names[:6]} ran in the forward pass (their weights are "
                "used functionally, e.g. by attention); select other layers with layers=... or stem=True"
            )
        log_probs = class_log_probs(logits)
        labels = check_labels(y, log_probs.shape[-1]).to(log_probs.device).repeat_interleave(train_samples)
        return F.nll_loss(log_probs, labels), self.nodes.kl()

    @torch.no_grad()
    def _refresh_batchnorm(self, loader: Iterable, device: torch.device, train_samples: int, progress: bool) -> None:
        norms = [m for m in self.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
        if not norms:
            return
        momenta = [m.momentum for m in norms]
        for m in norms:
            m.reset_running_stats()
            m.momentum = None
        try:
            with eval_mode(self.model):
                for m in norms:
                    m.train()
                for x, _ in iterate(loader, device=device, progress=progress, desc="ibnn BatchNorm refresh"):
                    route = torch.arange(batch_size(x) * train_samples, device=device) % self.components
                    with self.nodes.sampling(route):
                        run_model(self.model, expand(x, train_samples))
        finally:
            for m, momentum in zip(norms, momenta):
                m.momentum = momentum

    def log_predictive(self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None) -> LogPredictive:
        """``K * S`` samples in one expanded forward per chunk; sample ``r`` uses component ``r mod K``.

        ``num_samples`` overrides ``S``, the number of samples per component.
        """
        repeats = self.components * (num_samples or self.num_samples)
        n = batch_size(x)
        pieces, start = [], 0
        chunk = self._examples_per_chunk(x, repeats) if _shape_key(x) in self._row_bytes else 1
        while start < n:
            stop = min(n, start + chunk)
            pieces.append(self._expanded_log_probs(_rows(x, start, stop), repeats, generator))
            start = stop
            chunk = self._examples_per_chunk(x, repeats)
        samples = torch.cat(pieces, 0).transpose(0, 1)  # (R, N, C)
        return torch.logsumexp(samples, 0) - math.log(repeats), samples

    def _expanded_log_probs(self, x: Inputs, repeats: int, generator: torch.Generator | None) -> Tensor:
        n = batch_size(x)
        route = torch.arange(n * repeats, device=self.nodes.called.device) % self.components
        with self.nodes.sampling(route, generator=generator):
            log_probs = class_log_probs(run_model(self.model, expand(x, repeats)))
        key = _shape_key(x)
        if key not in self._row_bytes:
            self._row_bytes[key] = max(1, 4 * self.nodes.largest_input_bytes)
        return log_probs.reshape(n, repeats, -1)

    def _examples_per_chunk(self, x: Inputs, repeats: int) -> int:
        """Examples per expanded forward: ``4 x`` the largest layer input per row stands for the peak memory."""
        row_bytes = self._row_bytes.get(_shape_key(x), 1)
        return max(1, settings.memory_budget(self.max_memory) // (row_bytes * repeats))

    def extra_repr(self) -> str:
        return f"components={self.components}, num_samples={self.num_samples}"


def _shape_key(x: Inputs) -> tuple:
    if isinstance(x, Mapping):
        return tuple((k, tuple(v.shape[1:])) for k, v in sorted(x.items()) if isinstance(v, Tensor))
    return tuple(x.shape[1:])


def _length(loader: Iterable) -> int | None:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def _dataset_size(loader: Iterable) -> int | None:
    """``N`` for the KL scale: the loader's dataset length if known (else estimated from the first batch)."""
    dataset = getattr(loader, "dataset", None)
    try:
        return len(dataset) if dataset is not None else None  # type: ignore[arg-type]
    except TypeError:
        return None


def _check_fit_options(epochs: int, lr_nodes: float, lr_weights: float, momentum: float, weight_decay: float,
                       beta: float, kl_warmup: float, train_samples: int) -> None:
    def number(value: object) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ConfigError(f"epochs must be an integer >= 1, got {epochs!r}")
    if isinstance(train_samples, bool) or not isinstance(train_samples, int) or train_samples < 1:
        raise ConfigError(f"train_samples must be an integer >= 1, got {train_samples!r}")
    checks = (
        ("lr_nodes", lr_nodes, lambda v: v > 0, "> 0"),
        ("lr_weights", lr_weights, lambda v: v >= 0, ">= 0 (0 keeps the weights frozen)"),
        ("momentum", momentum, lambda v: 0 <= v < 1, "in [0, 1)"),
        ("weight_decay", weight_decay, lambda v: v >= 0, ">= 0"),
        ("beta", beta, lambda v: v >= 0, ">= 0"),
        ("kl_warmup", kl_warmup, lambda v: 0 <= v <= 1, "in [0, 1]"),
    )
    for name, value, valid, described in checks:
        if not number(value) or not valid(value):
            raise ConfigError(f"{name} must be a number {described}, got {value!r}")
