"""Dense outputs: a model whose logits carry positions, ``(N, C, H, W)`` for a segmentation map or ``(N, T, V)`` for
tokens, with labels of the matching shape ``(N, H, W)`` / ``(N, T)``.

Every valid position is an example of the likelihood. The methods keep working on rows: :class:`PositionRows` shows
the user's network to them as a row model, its logits ``(N, C, *P)`` turned into rows ``(N·P, C)`` (the class
dimension moved last), and the batches of a fit as ``({inputs, keep}, labels[keep])``: the positions whose label is
the ignore index are dropped before any method sees them (the boolean mask ``keep`` travels inside the inputs, a
tensor with the batch dimension first, so every slice, copy or perturbation of a batch keeps it aligned). Positions
are the runner's business: :class:`DenseModel` fits the row model, and its ``predict`` streams the images (sequences)
in chunks sized with their positions counted under ``max_memory``, and shapes the prediction back: ``probs``
``(N, C, H, W)`` (tokens ``(N, T, V)``), ``entropy``, ``aleatoric``, ``epistemic``, ``confidence`` and ``label``
``(N, H, W)`` (tokens ``(N, T)``).

The class dimension is read from the labels: the one dimension of the logits whose removal leaves the labels' shape
(``class_dim=`` overrides it); none or several is a :class:`~posthoc.errors.InputError`. The ignore index is
``ignore_index=`` when given, else -100 (Hugging Face) and 255 (torchvision, Pascal VOC) for a model of at most
255 classes.

The selection step's unit. The positions of one image are strongly correlated, so a confidence bound that counted
every pixel as an independent example would be far too narrow. The held-out rows carry their image (sequence) and the
selection step averages each candidate's per-position NLL over the valid positions of each image before it takes its
paired bound: the image is the unit of its standard error.

Perturbed copies. ``fit(..., shift="auto")`` judges the held-out choices on perturbed copies of the held-out images
too, as for one label per input: the kinds are graded by per-position accuracy and each copy's kind and strength is
recorded per position. The default is ``shift=None``: a dense held-out set has a row per position, so the shift-aware
choice costs tens of times the clean one, and a single temperature chosen that way helps some unseen shifts and hurts
others (docs/dense.md).

Example:
    >>> import torch
    >>> from torch import nn
    >>> import posthoc
    >>> model = nn.Conv2d(1, 3, 1)                               # logits (N, 3, H, W)
    >>> images, masks = torch.randn(16, 1, 8, 8), torch.randint(0, 3, (16, 8, 8))
    >>> um = posthoc.wrap(model, method="temperature", dense=True).fit(None, [(images, masks)])
    >>> pred = um.predict(images[:4])
    >>> tuple(pred.probs.shape), tuple(pred.entropy.shape)
    ((4, 3, 8, 8), (4, 8, 8))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from posthoc import settings
from posthoc.core.checks import memory_bytes, positive_int
from posthoc.core.chunks import budget_scope, rows_per_chunk
from posthoc.core.inputs import KEEP, Inputs, batch_size, labels_per_input, slice_inputs, split_batch, to_device
from posthoc.core.logits import LOGITS_KEY
from posthoc.core.method import Method, chain_of
from posthoc.core.modules import eval_mode
from posthoc.core.prediction import Prediction, RegressionPrediction, concat
from posthoc.engine.dense_head import position_head
from posthoc.errors import ExportError, InputError, NotFittedError
from posthoc.export.build import to_module
from posthoc.export.modules import Backbone, ExportedPositions

#: the key a tensor input goes under: images (floating point) and token ids (integers), as the perturbations read them
IMAGE_KEY, TOKEN_KEY = "pixel_values", "input_ids"
#: the ignore indices of torchvision (Pascal VOC) and of Hugging Face
PIXEL_IGNORE, TOKEN_IGNORE = 255, -100
#: float32 copies of one position's samples ``predict`` holds at once (as the row predict)
SAMPLE_COPIES = 2
#: float32 copies of a group's samples alive at once when one input's samples are drawn in groups: the network's
#: outputs, their log-softmax and the method's mean over them, then the probabilities and their entropy terms
GROUP_COPIES = 5


def dense_logits(output: Any) -> Tensor:
    """The per-position logits of a model's ``output``: the tensor, its ``.logits``, or the ``"out"`` / ``"logits"``
    entry of a dict (torchvision's segmentation models return ``{"out": ...}``).

    Example:
        >>> import torch
        >>> from posthoc.engine.dense import dense_logits
        >>> dense_logits({"out": torch.zeros(2, 5, 4, 4)}).shape
        torch.Size([2, 5, 4, 4])
    """
    if isinstance(output, Tensor):
        logits = output
    elif isinstance(output, Mapping):
        logits = output.get("out", output.get(LOGITS_KEY))
    else:
        logits = getattr(output, LOGITS_KEY, None)
    if not isinstance(logits, Tensor) or logits.dim() < 3:
        shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(output).__name__
        raise InputError(
            f"dense=True needs per-position logits (N, C, H, W) or (N, T, V); the model returned {shape}. Wrap a "
            "classifier of one label per input without dense=True"
        )
    return logits


def class_dim_of(logits_shape: torch.Size, labels_shape: torch.Size, class_dim: int | None = None) -> int:
    """The class dimension of logits shaped ``logits_shape`` for labels shaped ``labels_shape`` (non-negative).

    Example:
        >>> import torch
        >>> from posthoc.engine.dense import class_dim_of
        >>> class_dim_of(torch.Size([2, 11, 32, 32]), torch.Size([2, 32, 32])), class_dim_of(torch.Size([2, 7, 50]), torch.Size([2, 7]))
        (1, 2)
        >>> class_dim_of(torch.Size([2, 5, 5]), torch.Size([2, 5]))
        Traceback (most recent call last):
        posthoc.errors.InputError: the class dimension of logits (2, 5, 5) for labels (2, 5) is ambiguous ...
    """
    logits_shape, labels_shape = tuple(logits_shape), tuple(labels_shape)
    if class_dim is not None:
        dim = class_dim % len(logits_shape)
        if dim == 0 or logits_shape[:dim] + logits_shape[dim + 1 :] != labels_shape:
            raise InputError(
                f"labels {labels_shape} do not match logits {logits_shape} with class_dim={class_dim}: the labels "
                "must have the logits' shape without the class dimension (one class index per position)"
            )
        return dim
    dims = [d for d in range(1, len(logits_shape)) if logits_shape[:d] + logits_shape[d + 1 :] == labels_shape]
    if not dims:
        raise InputError(
            f"labels {labels_shape} do not match logits {logits_shape}: dense labels hold one class index per position, "
            "the logits' shape without the class dimension (masks (N, H, W) for logits (N, C, H, W); tokens (N, T) for "
            "(N, T, V))"
        )
    if len(dims) > 1:
        raise InputError(
            f"the class dimension of logits {logits_shape} for labels {labels_shape} is ambiguous (dimensions {dims} "
            "both fit); pass class_dim= to posthoc.wrap (1 for (N, C, H, W), -1 for (N, T, V))"
        )
    return dims[0]


def regression_dim_of(outputs_shape: torch.Size, targets_shape: torch.Size, dim: int | None = None) -> int:
    """The output dimension of a per-position regressor's outputs ``(N, D, *P)`` for targets of the same shape
    (``dim``, default 1; a target may be NaN where there is none, e.g. an invalid depth pixel).

    Example:
        >>> import torch
        >>> from posthoc.engine.dense import regression_dim_of
        >>> regression_dim_of(torch.Size([2, 1, 8, 8]), torch.Size([2, 1, 8, 8]))
        1
    """
    if tuple(outputs_shape) != tuple(targets_shape):
        raise InputError(
            f"targets {tuple(targets_shape)} do not match the outputs {tuple(outputs_shape)}: a per-position regressor "
            "takes targets of its outputs' shape (N, D, H, W), NaN where a position has no target"
        )
    return 1 if dim is None else dim % len(outputs_shape)


def to_rows(logits: Tensor, class_dim: int) -> Tensor:
    """Logits ``(N, ..., C, ...)`` as rows ``(N·P, C)``, positions in the order of ``logits`` without the class dim."""
    return logits.movedim(class_dim, -1).reshape(-1, logits.shape[class_dim])


class PositionRows(nn.Module):
    """The user's dense network as a row model: ``forward(**inputs)`` returns the rows ``(kept positions, C)`` of the
    positions ``inputs[KEEP]`` marks. ``class_dim`` and whether the user's input was one tensor are set by
    :class:`DenseModel` from the first batch it sees.

    With ``split_head=True`` (last-layer methods) the row model ends in a linear ``head``: the user's per-position head
    (a 1x1 convolution or a Linear applied at every position, :func:`~posthoc.engine.dense_head.position_head`) as
    an ``nn.Linear`` sharing its weights, applied to the rows of the features it receives. The user's head is then
    not run on the positions left out, and the row model's features are the head's input at each kept position, so
    last-layer curvature counts every position as an example (KFAC over positions)."""

    def __init__(self, model: nn.Module, class_dim: int | None = None, *, split_head: bool = False) -> None:
        super().__init__()
        self.model = model
        self.class_dim = class_dim
        self.tensor_key: str | None = None
        self.position_head = position_head(model) if split_head else None
        if self.position_head is not None:
            self.head = self.position_head.as_linear()

    def dense(self, inputs: Mapping[str, Tensor]) -> Tensor:
        """The user's per-position logits for the row model's ``inputs`` (the mask left out)."""
        given = {k: v for k, v in inputs.items() if k != KEEP}
        return self.user_logits(given[self.tensor_key] if self.tensor_key else given)

    def user_logits(self, x: Inputs) -> Tensor:
        """The user's per-position logits for the user's inputs ``x``."""
        return dense_logits(self.model(**x) if isinstance(x, Mapping) else self.model(x))

    def forward(self, **inputs: Tensor) -> Tensor:
        keep = inputs.get(KEEP)  # None: every position (the exported module, DenseModel.to_module)
        if self.position_head is None:
            grid = self.dense(inputs).movedim(self.class_dim if self.class_dim is not None else 1, -1)
        else:
            given = {k: v for k, v in inputs.items() if k != KEEP}
            x = given[self.tensor_key] if self.tensor_key else given
            grid = self.position_head.features(self.model, x, stop=keep is not None)
        self.positions = grid.shape[:-1]  # (N, *P) of the last call: the exported module shapes its rows back by it
        rows = grid.reshape(-1, grid.shape[-1])
        if keep is not None:
            rows = rows[_samples_of(keep, rows)]
        return rows if self.position_head is None else self.head(rows)


def _samples_of(keep: Tensor, rows: Tensor) -> Tensor:
    """The mask ``keep`` ``(m, *P)`` over ``rows`` ``(S·m·P, ·)``: a sampling method that repeats the batch inside the
    network (the suffix runner, sample-major) gives ``S`` rows per position, each kept as its position is."""
    keep = keep.reshape(-1)
    samples = rows.shape[0] // max(keep.numel(), 1)
    return keep.repeat(samples) if samples > 1 else keep


def kept(labels: Tensor, num_classes: int, ignore_index: int | None) -> Tensor:
    """Which positions of ``labels`` count: not the ignore index (default -100, and 255 for at most 255 classes)."""
    if ignore_index is not None:
        return labels != ignore_index
    keep = labels != TOKEN_IGNORE
    return keep & (labels != PIXEL_IGNORE) if num_classes <= PIXEL_IGNORE else keep


def valid_labels(labels: Tensor, num_classes: int, ignore_index: int | None) -> tuple[Tensor, Tensor]:
    """``(keep, labels[keep])``: the mask of the positions that count (:func:`kept`) and their labels, checked to be
    class indices."""
    keep = kept(labels, num_classes, ignore_index)
    valid = labels[keep]
    if valid.numel() and (valid.min() < 0 or valid.max() >= num_classes):
        raise InputError(
            f"dense labels must be class indices in [0, {num_classes}) or the ignore index; got values "
            f"{int(valid.min())}..{int(valid.max())}. Pass ignore_index= to posthoc.wrap for another ignore value"
        )
    return keep, valid


class DenseBatches:
    """A loader of ``(inputs, labels)`` with labels per position, seen as the row batches ``({inputs, keep}, rows)``."""

    def __init__(
        self,
        loader: Iterable,
        rows: PositionRows,
        num_classes: int,
        ignore_index: int | None,
        *,
        regression: bool = False,
    ) -> None:
        self.loader, self.rows, self.num_classes, self.ignore_index = loader, rows, num_classes, ignore_index
        self.regression = regression

    def __iter__(self) -> Iterator[tuple[dict[str, Tensor], Tensor]]:
        for batch in self.loader:
            x, y = split_batch(batch)
            if self.regression:  # targets (N, D, *P): a position counts where all its D targets are finite
                dim = self.rows.class_dim
                keep = torch.isfinite(y).all(dim=dim)
                yield row_inputs(x, keep, self.rows), y.movedim(dim, -1)[keep]
                continue
            keep, labels = valid_labels(y, self.num_classes, self.ignore_index)
            yield row_inputs(x, keep, self.rows), labels

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]


def row_inputs(x: Inputs, keep: Tensor, rows: PositionRows) -> dict[str, Tensor]:
    """The row model's inputs: the user's inputs (one tensor under :data:`IMAGE_KEY` or :data:`TOKEN_KEY`) and the
    mask ``keep`` ``(N, *P)``."""
    if isinstance(x, Mapping):
        return {**x, KEEP: keep}
    key = rows.tensor_key or (IMAGE_KEY if x.is_floating_point() else TOKEN_KEY)
    return {key: x, KEEP: keep}


class DenseModel(nn.Module):
    """A wrapped model with dense outputs (``posthoc.wrap(model, ..., dense=True)``): ``fit`` / ``choose`` on loaders of
    ``(inputs, labels per position)``, ``predict`` with the positions kept (see module docs). A per-position regressor
    may carry a ``calibration``, fitted after the methods on the valid held-out positions, each row with its image."""

    def __init__(
        self,
        inner: nn.Module,
        rows: PositionRows | list[PositionRows],
        ignore_index: int | None,
        calibration: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.position_rows = rows if isinstance(rows, list) else [rows]
        self.ignore_index = ignore_index
        self.num_classes: int | None = None
        #: a per-position regressor's calibrator, fitted on the valid held-out positions after the methods
        #: (:class:`~posthoc.methods.calibration.per_position.PositionCalibration`; ``None``: none)
        self.calibration = calibration

    @property
    def methods(self) -> list[str]:
        """The methods, inner first, and the per-position calibrator last where there is one."""
        return self.inner.methods + ([] if self.calibration is None else [self.calibration.name])

    @property
    def is_fitted(self) -> bool:
        calibrated = self.calibration is None or self.calibration.fitted
        return self.inner.is_fitted and self.num_classes is not None and calibrated

    def _learn_layout(self, loader: Iterable | None) -> None:
        """The class dimension and the input kind, from the first labelled batch of ``loader`` and one forward."""
        if loader is None:
            return
        x, y = split_batch(next(iter(loader)))
        for rows in self.position_rows:
            rows.tensor_key = None if isinstance(x, Mapping) else (IMAGE_KEY if x.is_floating_point() else TOKEN_KEY)
            device = next((p.device for p in rows.parameters()), torch.device("cpu"))
            with torch.no_grad(), eval_mode(rows):
                logits = rows.user_logits(to_device(x, device))
            if self.regression:
                rows.class_dim = regression_dim_of(logits.shape, y.shape, rows.class_dim)
            else:
                rows.class_dim = class_dim_of(logits.shape, y.shape, rows.class_dim)
            self.num_classes = logits.shape[rows.class_dim]
            if rows.position_head is not None:
                with torch.no_grad(), eval_mode(rows):
                    rows.position_head.check(rows.user_logits, to_device(x, device), rows.class_dim)

    @property
    def regression(self) -> bool:
        """Whether the outputs are real values per position (``likelihood="regression"``), not class logits."""
        return self.inner.likelihood.prediction_type is RegressionPrediction

    def _rows(self, loader: Iterable | None) -> Iterable | None:
        if loader is None:
            return None
        rows = self.position_rows[0]
        return DenseBatches(loader, rows, self.num_classes, self.ignore_index, regression=self.regression)

    def fit(
        self, train_loader: Iterable | None = None, val_loader: Iterable | None = None, **options: Any
    ) -> DenseModel:
        """Fit the methods on the valid positions of the batches (``UncertainModel.fit``'s options)."""
        if self.calibration is not None and val_loader is None:
            raise InputError(
                f"'{self.calibration.name}' is fitted on held-out positions: call um.fit(train_loader, val_loader)"
            )
        self._learn_layout(val_loader if val_loader is not None else train_loader)
        options.setdefault("shift", None)  # module docs: why the held-out choices see clean batches by default
        self.inner.fit(self._rows(train_loader), self._rows(val_loader), **options)
        self._calibrate_on(val_loader, options.get("tolerance"))
        return self

    def choose(self, val_loader: Iterable, **options: Any) -> DenseModel:
        """Make the held-out choices again on ``val_loader`` (``UncertainModel.choose``'s options)."""
        options.setdefault("shift", None)
        self.inner.choose(self._rows(val_loader), **options)
        self._calibrate_on(val_loader, options.get("tolerance"))
        return self

    def _calibrate_on(self, val_loader: Iterable | None, tolerance: Any) -> None:
        """Fit the calibration (if any) on the inner predictive of every valid position of ``val_loader``, each row
        with the image it belongs to (the unit of ``"auto"``'s choice)."""
        if self.calibration is None:
            return
        device = self.inner.method.follow_model_device()
        generator = torch.Generator(device=device).manual_seed(0)
        parts, targets, units, images = [], [], [], 0
        for inputs, y in self._rows(val_loader):
            inputs = to_device(inputs, device)
            with torch.no_grad(), eval_mode(self.inner.method, self.inner._served()):
                parts.append(self.inner.method.regression_predictive(inputs, generator=generator))
            counts = labels_per_input(inputs)
            units.append(torch.repeat_interleave(torch.arange(images, images + len(counts)), counts).to(device))
            images += len(counts)
            targets.append(y.to(device))
        self.calibration.fit(concat(parts), torch.cat(targets), torch.cat(units), tolerance=tolerance)

    #: read by the entry points that treat dense outputs their own way (``posthoc.conformal``, ``evaluate_shift``)
    dense_outputs = True

    def summary(self) -> Any:
        """The wrapped model's card, with the per-position calibration's (``"calibration"``) where there is one."""
        card = self.inner.summary()
        if self.calibration is not None:
            card["calibration"] = self.calibration.summary()
        return card

    def forward(self, x: Inputs) -> Tensor:
        """The predictive probabilities at every position of ``x``, shaped like the model's logits."""
        return self.predict(x).probs

    def save(self, path: str) -> None:
        """Write the fitted posterior and the layout of the positions to ``path``; ``posthoc.load(path, model)``
        (an ensemble: ``posthoc.load(path, [m1, m2])``) gives the dense model back, on the same checkpoints only (the
        fingerprints cover the networks' weights). The members of an ensemble share the layout: they were fitted on
        the same batches."""
        if not self.is_fitted:
            raise NotFittedError("nothing to save: fit the dense model first (um.fit(...))")
        rows = self.position_rows[0]
        layout = {
            "class_dim": rows.class_dim,
            "tensor_key": rows.tensor_key,
            "ignore_index": self.ignore_index,
            "num_classes": self.num_classes,
            "split_head": rows.position_head is not None,
        }
        if self.calibration is not None:
            layout["calibration"] = self.calibration.state()
        self.inner.save(path, dense=layout)

    @classmethod
    def restored(
        cls, inner: nn.Module, rows: PositionRows | list[PositionRows], layout: Mapping[str, Any]
    ) -> DenseModel:
        """The dense model of a loaded ``inner`` model, fitted on ``rows`` with the saved ``layout``."""
        dense = cls(inner, rows, layout["ignore_index"])
        dense.num_classes = layout["num_classes"]
        return dense

    def to_module(self, *, num_samples: int | None = None, seed: int = 0) -> nn.Module:
        """The fitted predictive as a self-contained ``nn.Module`` (``UncertainModel.to_module``) whose
        ``module(x)`` gives the probabilities at every position of ``x``, shaped like the model's logits, as
        ``um.predict(x).probs``; ``torch.export`` takes it. The methods it exports: :data:`EXPORTED`, and ``auto``
        when it chose one of them; the others are refused with an :class:`~posthoc.errors.ExportError`.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> import posthoc
            >>> images, masks = torch.randn(8, 1, 6, 6), torch.randint(0, 3, (8, 6, 6))
            >>> um = posthoc.wrap(nn.Conv2d(1, 3, 1), method="temperature", dense=True).fit(None, [(images, masks)])
            >>> module = um.to_module()
            >>> torch.allclose(module(images), um.predict(images).probs, atol=1e-6)
            True
        """
        positive_int(num_samples, "num_samples", none="the method's own")
        if not self.is_fitted:
            raise NotFittedError("um.to_module() exports the fitted predictive: call um.fit(...) first")
        unsupported = [name for name in _exported_chain(self.inner.method) if name not in EXPORTED]
        if len(self.position_rows) > 1 or self.regression or unsupported:
            what = (
                "an ensemble"
                if len(self.position_rows) > 1
                else "a per-position regressor"
                if self.regression
                else f"'{unsupported[0]}'"
            )
            raise ExportError(
                f"um.to_module() of a dense model does not export {what} yet; it exports dense classifiers under "
                f"{', '.join(EXPORTED)} (and auto when it chose them); serve it in process with um.predict instead"
            )
        classifier = to_module(self.inner, num_samples=num_samples, seed=seed)
        backbone = next(m for m in classifier.modules() if isinstance(m, Backbone))
        rows = self.position_rows[0]
        return ExportedPositions(classifier, backbone, rows.class_dim, rows.tensor_key).eval()

    @torch.no_grad()
    def predict(
        self,
        x: Inputs,
        *,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
        chunk_size: int | None = None,
        keep_samples: bool = False,
        max_memory: int | None = None,
    ) -> Prediction:
        """The predictive at every position of ``x``: ``probs`` shaped like the model's logits, the per-position
        fields shaped like its labels, ``samples`` ``(S, *probs.shape)`` only with ``keep_samples=True``. Images
        (sequences) are predicted in chunks whose ``(S, P, C)`` samples fit ``max_memory``."""
        if not self.is_fitted:
            raise NotFittedError("fit the dense model first: um.fit(train_loader, val_loader)")
        if self.regression:
            return self._predict_regression(x, num_samples, generator, chunk_size, keep_samples)
        positive_int(num_samples, "num_samples", none="the method's own")
        chunk_size = positive_int(settings.chunk_size if chunk_size is None else chunk_size, "chunk_size")
        budget = settings.memory_budget(memory_bytes(max_memory) or self.inner.run.max_memory)
        total = batch_size(x)
        options = {"num_samples": num_samples, "generator": generator}
        device = self.inner.method.follow_model_device()
        layout = self._layout(x, device)
        draws = num_samples or getattr(self.inner.method, "num_samples", None)
        group = max(1, budget // (SAMPLE_COPIES * 4 * layout.numel()))
        if draws is not None and draws > group and not keep_samples:
            grouped = self._predict_in_sample_groups(x, layout, device, draws, budget, generator)
            if grouped is not None:
                return grouped
        with budget_scope(max(1, budget - budget // SAMPLE_COPIES)):
            parts = [self._chunk(slice_inputs(x, 0, 1), layout, device, options)]
            draws = 1 if parts[0].samples is None else parts[0].samples.shape[0]
            per_input = SAMPLE_COPIES * 4 * draws * parts[0].probs.numel()
            step = rows_per_chunk(per_input, max_memory=budget, limit=chunk_size)
            if not keep_samples:
                parts[0] = dataclasses.replace(parts[0], samples=None)
            for start in range(1, total, step):
                part = self._chunk(slice_inputs(x, start, start + step), layout, device, options)
                if not keep_samples:
                    part = dataclasses.replace(part, samples=None)
                parts.append(part)
        return _joined(parts)

    def _predict_in_sample_groups(
        self,
        x: Inputs,
        layout: torch.Size,
        device: torch.device,
        draws: int,
        budget: int,
        generator: torch.Generator | None,
    ) -> Prediction | None:
        """One input at a time, its ``draws`` samples drawn in groups that fit ``budget`` (one input's ``(S, P, C)``
        samples do not): the mean predictive is a running log-sum-exp of the groups' means and the aleatoric part a
        running sum of the samples' entropies, so no more than one group of samples of a map is alive at once.
        Without a ``generator`` one is seeded from torch's global generator, so that the groups draw different
        samples. ``None`` when the method's predictive draws no samples (probit Laplace): it needs no groups."""
        if generator is None:
            seed = int(torch.randint(2**62, (), generator=None))
            generator = torch.Generator(device=device).manual_seed(seed)
        rows, method = self.position_rows[0], self.inner.method
        group = max(1, budget // (GROUP_COPIES * 4 * layout.numel()))
        keep = torch.ones((1, *layout[:-1]), dtype=torch.bool, device=device)
        parts = []
        for start in range(batch_size(x)):
            inputs = to_device(row_inputs(slice_inputs(x, start, start + 1), keep, rows), device)
            log_mean, expected_entropy, done = None, None, 0
            while done < draws:
                count = min(group, draws - done)
                with budget_scope(budget // 2), eval_mode(method, self.inner._served()):
                    log_probs, samples = method.log_predictive(inputs, num_samples=count, generator=generator)
                if samples is None:
                    return None
                weighted = log_probs.float() + math.log(count)
                log_mean = weighted if log_mean is None else torch.logaddexp(log_mean, weighted)
                probs = samples.float().exp()
                del samples
                total = -torch.special.xlogy(probs, probs).sum((0, -1))
                expected_entropy = total if expected_entropy is None else expected_entropy + total
                done += count
            flat = Prediction.from_probs((log_mean - math.log(draws)).exp())
            aleatoric = expected_entropy / draws
            epistemic = (flat.entropy - aleatoric).clamp_min(0.0)
            flat = dataclasses.replace(flat, aleatoric=aleatoric, epistemic=epistemic)
            parts.append(_positions_of(flat, (1, *layout), rows.class_dim))
        return _joined(parts)

    def _predict_regression(
        self,
        x: Inputs,
        num_samples: int | None,
        generator: torch.Generator | None,
        chunk_size: int | None,
        keep_samples: bool,
    ) -> RegressionPrediction:
        """The Gaussian predictive of every position of ``x`` as rows ``(N·P, D)``, positions in the order of the
        outputs without their output dimension (:func:`to_rows`; :meth:`maps` shapes a field back)."""
        positive_int(num_samples, "num_samples", none="the method's own")
        step = positive_int(settings.chunk_size if chunk_size is None else chunk_size, "chunk_size")
        rows = self.position_rows[0]
        device = self.inner.method.follow_model_device()
        positions = self._layout(x, device)[:-1]
        parts = []
        for start in range(0, batch_size(x), step):
            part = to_device(slice_inputs(x, start, start + step), device)
            keep = torch.ones((batch_size(part), *positions), dtype=torch.bool, device=device)
            inputs = row_inputs(part, keep, rows)
            with eval_mode(self.inner.method, self.inner._served()):
                part = self.inner.method.regression_predictive(inputs, num_samples=num_samples, generator=generator)
            parts.append(part if self.calibration is None else self.calibration.calibrate(part))
        return concat(parts, keep_samples)

    def _layout(self, x: Inputs, device: torch.device) -> torch.Size:
        """The positions and outputs of one input of ``x``, ``(*P, C)``: one forward of its first input."""
        rows = self.position_rows[0]
        with eval_mode(rows):
            return rows.user_logits(to_device(slice_inputs(x, 0, 1), device)).movedim(rows.class_dim, -1).shape[1:]

    def maps(self, values: Tensor, x_shape: torch.Size | tuple[int, ...]) -> Tensor:
        """A regression field ``values`` ``(N·P, D)`` of :meth:`predict` shaped like the outputs ``x_shape``
        ``(N, D, *P)`` (the output dimension where the model has it)."""
        dim = self.position_rows[0].class_dim
        positions = (x_shape[0], *x_shape[1:dim], *x_shape[dim + 1 :], x_shape[dim])
        return values.reshape(positions).movedim(-1, dim)

    def _chunk(self, x: Inputs, layout: torch.Size, device: torch.device, options: dict[str, Any]) -> Prediction:
        """One chunk's prediction, shaped back from rows to positions (``layout``: one input's ``(*P, C)``)."""
        rows = self.position_rows[0]
        shape = (batch_size(x), *layout)  # (n, *P, C)
        keep = torch.ones(shape[:-1], dtype=torch.bool, device=device)
        inputs = to_device(row_inputs(x, keep, rows), device)
        with eval_mode(self.inner.method, self.inner._served()):
            log_probs, samples = self.inner.method.log_predictive(inputs, **options)
        probs = torch.softmax(log_probs.float(), dim=-1)
        samples = None if samples is None else samples.float().exp()
        return _positions_of(Prediction.from_probs(probs, samples), shape, rows.class_dim)


def _positions_of(flat: Prediction, shape: tuple[int, ...], class_dim: int) -> Prediction:
    """A prediction over rows ``(n·P, C)`` shaped back to the positions ``shape`` ``(n, *P, C)``: ``probs`` with the
    classes at ``class_dim`` as in the model's logits, the per-position fields ``(n, *P)``."""

    def back(values: Tensor, lead: tuple[int, ...] = ()) -> Tensor:
        return values.reshape(*lead, *shape).movedim(-1, class_dim + len(lead))

    return Prediction(
        back(flat.probs),
        None if flat.samples is None else back(flat.samples, (flat.samples.shape[0],)),
        *(
            getattr(flat, name).reshape(shape[:-1])
            for name in ("entropy", "aleatoric", "epistemic", "confidence", "label")
        ),
    )


#: the methods a dense model's ``to_module`` exports (:meth:`DenseModel.to_module`)
EXPORTED = ("none", "temperature", "vector", "laplace")


def _exported_chain(method: Method) -> list[str]:
    """The names of the methods ``method`` exports: its chain, ``auto`` replaced by the chain it chose."""
    names: list[str] = []
    for member in chain_of(method):
        chosen = getattr(member, "chosen", None) if member.name == "auto" else None
        names += _exported_chain(chosen) if chosen is not None else [member.name]
    return names


def _joined(parts: list[Prediction]) -> Prediction:
    def cat(name: str, dim: int = 0) -> Tensor | None:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else torch.cat(values, dim=dim)

    return Prediction(
        cat("probs"), cat("samples", 1), *(cat(n) for n in ("entropy", "aleatoric", "epistemic", "confidence", "label"))
    )
