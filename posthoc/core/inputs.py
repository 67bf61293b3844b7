"""Reading batches from loaders and running models on them, with clear errors.

Loaders yield ``(x, y)`` pairs; ``x`` may be a tensor or a dict of tensors (keyword arguments of the model, e.g. a
Hugging Face ``BatchEncoding``), or a batch is one mapping with its labels under one of :data:`LABEL_KEYS`. Every
public entry point that takes data checks it here (:func:`check_batch`, :func:`iterate`), so a misuse reads the same
everywhere.

Example:
    >>> import torch
    >>> from posthoc.core.inputs import iterate
    >>> loader = [(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))]
    >>> [x.shape[0] for x, y in iterate(loader, device="cpu", progress=False)]
    [4]
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from posthoc.core import distributed
from posthoc.core.logits import logits_of
from posthoc.core.progress import progress_bar
from posthoc.errors import InputError, NumericalError

Inputs = Tensor | Mapping[str, Tensor]
#: the keys under which a mapping batch carries its labels: a Hugging Face collator's ``"labels"``, a ``datasets``
#: column's ``"label"``
LABEL_KEYS = ("labels", "label")
#: what a loader should yield in place of labels that are not numbers
LABELS_AS_NUMBERS = (
    "yield numbers: class indices for a classifier (e.g. map names with "
    "{name: i for i, name in enumerate(class_names)} in the dataset), real values for a regressor"
)


def split_batch(batch: Any, *, require_labels: bool = True) -> tuple[Inputs, Tensor | None]:
    """``(x, y)`` of one batch (a mapping's labels entry is ``y``); ``y`` is ``None`` for unlabelled batches if allowed.

    Example:
        >>> import torch
        >>> from posthoc.core.inputs import split_batch
        >>> x, y = split_batch({"input_ids": torch.ones(2, 5, dtype=torch.long), "labels": torch.tensor([0, 1])})
        >>> sorted(x), y.tolist()
        (['input_ids'], [0, 1])
    """
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[0], batch[1]
    if isinstance(batch, (tuple, list)) and len(batch) == 1:
        batch = batch[0]
    if isinstance(batch, Mapping):
        keys = [key for key in LABEL_KEYS if key in batch]
        if len(keys) > 1:
            raise InputError(
                f"a dict batch holds both {keys[0]!r} and {keys[1]!r}: which are the labels? Keep one of "
                f"{' or '.join(map(repr, LABEL_KEYS))} (drop the other, e.g. dataset.remove_columns)"
            )
        if keys:
            return {k: v for k, v in batch.items() if k != keys[0]}, batch[keys[0]]
    if isinstance(batch, (Tensor, Mapping)):
        if require_labels:
            if isinstance(batch, Mapping):
                raise InputError(
                    f"a dict batch carries its labels under {' or '.join(map(repr, LABEL_KEYS))} (as Hugging Face "
                    f"collators and datasets name them); got keys {sorted(map(str, batch))}: rename the labels "
                    "entry to 'labels', or yield (inputs, labels) pairs"
                )
            raise InputError(
                "the loader yields inputs without labels; this step needs (x, y) pairs "
                "(e.g. a DataLoader over a TensorDataset(x, y)) or dict batches with a 'labels' entry"
            )
        return batch, None
    raise InputError(f"a batch must be (x, y), got {type(batch).__name__}; yield (inputs, labels) pairs")


def to_device(x: Inputs, device: torch.device | str) -> Inputs:
    """Move a tensor, or every tensor of a dict, to ``device`` (non-blocking)."""
    if isinstance(x, Mapping):
        return {k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v for k, v in x.items()}
    if isinstance(x, np.ndarray):
        raise InputError(
            "inputs must be a tensor (or a dict of tensors), got a numpy array; convert them where the batches are "
            "made, e.g. torch.as_tensor(x, dtype=torch.float32), or build the loader with "
            "DataLoader(TensorDataset(torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y)), batch_size=256)"
        )
    if not isinstance(x, Tensor):
        raise InputError(
            f"inputs must be a tensor (or a dict of tensors), got {type(x).__name__}; yield (x, y) "
            "batches whose inputs are stacked into a tensor, e.g. with torch.stack"
        )
    return x.to(device, non_blocking=True)


def batch_size(x: Inputs) -> int:
    """Number of examples in ``x`` (the first dimension of its first tensor)."""
    if isinstance(x, Mapping):
        for value in x.values():
            if isinstance(value, Tensor):
                return value.shape[0]
        raise InputError("the input dict holds no tensor")
    if x.dim() == 0:
        raise InputError("inputs must have a batch dimension; got a 0-d tensor")
    return x.shape[0]


#: the key of the mask of kept positions inside a dense batch's inputs (:mod:`posthoc.engine.dense`): such a batch
#: holds one example (one label) per kept position, not per input
KEEP = "posthoc_keep"


def label_rows(x: Inputs) -> int:
    """The labels a batch ``x`` has: one per input, or one per kept position of a dense batch."""
    if isinstance(x, Mapping) and KEEP in x:
        return int(x[KEEP].sum())
    return batch_size(x)


def labels_per_input(x: Inputs) -> Tensor | None:
    """How many labels each input of a dense batch ``x`` has (its kept positions), ``(N,)`` on the CPU; ``None`` for a
    batch of one label per input."""
    if isinstance(x, Mapping) and KEEP in x:
        return x[KEEP].flatten(1).sum(1).cpu()
    return None


def slice_inputs(x: Inputs, start: int, stop: int) -> Inputs:
    """Examples ``start:stop`` of a tensor, or of every tensor in a dict (views, no copy)."""
    if isinstance(x, Mapping):
        return {k: v[start:stop] if isinstance(v, Tensor) else v for k, v in x.items()}
    return x[start:stop]


def all_finite(x: Inputs) -> bool:
    """Whether every floating-point tensor of ``x`` is free of NaN and inf (one sum per tensor, element by element
    only where the sum is not finite)."""
    tensors = x.values() if isinstance(x, Mapping) else [x]
    return all(_finite(v) for v in tensors if isinstance(v, Tensor) and v.is_floating_point())


def _finite(tensor: Tensor) -> bool:
    total = tensor.sum(dtype=torch.float32 if tensor.element_size() < 4 else None)
    return bool(torch.isfinite(total)) or bool(torch.isfinite(tensor).all())


def check_batch(x: Any, what: str, *, values: bool = True) -> int:
    """Refuse, for ``what`` (the entry point), a batch that is not a tensor or dict of tensors with at least one
    example, finite values and a real token per example; return its example count. ``values=False`` leaves the last
    two to the caller (``predict`` checks them chunk by chunk).

    Example:
        >>> import torch
        >>> from posthoc.core.inputs import check_batch
        >>> check_batch(torch.zeros(0, 3), "detector.score")
        Traceback (most recent call last):
        posthoc.errors.InputError: detector.score got an empty batch (0 examples)...
    """
    if not isinstance(x, (Tensor, Mapping)):
        if isinstance(x, np.ndarray):
            hint = ": convert it first, e.g. torch.as_tensor(x, dtype=torch.float32)"
        elif isinstance(x, (list, tuple)):
            hint = ": stack the examples into one tensor first, e.g. torch.stack(examples) or torch.tensor(rows)"
        elif isinstance(x, Iterable) and not isinstance(x, (str, bytes)):
            hint = (
                ": it takes one batch of inputs; for a loader of (x, y) batches use posthoc.evaluate(um, loader), or "
                "predict batch by batch: [um.predict(x) for x, y in loader]"
            )
        else:
            hint = ""
        raise InputError(f"{what} takes a tensor (or a dict of tensors), got {type(x).__name__}{hint}")
    count = batch_size(x)
    if count == 0:
        raise InputError(f"{what} got an empty batch (0 examples); pass at least one example")
    if values:
        check_finite(x)
        check_attention(x)
    return count


def as_tensor(values: Any, what: str, *, numbers: bool = False, hint: str | None = None) -> Tensor:
    """``values`` (a tensor, numpy array, or list) as a tensor, refusing strings and objects with ``hint``;
    ``numbers=True`` also takes a single number (a batch's one label).

    Example:
        >>> import numpy as np
        >>> from posthoc.core.inputs import as_tensor
        >>> as_tensor(np.array(["cat", "dog"]), "labels")
        Traceback (most recent call last):
        posthoc.errors.InputError: labels are strings (e.g. 'cat')...
    """
    if isinstance(values, Tensor):
        return values.detach()
    if numbers and isinstance(values, (int, float, np.number)) and not isinstance(values, bool):
        return torch.as_tensor(values)
    if not isinstance(values, (np.ndarray, list, tuple)):
        raise InputError(f"{what} must be a tensor or a numpy array, got {type(values).__name__}")
    try:
        array = np.asarray(values)
    except ValueError as err:  # ragged nested lists
        raise InputError(
            f"{what} cannot be read as an array of numbers ({err}); pass a tensor or an array of one shape"
        ) from None
    if array.dtype.kind in "USO":
        example = str(array.reshape(-1)[0]) if array.size else ""
        if hint is None:
            hint = (
                (
                    "pass integer class indices 0..C-1 in the order of the logits' columns, e.g. "
                    "np.unique(labels, return_inverse=True)[1]"
                )
                if what == "labels"
                else "pass numbers"
            )
        raise InputError(
            f"{what} are {'strings' if array.dtype.kind in 'US' else 'Python objects'} "
            f"(e.g. {example!r}), not numbers; {hint}"
        )
    return torch.as_tensor(array)


def like_given(result: Any, *given: Any) -> Any:
    """``result`` (a tensor, or a tuple of them) as numpy arrays when any of ``given`` was numpy, else as it is."""
    if not any(isinstance(value, np.ndarray) for value in given):
        return result
    if isinstance(result, tuple):
        return tuple(like_given(part, *given) for part in result)
    return result.detach().cpu().numpy() if isinstance(result, Tensor) else result


def real_values(values: Any, what: str = "targets") -> Tensor:
    """``values`` as a tensor of real numbers, refusing strings, objects, NaN and inf (how regression reads targets).

    Example:
        >>> from posthoc.core.inputs import real_values
        >>> real_values([1.0, float("nan")])
        Traceback (most recent call last):
        posthoc.errors.InputError: targets contain NaN or inf; drop or impute those rows first
    """
    values = as_tensor(values, what)
    if values.is_complex():
        raise InputError(f"{what} are complex numbers; pass real values")
    if values.is_floating_point() and not bool(torch.isfinite(values).all()):
        raise InputError(f"{what} contain NaN or inf; drop or impute those rows first")
    return values


def looks_like_loader(data: Any) -> bool:
    """Whether ``data`` is a loader of batches rather than an array of labels or numbers (a nested list of numbers)."""
    if isinstance(data, (Tensor, np.ndarray, Mapping, str, bytes)) or not isinstance(data, Iterable):
        return False
    if isinstance(data, (list, tuple)):
        return all(
            isinstance(batch, Mapping)
            or (
                isinstance(batch, (list, tuple))
                and any(isinstance(v, (Tensor, Mapping, np.ndarray, list)) for v in batch)
            )
            for batch in data
        )
    return True


def loader_fix(data: Any) -> str:
    """The one line that turns arrays like ``data`` (tensors or numpy arrays) into a loader of ``(x, y)`` batches."""
    values = data if isinstance(data, (list, tuple)) else [data]
    if any(isinstance(value, np.ndarray) for value in values):
        return "DataLoader(TensorDataset(torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y)), batch_size=256)"
    return "DataLoader(TensorDataset(x, y), batch_size=256)"


def arrays_pair(data: Any) -> bool:
    """Whether ``data`` is a pair of arrays ``(x, y)`` (tensors or numpy arrays) rather than a loader of batches."""
    return (
        isinstance(data, (list, tuple))
        and len(data) == 2
        and all(isinstance(value, (Tensor, np.ndarray)) for value in data)
    )


def check_loader(loader: Any, what: str, *, labelled: bool = True) -> None:
    """Refuse, for ``what``, something that is not a loader of batches and, where labels are needed (``labelled``), a
    pair of arrays ``(x, y)`` in a loader's place, with the line that makes a loader of them.

    Example:
        >>> import torch
        >>> from posthoc.core.inputs import check_loader
        >>> check_loader(torch.zeros(4, 3), "evaluate")
        Traceback (most recent call last):
        posthoc.errors.InputError: evaluate takes a loader of (x, y) batches, got a Tensor...
    """
    if labelled and arrays_pair(loader):
        raise InputError(
            f"{what} takes a loader of (x, y) batches, got a {type(loader).__name__} of two arrays (x, y); wrap them "
            f"in a DataLoader: {loader_fix(loader)}"
        )
    if isinstance(loader, (Tensor, np.ndarray, Mapping, str, bytes)) or not isinstance(loader, Iterable):
        raise InputError(
            f"{what} takes a loader of (x, y) batches, got a {type(loader).__name__}; wrap tensors in one, e.g. "
            f"{loader_fix(loader)}, or pass a list of (x, y) pairs"
        )


def check_fit_loaders(train_loader: Any, val_loader: Any, what: str = "um.fit") -> None:
    """Refuse arrays passed to ``fit`` in the loaders' place (``um.fit(x, y)``), with the line that makes a loader.

    Example:
        >>> import torch
        >>> from posthoc.core.inputs import check_fit_loaders
        >>> check_fit_loaders(torch.zeros(4, 3), torch.zeros(4))
        Traceback (most recent call last):
        posthoc.errors.InputError: um.fit takes loaders, um.fit(train_loader, val_loader), got two arrays...
    """
    arrays = (Tensor, np.ndarray)
    if isinstance(train_loader, arrays) and isinstance(val_loader, arrays):
        raise InputError(
            f"{what} takes loaders, {what}(train_loader, val_loader), got two arrays (x, y); wrap them in a "
            f"DataLoader: {what}({loader_fix([train_loader, val_loader])})"
        )
    for name, loader in (("train_loader", train_loader), ("val_loader", val_loader)):
        if loader is not None:
            check_loader(loader, f"{what} ({name})")


def check_label_count(count: int, y: Tensor, where: str) -> None:
    """Refuse labels ``y`` that are not one per input of a batch of ``count`` examples (``where`` names the batch)."""
    if y.dim() == 0 and count > 1:
        raise InputError(
            f"{where} holds one label (a 0-d tensor) beside inputs whose first dimension is {count}: the loader "
            "yields one example at a time, without a batch dimension (DataLoader(..., batch_size=None)?); give it a "
            "batch size, e.g. DataLoader(dataset, batch_size=256)"
        )
    labels = y.shape[0] if y.dim() else 1
    if labels != count:
        raise InputError(
            f"{where} has {count} inputs but {labels} labels; yield one label per input (check the "
            "dataset's __getitem__ or the collate function)"
        )


def check_finite(x: Inputs) -> None:
    """Refuse inputs that contain NaN or inf: no predictive is meaningful for them."""
    if not all_finite(x):
        raise InputError("inputs contain NaN or inf; clean or impute them before predicting")


def check_finite_result(values: Tensor, what: str, *, log_probs: bool = False) -> None:
    """Refuse a result computed from finite inputs (features, log-probabilities) that holds NaN or inf;
    ``log_probs=True`` allows ``-inf`` (a probability of exactly 0).

    Example:
        >>> import torch
        >>> from posthoc.core.inputs import check_finite_result
        >>> check_finite_result(torch.tensor([0.5, float("nan")]), "dac's features at 'layer3'")
        Traceback (most recent call last):
        posthoc.errors.NumericalError: dac's features at 'layer3' hold NaN or inf although the inputs are finite...
    """
    bad = torch.isnan(values) | torch.isposinf(values) if log_probs else ~torch.isfinite(values)
    if bool(bad.any()):
        raise NumericalError(
            f"{what} hold NaN or inf although the inputs are finite: the model's weights hold NaN or its activations "
            "overflow; check its weights and dtype (e.g. float16 overflow), or run it in float32, then fit again"
        )


def check_attention(x: Inputs) -> None:
    """Refuse a dict batch whose ``attention_mask`` masks every position of some example (padding only).

    Example:
        >>> import torch
        >>> from posthoc.core.inputs import check_attention
        >>> check_attention({"input_ids": torch.ones(2, 3), "attention_mask": torch.tensor([[1, 1, 0], [0, 0, 0]])})
        Traceback (most recent call last):
        posthoc.errors.InputError: example(s) [1] are padding only...
    """
    mask = x.get("attention_mask") if isinstance(x, Mapping) else None
    if not isinstance(mask, Tensor) or mask.dim() < 2:
        return
    empty = ~mask.reshape(mask.shape[0], -1).bool().any(dim=1)
    if bool(empty.any()):
        rows = empty.nonzero().flatten().tolist()
        raise InputError(
            f"example(s) {rows[:10]}{' ...' if len(rows) > 10 else ''} are padding only (attention_mask is 0 at every "
            "position): the model has nothing to read. Drop empty texts before tokenizing, or pass inputs whose "
            "attention_mask marks at least one real token"
        )


def check_labels(y: Tensor, num_classes: int, *, where: str = "") -> Tensor:
    """Class labels ``y`` checked against ``num_classes``, as int64 (``where`` names whose labels).

    Example:
        >>> import torch
        >>> from posthoc.core.inputs import check_labels
        >>> check_labels(torch.tensor([0, 3]), 3, where="the validation loader's")
        Traceback (most recent call last):
        posthoc.errors.InputError: the validation loader's labels must lie in [0, 3) for a model with 3 classes; ...
    """
    whose = f"{where} labels" if where else "labels"
    y = as_tensor(y, "labels", numbers=True)
    if y.is_floating_point() or y.is_complex():
        if y.numel() and not torch.equal(y, y.round()):
            raise InputError(
                f"{whose} are not whole numbers: this looks like regression targets, but the "
                "model is wrapped as a classifier; pass integer class indices in [0, C), or wrap a model that "
                "predicts numbers with posthoc.wrap(..., likelihood='regression')"
            )
    if y.dim() == 2 and y.shape[1] > 1 and y.shape[1] == num_classes and bool(((y == 0) | (y == 1)).all()):
        raise InputError(
            f"{whose} have shape {tuple(y.shape)}, one-hot rows over the {num_classes} classes: pass class indices "
            "(N,) instead, e.g. y.argmax(-1)"
        )
    y = y.long().reshape(-1)
    if y.numel() and (y.min() < 0 or y.max() >= num_classes):
        raise InputError(
            f"{whose} must lie in [0, {num_classes}) for a model with {num_classes} classes; "
            f"got values from {int(y.min())} to {int(y.max())}. Pass label ids the model was trained on "
            "(for a Hugging Face model: its config.num_labels / label2id)"
        )
    return y


def run_model(model: nn.Module, x: Inputs) -> Tensor:
    """The logits ``model`` returns for ``x`` (keyword arguments for a dict; :func:`logits_of` reads the output);
    shape or dtype failures become an :class:`InputError` that says what to pass.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from posthoc.core.inputs import run_model
        >>> run_model(nn.Linear(3, 2), torch.zeros(4, 3, dtype=torch.float64))
        Traceback (most recent call last):
        posthoc.errors.InputError: the model failed on inputs with shape (4, 3), dtype torch.float64: ...
    """
    try:
        out = model(**x) if isinstance(x, Mapping) else model(x)
    except (RuntimeError, TypeError, ValueError, IndexError) as err:
        described = (
            {k: (tuple(v.shape), str(v.dtype)) for k, v in x.items() if isinstance(v, Tensor)}
            if isinstance(x, Mapping)
            else f"shape {tuple(x.shape)}, dtype {x.dtype}"
        )
        raise InputError(
            f"the model failed on inputs with {described}: {err}. {_dtype_hint(model, x)}{_labels_hint(x)}"
            "Pass inputs shaped and "
            "typed like the model's training data: the batch dimension first (one example x: x[None]), the same "
            "channels, size and float dtype"
        ) from err
    return logits_of(out)


def _dtype_hint(model: Any, x: Inputs) -> str:
    """A sentence naming inputs of another float dtype than the model's weights (numpy arrays are float64), or ''."""
    weights = (
        next((p for p in model.parameters() if p.is_floating_point()), None) if isinstance(model, nn.Module) else None
    )
    tensors = x.values() if isinstance(x, Mapping) else [x]
    given = {v.dtype for v in tensors if isinstance(v, Tensor) and v.is_floating_point()}
    if weights is None or not given or given == {weights.dtype}:
        return ""
    names = ", ".join(sorted(str(d).replace("torch.", "") for d in given))
    return (
        f"The inputs are {names} but the model's weights are {str(weights.dtype).replace('torch.', '')} (numpy "
        f"arrays are float64): convert them, e.g. x.to({weights.dtype}) or torch.as_tensor(x, dtype={weights.dtype}). "
    )


def _labels_hint(x: Inputs) -> str:
    """A sentence naming a labels entry left in a dict of inputs (the model gets it as a keyword), or ''."""
    keys = [key for key in LABEL_KEYS if isinstance(x, Mapping) and key in x]
    if not keys:
        return ""
    return (
        f"The inputs hold {keys[0]!r}, which the model gets as a keyword argument: pass the inputs alone, e.g. "
        f"{{k: v for k, v in batch.items() if k != {keys[0]!r}}}. "
    )


def unbatched_message(x: Any, what: str) -> str | None:
    """For a 1-D tensor the model could not take as a batch: the message that it lacks its batch dimension.

    Example:
        >>> import torch
        >>> from posthoc.core.inputs import unbatched_message
        >>> unbatched_message(torch.zeros(30), "um.predict")
        'um.predict takes a batch of examples, batch dimension first; got a 1-D tensor of shape (30,)...'
    """
    if not isinstance(x, Tensor) or x.dim() != 1:
        return None
    return (
        f"{what} takes a batch of examples, batch dimension first; got a 1-D tensor of shape {tuple(x.shape)}, which "
        f"the model cannot take as {x.shape[0]} examples. For one example, add its batch dimension: "
        f"{what}(x[None]) (or x.unsqueeze(0))"
    )


def check_rows_out(out: Tensor, x: Inputs, what: str) -> None:
    """Refuse ``out`` (a model's per-example result for ``x``) that does not hold one row per example of ``x``."""
    count = batch_size(x)
    if out.dim() == 0 or out.shape[0] != count:
        raise InputError(
            f"{what} got {count} examples but the model returned outputs of shape {tuple(out.shape)}, not one row per "
            "example; pass a batch shaped like the model's training data, batch dimension first (one example x: "
            "x[None])"
        )


def run_model_with(model: nn.Module, replaced: Mapping[str, Tensor], x: Inputs) -> Tensor:
    """The model's output with some parameters or buffers replaced (``torch.func.functional_call``); the model is untouched."""
    return run_model(lambda *args, **kwargs: torch.func.functional_call(model, dict(replaced), args, kwargs), x)


#: ``observe(loader, index, x, y)`` for every batch :func:`iterate` yields (the engine's feature store knows batches
#: by it); ``None`` outside a fit
batch_observer: contextvars.ContextVar[Callable[[Any, int, Any, Any], None] | None] = contextvars.ContextVar(
    "posthoc_batch_observer", default=None
)


def iterate(
    loader: Iterable,
    *,
    device: torch.device | str,
    progress: bool = True,
    desc: str = "",
    require_labels: bool = True,
) -> Iterator[tuple[Inputs, Tensor | None]]:
    """Yield ``(x, y)`` on ``device`` from ``loader`` with a progress bar, refusing (by its index) an empty loader or
    batch, NaN or inf inputs, labels that are not one per input, and a ``DistributedSampler`` of another world size."""
    where = f"the loader for '{desc or 'this step'}'"
    check_loader(loader, where, labelled=require_labels)
    distributed.check_loader(loader)
    try:
        total = len(loader)  # type: ignore[arg-type]
    except TypeError:
        total = None
    seen = 0
    for batch in progress_bar(loader, total=total, desc=desc, progress=progress, unit="batches"):
        x, y = split_batch(batch, require_labels=require_labels)
        x = to_device(x, device)
        check_attention(x)
        named = f"batch {seen} (0-based) of {where}"
        if batch_size(x) == 0:
            raise InputError(f"{named} is an empty batch (0 examples); drop empty batches from the loader")
        if not all_finite(x):
            raise InputError(
                f"{named}: inputs contain NaN or inf (the inputs are not finite); clean or impute them (e.g. "
                "torch.nan_to_num) or drop those examples"
            )
        if y is not None:
            y = as_tensor(y, f"y of {named}", numbers=True, hint=LABELS_AS_NUMBERS)
            check_label_count(label_rows(x), y, named)
        y = None if y is None else y.to(device)
        observe = batch_observer.get()
        if observe is not None:
            observe(loader, seen, x, y)
        seen += 1
        yield x, y
    if seen == 0:
        raise InputError(f"{where} yielded no batches; pass a non-empty loader")
