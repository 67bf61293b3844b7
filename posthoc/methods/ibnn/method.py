"""``"ibnn"``: implicit Bayesian neural network with node posteriors (Trinh et al., 2022).

Multiplicative latent variables ``z`` sit on the inputs of the model's ``Conv2d`` / ``Linear``
layers (one per input channel / feature, see :mod:`posthoc.methods.ibnn.nodes`), with a mixture posterior
``q(z) = 1/K sum_k N(mu_k, sigma_k^2)`` and prior ``N(1, s^2)``. The weights stay those of the
checkpoint (frozen by default); ``fit`` maximises the ELBO over the node parameters, starting
from means close to 1 so the pretrained function is kept (see :mod:`posthoc.methods.ibnn.elbo`).
Predictions average ``K x S`` samples (``S`` per component) computed in one forward pass over a
batch expanded ``K * S`` times, chunked under a memory budget.

Reference: T. Trinh, S. Kaski, M. Heinonen, "Scalable Bayesian neural networks by layer-wise
input augmentation" (arXiv:2010.13498); published as "Tackling covariate shift with node-based
Bayesian neural networks", ICML 2022.

Example:
    >>> um = posthoc.wrap(model, method="ibnn", components=4).fit(train_loader, epochs=1)
    >>> um.predict(x).samples.shape      # (K * S, N, C)
    torch.Size([20, 8, 10])
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn

from posthoc.core.checks import memory_bytes, positive_int
from posthoc.core.chunks import rows_per_chunk
from posthoc.core.inputs import Inputs, batch_size, run_model, slice_inputs
from posthoc.core.logits import class_log_probs, log_mean_exp
from posthoc.core.method import LogPredictive, Method
from posthoc.core.registry import register
from posthoc.methods.ibnn.elbo import ElboOptions, expand, maximise_elbo, refresh_batchnorm_sampling, routes
from posthoc.methods.ibnn.nodes import NodeSet

#: copies of the largest layer input of an expanded row alive at once in its forward (the input,
#: its product with the nodes, the layer's output, the expanded batch)
ACTIVATION_COPIES = 4
#: copies of an expanded row's class scores alive at once: the logits and their log-softmax
LOG_PROB_COPIES = 2


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
        self.nodes = NodeSet(model, components=components, prior_std=prior_std, init_mean_std=init_mean_std,
                             init_std=init_std, layers=None if layers is None else list(layers), stem=stem,
                             head=head, seed=seed)
        self.num_samples = positive_int(num_samples, "num_samples")
        self.max_memory = memory_bytes(max_memory)
        #: bytes one expanded row keeps alive at the peak of a forward, per input shape (measured once)
        self._expanded_row_bytes: dict[tuple, int] = {}

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
        of the steps), minimised by SGD with Nesterov momentum (:func:`~posthoc.methods.ibnn.elbo.maximise_elbo`):
        a high constant ``lr_nodes`` without weight decay for the node parameters, ``lr_weights``
        (0 = frozen) with ``weight_decay`` for the weights. The model stays in eval mode (pretrained
        BatchNorm statistics, no dropout); ``refresh_bn=True`` recomputes the BatchNorm statistics
        afterwards with the nodes sampling (this changes the saved weights' buffers). On a NaN/inf ELBO the fit stops with
        :class:`~posthoc.NumericalError` and every tensor is restored to its state before ``fit``.

        Args:
            epochs: passes over ``train_loader``.
            lr_nodes, lr_weights, momentum, weight_decay: optimiser settings (see above).
            beta: final KL weight.
            kl_warmup: fraction of the steps over which the KL weight rises from 0 to ``beta``.
            train_samples: copies of each example per step (default ``K``: every component once).
            refresh_bn: re-estimate BatchNorm running statistics after fine-tuning.
        """
        options = ElboOptions(epochs, lr_nodes, lr_weights, momentum, weight_decay, beta, kl_warmup,
                              self.components if train_samples is None else train_samples)
        changing = self if lr_weights > 0 or refresh_bn else self.nodes
        before = {k: v.detach().clone() for k, v in changing.state_dict().items()}
        try:
            maximise_elbo(self.model, self.nodes, train_loader, options, progress=progress)
            if refresh_bn:
                refresh_batchnorm_sampling(self.model, self.nodes, train_loader, options.train_samples, progress=progress)
        except BaseException:
            changing.load_state_dict(before)
            raise

    def log_predictive(self, x: Inputs, *, num_samples: int | None = None, generator: torch.Generator | None = None) -> LogPredictive:
        """``K * S`` samples in one expanded forward per chunk; sample ``r`` uses component ``r mod K``.

        ``num_samples`` overrides ``S``, the number of samples per component. The first input of a
        shape runs one example alone, which measures the bytes of an expanded row; the rest runs in
        chunks of :func:`~posthoc.core.chunks.rows_per_chunk` examples, written into one ``(K * S, N, C)``.
        """
        repeats = self.components * (num_samples or self.num_samples)
        total, key = batch_size(x), _shape_key(x)
        samples, start = None, 0
        while start < total:
            rows = 1 if key not in self._expanded_row_bytes else rows_per_chunk(
                repeats * self._expanded_row_bytes[key], max_memory=self.max_memory)
            part = self._expanded_log_probs(slice_inputs(x, start, start + rows), repeats, generator, key)
            if samples is None:
                samples = part.new_empty(repeats, total, part.shape[-1])
            samples[:, start:start + rows] = part
            start += rows
        return log_mean_exp(samples), samples

    def _expanded_log_probs(self, x: Inputs, repeats: int, generator: torch.Generator | None, key: tuple) -> Tensor:
        """``(repeats, n, C)`` log-probabilities of ``x`` expanded ``repeats`` times."""
        n = batch_size(x)
        with self.nodes.sampling(routes(n, repeats, self.components, self.nodes.called.device), generator=generator):
            log_probs = class_log_probs(run_model(self.model, expand(x, repeats)))
        if key not in self._expanded_row_bytes:
            self._expanded_row_bytes[key] = (ACTIVATION_COPIES * self.nodes.largest_input_bytes
                                             + LOG_PROB_COPIES * log_probs[0].numel() * log_probs.element_size())
        return log_probs.reshape(n, repeats, -1).transpose(0, 1)

    def extra_repr(self) -> str:
        return f"components={self.components}, num_samples={self.num_samples}"


def _shape_key(x: Inputs) -> tuple:
    if isinstance(x, Mapping):
        return tuple((k, tuple(v.shape[1:])) for k, v in sorted(x.items()) if isinstance(v, Tensor))
    return tuple(x.shape[1:])
