"""Held-out data for the held-out choices: the clean batches, their perturbed copies, and the plain model's scores.

Every held-out choice reads its data from one :class:`HeldOut`, built once per fit. With ``shift="auto"`` (the
default) it also holds :class:`ShiftedHeldOut`: each clean batch again at every graded strength of the fit-time
perturbations that suit the inputs (:mod:`posthoc.engine.perturb`), one kind drawn at random per example. A
classifier's kinds are graded by its accuracy (towards chance), a regressor's by its RMSE (towards that of a constant
prediction, or twice the clean RMSE if that is not larger). The choice itself is :func:`posthoc.engine.selection.select`.

Example:
    >>> from posthoc.engine.held_out import shifted_held_out
    >>> from posthoc_apps.demo.examples import val_loader, model
    >>> shifted = shifted_held_out(val_loader, lambda x: model(x).log_softmax(-1), "auto", device="cpu")
    >>> len(shifted.levels), shifted.description["graded_by"]
    (3, 'accuracy')
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from posthoc.core import distributed
from posthoc.core.checks import check_shift
from posthoc.core.fit_record import CountingLoader, reads_once
from posthoc.core.inputs import (
    Inputs,
    batch_size,
    check_finite_result,
    check_labels,
    iterate,
    label_rows,
    labels_per_input,
    slice_inputs,
    split_batch,
)
from posthoc.core.likelihood import best_noise_nlls, make_likelihood, model_outputs, real_targets
from posthoc.core.logits import class_log_probs
from posthoc.core.modules import eval_mode
from posthoc.core.prediction import Prediction
from posthoc.engine.feature_store import plain_output, tracked_batches
from posthoc.engine.perturb import Kind, family_for, grade, kinds_named, user_perturbation
from posthoc.engine.selection import Candidate, Layout, Rows, Scores, Selection, Tolerance, select
from posthoc.errors import InputError

#: how far towards chance each graded strength takes the model's held-out accuracy
STRENGTHS = (0.25, 0.5, 0.75)
#: held-out examples the strengths are graded on
GRADING_ROWS = 256
#: graded strengths remembered (per model, weights, loader and kinds): a chain or a demo grades once per checkpoint
GRADED_KEPT = 8
_GRADED: dict[tuple, dict[str, tuple[float, ...]]] = {}

#: a user's own perturbation: ``f(x, generator) -> x``
UserPerturbation = Callable[[Inputs, torch.Generator], Inputs]


class ShiftedHeldOut:
    """Perturbed copies of a labelled loader's batches, the same on every pass (seeded with ``seed``).

    Each pass yields every batch of ``loader`` at every level of ``levels`` (one list of ``perturbation(x, generator)
    -> x`` per strength), each example perturbed by one of that level's perturbations drawn at random.
    """

    def __init__(
        self,
        loader: Iterable,
        levels: Sequence[Sequence[UserPerturbation]],
        *,
        description: dict[str, Any],
        seed: int = 0,
    ) -> None:
        self.loader = loader
        self.levels = [list(level) for level in levels]
        self.description = description
        self.seed = seed

    def __len__(self) -> int:
        return len(self.loader) * len(self.levels)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[Inputs, Tensor]]:
        generator: torch.Generator | None = None
        width = max(len(level) for level in self.levels)
        groups = []
        for batch in self.loader:
            x, y = split_batch(batch)
            if generator is None or generator.device != _device_of(x):
                generator = torch.Generator(device=_device_of(x)).manual_seed(self.seed)
            for number, level in enumerate(self.levels):
                perturbed, choice = _perturbed(x, level, generator)
                groups.append(number * width + _per_label(choice.cpu(), x))
                yield perturbed, y
        self.groups = torch.cat(groups) if groups else None

    #: after a whole pass: each copy's group, ``level · kinds + kind`` (the same on every pass: the draws are seeded)
    groups: Tensor | None = None


def _per_label(values: Tensor, x: Inputs) -> Tensor:
    """``values`` ``(n,)`` per input, repeated for each label of the input (each kept position of a dense batch)."""
    counts = labels_per_input(x)
    return values if counts is None else torch.repeat_interleave(values, counts)


def _device_of(x: Inputs) -> torch.device:
    tensor = next(iter(x.values())) if isinstance(x, Mapping) else x
    return tensor.device


def _perturbed(x: Inputs, level: Sequence[UserPerturbation], generator: torch.Generator) -> tuple[Inputs, Tensor]:
    """``x`` with each example perturbed by one of ``level`` (drawn uniformly), and which one ``(n,)``."""
    n = batch_size(x)
    if len(level) == 1:
        return level[0](x, generator), torch.zeros(n, dtype=torch.long)
    choice = torch.randint(len(level), (n,), generator=generator, device=generator.device)
    versions = [perturb(x, generator) for perturb in level]
    if isinstance(x, Mapping):
        return {key: _pick([v[key] for v in versions], choice) for key in x}, choice
    return _pick(versions, choice), choice


def _pick(versions: list[Tensor], choice: Tensor) -> Tensor:
    stacked = torch.stack(versions)
    index = choice.to(stacked.device).view(1, -1, *([1] * (stacked.dim() - 2))).expand(1, *stacked.shape[1:])
    return stacked.gather(0, index).squeeze(0)


def shifted_held_out(
    loader: Iterable | None,
    log_probs: Callable[[Inputs], Tensor],
    shift: Any,
    *,
    device: torch.device | str,
    model: nn.Module | None = None,
    strengths: Sequence[float] = STRENGTHS,
    grading_rows: int = GRADING_ROWS,
    seed: int = 0,
    source: Iterable | None = None,
    regression: bool = False,
) -> ShiftedHeldOut | None:
    """The perturbed copies of ``loader`` that ``shift`` asks for (``None`` for ``shift=None`` or no loader).

    Named kinds (``"auto"`` picks them from the inputs) are graded on the first ``grading_rows`` examples by
    ``log_probs`` (with ``regression``: the predicted means, graded by RMSE): level ``k`` takes each kind
    ``strengths[k]`` of the way to chance. A user's callables are used as given, all at one level. ``model`` is kept in
    eval mode while grading; the grades are remembered per model, weights and loader (``source``: the user's loader
    ``loader`` was copied from), so several methods fitted on one checkpoint grade once.
    """
    check_shift(shift)
    if shift is None or loader is None:
        return None
    if reads_once(loader):  # a generator or iterator: read once, by the clean choice
        warnings.warn(
            "the held-out loader is a one-shot iterator, which the shift-aware choice cannot read again: "
            "choosing on the clean batches only (pass a DataLoader or a list of batches, or shift=None)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    rows = _grading_rows(loader, device, grading_rows)
    auto = isinstance(shift, str)
    names = None if auto else [s for s in shift if isinstance(s, str)]
    own = [] if auto else [user_perturbation(s, i) for i, s in enumerate(shift) if not isinstance(s, str)]
    if regression and auto:
        try:
            kinds: dict[str, Kind] = family_for(rows[0][0])
        except InputError as err:
            warnings.warn(
                f"{err}: the regressor's held-out choices see the clean batches only", RuntimeWarning, stacklevel=3
            )
            return None
    else:
        kinds = family_for(rows[0][0]) if names is None else kinds_named(names, rows[0][0])
    levels: list[list[UserPerturbation]] = []
    description: dict[str, Any] = {"strengths": list(strengths), "graded_by": "rmse" if regression else "accuracy"}
    if kinds:
        origin = source if source is not None else loader
        origin = origin.loader if isinstance(origin, CountingLoader) else origin  # the user's loader, not a wrapper
        grading = (tuple(kinds), tuple(strengths), grading_rows, seed, regression)
        key = None if model is None else (id(model), _weights_version(model), id(origin), *grading)
        graded = _GRADED.get(key) if key is not None else None
        if graded is None:
            with eval_mode(model) if model is not None else contextlib.nullcontext():
                graded = (_graded_rmse if regression else _graded)(rows, log_probs, kinds, strengths, seed)
            if key is not None:
                _GRADED[key] = graded
                while len(_GRADED) > GRADED_KEPT:
                    _GRADED.pop(next(iter(_GRADED)))
        levels = [[_at(kinds[name], graded[name][k]) for name in kinds] for k in range(len(strengths))]
        description["kinds"] = {name: [round(p, 4) for p in parameters] for name, parameters in graded.items()}
    if own:
        levels.append(list(own))
        description["callables"] = len(own)
    return ShiftedHeldOut(loader, levels, description=description, seed=seed)


def _weights_version(model: nn.Module) -> tuple[tuple[int, int], ...]:
    """Where each weight and buffer lives and how often it was changed in place: equal only for the same weights."""
    return tuple((t.data_ptr(), t._version) for t in (*model.parameters(), *model.buffers()))


def _at(kind: Kind, parameter: float) -> UserPerturbation:
    return lambda x, generator: kind.perturb(x, parameter, generator)


def _grading_rows(loader: Iterable, device: torch.device | str, rows: int) -> list[tuple[Inputs, Tensor]]:
    kept, seen = [], 0
    for x, y in iterate(loader, device=device, progress=False, desc="grading perturbations"):
        take = min(batch_size(x), rows - seen)
        part = slice_inputs(x, 0, take)
        kept.append((part, y[: label_rows(part)]))
        seen += take
        if seen >= rows:
            break
    if not kept:
        raise InputError("the held-out loader is empty; shift-aware fitting needs labelled validation batches")
    return kept


@torch.no_grad()
def _graded(
    rows: list[tuple[Inputs, Tensor]],
    log_probs: Callable[[Inputs], Tensor],
    kinds: dict[str, Kind],
    strengths: Sequence[float],
    seed: int,
) -> dict[str, tuple[float, ...]]:
    def accuracy(perturb: Callable[[Inputs], Inputs]) -> tuple[float, int]:
        """Accuracy on the grading rows of every rank (so that all ranks grade alike), and the class count."""
        counts, classes = torch.zeros(2, dtype=torch.float64), 0
        for x, y in rows:
            lp = log_probs(perturb(x))
            classes = lp.shape[-1]
            labels = check_labels(y, classes, where="the validation loader's")
            counts += torch.tensor([float((lp.argmax(-1) == labels).sum()), float(y.shape[0])], dtype=torch.float64)
        counts = distributed.all_reduce_sum(counts) if distributed.active() else counts
        return float(counts[0] / counts[1]), classes

    clean, classes = accuracy(lambda x: x)

    def accuracy_at(kind: Kind, parameter: float) -> float:
        generator = torch.Generator(device=_device_of(rows[0][0])).manual_seed(seed)
        return accuracy(lambda x: kind.perturb(x, parameter, generator))[0]

    return grade(accuracy_at, kinds, clean_accuracy=clean, chance=1.0 / max(classes, 1), fractions=tuple(strengths))


@torch.no_grad()
def _graded_rmse(
    rows: list[tuple[Inputs, Tensor]],
    means: Callable[[Inputs], Tensor],
    kinds: dict[str, Kind],
    strengths: Sequence[float],
    seed: int,
) -> dict[str, tuple[float, ...]]:
    """:func:`_graded` for a regressor, by the RMSE of ``means(x)`` ``(n, D)`` (module docs)."""

    def rmse(perturb: Callable[[Inputs], Inputs]) -> float:
        """RMSE on the grading rows of every rank (so that all ranks grade alike)."""
        sums = torch.zeros(2, dtype=torch.float64)
        for x, y in rows:
            predicted = means(perturb(x)).double()
            targets = real_targets(y, predicted)
            sums += torch.stack([(targets - predicted).square().sum(), torch.tensor(float(targets.numel()))]).cpu()
        sums = distributed.all_reduce_sum(sums) if distributed.active() else sums
        return float((sums[0] / sums[1]).sqrt())

    targets = torch.cat([real_targets(y, means(x).double()) for x, y in rows]).cpu()
    moments = torch.stack([targets.sum(0), targets.square().sum(0), torch.full_like(targets[0], targets.shape[0])])
    moments = distributed.all_reduce_sum(moments) if distributed.active() else moments
    constant = float((moments[1] / moments[2] - (moments[0] / moments[2]).square()).clamp_min(0).mean().sqrt())
    clean = rmse(lambda x: x)
    worst = constant if constant > clean else 2 * clean

    def negative_rmse_at(kind: Kind, parameter: float) -> float:
        generator = torch.Generator(device=_device_of(rows[0][0])).manual_seed(seed)
        return -rmse(lambda x: kind.perturb(x, parameter, generator))

    return grade(negative_rmse_at, kinds, clean_accuracy=-clean, chance=-worst, fractions=tuple(strengths))


#: bytes of held-out batches kept in memory for the passes of a selection; a larger set is read again each pass
HELD_OUT_BYTES = 1 << 30
#: the seed of the generator every candidate's pass over the held-out data starts from (the same draws for each)
SCORE_SEED = 0


def _inputs_bytes(x: Inputs) -> int:
    tensors = x.values() if isinstance(x, Mapping) else [x]
    return sum(t.element_size() * t.numel() for t in tensors)


@dataclasses.dataclass
class Prepared:
    """Held-out batches after a method's ``prepare`` (e.g. the features before its head), with their labels, kept for
    the passes of a selection: ``clean`` and ``perturbed`` lists of ``(prepared, labels)``."""

    clean: list[tuple[Any, Tensor]]
    perturbed: list[tuple[Any, Tensor]]

    def outputs(
        self, predict: Callable[[Any, torch.Generator], Tensor], *, device: torch.device | str
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """``predict(prepared, generator)`` over every clean and perturbed batch (each pass from :data:`SCORE_SEED`),
        gathered over ranks: ``(clean outputs, clean labels, perturbed outputs or None, their labels or None)``."""
        clean = _run(predict, self.clean, device)
        if not self.perturbed:
            return (*clean, None, None)
        return (*clean, *_run(predict, self.perturbed, device))

    def scores(self, predict: Callable[[Any, torch.Generator], Tensor], *, device: torch.device | str) -> Scores:
        """The :class:`~posthoc.engine.selection.Scores` of class log-probabilities ``predict(prepared, generator)``."""
        return Scores.of_log_probs(*self.outputs(predict, device=device))


def _run(
    predict: Callable[[Any, torch.Generator], Tensor], batches: list[tuple[Any, Tensor]], device: torch.device | str
) -> tuple[Tensor, Tensor]:
    generator = torch.Generator(device=device).manual_seed(SCORE_SEED)
    outputs = [predict(prepared, generator) for prepared, _ in batches]
    dim = 1 if outputs[0].dim() == 3 else 0
    return (
        distributed.gather_cat(torch.cat(outputs, dim), dim),
        distributed.gather_cat(torch.cat([labels for _, labels in batches])),
    )


class FixedCopies:
    """Perturbed copies kept as batches (a :meth:`HeldOut.subset`'s), with the interface of :class:`ShiftedHeldOut`."""

    def __init__(self, batches: list[tuple[Inputs, Tensor]], levels: int, description: dict[str, Any] | None) -> None:
        self.batches = batches
        self.levels = [None] * levels
        self.description = description
        #: each copy's group (see :attr:`ShiftedHeldOut.groups`)
        self.groups: Tensor | None = None

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[Inputs, Tensor]]:
        return iter(self.batches)


def _cat_inputs(parts: list[Inputs]) -> Inputs:
    if isinstance(parts[0], Mapping):
        return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
    return torch.cat(parts)


def _take(x: Inputs, index: Tensor) -> Inputs:
    if isinstance(x, Mapping):
        return {key: value[index.to(value.device)] for key, value in x.items()}
    return x[index.to(x.device)]


def _copy_table(layout: Layout) -> Tensor:
    """``table[l, i]``: the index of example ``i``'s perturbed copy at level ``l``."""
    order = torch.argsort(layout.source, stable=True)
    return order.view(layout.count, -1).T


def _outputs_of(outputs: tuple, picked: Rows) -> tuple:
    clean, labels, shifted, shifted_labels = outputs
    dim = 1 if clean.dim() == 3 else 0
    clean, labels = clean.index_select(dim, picked.clean.to(clean.device)), labels[picked.clean.to(labels.device)]
    if shifted is None or picked.shifted is None:
        return clean, labels, None, None
    return (
        clean,
        labels,
        shifted.index_select(dim, picked.shifted.to(shifted.device)),
        shifted_labels[picked.shifted.to(shifted_labels.device)],
    )


class HeldOut:
    """The held-out data of one fit, read once and shared by every held-out choice of the methods it fits.

    It holds the clean batches (in memory up to :data:`HELD_OUT_BYTES`, so every pass sees the same examples in the
    same order), their perturbed copies, the plain model's :class:`Scores` on both, and the tolerance. A method scores
    its candidates with :meth:`scores` (or :meth:`prepared`) and chooses with :meth:`select`.

    Example:
        >>> from posthoc.engine.held_out import HeldOut
        >>> from posthoc_apps.demo.examples import val_loader, model
        >>> from posthoc.core.likelihood import Categorical
        >>> held = HeldOut.read(val_loader, model=model, likelihood=Categorical(), shift="auto", device="cpu")
        >>> held.plain.clean.shape, held.layout.count
        (torch.Size([128]), 128)
    """

    def __init__(
        self,
        batches: list[tuple[Inputs, Tensor]] | None,
        loader: Iterable,
        shifted: ShiftedHeldOut | None,
        *,
        device: torch.device | str,
        tolerance: Tolerance,
        likelihood: Any,
        from_training_data: bool = False,
    ) -> None:
        self._batches = batches
        #: whether these are training rows standing in for a missing validation loader (Laplace's ``"auto"``)
        self.from_training_data = from_training_data
        self._loader = loader
        self.shifted = shifted
        self.device = torch.device(device)
        self.likelihood = likelihood
        self.tolerance_rule = tolerance
        self._labels: list[Tensor] | None = None if batches is None else [y for _, y in batches]
        self.layout = self._layout()
        self.plain: Scores = Scores(torch.zeros(0))  # set by rebased()
        #: the plain model's log-probabilities and labels on the clean and perturbed examples (classes only)
        self.plain_outputs: tuple[Tensor, Tensor, Tensor | None, Tensor | None] | None = None

    @classmethod
    def read(
        cls,
        loader: Iterable,
        *,
        model: nn.Module,
        likelihood: Any,
        shift: Any = "auto",
        tolerance: Tolerance | float | None = None,
        device: torch.device | str,
        progress: bool = False,
        from_training_data: bool = False,
    ) -> HeldOut:
        """Read ``loader``, grade the fit-time perturbations ``shift`` on the plain ``model`` and score it on both."""
        check_shift(shift)
        classes = likelihood.prediction_type is Prediction
        batches: list[tuple[Inputs, Tensor]] | None = []
        size = 0
        for x, y in iterate(loader, device=device, progress=progress, desc="held-out data"):
            size += _inputs_bytes(x)
            if size > HELD_OUT_BYTES:
                batches = None
                break
            batches.append((x, y))
        source: Iterable = batches if batches is not None else loader
        with eval_mode(model), torch.no_grad():
            if classes:
                plain = lambda x: class_log_probs(plain_output(model, x))  # noqa: E731
            else:
                plain = lambda x: likelihood.means(model_outputs(plain_output(model, x)))  # noqa: E731
            shifted = shifted_held_out(
                source, plain, shift, device=device, model=model, source=loader, regression=not classes
            )
        return cls(
            batches,
            loader,
            shifted,
            device=device,
            tolerance=Tolerance.of(tolerance),
            likelihood=likelihood,
            from_training_data=from_training_data,
        ).rebased(model)

    def rebased(self, model: nn.Module) -> HeldOut:
        """The same held-out batches and perturbed copies, judged against another plain ``model`` (an ensemble member)."""
        held = self._like(self._batches, self._loader, self.shifted)
        with eval_mode(model), torch.no_grad():
            if self.likelihood.prediction_type is Prediction:
                held.plain_outputs = held.outputs(lambda x, generator: class_log_probs(plain_output(model, x)))
                log_probs, labels = held.plain_outputs[:2]
                check_labels(labels, log_probs.shape[-1], where="the validation loader's")
                held.plain = Scores.of_log_probs(*held.plain_outputs)
            else:
                held.plain = held.regression_scores(lambda x, generator: model_outputs(plain_output(model, x))[None])
        held.plain.units = held.units()
        if held.plain.shifted is not None and getattr(self.shifted, "groups", None) is not None:
            held.plain.groups = distributed.gather_cat(self.shifted.groups.to(held.device)).cpu()
        held.layout = dataclasses.replace(held.layout, key=held.plain.clean)
        outputs = (
            [t for t in (held.plain.clean, held.plain.shifted) if t is not None]
            if held.plain_outputs is None
            else [t for t in held.plain_outputs[::2] if t is not None]
        )
        for values in outputs:
            check_finite_result(values, "the plain model's outputs on the held-out data", log_probs=True)
        return held

    def subset(self, rows: Tensor, *, batch_size: int = 256) -> HeldOut:
        """These held-out data restricted to the clean examples ``rows`` and their perturbed copies (the same copies,
        not new draws), judged against the same plain model.

        Example:
            >>> import torch
            >>> from posthoc.engine.held_out import HeldOut
            >>> from posthoc_apps.demo.examples import val_loader, model
            >>> from posthoc.core.likelihood import Categorical
            >>> held = HeldOut.read(val_loader, model=model, likelihood=Categorical(), shift="auto", device="cpu")
            >>> half = held.subset(torch.arange(64))
            >>> half.layout.count, half.plain.clean.shape
            (64, torch.Size([64]))
        """
        if self._batches is None or distributed.active():
            raise InputError("a subset of held-out data needs its batches in memory in one process")
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        x = _cat_inputs([x for x, _ in self._batches])
        y = torch.cat([y for _, y in self._batches])
        starts = range(0, len(rows), batch_size)
        clean = [(_take(x, rows[i : i + batch_size]), y[rows[i : i + batch_size].to(y.device)]) for i in starts]
        shifted, picked = None, Rows(rows)
        if self.shifted is not None:
            copies = list(self.perturbed())
            px, py = _cat_inputs([c for c, _ in copies]), torch.cat([t for _, t in copies])
            table = _copy_table(self.layout)
            levels = table.shape[0]
            order = [table[level, rows[i : i + batch_size]] for i in starts for level in range(levels)]
            shifted = FixedCopies(
                [(_take(px, index), py[index.to(py.device)]) for index in order], levels, self.shifted.description
            )
            picked = Rows(rows, torch.cat(order))
        held = self._like(clean, clean, shifted)
        held.plain = self.plain.take(picked)
        held.layout = dataclasses.replace(held.layout, key=held.plain.clean)
        if shifted is not None:
            shifted.groups = held.plain.groups
        held.plain_outputs = None if self.plain_outputs is None else _outputs_of(self.plain_outputs, picked)
        return held

    def _like(self, batches: list | None, loader: Iterable, shifted: Any) -> HeldOut:
        """Other held-out data with this one's device, tolerance and likelihood."""
        return HeldOut(
            batches,
            loader,
            shifted,
            device=self.device,
            tolerance=self.tolerance_rule,
            likelihood=self.likelihood,
            from_training_data=self.from_training_data,
        )

    # ---- passes over the data ---------------------------------------------------------------------------------
    def units(self) -> Tensor | None:
        """The input each clean example belongs to in dense batches (:data:`~posthoc.core.inputs.KEEP`), else ``None``."""
        counts = []
        for x, _ in self.clean():
            count = labels_per_input(x)
            if count is None:
                return None
            counts.append(count)
        if not counts:
            return None
        counts = torch.cat(counts)
        return torch.repeat_interleave(torch.arange(len(counts)), counts)

    def clean(self) -> Iterator[tuple[Inputs, Tensor]]:
        """The clean batches, the same on every pass (a streamed loader is checked to repeat its labels)."""
        if self._batches is not None:
            with tracked_batches(self._batches, self._batches) as batches:
                yield from batches
            return
        labels: list[Tensor] = []
        for index, (x, y) in enumerate(iterate(self._loader, device=self.device, progress=False, desc="held-out data")):
            if self._labels is not None and (index >= len(self._labels) or not torch.equal(self._labels[index], y)):
                raise InputError(
                    "the validation loader yields its examples in another order on each pass (shuffle=True?); "
                    "the held-out choice compares every candidate with the plain model on the same examples: "
                    "pass a loader with shuffle=False"
                )
            labels.append(y)
            yield x, y
        self._labels = labels

    def perturbed(self) -> Iterator[tuple[Inputs, Tensor]]:
        """The perturbed copies (nothing without ``shift``), the same draws on every pass."""
        if self.shifted is None:
            return
        with tracked_batches(self.shifted, self.shifted) as batches:
            yield from batches

    def _layout(self) -> Layout:
        counts = [len(y) for _, y in self.clean()]
        offset = distributed.rank_offset(sum(counts))
        total = distributed.total_examples(sum(counts))
        if self.shifted is None:
            return Layout(total)
        starts = torch.tensor([0, *counts[:-1]]).cumsum(0) + offset
        levels = len(self.shifted.levels)
        local = torch.cat(
            [torch.arange(start, start + count).repeat(levels) for start, count in zip(starts.tolist(), counts)]
        )
        return Layout(total, distributed.gather_cat(local))

    @property
    def tolerance(self) -> float:
        """The excess NLL a candidate may cost over the plain model, in nats per example."""
        return self.tolerance_rule.nats(self.plain.nll)

    @property
    def description(self) -> dict[str, Any] | None:
        """What the perturbed copies are, for the model card (``None`` without them)."""
        return None if self.shifted is None else self.shifted.description

    # ---- scoring ----------------------------------------------------------------------------------------------
    def prepared(self, prepare: Callable[[Inputs], Any] | None = None) -> Prepared:
        """Every clean and perturbed batch after ``prepare`` (``None``: the inputs as they are), with its labels."""
        step = (lambda x: x) if prepare is None else prepare  # noqa: E731
        return Prepared([(step(x), y) for x, y in self.clean()], [(step(x), y) for x, y in self.perturbed()])

    def scores(self, predict: Callable[[Inputs, torch.Generator], Tensor]) -> Scores:
        """The :class:`Scores` of class log-probabilities ``predict(x, generator)`` ``(n, C)`` (every candidate sees the
        same draws)."""
        return Scores.of_log_probs(*self.outputs(predict))

    def outputs(
        self, predict: Callable[[Inputs, torch.Generator], Tensor]
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """:meth:`Prepared.outputs` of the raw clean and perturbed batches."""
        return Prepared(list(self.clean()), list(self.perturbed())).outputs(predict, device=self.device)

    def method_scores(self, method: Any) -> Scores:
        """The :class:`Scores` of a fitted method's predictive (under regression, at the noise the method fitted)."""
        with torch.no_grad(), eval_mode(method):
            if self.likelihood.prediction_type is Prediction:
                return self._class_scores(method)

            def nlls(batches: Iterable[tuple[Inputs, Tensor]]) -> Tensor | None:
                generator = torch.Generator(device=self.device).manual_seed(SCORE_SEED)
                nll = []
                for x, y in batches:
                    prediction = method.regression_predictive(x, generator=generator)
                    nll.append(-prediction.log_prob(real_targets(y, prediction.mean)).double())
                return distributed.gather_cat(torch.cat(nll)) if nll else None

            return Scores(nlls(self.clean()), nlls(self.perturbed()))

    def sampling_scores(self, method: Any, *, own_draws: bool = False) -> Scores:
        """The :class:`Scores` of a sampling method at its current setting, drawing from the scoring generator (or,
        with ``own_draws``, from the method's own seeded draws, as SWAG's)."""

        if self.likelihood.prediction_type is Prediction:
            return self._class_scores(method, own_draws=own_draws)
        return self.regression_scores(
            lambda x, generator: method.sampled_outputs(x, generator=None if own_draws else generator)
        )

    def _class_scores(self, method: Any, *, own_draws: bool = False) -> Scores:
        """The :class:`Scores` of a method's class log-probabilities."""
        return self.scores(lambda x, generator: method.log_predictive(x, generator=None if own_draws else generator)[0])

    def regression_scores(self, outputs: Callable[[Inputs, torch.Generator], Tensor]) -> Scores:
        """The :class:`Scores` of sampled outputs ``outputs(x, generator)`` ``(S, n, D)``: each example's NLL under the
        mixture of ``N(f_s(x), σ²)`` at the noise of maximum likelihood on the clean examples (also for the copies)."""

        def drawn(batches: Iterable[tuple[Inputs, Tensor]]) -> tuple[Tensor, Tensor] | None:
            generator = torch.Generator(device=self.device).manual_seed(SCORE_SEED)
            found, targets = [], []
            for x, y in batches:
                sampled = outputs(x, generator)
                found.append(sampled)
                targets.append(self.likelihood.targets(y, sampled[0]))
            if not found:
                return None
            return distributed.gather_cat(torch.cat(found, dim=1), 1), distributed.gather_cat(torch.cat(targets))

        samples, targets = drawn(self.clean())
        clean = best_noise_nlls(self.likelihood, samples, targets)
        perturbed = drawn(self.perturbed())
        if perturbed is None:
            return Scores(clean)
        scorer = make_likelihood(self.likelihood)  # the noise of the clean examples, not refitted on the copies
        scorer.fit_noise(samples, None, targets)
        return Scores(clean, -scorer.predictive(perturbed[0]).log_prob(perturbed[1]).double())

    def select(
        self,
        candidates: Sequence[Candidate],
        scores: Sequence[Scores] | Callable[[int], Scores],
        *,
        knob: str,
        walk: bool = False,
        folds: int | None = None,
        **options: Any,
    ) -> Selection:
        """:func:`~posthoc.engine.selection.select` against the plain model at this held-out data's tolerance."""
        selection = select(
            candidates, scores, plain=self.plain, tolerance=self.tolerance, knob=knob, walk=walk, folds=folds, **options
        )
        selection.shift = self.description
        return selection
