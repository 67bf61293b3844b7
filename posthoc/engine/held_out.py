"""Held-out data for choosing a predictive's spread: the clean batches, and perturbed copies of them.

Every held-out choice of the methods (Laplace's prior precision, MC dropout's rate, SWAG's and IVON's
scale, iBNN's spread, a stacked calibrator) scores its candidates here. With ``shift=None`` only the
clean validation batches count. With ``shift="auto"`` (the default of ``UncertainModel.fit``) they
are also scored on :class:`ShiftedHeldOut`: each clean batch again at every graded strength of the
fit-time perturbations that suit the inputs (:mod:`posthoc.engine.perturb`), each example with one
kind drawn at random. :func:`walk_spreads` walks a method's ladder of spreads to the widest its
clean tolerance accepts; :func:`choose` then takes, among the candidates whose clean NLL the method's
own tolerance accepts, the one with the lowest NLL over clean and perturbed examples together.

Example:
    >>> shifted = shifted_held_out(val_loader, lambda x: model(x).log_softmax(-1), "auto", device="cpu")
    >>> held_out_nll(lambda x: model(x).log_softmax(-1), shifted, device="cpu") > held_out_nll(
    ...     lambda x: model(x).log_softmax(-1), val_loader, device="cpu")
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from posthoc.core import distributed
from posthoc.core.checks import check_shift
from posthoc.core.errors import InputError
from posthoc.core.fit_record import reads_once
from posthoc.core.modules import eval_mode
from posthoc.core.inputs import Inputs, batch_size, check_labels, iterate, slice_inputs, split_batch
from posthoc.engine.perturb import Kind, family_for, grade, kinds_named, user_perturbation

#: how far towards chance each graded strength takes the model's held-out accuracy
STRENGTHS = (0.25, 0.5, 0.75)
#: held-out examples the strengths are graded on
GRADING_ROWS = 256
#: clean held-out NLL a shift-aware choice may cost over the clean-only one, relative (where the method has no own rule)
CLEAN_TOLERANCE = 0.01
#: graded strengths remembered (per model, weights, loader and kinds): a chain or a demo grades once per checkpoint
GRADED_KEPT = 8
_GRADED: dict[tuple, dict[str, tuple[float, ...]]] = {}
#: bisection steps of :func:`widest_accepted`
BISECTION_STEPS = 12

Candidate = TypeVar("Candidate")
#: a user's own perturbation: ``f(x, generator) -> x``
UserPerturbation = Callable[[Inputs, torch.Generator], Inputs]


@torch.no_grad()
def held_out_nll(log_probs: Callable[[Inputs], Tensor], loader: Iterable, *, device: torch.device | str) -> float:
    """Mean negative log-likelihood of ``log_probs(x) (N, C)`` over ``loader``'s labels (every rank's examples once)."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in iterate(loader, device=device, progress=False, desc="held-out NLL"):
        lp = log_probs(x)
        total[0] -= lp.gather(-1, check_labels(y, lp.shape[-1]).unsqueeze(-1)).double().sum()
        total[1] += lp.shape[0]
    total = distributed.all_reduce_sum(total) if distributed.active() else total
    return float(total[0] / total[1])


class ShiftedHeldOut:
    """Perturbed copies of a labelled loader's batches, the same on every pass.

    Each pass yields, for every batch of ``loader`` and every level of ``levels``, the batch with
    each example perturbed by one of that level's perturbations (drawn at random), and its labels.
    The draws come from a generator seeded with ``seed`` at the start of each pass.

    Args:
        loader: the clean labelled batches.
        levels: one list of ``perturbation(x, generator) -> x`` per strength.
        description: what the levels are, for the model card.
    """

    def __init__(self, loader: Iterable, levels: Sequence[Sequence[UserPerturbation]], *,
                 description: dict[str, Any], seed: int = 0) -> None:
        self.loader = loader
        self.levels = [list(level) for level in levels]
        self.description = description
        self.seed = seed

    def __len__(self) -> int:
        return len(self.loader) * len(self.levels)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[Inputs, Tensor]]:
        generator: torch.Generator | None = None
        for batch in self.loader:
            x, y = split_batch(batch)
            if generator is None or generator.device != _device_of(x):
                generator = torch.Generator(device=_device_of(x)).manual_seed(self.seed)
            for level in self.levels:
                yield _perturbed(x, level, generator), y


def _device_of(x: Inputs) -> torch.device:
    tensor = next(iter(x.values())) if isinstance(x, Mapping) else x
    return tensor.device


def _perturbed(x: Inputs, level: Sequence[UserPerturbation], generator: torch.Generator) -> Inputs:
    """``x`` with each example perturbed by one of ``level`` (drawn uniformly)."""
    if len(level) == 1:
        return level[0](x, generator)
    n = batch_size(x)
    choice = torch.randint(len(level), (n,), generator=generator, device=generator.device)
    versions = [perturb(x, generator) for perturb in level]
    if isinstance(x, Mapping):
        return {key: _pick([v[key] for v in versions], choice) for key in x}
    return _pick(versions, choice)


def _pick(versions: list[Tensor], choice: Tensor) -> Tensor:
    stacked = torch.stack(versions)
    index = choice.to(stacked.device).view(1, -1, *([1] * (stacked.dim() - 2))).expand(1, *stacked.shape[1:])
    return stacked.gather(0, index).squeeze(0)


def shifted_held_out(loader: Iterable | None, log_probs: Callable[[Inputs], Tensor], shift: Any, *,
                     device: torch.device | str, model: nn.Module | None = None, strengths: Sequence[float] = STRENGTHS,
                     grading_rows: int = GRADING_ROWS, seed: int = 0) -> ShiftedHeldOut | None:
    """The perturbed copies of ``loader`` that ``shift`` asks for (``None`` for ``shift=None`` or no loader).

    Named kinds (``"auto"`` picks them from the inputs) are graded on the first ``grading_rows``
    held-out examples by ``log_probs`` (the plain model's log-probabilities): level ``k`` takes each
    kind to where accuracy has fallen ``strengths[k]`` of the way to chance. A user's callables are
    used as given, all at one level. ``model`` (what ``log_probs`` runs) is kept in eval mode while
    grading, so BatchNorm statistics and dropout stay as they are; the grades are remembered per
    model, weights and loader (:data:`GRADED_KEPT` of them), so the methods of one chain, or several
    methods fitted on one checkpoint, grade once.

    Example:
        >>> shifted = shifted_held_out(val_loader, plain_log_probs, ["noise", "blur"], device="cpu")
        >>> len(shifted.levels)
        3
    """
    check_shift(shift)
    if shift is None or loader is None:
        return None
    if reads_once(loader):  # a generator or iterator: read once, by the clean choice
        warnings.warn("the held-out loader is a one-shot iterator, which the shift-aware choice cannot read again: "
                      "choosing on the clean batches only (pass a DataLoader or a list of batches, or shift=None)",
                      RuntimeWarning, stacklevel=3)
        return None
    rows = _grading_rows(loader, device, grading_rows)
    auto = isinstance(shift, str)
    names = None if auto else [s for s in shift if isinstance(s, str)]
    own = [] if auto else [user_perturbation(s, i) for i, s in enumerate(shift) if not isinstance(s, str)]
    kinds: dict[str, Kind] = family_for(rows[0][0]) if names is None else kinds_named(names, rows[0][0])
    levels: list[list[UserPerturbation]] = []
    description: dict[str, Any] = {"strengths": list(strengths)}
    if kinds:
        key = None if model is None else (id(model), _weights_version(model), id(loader), tuple(kinds), tuple(strengths),
                                          grading_rows, seed)
        graded = _GRADED.get(key) if key is not None else None
        if graded is None:
            with eval_mode(model) if model is not None else contextlib.nullcontext():
                graded = _graded(rows, log_probs, kinds, strengths, seed)
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
        kept.append((slice_inputs(x, 0, take), y[:take]))
        seen += take
        if seen >= rows:
            break
    if not kept:
        raise InputError("the held-out loader is empty; shift-aware fitting needs labelled validation batches")
    return kept


@torch.no_grad()
def _graded(rows: list[tuple[Inputs, Tensor]], log_probs: Callable[[Inputs], Tensor], kinds: dict[str, Kind],
            strengths: Sequence[float], seed: int) -> dict[str, tuple[float, ...]]:
    def accuracy(perturb: Callable[[Inputs], Inputs]) -> tuple[float, int]:
        """Accuracy on the grading rows of every rank (so that all ranks grade alike), and the class count."""
        counts, classes = torch.zeros(2, dtype=torch.float64), 0
        for x, y in rows:
            lp = log_probs(perturb(x))
            classes = lp.shape[-1]
            counts += torch.tensor([float((lp.argmax(-1) == check_labels(y, classes)).sum()), float(y.shape[0])],
                                   dtype=torch.float64)
        counts = distributed.all_reduce_sum(counts) if distributed.active() else counts
        return float(counts[0] / counts[1]), classes

    clean, classes = accuracy(lambda x: x)

    def accuracy_at(kind: Kind, parameter: float) -> float:
        generator = torch.Generator(device=_device_of(rows[0][0])).manual_seed(seed)
        return accuracy(lambda x: kind.perturb(x, parameter, generator))[0]

    return grade(accuracy_at, kinds, clean_accuracy=clean, chance=1.0 / max(classes, 1), fractions=tuple(strengths))


@dataclasses.dataclass(frozen=True)
class Walk:
    """Where :func:`walk_spreads` stopped on a ladder of spreads ordered from narrow to wide.

    ``accepted`` is the index of the widest spread it accepted (``None``: none was), ``rejected`` the
    index of the next wider one, which it tried and rejected (``None``: the top of the ladder was accepted).
    """

    accepted: int | None
    rejected: int | None


def walk_spreads(ladder: Sequence[float], within: Callable[[float], bool], *, start: int = 0) -> Walk:
    """Walk ``ladder`` (spreads from narrow to wide) from ``start``: wider while ``within``, else narrower until it is.

    The rule every clean held-out choice shares (Laplace's prior precision, MC dropout's rate, SWAG's
    and IVON's scale): the widest spread whose held-out NLL the method's tolerance accepts, reached
    without stepping over a rejected one, so a wide spread that looks cheap by chance past a costly
    one is not taken. ``within`` is called once per spread visited, in walking order (a method may
    keep state in it, e.g. the best NLL seen so far). Each method keeps its own ladder, start,
    acceptance rule and what to do when none is accepted; Laplace refines between ``accepted`` and
    ``rejected`` by bisection.

    Example:
        >>> walk_spreads([0.01, 0.05, 0.1, 0.2], lambda p: p <= 0.05)
        Walk(accepted=1, rejected=2)
        >>> walk_spreads([0.5, 1.0, 2.0, 4.0], lambda s: s <= 1.0, start=3)   # from the widest down
        Walk(accepted=1, rejected=2)
    """
    if not 0 <= start < len(ladder):
        raise ValueError(f"start {start} is outside a ladder of {len(ladder)} spreads")
    index = start
    if within(ladder[index]):
        while index + 1 < len(ladder) and within(ladder[index + 1]):
            index += 1
        return Walk(index, index + 1 if index + 1 < len(ladder) else None)
    while index > 0:
        index -= 1
        if within(ladder[index]):
            return Walk(index, index + 1)
    return Walk(None, 0)



def widest_spread(ladder: Sequence[float], within: Callable[[float], bool], *, start: int, method: str,
                  tolerance: float, over: str, fallback: str, advice: str) -> float:
    """The spread :func:`walk_spreads` accepts, else 0 with a warning that names what is used instead.

    The scale choices of SWAG, IVON and iBNN share it: ``within`` accepts a scale whose held-out NLL is
    within ``tolerance`` of ``over`` (e.g. "the checkpoint"); a scale of 0 predicts with the method's
    point estimate alone (``fallback``, e.g. "the SWA mean"); ``advice`` says what to change.

    Example:
        >>> widest_spread([0.5, 1.0, 2.0], lambda s: s <= 1.0, start=1, method="SWAG", tolerance=0.02,
        ...               over="the checkpoint", fallback="the SWA mean", advice="Raise val_tolerance")
        1.0
    """
    walk = walk_spreads(ladder, within, start=start)
    if walk.accepted is not None:
        return ladder[walk.accepted]
    warnings.warn(f"every {method} scale down to {ladder[0]:g} costs more than {tolerance:.0%} of held-out NLL over "
                  f"{over}; predicting with {fallback} alone (scale 0). {advice}", RuntimeWarning, stacklevel=4)
    return 0.0

def choose(candidates: Sequence[Candidate], *, accepted: Callable[[Candidate], bool],
           combined_nll: Callable[[Candidate], float], unimodal: bool = False) -> Candidate:
    """Among ``candidates`` that ``accepted`` (the method's clean-NLL tolerance), the lowest ``combined_nll``.

    ``combined_nll`` is the NLL over the clean and the perturbed held-out examples together; ties
    go to the earlier candidate. ``unimodal=True`` stops at the first candidate that scores worse
    than the one before (candidates ordered from the widest spread down, whose combined NLL has one
    minimum), so a search usually costs two evaluations. The first candidate should be the method's
    clean-only choice, which its tolerance always accepts; it is returned when none is accepted.

    Example:
        >>> choose([1.0, 2.0, 4.0], accepted=lambda s: s <= 2, combined_nll=lambda s: 1 / s)
        2.0
    """
    best, best_score = candidates[0], math.inf
    for candidate in candidates:
        if not accepted(candidate):
            continue
        score = combined_nll(candidate)
        if score < best_score:
            best, best_score = candidate, score
        elif unimodal:
            break
    return best


def shift_aware_spread(chosen: float, narrower: Sequence[float], *, nll_at: Callable[[float, Iterable], float],
                       loader: Iterable, shifted: ShiftedHeldOut, limit: float,
                       known: dict[float, float] | None = None) -> float:
    """The spread of lowest NLL over clean and perturbed held-out examples, from the clean choice down.

    ``chosen`` is the method's clean-only choice (the widest spread its tolerance accepts) and
    ``narrower`` the smaller spreads it could take instead, widest first; ``nll_at(spread, loader)``
    is the mean held-out NLL at a spread. A narrower spread is eligible while its clean NLL stays
    at most ``limit``. ``known`` holds clean NLLs already measured (spread -> NLL); the ones measured
    here are added to it.

    Example:
        >>> shift_aware_spread(0.2, [0.1, 0.05], nll_at=nll_at, loader=val_loader, shifted=shifted, limit=0.081)
        0.2
    """
    clean = {} if known is None else known

    def clean_nll(spread: float) -> float:
        if spread not in clean:
            clean[spread] = nll_at(spread, loader)
        return clean[spread]

    levels = len(shifted.levels)
    return choose([chosen, *narrower], accepted=lambda spread: spread == chosen or clean_nll(spread) <= limit,
                  combined_nll=lambda spread: (clean_nll(spread) + levels * nll_at(spread, shifted)) / (1 + levels),
                  unimodal=True)


def widest_accepted(set_weight: Callable[[float], None], accepted: Callable[[], bool], *, interpolable: bool) -> float:
    """Move a fitted map from its clean fit (weight 0) towards its shift-aware fit (weight 1) while ``accepted()``.

    ``set_weight(w)`` puts the map at ``w``; returns the largest weight found accepted (by bisection
    when 1 is not), with the map left there. A map that cannot be interpolated (``interpolable=False``:
    histogram bins, isotonic steps) takes 1 if accepted, else 0.

    Example:
        >>> state = {}
        >>> widest_accepted(lambda w: state.update(w=w), lambda: state["w"] <= 0.3, interpolable=True)
        0.29...
    """
    set_weight(1.0)
    if accepted():
        return 1.0
    if not interpolable:
        set_weight(0.0)
        return 0.0
    low, high = 0.0, 1.0
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        set_weight(middle)
        if accepted():
            low = middle
        else:
            high = middle
    set_weight(low)
    return low
