"""Property-based checks over the public API: every problem the fuzzer draws either gives a valid
Prediction or is refused with the one error, at the one stage, and the message that name what is
wrong — never NaN, never a raw internal exception.

The number of cases tried per method is printed in pytest's terminal summary.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
import posthoc_apps.report as present
from posthoc.core.registry import REGISTRY
from posthoc.errors import ConfigError, InputError, PosteriorFileError
from posthoc.guarantees.selective import RiskNotReachableError

CASES: collections.Counter = collections.Counter()
OUTCOMES: collections.Counter = collections.Counter()

#: fit options that keep each method's fit small on these toy problems
FAST_FIT: dict[str, dict] = {
    "swag": {"epochs": 3, "collect_per_epoch": 1},
    "multiswag": {"epochs": 3, "collect_per_epoch": 1},
    "ibnn": {"epochs": 1},
}
#: wrap options that keep the slowest methods' fits short on the same code path (fewer folds, fewer members)
FAST_WRAP: dict[str, dict] = {"auto-calibration": {"folds": 2}, "multiswag": {"members": 2}}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _methods() -> list[str]:
    return sorted(posthoc.available_methods())


def _entropy64(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats over the last axis, in float64, written apart from posthoc's."""
    probs = probs.double()
    return -(probs * torch.where(probs > 0, probs, 1.0).log()).sum(-1)


def _check_prediction(pred: posthoc.Prediction, n: int, c: int) -> None:
    num_classes = max(c, 2)
    assert pred.probs.shape == (n, num_classes)
    assert (pred.probs >= 0).all()
    assert torch.allclose(
        pred.probs.double().sum(-1), torch.ones(n, dtype=torch.float64, device=pred.probs.device), atol=1e-5
    )
    for field in (pred.entropy, pred.aleatoric, pred.epistemic, pred.confidence):
        assert field.shape == (n,) and torch.isfinite(field).all()
    total = _entropy64(pred.probs)
    assert torch.allclose(pred.entropy.double(), total, atol=1e-4)
    if pred.samples is None:
        assert torch.equal(pred.aleatoric, pred.entropy) and not pred.epistemic.any()
        return
    assert pred.samples.shape[1:] == (n, num_classes)
    assert torch.allclose(pred.samples.double().mean(0), pred.probs.double(), atol=1e-3), (
        "probs must average the samples"
    )
    aleatoric = _entropy64(pred.samples).mean(0)
    assert torch.allclose(pred.aleatoric.double(), aleatoric, atol=1e-4)
    assert torch.allclose(pred.epistemic.double(), total - aleatoric, atol=1e-3)


@st.composite
def problems(draw):
    c = draw(st.sampled_from([1, 2, 3, 1000]))
    d = draw(st.integers(1, 6))
    n_train = draw(st.sampled_from([1, 3, 7, 40]))
    batch = draw(st.sampled_from([1, 5, 64]))
    dtype = draw(st.sampled_from(DTYPES))
    device = draw(st.sampled_from(DEVICES))
    n_test = draw(st.sampled_from([1, 3, 17]))
    corrupt = draw(st.sampled_from(["none", "nan", "inf", "constant", "huge"]))
    seed = draw(st.integers(0, 2**16))
    return c, d, n_train, batch, dtype, device, n_test, corrupt, seed


def _build(c, d, n_train, batch, dtype, device, n_test, corrupt, seed):
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, c)).to(device, dtype)
    x_train = torch.randn(n_train, d, generator=generator)
    y_train = torch.randint(0, max(c, 2), (n_train,), generator=generator)
    loader = DataLoader(TensorDataset(x_train.to(device, dtype), y_train.to(device)), batch_size=batch)
    x = torch.randn(n_test, d, generator=generator)
    if corrupt == "nan":
        x[0, 0] = float("nan")
    elif corrupt == "inf":
        x[-1, -1] = float("inf")
    elif corrupt == "constant":
        x = torch.full_like(x, 3.0)
    elif corrupt == "huge":
        x = x * 1e4
    return model, loader, x.to(device, dtype)


class Refusal(NamedTuple):
    """How a problem must be refused: at which stage, with which error, saying what."""

    stage: str
    error: type[posthoc.PosthocError]
    says: str


def _expected_refusal(method: str, c: int, corrupt: str) -> Refusal | None:
    """The refusal the fuzzer's problem calls for, or ``None`` when it must give a valid prediction."""
    if method == "mc-batchnorm":  # the fuzzer's networks have no BatchNorm to sample
        return Refusal("fit", ConfigError, "BatchNorm layers and this model has none")
    if method == "abnn":  # nor BatchNorm layers to make Bayesian
        return Refusal("fit", ConfigError, "Bayesian normalisation layers and this model has none")
    if c == 1 and method == "laplace":
        return Refusal("fit", ConfigError, "needs a head with at least 2 outputs; this head has 1")
    if corrupt in ("nan", "inf"):
        return Refusal("predict", InputError, "inputs contain NaN or inf")
    return None


def _refused_as_too_few_for_a_calibrator(method: str, refusal: Refusal) -> bool:
    """Calibrators refuse held-out sets below their documented minimum (examples, examples per class, two
    classes; platt: binary classifiers only) with an error that names it."""
    if not hasattr(REGISTRY[method], "calibrator_class"):
        return False
    return refusal.error in (InputError, ConfigError) and (
        "held-out" in refusal.says or "binary classifiers" in refusal.says
    )


@pytest.mark.parametrize("method", _methods())
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(problem=problems())
def test_every_call_is_valid_or_the_expected_error(method, problem):
    c, d, n_train, batch, dtype, device, n_test, corrupt, seed = problem
    model, loader, x = _build(*problem)
    expected = _expected_refusal(method, c, corrupt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    CASES[method] += 1
    stage, refusal = "fit", None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            um = posthoc.wrap(model, method=method, **FAST_WRAP.get(method, {})).fit(
                loader, loader, progress=False, **FAST_FIT.get(method, {})
            )
            stage = "predict"
            pred = um.predict(x, generator=torch.Generator(device=device).manual_seed(0))
    except posthoc.PosthocError as err:
        refusal = Refusal(stage, type(err), str(err))
    finally:
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), "the user's model was modified"
    if refusal is not None and refusal.stage == "fit" and _refused_as_too_few_for_a_calibrator(method, refusal):
        OUTCOMES[f"{method}: too few held-out examples"] += 1
        return
    if expected is None:
        assert refusal is None, f"a valid problem was refused: {refusal}"
        _check_prediction(pred, n_test, c)
        OUTCOMES[f"{method}: valid prediction"] += 1
        return
    assert refusal is not None, f"expected {expected}, got a prediction"
    assert refusal.stage == expected.stage and refusal.error is expected.error, (expected, refusal)
    assert expected.says in refusal.says, (expected, refusal)
    OUTCOMES[f"{method}: {refusal.error.__name__} in {refusal.stage}"] += 1


# --------------------------------------------------------------------------- every public function, misused
#
# Each entry point of ``posthoc.__all__`` gets bad data (hypothesis draws the kind of damage, the sizes and
# the batch it hits) or a bad call, and must answer with one error type and a phrase that names the problem.

#: the phrase each kind of bad data must be refused with, for batch and loader entry points alike
DAMAGE = {
    "list": (InputError, "a tensor (or a dict of tensors), got list"),
    "empty": (InputError, "empty batch (0 examples)"),
    "nan": (InputError, "inputs contain NaN or inf"),
    "mismatch": (InputError, "inputs but"),
    "not a loader": (InputError, "takes a loader of (x, y) batches"),
    "no batches": (InputError, "yielded no batches"),
}
BATCH_DAMAGE = ("list", "empty", "nan")


@pytest.fixture(scope="module")
def world():
    """A small image classifier, its labelled batches, and what the entry points are built from."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 3)).eval()
    x, y = torch.rand(24, 1, 8, 8), torch.arange(24) % 3
    loader = [(x[:12], y[:12]), (x[12:], y[12:])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        um = posthoc.wrap(model, method="temperature").fit(val_loader=loader, progress=False)
    detector = posthoc.detector(model, score=["energy", "knn"], k=3).fit(loader, progress=False)
    return {
        "model": model,
        "x": x,
        "y": y,
        "loader": loader,
        "um": um,
        "detector": detector,
        "report": posthoc.evaluate(um, loader, progress=False),
    }


def _damaged_batch(x: torch.Tensor, damage: str, rows: int) -> object:
    if damage == "list":
        return x[:rows].tolist()
    if damage == "empty":
        return x[:0]
    bad = x[:rows].clone()
    bad[rows // 2, 0, 0, 0] = float("nan")
    return bad


def _damaged_loader(x: torch.Tensor, y: torch.Tensor, damage: str, rows: int, where: int) -> object:
    if damage == "not a loader":
        return x
    if damage == "no batches":
        return []
    batches = [(x[:rows], y[:rows]), (x[rows : 2 * rows], y[rows : 2 * rows])]
    bx, by = batches[where]
    if damage == "mismatch":
        by = by[:-1]
    else:
        bx = _damaged_batch(bx, damage, rows)
    batches[where] = (bx, by)
    return batches


#: the entry points that take a loader, each called on one
LOADER_ENTRY_POINTS = {
    "UncertainModel.fit": lambda w, data: posthoc.wrap(w["model"], method="temperature").fit(
        val_loader=data, progress=False
    ),
    "evaluate": lambda w, data: posthoc.evaluate(w["um"], data, progress=False),
    "evaluate_shift": lambda w, data: posthoc.evaluate_shift(
        w["um"], data, kinds=["contrast"], severities=[1], progress=False
    ),
    "conformal": lambda w, data: posthoc.conformal(w["um"], data, progress=False),
    "selective": lambda w, data: posthoc.selective(w["um"], data, target_risk=0.5, progress=False),
    "Detector.fit": lambda w, data: posthoc.detector(w["model"], score="knn", k=3).fit(data, progress=False),
    "Detector.score_loader": lambda w, data: w["detector"].score_loader(data, progress=False),
    "shift.corrupt": lambda w, data: list(posthoc.shift.corrupt(data, "contrast", 1)),
}

#: the entry points that take one batch
BATCH_ENTRY_POINTS = {
    "UncertainModel.predict": lambda w, x: w["um"].predict(x),
    "Detector.score": lambda w, x: w["detector"].score(x, "energy"),
    "Detector.scores": lambda w, x: w["detector"].scores(x),
    "shift.corrupt_images": lambda w, x: posthoc.shift.corrupt_images(x, "contrast", 1, torch.Generator()),
}


@pytest.mark.parametrize("entry", sorted(LOADER_ENTRY_POINTS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damage=st.sampled_from(sorted(DAMAGE)), rows=st.integers(2, 6), where=st.integers(0, 1))
def test_every_loader_entry_point_refuses_bad_data_with_the_same_words(world, entry, damage, rows, where):
    if entry == "shift.corrupt" and damage == "mismatch":
        where = 0  # the corrupted loader is consumed batch by batch: the damage is seen where it is
    error, says = DAMAGE[damage]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(error, match=re_escape(says)):
            LOADER_ENTRY_POINTS[entry](world, _damaged_loader(world["x"], world["y"], damage, rows, where))
    OUTCOMES[f"{entry}: {damage}"] += 1


@pytest.mark.parametrize("entry", sorted(BATCH_ENTRY_POINTS))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damage=st.sampled_from(BATCH_DAMAGE), rows=st.integers(1, 8))
def test_every_batch_entry_point_refuses_bad_data_with_the_same_words(world, entry, damage, rows):
    error, says = DAMAGE[damage]
    with pytest.raises(error, match=re_escape(says)):
        BATCH_ENTRY_POINTS[entry](world, _damaged_batch(world["x"], damage, max(rows, 2)))
    OUTCOMES[f"{entry}: {damage}"] += 1


def _nan_model(w):
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 3)).eval()
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    return model


def _saved(w, tmp_path, what):
    path = tmp_path / f"{what}.pt"
    if what == "posterior":
        w["um"].save(path)
    else:
        posthoc.calibrate(w["model"](w["x"]).detach() * 3, w["y"]).save(path)
    return path


def _probabilities(w):
    return w["model"](w["x"]).detach().softmax(-1)


#: one bad call per row: (public name, call, error, phrase); ``tmp`` is a fresh folder
MISUSES = [
    ("wrap", lambda w, tmp: posthoc.wrap(w["model"], method="nope"), ConfigError, "unknown method 'nope'"),
    ("wrap", lambda w, tmp: posthoc.wrap("a model", method="none"), ConfigError, "model must be a torch.nn.Module"),
    (
        "wrap",
        lambda w, tmp: posthoc.wrap(w["model"], method=["laplace", "variance-scaling"], likelihood="regression"),
        ConfigError,
        "wrap without it and fit posthoc.calibrate(mean=pred.mean, std=pred.std, targets=y_val",
    ),
    ("load", lambda w, tmp: posthoc.load(tmp, w["model"]), PosteriorFileError, "is a directory, not a posterior file"),
    (
        "load",
        lambda w, tmp: posthoc.load(_saved(w, tmp, "calibrator"), w["model"]),
        PosteriorFileError,
        "is a calibrator file",
    ),
    ("load", lambda w, tmp: posthoc.load(tmp / "missing.pt", w["model"]), PosteriorFileError, "no posterior file at"),
    (
        "UncertainModel.save",
        lambda w, tmp: w["um"].save(_saved(w, tmp, "posterior") / "x.pt"),
        PosteriorFileError,
        "cannot be created or written",
    ),
    ("calibrate", lambda w, tmp: posthoc.calibrate(_probabilities(w), w["y"]), InputError, "look like probabilities"),
    (
        "calibrate",
        lambda w, tmp: posthoc.calibrate(w["x"].flatten(1)[:, :3], w["y"][:-1]),
        InputError,
        "different lengths",
    ),
    ("calibrate", lambda w, tmp: posthoc.calibrate(torch.zeros(0, 3), torch.zeros(0)), InputError, "got no examples"),
    (
        "calibrate",
        lambda w, tmp: posthoc.calibrate(torch.full((24, 3), float("nan")), w["y"]),
        InputError,
        "NaN or inf logits",
    ),
    (
        "calibrate",
        lambda w, tmp: posthoc.calibrate(w["x"].flatten(1)[:, :3], w["y"], method="nope"),
        ConfigError,
        "unknown calibration method 'nope'",
    ),
    (
        "calibrate.load",
        lambda w, tmp: posthoc.calibrate.load(_saved(w, tmp, "posterior")),
        PosteriorFileError,
        "is a posterior file",
    ),
    (
        "Calibrator.__call__",
        lambda w, tmp: posthoc.calibrate(w["model"](w["x"]).detach() * 3, w["y"])(_probabilities(w)),
        InputError,
        "look like probabilities",
    ),
    (
        "compare",
        lambda w, tmp: posthoc.compare(w["report"], "a report"),
        InputError,
        "compare takes two posthoc.Report",
    ),
    (
        "compare",
        lambda w, tmp: posthoc.compare(w["report"], w["report"], metric="nope"),
        ConfigError,
        "cannot compare 'nope'",
    ),
    (
        "evaluate_shift",
        lambda w, tmp: posthoc.evaluate_shift(w["um"], w["loader"], kinds=["nope"], progress=False),
        ConfigError,
        "unknown corruption kind 'nope'",
    ),
    (
        "shift.corrupt",
        lambda w, tmp: posthoc.shift.corrupt(w["loader"], "contrast", 1, normalization=(0.5, 0.0)),
        ConfigError,
        "std must be finite and > 0",
    ),
    (
        "shift.corrupt",
        lambda w, tmp: posthoc.shift.corrupt(w["loader"], "contrast", 9),
        ConfigError,
        "severity must be an integer from 1 to 5",
    ),
    (
        "shift.extrapolation_split",
        lambda w, tmp: posthoc.shift.extrapolation_split(w["x"].flatten(1), w["y"]),
        ConfigError,
        "features: name the one to split by, feature=",
    ),
    (
        "shift.gap_split",
        lambda w, tmp: posthoc.shift.gap_split(w["x"], w["y"], feature=0),
        InputError,
        "for images use the corruption kinds (posthoc.shift.corrupt)",
    ),
    (
        "conformal",
        lambda w, tmp: posthoc.conformal(w["um"], w["loader"], alpha=2, progress=False),
        ConfigError,
        "alpha must be a number strictly between 0 and 1",
    ),
    (
        "conformal",
        lambda w, tmp: posthoc.conformal(w["um"], w["y"], progress=False),
        InputError,
        "takes a loader of (x, y) batches",
    ),
    (
        "label_shift",
        lambda w, tmp: posthoc.label_shift(w["um"], w["loader"], w["loader"], estimator="nope"),
        ConfigError,
        "estimator must be one of ('em', 'bbse'), got 'nope'",
    ),
    (
        "selective",
        lambda w, tmp: posthoc.selective(w["um"], w["loader"], target_risk=0, progress=False),
        ConfigError,
        "target_risk must be a number strictly between 0 and 1",
    ),
    (
        "detector",
        lambda w, tmp: posthoc.detector(w["model"], score="nope"),
        ConfigError,
        "unknown OOD score(s) ['nope']",
    ),
    (
        "detector",
        lambda w, tmp: posthoc.detector(_nan_model(w), score="knn", k=3).fit(w["loader"], progress=False),
        posthoc.NumericalError,
        "hold NaN or inf for these inputs",
    ),
    (
        "detector",
        lambda w, tmp: posthoc.detector(_nan_model(w), score="energy").score(w["x"]),
        posthoc.NumericalError,
        "hold NaN or inf for these inputs",
    ),
    (
        "Detector.score",
        lambda w, tmp: posthoc.detector(w["model"], score="knn").score(w["x"]),
        posthoc.NotFittedError,
        "needs statistics of the training data",
    ),
    (
        "UncertainModel.predict",
        lambda w, tmp: posthoc.wrap(w["model"], method="laplace").predict(w["x"]),
        posthoc.NotFittedError,
        "must be fitted before predicting",
    ),
    (
        "UncertainModel.sparsity",
        lambda w, tmp: posthoc.wrap(w["model"], method="sparse-vd").sparsity(),
        posthoc.NotFittedError,
        "um.sparsity() reads the fitted posterior of 'sparse-vd'",
    ),
    (
        "UncertainModel.prune",
        lambda w, tmp: posthoc.wrap(w["model"], method="sparse-vd").prune(),
        posthoc.NotFittedError,
        "um.prune() reads the fitted posterior of 'sparse-vd'",
    ),
    (
        "UncertainModel.fit",
        lambda w, tmp: posthoc.wrap(w["model"], method="sgld", cycles=50, num_samples=2).fit(
            w["loader"], progress=False
        ),
        ConfigError,
        "never reach the sampling phase",
    ),
    (
        "evaluate",
        lambda w, tmp: posthoc.evaluate(w["um"], [(torch.rand(64, 1, 8, 8), torch.arange(60) % 3)], progress=False),
        InputError,
        "batch 0 (0-based) of the loader for 'evaluate' has 64 inputs but 60 labels",
    ),
    (
        "UncertainModel.fit",
        lambda w, tmp: posthoc.wrap(w["model"], method="sgld", cycles=4, num_samples=2).fit(
            [(w["x"][:3], w["y"][:3])] * 8, progress=False
        ),
        ConfigError,
        "cycles=4 over 16 steps",
    ),
    ("register", lambda w, tmp: posthoc.register(42), ConfigError, "takes a subclass of posthoc.Method"),
    # the newest API: ensembles registered as "ensemble", the calibrators read from the method registry, dac
    (
        "wrap",
        lambda w, tmp: posthoc.wrap(w["model"], method=5),
        ConfigError,
        "method must be a method name or a list of them",
    ),
    (
        "wrap",
        lambda w, tmp: posthoc.wrap(w["model"], method="ensemble"),
        ConfigError,
        "'ensemble' is built from a list of models: pass posthoc.wrap([model_a, model_b, ...]",
    ),
    (
        "wrap",
        lambda w, tmp: posthoc.wrap([w["model"]], method="ensemble"),
        ConfigError,
        "'ensemble' is built from a list of models",
    ),
    (
        "wrap",
        lambda w, tmp: posthoc.wrap([w["model"], w["model"]], method=["none", "ensemble"]),
        ConfigError,
        "'ensemble' is built from a list of models",
    ),
    (
        "wrap",
        lambda w, tmp: posthoc.wrap([], method="none"),
        ConfigError,
        "an ensemble needs at least one model; got an empty list",
    ),
    (
        "wrap",
        lambda w, tmp: posthoc.wrap([w["model"], 3]),
        ConfigError,
        "ensemble member 1 must be a torch.nn.Module, got int",
    ),
    (
        "calibrate",
        lambda w, tmp: posthoc.calibrate(w["model"](w["x"]).detach(), w["y"], method="ensemble"),
        ConfigError,
        "unknown calibration method 'ensemble'; valid: none, identity, temperature",
    ),
    (
        "Calibrator.__call__",
        lambda w, tmp: posthoc.calibrate(w["model"](w["x"]).detach() * 3, w["y"], method="auto")(_probabilities(w)),
        InputError,
        "look like probabilities",
    ),
    (
        "UncertainModel.fit",
        lambda w, tmp: posthoc.wrap(w["model"], method="dac").fit(w["loader"], progress=False),
        InputError,
        "'dac' is fitted on held-out data: call um.fit(train_loader, val_loader)",
    ),
    (
        "UncertainModel.fit",
        lambda w, tmp: posthoc.wrap(w["model"], method=["laplace", "dac"]).fit(w["loader"], progress=False),
        InputError,
        "'dac' is fitted on held-out data",
    ),
    (
        "UncertainModel.fit",
        lambda w, tmp: posthoc.wrap(w["model"], method="dac").fit(val_loader=w["loader"], progress=False),
        InputError,
        "'dac' compares features with the training features",
    ),
    (
        "wrap",
        lambda w, tmp: posthoc.wrap(w["model"], method="dac", layers=["nope"]),
        ConfigError,
        "layers: the model has no module named 'nope'",
    ),
    (
        "wrap",
        lambda w, tmp: posthoc.wrap(w["model"], method="dac", layers="3"),
        ConfigError,
        "layers must be None (found automatically) or a list of module names",
    ),
    (
        "wrap",
        lambda w, tmp: posthoc.wrap(w["model"], method="dac", k=0),
        ConfigError,
        "k must be a positive integer, got 0",
    ),
    (
        "wrap",
        lambda w, tmp: posthoc.wrap(w["model"], method="dac", head="nope"),
        posthoc.HeadNotFoundError,
        "the model has no module named 'nope'",
    ),
    (
        "UncertainModel.predict",
        lambda w, tmp: posthoc.wrap(w["model"], method="dac").predict(w["x"]),
        posthoc.NotFittedError,
        "method 'dac' must be fitted before predicting",
    ),
    # non-finite intermediate results while fitting: features and the inner predictive's log-probabilities
    (
        "UncertainModel.fit",
        lambda w, tmp: posthoc.wrap(_nan_model(w), method="dac").fit(w["loader"], w["loader"], progress=False),
        posthoc.NumericalError,
        "the plain model's outputs on the held-out data hold NaN or inf although the inputs are finite",
    ),
    (
        "UncertainModel.fit",
        lambda w, tmp: posthoc.wrap(_nan_model(w), method="temperature").fit(val_loader=w["loader"], progress=False),
        posthoc.NumericalError,
        "the plain model's outputs on the held-out data hold NaN or inf",
    ),
    (
        "UncertainModel.fit",
        lambda w, tmp: posthoc.wrap(_nan_model(w), method="isotonic").fit(val_loader=w["loader"], progress=False),
        posthoc.NumericalError,
        "the plain model's outputs on the held-out data hold NaN or inf",
    ),
    (
        "UncertainModel.fit",
        lambda w, tmp: posthoc.wrap(_nan_model(w), method="auto-calibration").fit(
            val_loader=w["loader"], progress=False
        ),
        posthoc.NumericalError,
        "the plain model's outputs on the held-out data hold NaN",
    ),
    (
        "Tolerance",
        lambda w, tmp: posthoc.Tolerance(relative=-0.1),
        ConfigError,
        "Tolerance.relative must be a number >= 0",
    ),
    (
        "SWAGCollector",
        lambda w, tmp: posthoc.SWAGCollector(w["model"], rank=1),
        ConfigError,
        "rank must be an integer >= 2",
    ),
    (
        "SWAGCollector",
        lambda w, tmp: posthoc.SWAGCollector(w["model"]).update(nn.Linear(2, 2)),
        InputError,
        "the model has no parameter",
    ),
    (
        "UncertainModel.fit",
        lambda w, tmp: posthoc.wrap(w["model"], method="temperature").fit(
            val_loader=w["loader"], tolerance="2%", progress=False
        ),
        ConfigError,
        "tolerance must be None",
    ),
    (
        "settings",
        lambda w, tmp: posthoc.settings.override(chunk_size=0).__enter__(),
        ConfigError,
        "posthoc.settings.chunk_size must be a positive integer",
    ),
    (
        "available_methods",
        lambda w, tmp: posthoc.wrap(w["model"], method="laplace", **{"nope": 1}),
        ConfigError,
        "unknown option(s) ['nope']",
    ),
]


@pytest.mark.parametrize("entry", sorted(LOADER_ENTRY_POINTS))
def test_every_loader_entry_point_accepts_the_same_loader_shapes(world, entry):
    """A plain list of (x, y) pairs, a DataLoader and a generator: wherever a loader is taken (evaluate_shift reads
    its loader once per corruption, which a generator cannot give)."""
    x, y = world["x"], world["y"]
    shapes = {"list": world["loader"], "DataLoader": DataLoader(TensorDataset(x, y), batch_size=12)}
    if entry != "evaluate_shift":
        shapes["generator"] = ((x[k : k + 12], y[k : k + 12]) for k in (0, 12))
    for shape, data in shapes.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                LOADER_ENTRY_POINTS[entry](world, data)
            except RiskNotReachableError:
                pass  # read the whole loader, then found no threshold on 24 examples: the shape was accepted
        OUTCOMES[f"{entry}: accepts a {shape}"] += 1


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize("case", range(len(MISUSES)), ids=[f"{name}-{i}" for i, (name, *_) in enumerate(MISUSES)])
def test_every_public_function_refuses_a_misuse_with_the_one_error(world, case, tmp_path):
    name, call, error, says = MISUSES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(error, match=re_escape(says)):
            call(world, tmp_path)
    OUTCOMES[f"{name}: {error.__name__}"] += 1


def test_the_misuses_cover_every_public_function():
    """Every function (and public module) of ``posthoc.__all__`` is misused above or in :data:`NEWEST_API_MISUSES`;
    classes are reached through their instances (``UncertainModel.*``, ``Detector.*``, ``Calibrator``), exceptions are
    what is checked."""
    tried = (
        {name.split(".")[0] for name, *_ in MISUSES + NEWEST_API_MISUSES}
        | set(LOADER_ENTRY_POINTS)
        | set(BATCH_ENTRY_POINTS)
    )
    tried = {name.split(".")[0] for name in tried}
    public = {
        name
        for name in posthoc.__all__
        if not (isinstance(getattr(posthoc, name), type) and issubclass(getattr(posthoc, name), BaseException))
    }
    untried = public - tried - {"Prediction", "Report", "Comparison", "ShiftTable", "Method"}
    assert not untried, f"public names with no misuse tried: {sorted(untried)}"


# --------------------------------------------------------------------------- the regression, shift and DAC API, misused
#
# Issue 35: the API that came with regression, shift-aware fitting and DAC, every public function and method of it,
# misused the ways a new user does; each answers with one error type and a phrase naming the problem and the way out.


@pytest.fixture(scope="module")
def regression(tmp_path_factory):
    """A small regressor wrapped and fitted, its prediction, calibrator, conformal intervals, report and shift table."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=generator)
    y = 2 * x[:, :1] + 0.3 * torch.randn(40, 1, generator=generator)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).eval()
    loader = [(x[:20], y[:20]), (x[20:], y[20:])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        um = posthoc.wrap(model, method="none", likelihood="regression").fit(loader, loader, progress=False)
        pred = um.predict(x)
        isotonic = posthoc.calibrate(mean=pred.mean, std=pred.std, targets=y, method="isotonic")
        table = posthoc.evaluate_shift([um], {"random": loader, "far": [(x + 2, y)]}, progress=False)
    folder = tmp_path_factory.mktemp("regression")
    um.save(folder / "posterior.pt")
    (folder / "file").write_text("a file where a folder would be")
    return {
        "model": model,
        "x": x,
        "y": y,
        "loader": loader,
        "um": um,
        "pred": pred,
        "folder": folder,
        "calibrator": posthoc.calibrate(mean=pred.mean, std=pred.std, targets=y),
        "recalibrated": isotonic.calibrate(pred),
        "conformal": posthoc.conformal(um, loader, alpha=0.2, progress=False),
        "report": posthoc.evaluate(um, loader, progress=False),
        "table": table,
        "two": posthoc.RegressionPrediction.from_components(torch.zeros(1, 40, 2), None, torch.ones(1, 1, 2)),
    }


def _exact(r):
    """Targets the model predicts exactly."""
    with torch.no_grad():
        return [(r["x"], r["model"](r["x"]))]


def _rewritten(r, tmp, edit):
    """The saved regression posterior with ``edit(payload)`` applied and a fresh checksum: a file from another version."""
    from posthoc.core import persistence

    payload = torch.load(r["folder"] / "posterior.pt", weights_only=True)
    edit(payload)
    payload.pop("checksum")
    payload["checksum"] = persistence.checksum(payload)
    torch.save(payload, tmp / "edited.pt")
    return tmp / "edited.pt"


def _image_classifier():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 3)).eval()


#: one bad call per row: (API member, call(r, w, tmp), error, phrase); ``r`` the regression world, ``w`` the classifier's
NEWEST_API_MISUSES = [
    # the likelihoods and wrap
    (
        "Gaussian",
        lambda r, w, tmp: posthoc.Gaussian(noise_std=0),
        ConfigError,
        "noise_std must be a positive finite float",
    ),
    (
        "HeteroscedasticGaussian",
        lambda r, w, tmp: posthoc.wrap(r["model"], method="none", likelihood=posthoc.HeteroscedasticGaussian()),
        ConfigError,
        "this model returns 1 output(s) per example. Give it an even number",
    ),
    (
        "wrap",
        lambda r, w, tmp: posthoc.wrap(r["model"], method="none", likelihood={"name": "regression", "scale": 2}),
        ConfigError,
        "unknown option(s) ['scale'] for likelihood 'regression'",
    ),
    (
        "wrap",
        lambda r, w, tmp: posthoc.wrap(
            nn.Linear(r["x"].shape[1], 2), method="laplace", likelihood="heteroscedastic", subset="all"
        ),
        ConfigError,
        "does not do likelihood='heteroscedastic'",
    ),
    (
        "wrap",
        lambda r, w, tmp: posthoc.wrap(r["model"], method="swag", head="nope"),
        posthoc.HeadNotFoundError,
        "the model has no module named 'nope'",
    ),
    # fit and predict under regression
    (
        "UncertainModel.fit",
        lambda r, w, tmp: posthoc.wrap(r["model"], method="none", likelihood="regression").fit(
            [(r["x"], ["a"] * 40)], progress=False
        ),
        InputError,
        "are strings (e.g. 'a'), not numbers",
    ),
    (
        "UncertainModel.fit",
        lambda r, w, tmp: posthoc.wrap(r["model"], method="laplace", likelihood="regression").fit(
            _exact(r), progress=False
        ),
        InputError,
        "predicts every training target exactly, so the observation noise is 0",
    ),
    (
        "UncertainModel.fit",
        lambda r, w, tmp: posthoc.wrap(r["model"], method="none", likelihood="regression").fit(progress=False),
        InputError,
        "likelihood='regression' fits the observation noise on data",
    ),
    (
        "UncertainModel.predict",
        lambda r, w, tmp: r["um"].predict(r["x"], generator=42),
        ConfigError,
        "generator must be a torch.Generator or None, got 42; for a seed pass generator=torch.Generator().manual_seed(42)",
    ),
    # the prediction
    (
        "RegressionPrediction.from_components",
        lambda r, w, tmp: posthoc.RegressionPrediction.from_components(torch.zeros(4, 1), None, torch.ones(1)),
        InputError,
        "means must be a tensor (K, N, D)",
    ),
    (
        "RegressionPrediction.log_prob",
        lambda r, w, tmp: r["pred"].log_prob(["a"] * 40),
        InputError,
        "targets are strings (e.g. 'a'), not numbers",
    ),
    (
        "RegressionPrediction.log_prob",
        lambda r, w, tmp: r["pred"].log_prob(torch.full((40,), float("nan"))),
        InputError,
        "targets contain NaN or inf",
    ),
    (
        "RegressionPrediction.cdf",
        lambda r, w, tmp: r["pred"].cdf(torch.full((40, 1), float("nan"))),
        InputError,
        "targets contain NaN or inf",
    ),
    (
        "RegressionPrediction.cdf",
        lambda r, w, tmp: r["pred"].cdf(torch.zeros(39)),
        InputError,
        "this predictive is over 40 examples and 1 output(s)",
    ),
    (
        "RegressionPrediction.interval",
        lambda r, w, tmp: r["pred"].interval(90),
        InputError,
        "an interval level must be a number in (0, 1)",
    ),
    (
        "RegressionPrediction.quantile",
        lambda r, w, tmp: r["pred"].quantile(1.5),
        InputError,
        "a quantile level must be a number in (0, 1)",
    ),
    (
        "RegressionPrediction.scaled",
        lambda r, w, tmp: r["pred"].scaled(torch.ones(3)),
        InputError,
        "scale must be a tensor of 1 finite factor(s) > 0, one per output",
    ),
    (
        "RegressionPrediction.recalibrate",
        lambda r, w, tmp: r["recalibrated"].recalibrate(r["recalibrated"].recalibration),
        InputError,
        "this prediction is already recalibrated",
    ),
    # calibrating a regressor
    (
        "calibrate",
        lambda r, w, tmp: posthoc.calibrate(mean=r["pred"].mean, std=r["pred"].std, targets=r["pred"].mean),
        InputError,
        "the predicted means equal every target of output(s) [0] exactly",
    ),
    (
        "calibrate",
        lambda r, w, tmp: posthoc.calibrate(
            mean=r["pred"].mean[:12], std=r["pred"].std[:12], targets=r["y"][:12], method="auto"
        ),
        InputError,
        "'auto' compares the calibrators by 5-fold cross-validation",
    ),
    (
        "calibrate",
        lambda r, w, tmp: posthoc.calibrate(mean=r["pred"].mean, targets=r["y"], method="temperature"),
        ConfigError,
        "'temperature' calibrates a classifier's logits, not a regressor",
    ),
    (
        "RegressionCalibrator.fit",
        lambda r, w, tmp: type(r["calibrator"])().fit(w["um"].predict(w["x"]), r["y"][:24]),
        InputError,
        "takes a posthoc.RegressionPrediction (um.predict(x) of a model wrapped with likelihood='regression'), "
        "got a classifier's posthoc.Prediction",
    ),
    (
        "RegressionCalibrator.calibrate",
        lambda r, w, tmp: r["calibrator"].calibrate(r["two"]),
        InputError,
        "was fitted on 1 output(s) but got a prediction of 2",
    ),
    (
        "RegressionCalibrator.predict",
        lambda r, w, tmp: r["calibrator"].predict(r["pred"]),
        InputError,
        "mean= takes the predicted means (numbers), got a RegressionPrediction",
    ),
    (
        "RegressionCalibrator.save",
        lambda r, w, tmp: r["calibrator"].save(r["folder"] / "file" / "c.pt"),
        posthoc.PosteriorFileError,
        "cannot be created or written",
    ),
    # conformal intervals
    (
        "conformal",
        lambda r, w, tmp: posthoc.conformal(r["pred"], r["loader"]),
        InputError,
        "calibrated on a RegressionPrediction, conformal takes its targets (N,) or (N, D), not a loader",
    ),
    (
        "conformal",
        lambda r, w, tmp: posthoc.conformal(r["um"], r["loader"], score="aps", progress=False),
        ConfigError,
        "unknown regression conformal score 'aps'",
    ),
    (
        "conformal",
        lambda r, w, tmp: posthoc.conformal(r["um"], r["loader"], mondrian=True, progress=False),
        ConfigError,
        "configure conformal sets for classifiers",
    ),
    (
        "ConformalRegressor.intervals",
        lambda r, w, tmp: r["conformal"].intervals(r["two"]),
        InputError,
        "these intervals were calibrated on 1 output(s) but mean has 2",
    ),
    (
        "ConformalRegressor.sets",
        lambda r, w, tmp: r["conformal"].sets(r["x"]),
        ConfigError,
        "conformal prediction sets are for classifiers",
    ),
    (
        "ConformalRegressor.prediction",
        lambda r, w, tmp: r["conformal"].prediction(w["um"].predict(w["x"])),
        InputError,
        "got a classifier's posthoc.Prediction",
    ),
    (
        "conformal_intervals",
        lambda r, w, tmp: __import__("posthoc.guarantees.intervals", fromlist=["x"]).conformal_intervals(
            r["y"], mean=r["pred"].mean, std=-r["pred"].std
        ),
        InputError,
        "every predictive std must be > 0",
    ),
    # evaluating
    (
        "evaluate",
        lambda r, w, tmp: posthoc.evaluate(r["model"], r["loader"], progress=False),
        InputError,
        "evaluate takes a wrapped model, got a Sequential; wrap it first",
    ),
    (
        "evaluate",
        lambda r, w, tmp: posthoc.evaluate(
            r["um"], r["loader"], conformal=posthoc.conformal(w["um"], w["loader"], progress=False), progress=False
        ),
        ConfigError,
        "conformal= holds a classifier's conformal sets",
    ),
    (
        "evaluate",
        lambda r, w, tmp: posthoc.evaluate(r["um"], r["loader"], seed="0", progress=False),
        ConfigError,
        "seed must be an integer, got '0'",
    ),
    (
        "conformal",
        lambda r, w, tmp: posthoc.conformal(r["um"], r["loader"], seed=0.5, progress=False),
        ConfigError,
        "seed must be an integer, got 0.5",
    ),
    (
        "evaluate_shift",
        lambda r, w, tmp: posthoc.evaluate_shift(r["um"], {"a": r["loader"]}, seed=None, progress=False),
        ConfigError,
        "seed must be an integer, got None",
    ),
    (
        "shift.corrupt",
        lambda r, w, tmp: posthoc.shift.corrupt(w["loader"], "contrast", 1, seed="1"),
        ConfigError,
        "seed must be an integer, got '1'",
    ),
    (
        "Report.from_gaussian",
        lambda r, w, tmp: posthoc.Report.from_gaussian("a", torch.zeros(1, 4, 1), torch.ones(1, 4, 1), torch.zeros(5)),
        InputError,
        "targets of shape (5, 1) do not match",
    ),
    (
        "Report.to_markdown",
        lambda r, w, tmp: r["report"].to_markdown(r["report"], shifts={"far": [r["report"]]}),
        ConfigError,
        "shift 'far' has 1 reports for 2 methods",
    ),
    (
        "posthoc_apps.report.write_html",
        lambda r, w, tmp: present.write_html(r["report"], r["folder"] / "file" / "r.html"),
        ConfigError,
        "cannot save to",
    ),
    (
        "posthoc_apps.report.calibration_curve",
        lambda r, w, tmp: present.calibration_curve(r["report"], kind="nope"),
        ConfigError,
        "kind must be one of ('interval', 'quantile')",
    ),
    (
        "posthoc_apps.report.error_against_std",
        lambda r, w, tmp: present.error_against_std(r["report"], r["folder"] / "file" / "e.png"),
        ConfigError,
        "the folder",
    ),
    # saved posteriors
    (
        "load",
        lambda r, w, tmp: posthoc.load(
            _rewritten(r, tmp, lambda p: p["spec"][0]["likelihood"].update(dof=3)), r["model"]
        ),
        posthoc.PosteriorFileError,
        "that this posthoc (version",
    ),
    (
        "load",
        lambda r, w, tmp: posthoc.load(
            _rewritten(r, tmp, lambda p: p["state"].pop("likelihood.noise_std")), r["model"]
        ),
        posthoc.PosteriorFileError,
        "lacks the fitted tensor(s) ['likelihood.noise_std']",
    ),
    (
        "load",
        lambda r, w, tmp: posthoc.load(r["folder"] / "posterior.pt", r["model"], likelihood="classification"),
        posthoc.PosteriorFileError,
        "holds a posterior for likelihood='regression'",
    ),
    # shift: fit-time kinds, the harness and the splits
    (
        "UncertainModel.fit",
        lambda r, w, tmp: posthoc.wrap(nn.Sequential(nn.Linear(3, 3)), method="temperature").fit(
            val_loader=[(r["x"], torch.arange(40) % 3)], shift=["blur"], progress=False
        ),
        ConfigError,
        "fit-time perturbation(s) ['blur'] do not suit the inputs (feature vectors of shape",
    ),
    (
        "UncertainModel.fit",
        lambda r, w, tmp: posthoc.wrap(w["model"], method="temperature").fit(
            val_loader=w["loader"], shift=[lambda x, g: x, lambda x, g: x[:, :, :4]], progress=False
        ),
        InputError,
        "shift[1] (<lambda>) returned inputs of shape",
    ),
    (
        "shift.corrupt",
        lambda r, w, tmp: list(posthoc.shift.corrupt(r["loader"], "contrast", 1)),
        InputError,
        "corruptions need image batches (N, C, H, W)",
    ),
    (
        "shift.corrupt_images",
        lambda r, w, tmp: posthoc.shift.corrupt_images(w["x"], "contrast", 1, 42),
        ConfigError,
        "generator must be a torch.Generator or None",
    ),
    (
        "shift.CorruptedLoader",
        lambda r, w, tmp: posthoc.shift.CorruptedLoader(w["loader"], "fog", 1),
        ConfigError,
        "unknown corruption kind 'fog'",
    ),
    (
        "shift.extrapolation_split",
        lambda r, w, tmp: posthoc.shift.extrapolation_split(r["x"], r["y"], feature=0, quantile=1.5),
        ConfigError,
        "quantile must be a number strictly between 0 and 1",
    ),
    (
        "shift.extrapolation_split",
        lambda r, w, tmp: posthoc.shift.extrapolation_split(r["x"], r["y"][:-1], feature=0),
        InputError,
        "y must be a tensor with one target per row of x",
    ),
    (
        "shift.gap_split",
        lambda r, w, tmp: posthoc.shift.gap_split(r["x"], r["y"], feature=0, quantiles=(0.6, 0.4)),
        ConfigError,
        "quantiles must be (low, high) with low < high",
    ),
    (
        "shift.gap_split",
        lambda r, w, tmp: posthoc.shift.gap_split(r["x"], r["y"], feature=7),
        ConfigError,
        "feature must be a column index from 0 to 2",
    ),
    (
        "evaluate_shift",
        lambda r, w, tmp: posthoc.evaluate_shift({"plain": r["model"]}, {"a": r["loader"]}, progress=False),
        InputError,
        "evaluate_shift (model 'plain') takes a wrapped model, got a Sequential",
    ),
    (
        "evaluate_shift",
        lambda r, w, tmp: posthoc.evaluate_shift([], {"a": r["loader"]}, progress=False),
        InputError,
        "evaluate_shift got no models",
    ),
    (
        "evaluate_shift",
        lambda r, w, tmp: posthoc.evaluate_shift(r["um"], r["loader"], kinds=["contrast"], progress=False),
        InputError,
        "for tabular, 1-D or token inputs pass named shifted test sets instead",
    ),
    (
        "ShiftTable.value",
        lambda r, w, tmp: r["table"].value("laplace", "far", 0, "nll"),
        ConfigError,
        "this table has no method 'laplace'; its methods: none",
    ),
    (
        "ShiftTable.example_nll",
        lambda r, w, tmp: r["table"].example_nll("laplace"),
        ConfigError,
        "this table has no method 'laplace'; its methods: none",
    ),
    (
        "ShiftTable.to_markdown",
        lambda r, w, tmp: r["table"].to_markdown(["ece"]),
        ConfigError,
        "this table has no ['ece']",
    ),
    (
        "posthoc_apps.report.shift_plot",
        lambda r, w, tmp: present.shift_plot(r["table"], r["folder"] / "file" / "shift.png"),
        ConfigError,
        "cannot save to",
    ),
    (
        "ShiftTable.chosen_metrics",
        lambda r, w, tmp: r["table"].chosen_metrics(["ece"]),
        ConfigError,
        "this table has no ['ece']",
    ),
    (
        "ShiftTable.merge",
        lambda r, w, tmp: posthoc.ShiftTable.merge([]),
        ConfigError,
        "ShiftTable.merge takes a non-empty list of ShiftTables",
    ),
    (
        "ShiftTable.join",
        lambda r, w, tmp: posthoc.ShiftTable.join([r["table"], r["table"]]),
        ConfigError,
        "tables of named test sets have no severities to join",
    ),
    (
        "ShiftTable.best_method",
        lambda r, w, tmp: r["table"].best_method(exclude=["MAP"]),
        ConfigError,
        "exclude names no method of this table: ['MAP']",
    ),
    (
        "ShiftTable.confidence",
        lambda r, w, tmp: r["table"].confidence("none", "far", 0),
        ConfigError,
        "confidence is a classifier's top-class probability",
    ),
    (
        "ShiftTable.confidence_series",
        lambda r, w, tmp: r["table"].confidence_series("none"),
        ConfigError,
        "named test sets have no severities to follow confidence along",
    ),
    (
        "posthoc_apps.report.confidence_plot",
        lambda r, w, tmp: present.confidence_plot(r["table"]),
        ConfigError,
        "named test sets have no severities to follow confidence along",
    ),
    ("shift.gap_split", lambda r, w, tmp: posthoc.shift.gap_split(torch.ones(40, 1), r["y"]), InputError, "leaves no"),
    # DAC: every option, fit and predict
    (
        "dac.k",
        lambda r, w, tmp: posthoc.wrap(w["model"], method="dac", k=1.5),
        ConfigError,
        "k must be a positive integer",
    ),
    (
        "dac.layers",
        lambda r, w, tmp: posthoc.wrap(w["model"], method="dac", layers=["9"]),
        ConfigError,
        "layers: the model has no module named '9'",
    ),
    (
        "dac.head",
        lambda r, w, tmp: posthoc.wrap(w["model"], method="dac", head="fc"),
        posthoc.HeadNotFoundError,
        "the model has no module named 'fc'",
    ),
    (
        "dac.bank_bytes",
        lambda r, w, tmp: posthoc.wrap(w["model"], method="dac", bank_bytes=None),
        ConfigError,
        "bank_bytes must be a positive number of bytes",
    ),
    (
        "dac.bank_positions",
        lambda r, w, tmp: posthoc.wrap(w["model"], method="dac", bank_positions=0),
        ConfigError,
        "bank_positions must be a positive integer",
    ),
    (
        "dac.anchor",
        lambda r, w, tmp: posthoc.wrap(w["model"], method="dac", anchor=2),
        ConfigError,
        "anchor must be a number strictly between 0 and 1",
    ),
    (
        "dac.val_tolerance",
        lambda r, w, tmp: posthoc.wrap(w["model"], method="dac", val_tolerance=0.01),
        ConfigError,
        "option 'val_tolerance' was removed: every held-out choice now takes one tolerance, um.fit(..., tolerance=...)",
    ),
    (
        "dac.shrink",
        lambda r, w, tmp: posthoc.wrap(w["model"], method="dac", shrink=1.5),
        ConfigError,
        "shrink must be a number in [0, 1]",
    ),
    (
        "dac.strength",
        lambda r, w, tmp: posthoc.wrap(w["model"], method="dac", strength=0),
        ConfigError,
        "strength must be",
    ),
    (
        "dac.max_memory",
        lambda r, w, tmp: posthoc.wrap(w["model"], method="dac", max_memory=0),
        ConfigError,
        "max_memory must be a positive number of bytes",
    ),
    (
        "dac.max_iter",
        lambda r, w, tmp: posthoc.wrap(w["model"], method="dac", max_iter=0),
        ConfigError,
        "max_iter must be a positive integer",
    ),
    (
        "dac.likelihood",
        lambda r, w, tmp: posthoc.wrap(r["model"], method="dac", likelihood="regression").fit(
            r["loader"], progress=False
        ),
        InputError,
        "'dac' is fitted on held-out data",
    ),
    (
        "detector",
        lambda r, w, tmp: posthoc.detector(r["um"], score=["knn", "energy"]),
        ConfigError,
        "the OOD score(s) ['energy'] read a classifier's logits or class probabilities; a regressor has none",
    ),
    (
        "detector",
        lambda r, w, tmp: posthoc.detector(w["model"], score="variance"),
        ConfigError,
        "the OOD score(s) ['variance'] are for regressors",
    ),
    (
        "evaluate",
        lambda r, w, tmp: posthoc.evaluate(r["um"], r["loader"], r["loader"], ood_scores=w["detector"], progress=False),
        ConfigError,
        "a classifier's detector",
    ),
    (
        "dac.fit",
        lambda r, w, tmp: posthoc.wrap(w["model"], method="dac").fit(
            w["loader"], w["loader"], shift=["feature-noise"], progress=False
        ),
        ConfigError,
        "fit-time perturbation(s) ['feature-noise'] do not suit the inputs (images",
    ),
    (
        "dac.predict",
        lambda r, w, tmp: (
            posthoc.wrap(w["model"], method="dac")
            .fit(w["loader"], w["loader"], progress=False)
            .predict(w["x"], generator=0)
        ),
        ConfigError,
        "generator must be a torch.Generator or None",
    ),
    # conformal risk control of masks and multi-label outputs
    (
        "risk_control",
        lambda r, w, tmp: posthoc.risk_control(torch.rand(20, 4), torch.ones(20, 5, dtype=torch.long), alpha=0.1),
        InputError,
        "do not match probs",
    ),
    (
        "RiskController",
        lambda r, w, tmp: posthoc.risk_control(torch.rand(20, 4), torch.ones(20, 4, dtype=torch.long), alpha=0.1).mask(
            torch.randn(5, 4) * 5
        ),
        InputError,
        "pass probabilities, not logits",
    ),
]


@pytest.mark.parametrize(
    "case", range(len(NEWEST_API_MISUSES)), ids=[f"{name}-{i}" for i, (name, *_) in enumerate(NEWEST_API_MISUSES)]
)
def test_every_function_of_the_newest_api_refuses_a_misuse_with_the_one_error(regression, world, case, tmp_path):
    name, call, error, says = NEWEST_API_MISUSES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(error, match=re_escape(says)):
            call(regression, world, tmp_path)
    OUTCOMES[f"{name}: {error.__name__}"] += 1


def _public_methods(cls: type) -> set[str]:
    """``Class.method`` for the methods ``cls`` defines (or inherits from posthoc classes) that take an argument."""
    import inspect

    found = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("posthoc"):
            continue
        for name, value in vars(klass).items():
            function = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            if name.startswith("_") or not inspect.isfunction(function):
                continue
            if len(inspect.signature(function).parameters) > (0 if isinstance(value, staticmethod) else 1):
                found.add(f"{cls.__name__}.{name}")
    return found


def test_the_misuses_cover_every_function_of_the_regression_shift_and_dac_api():
    """Every public function of the regression, shift and DAC API has a row above: the likelihoods, the prediction's,
    the report's, the conformal regressor's and the shift table's methods that take an argument, a calibrator's
    fit / calibrate / predict / save, every name of ``posthoc.shift``, every DAC option with its fit and predict."""
    from posthoc.guarantees.conformal import ConformalRegressor

    required = {
        "Gaussian",
        "HeteroscedasticGaussian",
        "wrap",
        "UncertainModel.fit",
        "UncertainModel.predict",
        "calibrate",
        "conformal",
        "conformal_intervals",
        "evaluate",
        "evaluate_shift",
        "load",
        *(f"RegressionCalibrator.{name}" for name in ("fit", "calibrate", "predict", "save")),
    }
    for cls in (
        posthoc.RegressionPrediction,
        posthoc.Report,
        ConformalRegressor,
        posthoc.ShiftTable,
        posthoc.shift.ShiftSplit,
    ):
        required |= _public_methods(cls)
    # the classifier's constructor from probabilities: not part of the regression API (the first battery's)
    required -= {"Report.from_predictions"}
    required |= {
        f"shift.{name}"
        for name in posthoc.shift.__all__
        if callable(getattr(posthoc.shift, name)) and name != "ShiftSplit"
    }
    required |= {f"dac.{option}" for option in posthoc.available_methods()["dac"]} | {
        "dac.fit",
        "dac.predict",
        "dac.likelihood",
    }
    tried = {name for name, *_ in NEWEST_API_MISUSES}
    assert not required - tried, f"functions of the newest API with no misuse tried: {sorted(required - tried)}"


# --------------------------------------------------------------------------- the first-hour mistakes
#
# Issue 46: what users of scikit-learn, timm, Lightning and Hugging Face do by habit in their first hour, crossed with
# wrap, fit, predict, evaluate, calibrate, conformal, save and load. Every row either works and gives the numbers of
# the well-formed call (``Same``: bit-exact where the path after the input is literally the same, else the stated
# tolerance), or raises a PosthocError whose message names the fix (``Refused``). Left out, by design: wrap takes a
# model and no data (its rows are the model mistakes: train mode, another device, a 1-output head, a dict-input
# model); save and load take a path (their rows are those of a model fitted after a mistake); calibrate takes arrays,
# never a loader (no loader rows), and predict one batch (its loader row is the reverse mistake, a loader passed to
# it).


class Same(NamedTuple):
    """The misuse works: its result gives the numbers of ``reference`` (the well-formed call) within ``atol`` (0:
    bit-exact), and is of type ``kind`` when given (numpy for numpy)."""

    reference: Callable
    atol: float = 0.0
    kind: type | None = None


class Refused(NamedTuple):
    """The misuse raises ``error`` (a PosthocError) with ``says`` (the fix) in its message."""

    error: type
    says: str


class Habit(NamedTuple):
    mistake: str
    entry: str
    call: Callable
    expect: Same | Refused


class Tabular(nn.Module):
    """A tabular classifier as users write one: ``forward(self, x)`` (so a dict batch ``{"x": ...}`` reaches it as
    ``model(x=...)``), with BatchNorm and dropout (so train mode would change its outputs)."""

    def __init__(self, features: int = 6, outputs: int = 3, *, two_logits: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3))
        self.head = nn.Linear(16, outputs)
        self.two_logits = two_logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.head(self.body(x))
        return torch.cat([torch.zeros_like(z), z], dim=1) if self.two_logits else z


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class Rows(torch.utils.data.Dataset):
    """One example per item, in the ``form`` a user's ``__getitem__`` returns it."""

    NAMES = ("ant", "bee", "cat")

    def __init__(self, x, y, form: str = "tuple") -> None:
        self.x, self.y, self.form = x, y, form

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        x, y = self.x[i], self.y[i]
        form = self.form
        if form == "list":
            return [x, y]
        if form == "triple":
            return x, y, i
        if form == "namedtuple":
            return Pair(x, y)
        if form.startswith("dict-"):
            keys = {"dict-labels": ["labels"], "dict-label": ["label"], "dict-target": ["target"]}
            return {"x": x, **{key: y for key in keys.get(form, ["label", "labels"])}}
        if form == "strings":
            return x, self.NAMES[int(y)]
        if form == "floats":
            return x, y.float()
        if form == "numpy":
            return x.numpy(), int(y)
        if form == "numpy64":
            return x.double().numpy(), int(y)
        return x, y


class StreamedRows(torch.utils.data.IterableDataset):
    """The same examples as an ``IterableDataset`` (a stream without ``len``), in order."""

    def __init__(self, x, y) -> None:
        self.x, self.y = x, y

    def __iter__(self):
        return iter(zip(self.x, self.y))


def _loader(h, part: str, form: str = "tuple", *, batch_size: int = 12, shuffle: bool = False, **kw) -> DataLoader:
    x, y = h[part]
    generator = torch.Generator().manual_seed(1) if shuffle else None
    return DataLoader(Rows(x, y, form), batch_size=batch_size, shuffle=shuffle, generator=generator, **kw)


@pytest.fixture(scope="module")
def first_hour():
    """A small trained tabular classifier (and its 1-output binary twin), its splits, loaders and logits."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=generator)
    y = (x[:, :3] + 0.8 * torch.randn(96, 3, generator=generator)).argmax(1)
    models = {}
    for name, outputs, labels in (("model", 3, y), ("binary", 1, (y > 0).long())):
        model = Tabular(outputs=outputs)
        optimiser = torch.optim.Adam(model.parameters(), 1e-2)
        for _ in range(60):
            optimiser.zero_grad()
            out = model(x[:48])
            loss = (
                nn.functional.cross_entropy(out, labels[:48])
                if outputs > 1
                else nn.functional.binary_cross_entropy_with_logits(out[:, 0], labels[:48].float())
            )
            loss.backward()
            optimiser.step()
        models[name] = model.eval()
    twin = Tabular(outputs=1, two_logits=True)
    twin.load_state_dict({k: v for k, v in models["binary"].state_dict().items()}, strict=False)
    twin.eval()
    h = {
        **models,
        "twin": twin,
        "train": (x[:48], y[:48]),
        "val": (x[48:72], y[48:72]),
        "test": (x[72:], y[72:]),
        "binary_train": (x[:48], (y[:48] > 0).long()),
        "binary_val": (x[48:72], (y[48:72] > 0).long()),
        "binary_test": (x[72:], (y[72:] > 0).long()),
        "cache": {},
    }
    with torch.no_grad():
        h["logits_val"], h["logits_test"] = models["model"](x[48:72]), models["model"](x[72:])
        h["binary_logits_val"], h["binary_logits_test"] = models["binary"](x[48:72]), models["binary"](x[72:])
    return h


def _fit(h, model="model", train="train", val="val", *, method="temperature", form="tuple", shuffle=False, **options):
    """``wrap(model, method).fit`` on loaders of ``form`` over the splits named (``val=None``: none; ``shuffle``: the
    validation loader shuffles)."""
    train_loader = _loader(h, train, form, batch_size=16)
    val_loader = None if val is None else _loader(h, val, form, shuffle=shuffle)
    return posthoc.wrap(h[model], method=method).fit(train_loader, val_loader, progress=False, **options)


def _fit_on_rows(h, val_batches, *, method="temperature", **options):
    """``wrap(model, method).fit`` on the training loader and these validation batches (a list)."""
    return posthoc.wrap(h["model"], method=method).fit(
        _loader(h, "train", batch_size=16), val_batches, progress=False, **options
    )


def _reference(h, key, make):
    """The well-formed call's result, made once per module."""
    if key not in h["cache"]:
        h["cache"][key] = make()
    return h["cache"][key]


def _fitted(h, method="temperature", model="model", *, val=True, **options):
    """The well-formed fit (tuple batches of tensors, int labels) of ``method`` on ``model``, made once."""
    key = ("fit", method, model, val, tuple(sorted(options.items())))
    prefix = "binary_" if model in ("binary", "twin") else ""
    return _reference(
        h, key, lambda: _fit(h, model, f"{prefix}train", f"{prefix}val" if val else None, method=method, **options)
    )


def _numbers(result, h) -> torch.Tensor:
    """What a result says, as one float64 tensor: a wrapped model's predictive on the test rows, a report's metrics,
    a calibrator's probabilities on the test logits, a conformal predictor's threshold, an array's values."""

    if isinstance(result, posthoc.UncertainModel):
        x = h["test"][0]
        return result.predict(x, generator=torch.Generator().manual_seed(0)).probs.double()
    if isinstance(result, posthoc.Prediction):
        return result.probs.double()
    if isinstance(result, posthoc.Report):
        return torch.tensor([result.nll, result.ece, result.brier, result.accuracy], dtype=torch.float64)
    if isinstance(result, posthoc.RegressionPrediction):
        return torch.cat([result.mean.double().reshape(-1), result.std.double().reshape(-1)])
    if isinstance(result, posthoc.guarantees.ConformalPredictor):
        return result.threshold.double().reshape(-1)
    if isinstance(result, np.ndarray):
        return torch.from_numpy(result).double()
    if isinstance(result, tuple):
        return torch.cat([_numbers(part, h).reshape(-1) for part in result])
    if isinstance(result, torch.Tensor):
        return result.detach().double()
    raise TypeError(f"no numbers for {type(result).__name__}")


def _saved_and_loaded(um, model, tmp):
    um.save(tmp / "um.pt")
    return posthoc.load(tmp / "um.pt", model)


def _still_in_train_mode(h, call):
    """``call(model)`` on a copy of the model left in train mode; the copy must still be in train mode after."""
    import copy

    model = copy.deepcopy(h["model"]).train()
    result = call(model)
    assert model.training and model.body[1].training, "posthoc changed the user's model's mode"
    return result


def _streamed(h, part):
    return DataLoader(StreamedRows(*h[part]), batch_size=12)


def _stream_held_out(h, monkeypatch_bytes, call):
    """``call()`` with the held-out batches read again on every pass (as for a set larger than memory)."""
    from posthoc.engine import held_out

    before = held_out.HELD_OUT_BYTES
    held_out.HELD_OUT_BYTES = monkeypatch_bytes
    try:
        return call()
    finally:
        held_out.HELD_OUT_BYTES = before


def _np(t):
    return t.detach().numpy()


def _intervals(convert):
    """Conformal intervals calibrated and applied on a regressor's numbers passed through ``convert``."""
    from posthoc.guarantees.intervals import conformal_intervals

    generator = torch.Generator().manual_seed(3)
    mean, y, std = (
        torch.randn(40, 1, generator=generator),
        torch.randn(40, 1, generator=generator),
        torch.full((40, 1), 0.8),
    )
    calibrated = conformal_intervals(convert(y[:20]), mean=convert(mean[:20]), std=convert(std[:20]), alpha=0.2)
    return calibrated.intervals(mean=convert(mean[20:]), std=convert(std[20:]))


def _all_numpy(parts):
    assert all(isinstance(part, np.ndarray) for part in parts), [type(part).__name__ for part in parts]
    return parts


def _selective(h, convert):
    """A selective rule calibrated on the validation logits (and the labels a reader keeps) passed through ``convert``."""
    return posthoc.selective(
        convert(h["logits_val"]), convert(h["val"][1]), target_risk=0.75, delta=0.2, progress=False
    )


def _calibrator_saved_and_loaded(calibrator, tmp):
    calibrator.save(tmp / "calibrator.pt")
    return posthoc.calibrate.load(tmp / "calibrator.pt")


_LOADER_FIX = "wrap them in a DataLoader: "
_TORCH_FIX = "DataLoader(TensorDataset(x, y), batch_size=256)"
_NUMPY_FIX = "DataLoader(TensorDataset(torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y)), batch_size=256)"
_ONE_ROW = "add its batch dimension: um.predict(x[None]) (or x.unsqueeze(0))"
_STRINGS = "are strings (e.g. 'ant'), not numbers"


def _cp(h, source, labels, **kw):
    return posthoc.conformal(source, labels, alpha=0.2, progress=False, **kw)


def _evaluated(h, loader):
    return posthoc.evaluate(_fitted(h), loader, progress=False)


def _loader_rows(mistake: str, make: Callable, atol: float = 0.0) -> list[Habit]:
    """The evaluate and conformal rows of a loader habit: on ``make(h, part)`` (the habit's loader of a split) they
    give the numbers of the same split in a loader of ``(x, y)`` tuples."""
    return [
        Habit(
            mistake,
            "evaluate",
            lambda h, t: _evaluated(h, make(h, "test")),
            Same(lambda h, t: _evaluated(h, _loader(h, "test")), atol),
        ),
        Habit(
            mistake,
            "conformal",
            lambda h, t: _cp(h, _fitted(h), make(h, "val")),
            Same(lambda h, t: _cp(h, _fitted(h), _loader(h, "val")), atol),
        ),
    ]


def _fit_rows(mistake: str, form: str) -> list[Habit]:
    """The fit rows of a loader habit: temperature (on held-out batches) and Laplace (on training batches alone) fitted
    on loaders of ``form`` give the numbers of the same fits on loaders of ``(x, y)`` tuples, bit for bit (the batches
    are read into the same tensors before anything is computed)."""
    return [
        Habit(mistake, "fit", lambda h, t: _fit(h, form=form), Same(lambda h, t: _fitted(h), 0.0)),
        Habit(
            mistake,
            "fit",
            lambda h, t: _fit(h, form=form, method="laplace", val=None),
            Same(lambda h, t: _fitted(h, method="laplace", val=False), 0.0),
        ),
    ]


HABITS: list[Habit] = [
    # ---- tensors where a loader goes (scikit-learn's fit(X, y))
    Habit(
        "tensors",
        "fit",
        lambda h, t: posthoc.wrap(h["model"], "temperature").fit(*h["train"], progress=False),
        Refused(InputError, f"got two arrays (x, y); {_LOADER_FIX}um.fit({_TORCH_FIX})"),
    ),
    Habit(
        "tensors",
        "fit",
        lambda h, t: posthoc.wrap(h["model"], "temperature").fit(h["train"], progress=False),
        Refused(
            InputError,
            f"um.fit (train_loader) takes a loader of (x, y) batches, got a tuple of two arrays (x, y); {_LOADER_FIX}{_TORCH_FIX}",
        ),
    ),
    Habit(
        "tensors",
        "fit",
        lambda h, t: posthoc.wrap(h["model"], "temperature").fit(_loader(h, "train"), h["val"], progress=False),
        Refused(
            InputError,
            f"um.fit (val_loader) takes a loader of (x, y) batches, got a tuple of two arrays (x, y); {_LOADER_FIX}{_TORCH_FIX}",
        ),
    ),
    Habit(
        "tensors",
        "fit",
        lambda h, t: posthoc.wrap(h["model"], "temperature").fit(val_loader=list(h["val"]), progress=False),
        Refused(InputError, f"got a list of two arrays (x, y); {_LOADER_FIX}{_TORCH_FIX}"),
    ),
    Habit(
        "tensors",
        "fit",
        lambda h, t: posthoc.wrap(h["model"], "laplace").fit(h["train"][0], progress=False),
        Refused(
            InputError,
            f"um.fit (train_loader) takes a loader of (x, y) batches, got a Tensor; wrap tensors in one, e.g. {_TORCH_FIX}",
        ),
    ),
    Habit(
        "tensors",
        "evaluate",
        lambda h, t: posthoc.evaluate(_fitted(h), h["test"][0], progress=False),
        Refused(InputError, f"got a Tensor; wrap tensors in one, e.g. {_TORCH_FIX}"),
    ),
    Habit(
        "tensors",
        "evaluate",
        lambda h, t: posthoc.evaluate(_fitted(h), h["test"], progress=False),
        Refused(InputError, f"got a tuple of two arrays (x, y); {_LOADER_FIX}{_TORCH_FIX}"),
    ),
    Habit(
        "tensors",
        "conformal",
        lambda h, t: _cp(h, _fitted(h), h["val"]),
        Refused(InputError, f"wrap arrays x, y in a DataLoader: {_TORCH_FIX}"),
    ),
    Habit(
        "tensors",
        "conformal",
        lambda h, t: _cp(h, _fitted(h), h["val"][0]),
        Refused(
            InputError,
            f"not Tensor labels, e.g. posthoc.conformal(um, calibration_loader); wrap arrays x, y in a DataLoader: {_TORCH_FIX}",
        ),
    ),
    Habit(
        "tensors",
        "predict",
        lambda h, t: _fitted(h).predict(_loader(h, "test")),
        Refused(
            InputError, "for a loader of (x, y) batches use posthoc.evaluate(um, loader), or predict batch by batch"
        ),
    ),
    # ---- dict batches {"x": ..., "labels": ...} on a tabular model (Hugging Face's habit)
    Habit("dict batches", "fit", lambda h, t: _fit(h, form="dict-labels"), Same(lambda h, t: _fitted(h), 1e-6)),
    Habit("dict batches", "fit", lambda h, t: _fit(h, form="dict-label"), Same(lambda h, t: _fitted(h), 1e-6)),
    Habit(
        "dict batches",
        "fit",
        lambda h, t: _fit(h, form="dict-labels", shift=None),
        Same(lambda h, t: _fitted(h, shift=None), 1e-6),
    ),
    Habit(
        "dict batches",
        "fit",
        lambda h, t: _fit(h, form="dict-labels", shift=["feature-noise"]),
        Same(lambda h, t: _fitted(h, shift=("feature-noise",)), 1e-6),
    ),
    Habit(
        "dict batches",
        "fit",
        lambda h, t: _fit(h, form="dict-labels", method="laplace", val=None),
        Same(lambda h, t: _fitted(h, method="laplace", val=False), 1e-5),
    ),
    Habit(
        "dict batches",
        "fit",
        lambda h, t: _fit(h, form="dict-target"),
        Refused(
            InputError,
            "a dict batch carries its labels under 'labels' or 'label' (as Hugging Face collators and datasets name "
            "them); got keys ['target', 'x']: rename the labels entry to 'labels'",
        ),
    ),
    Habit(
        "dict batches",
        "fit",
        lambda h, t: _fit(h, form="dict-both"),
        Refused(InputError, "a dict batch holds both 'labels' and 'label': which are the labels? Keep one of"),
    ),
    Habit(
        "dict batches",
        "predict",
        lambda h, t: _fitted(h).predict({"x": h["test"][0]}),
        Same(lambda h, t: _fitted(h).predict(h["test"][0]), 0.0),
    ),
    Habit(
        "dict batches",
        "predict",
        lambda h, t: _fitted(h).predict({"x": h["test"][0], "labels": h["test"][1]}),
        Refused(
            InputError,
            "The inputs hold 'labels', which the model gets as a keyword argument: pass the inputs alone, e.g. "
            "{k: v for k, v in batch.items() if k != 'labels'}",
        ),
    ),
    Habit(
        "dict batches",
        "save",
        lambda h, t: _saved_and_loaded(_fit(h, form="dict-labels"), h["model"], t),
        Same(lambda h, t: _fitted(h), 1e-6),
    ),
    Habit(
        "dict batches",
        "wrap",
        lambda h, t: posthoc.wrap(h["model"], method="none").predict({"x": h["test"][0]}),
        Same(lambda h, t: posthoc.wrap(h["model"], method="none").predict(h["test"][0]), 0.0),
    ),
]

HABITS += [
    # ---- numpy arrays (scikit-learn's and netcal's habit): numpy in, numpy out, or the line that converts
    Habit(
        "numpy",
        "fit",
        lambda h, t: posthoc.wrap(h["model"], "temperature").fit(*map(_np, h["train"]), progress=False),
        Refused(InputError, f"got two arrays (x, y); {_LOADER_FIX}um.fit({_NUMPY_FIX})"),
    ),
    Habit(
        "numpy",
        "fit",
        lambda h, t: posthoc.wrap(h["model"], "temperature").fit(
            val_loader=[tuple(map(_np, h["val"]))], progress=False
        ),
        Refused(
            InputError,
            "got a numpy array; convert them where the batches are made, e.g. torch.as_tensor(x, dtype=torch.float32)",
        ),
    ),
    Habit("numpy", "fit", lambda h, t: _fit(h, form="numpy"), Same(lambda h, t: _fitted(h), 0.0)),
    Habit(
        "numpy",
        "fit",
        lambda h, t: _fit(h, form="numpy64"),
        Refused(
            InputError,
            "The inputs are float64 but the model's weights are float32 (numpy arrays are float64): convert them, e.g. x.to(torch.float32)",
        ),
    ),
    Habit(
        "numpy",
        "predict",
        lambda h, t: _fitted(h).predict(_np(h["test"][0])),
        Refused(
            InputError,
            "um.predict takes a tensor (or a dict of tensors), got ndarray: convert it first, e.g. torch.as_tensor(x, dtype=torch.float32)",
        ),
    ),
    Habit(
        "numpy",
        "predict",
        lambda h, t: _fitted(h).predict(h["test"][0].double()),
        Refused(InputError, "The inputs are float64 but the model's weights are float32"),
    ),
    Habit(
        "numpy",
        "evaluate",
        lambda h, t: posthoc.evaluate(_fitted(h), _np(h["test"][0]), progress=False),
        Refused(InputError, f"got a ndarray; wrap tensors in one, e.g. {_NUMPY_FIX}"),
    ),
    Habit(
        "numpy",
        "evaluate",
        lambda h, t: posthoc.evaluate(_fitted(h), tuple(map(_np, h["test"])), progress=False),
        Refused(InputError, f"got a tuple of two arrays (x, y); {_LOADER_FIX}{_NUMPY_FIX}"),
    ),
    Habit(
        "numpy",
        "calibrate",
        lambda h, t: posthoc.calibrate(_np(h["logits_val"]), _np(h["val"][1]))(_np(h["logits_test"])),
        Same(lambda h, t: posthoc.calibrate(h["logits_val"], h["val"][1])(h["logits_test"]), 0.0, np.ndarray),
    ),
    Habit(
        "numpy",
        "calibrate",
        lambda h, t: posthoc.calibrate(_np(h["logits_val"]).astype("float64"), _np(h["val"][1]))(
            _np(h["logits_test"]).astype("float64")
        ),
        Same(
            lambda h, t: posthoc.calibrate(h["logits_val"], h["val"][1])(h["logits_test"]), 1e-6, np.ndarray
        ),  # float64 in: computed in float64, the reference in float32
    ),
    Habit(
        "numpy",
        "calibrate",
        lambda h, t: posthoc.calibrate(_np(h["logits_val"]), _np(h["val"][1])).log_probs(_np(h["logits_test"])),
        Same(lambda h, t: posthoc.calibrate(h["logits_val"], h["val"][1]).log_probs(h["logits_test"]), 0.0, np.ndarray),
    ),
    Habit(
        "numpy",
        "calibrate",
        lambda h, t: posthoc.calibrate(_np(h["logits_val"]), _np(h["val"][1]), method="vector")(_np(h["logits_test"])),
        Same(
            lambda h, t: posthoc.calibrate(h["logits_val"], h["val"][1], method="vector")(h["logits_test"]),
            0.0,
            np.ndarray,
        ),
    ),
    Habit(
        "numpy",
        "calibrate",
        lambda h, t: posthoc.calibrate(_np(h["logits_val"]), _np(h["val"][1])).predict(_np(h["logits_test"])),
        Same(
            lambda h, t: posthoc.calibrate(h["logits_val"], h["val"][1]).predict(h["logits_test"]),
            0.0,
            posthoc.Prediction,
        ),
    ),
    Habit(
        "numpy",
        "calibrate",
        lambda h, t: posthoc.calibrate(h["logits_val"], _np(h["val"][1]))(h["logits_test"]),
        Same(lambda h, t: posthoc.calibrate(h["logits_val"], h["val"][1])(h["logits_test"]), 0.0, torch.Tensor),
    ),
    Habit(
        "numpy",
        "calibrate",
        lambda h, t: posthoc.calibrate(
            mean=_np(h["logits_val"][:, 0]), std=np.full(24, 0.5), targets=_np(h["logits_val"][:, 1])
        ).predict(_np(h["logits_test"][:, 0]), np.full(24, 0.5)),
        Same(
            lambda h, t: posthoc.calibrate(
                mean=h["logits_val"][:, 0], std=torch.full((24,), 0.5), targets=h["logits_val"][:, 1]
            ).predict(h["logits_test"][:, 0], torch.full((24,), 0.5)),
            1e-12,
            posthoc.RegressionPrediction,
        ),
    ),
    Habit(
        "numpy",
        "conformal",
        lambda h, t: _cp(h, _np(h["logits_val"]), _np(h["val"][1])).sets(_np(h["logits_test"])),
        Same(lambda h, t: _cp(h, h["logits_val"], h["val"][1]).sets(h["logits_test"]), 0.0, np.ndarray),
    ),
    Habit(
        "numpy", "conformal", lambda h, t: _all_numpy(_intervals(_np)), Same(lambda h, t: _intervals(lambda v: v), 0.0)
    ),
    Habit(
        "numpy",
        "selective",
        lambda h, t: _selective(h, _np).accept(_np(h["logits_test"])),
        Same(lambda h, t: _selective(h, lambda v: v).accept(h["logits_test"]), 0.0, np.ndarray),
    ),
    Habit(
        "numpy",
        "save",
        lambda h, t: _calibrator_saved_and_loaded(posthoc.calibrate(_np(h["logits_val"]), _np(h["val"][1])), t)(
            _np(h["logits_test"])
        ),
        Same(lambda h, t: posthoc.calibrate(h["logits_val"], h["val"][1])(h["logits_test"]), 0.0, np.ndarray),
    ),
    # ---- float labels (y.astype(float), BCE targets)
    *_fit_rows("float labels", "floats"),
    Habit(
        "float labels",
        "fit",
        lambda h, t: posthoc.wrap(h["model"], "temperature").fit(
            val_loader=[(h["val"][0], h["val"][1] + 0.5)], progress=False
        ),
        Refused(InputError, "labels are not whole numbers: this looks like regression targets"),
    ),
    Habit(
        "float labels",
        "fit",
        lambda h, t: posthoc.wrap(h["model"], "temperature").fit(
            val_loader=[(h["val"][0], nn.functional.one_hot(h["val"][1], 3).float())], progress=False
        ),
        Refused(InputError, "one-hot rows over the 3 classes: pass class indices (N,) instead, e.g. y.argmax(-1)"),
    ),
    Habit(
        "float labels",
        "calibrate",
        lambda h, t: posthoc.calibrate(h["logits_val"], h["val"][1].float())(h["logits_test"]),
        Same(lambda h, t: posthoc.calibrate(h["logits_val"], h["val"][1])(h["logits_test"]), 0.0),
    ),
    Habit(
        "float labels",
        "calibrate",
        lambda h, t: posthoc.calibrate(h["logits_val"], nn.functional.one_hot(h["val"][1], 3).float()),
        Refused(InputError, "one-hot rows over the 3 classes: pass class indices (N,) instead, e.g. y.argmax(-1)"),
    ),
    Habit(
        "float labels",
        "conformal",
        lambda h, t: _cp(h, h["logits_val"], h["val"][1].float()),
        Same(lambda h, t: _cp(h, h["logits_val"], h["val"][1]), 0.0),
    ),
    Habit(
        "float labels",
        "save",
        lambda h, t: _saved_and_loaded(_fit(h, form="floats"), h["model"], t),
        Same(lambda h, t: _fitted(h), 0.0),
    ),
    # ---- one row without its batch dimension (x[0])
    Habit("one row", "predict", lambda h, t: _fitted(h).predict(h["test"][0][0]), Refused(InputError, _ONE_ROW)),
    Habit(
        "one row",
        "predict",
        lambda h, t: _fitted(h, method="laplace", val=False).predict(h["test"][0][0]),
        Refused(InputError, _ONE_ROW),
    ),
    Habit("one row", "predict", lambda h, t: _fitted(h)(h["test"][0][0]), Refused(InputError, _ONE_ROW)),
    Habit(
        "one row",
        "predict",
        lambda h, t: _fitted(h).predict(h["test"][0][0][None]),
        Same(lambda h, t: _fitted(h).predict(h["test"][0][:1]), 0.0),
    ),
    Habit(
        "one row",
        "fit",
        lambda h, t: posthoc.wrap(h["model"], "temperature").fit(
            val_loader=DataLoader(Rows(*h["val"]), batch_size=None), progress=False
        ),
        Refused(
            InputError,
            "the loader yields one example at a time, without a batch dimension (DataLoader(..., batch_size=None)?); give it a batch size",
        ),
    ),
    Habit(
        "one row",
        "evaluate",
        lambda h, t: posthoc.evaluate(_fitted(h), DataLoader(Rows(*h["test"]), batch_size=None), progress=False),
        Refused(InputError, "without a batch dimension (DataLoader(..., batch_size=None)?); give it a batch size"),
    ),
    Habit(
        "one row",
        "conformal",
        lambda h, t: _cp(h, _fitted(h), DataLoader(Rows(*h["val"]), batch_size=None)),
        Refused(InputError, "without a batch dimension (DataLoader(..., batch_size=None)?)"),
    ),
    Habit(
        "one row",
        "calibrate",
        lambda h, t: posthoc.calibrate(h["logits_val"][0], h["val"][1][0]),
        Refused(InputError, "one example's logits need their batch dimension, logits[None]"),
    ),
    Habit(
        "one row",
        "calibrate",
        lambda h, t: posthoc.calibrate(h["logits_val"], h["val"][1])(h["logits_test"][0]),
        Refused(InputError, "read as a binary classifier's N logits: pass logits[None]"),
    ),
    Habit(
        "one row",
        "conformal",
        lambda h, t: _cp(h, h["logits_val"], h["val"][1]).sets(h["logits_test"][0]),
        Refused(InputError, "one example: add its batch dimension, values[None]"),
    ),
]

HABITS += [
    # ---- a model left in train mode (timm's and Lightning's models come back from training in it)
    Habit(
        "train mode",
        "wrap",
        lambda h, t: _still_in_train_mode(h, lambda m: posthoc.wrap(m, method="none").predict(h["test"][0])),
        Same(lambda h, t: posthoc.wrap(h["model"], method="none").predict(h["test"][0]), 0.0),
    ),
    Habit(
        "train mode",
        "fit",
        lambda h, t: _still_in_train_mode(
            h, lambda m: posthoc.wrap(m, "temperature").fit(_loader(h, "train"), _loader(h, "val"), progress=False)
        ),
        Same(lambda h, t: _fitted(h), 0.0),
    ),
    Habit(
        "train mode",
        "fit",
        lambda h, t: _still_in_train_mode(
            h, lambda m: posthoc.wrap(m, "laplace").fit(_loader(h, "train", batch_size=16), progress=False)
        ),
        Same(lambda h, t: _fitted(h, method="laplace", val=False), 1e-6),
    ),
    Habit(
        "train mode",
        "fit",
        lambda h, t: _still_in_train_mode(
            h,
            lambda m: posthoc.wrap(m, ["none", "dac"]).fit(
                _loader(h, "train", batch_size=16), _loader(h, "val"), progress=False
            ),
        ),
        Same(lambda h, t: _fitted(h, method=("none", "dac")), 1e-6),
    ),
    Habit(
        "train mode",
        "predict",
        lambda h, t: _still_in_train_mode(
            h,
            lambda m: posthoc.wrap(m, "mc-dropout", p=0.2, num_samples=4).predict(
                h["test"][0], generator=torch.Generator().manual_seed(0)
            ),
        ),
        Same(
            lambda h, t: posthoc.wrap(h["model"], "mc-dropout", p=0.2, num_samples=4).predict(
                h["test"][0], generator=torch.Generator().manual_seed(0)
            ),
            0.0,
        ),
    ),
    Habit(
        "train mode",
        "evaluate",
        lambda h, t: _still_in_train_mode(
            h, lambda m: posthoc.evaluate(posthoc.wrap(m, method="none"), _loader(h, "test"), progress=False)
        ),
        Same(
            lambda h, t: posthoc.evaluate(posthoc.wrap(h["model"], method="none"), _loader(h, "test"), progress=False),
            0.0,
        ),
    ),
    Habit(
        "train mode",
        "conformal",
        lambda h, t: _still_in_train_mode(h, lambda m: _cp(h, posthoc.wrap(m, method="none"), _loader(h, "val"))),
        Same(lambda h, t: _cp(h, posthoc.wrap(h["model"], method="none"), _loader(h, "val")), 0.0),
    ),
    Habit(
        "train mode",
        "save",
        lambda h, t: _still_in_train_mode(
            h,
            lambda m: _saved_and_loaded(
                posthoc.wrap(m, "temperature").fit(_loader(h, "train"), _loader(h, "val"), progress=False), m, t
            ),
        ),
        Same(lambda h, t: _fitted(h), 0.0),
    ),
    Habit(
        "train mode",
        "load",
        lambda h, t: _still_in_train_mode(h, lambda m: _saved_and_loaded(_fitted(h), m, t)),
        Same(lambda h, t: _fitted(h), 0.0),
    ),
    # ---- a 1-output binary head (BCEWithLogitsLoss's habit): read as the logits [0, z], the twin's outputs
    Habit(
        "binary head",
        "wrap",
        lambda h, t: posthoc.wrap(h["binary"], method="none").predict(h["test"][0]),
        Same(lambda h, t: posthoc.wrap(h["twin"], method="none").predict(h["test"][0]), 0.0),
    ),
    Habit(
        "binary head", "fit", lambda h, t: _fitted(h, model="binary"), Same(lambda h, t: _fitted(h, model="twin"), 1e-6)
    ),
    Habit(
        "binary head",
        "fit",
        lambda h, t: _fit(h, "binary", "binary_train", "binary_val", form="floats"),
        Same(lambda h, t: _fitted(h, model="twin"), 1e-6),
    ),
    Habit(
        "binary head",
        "fit",
        lambda h, t: _fit(h, "binary", "binary_train", None, method="laplace"),
        Refused(
            posthoc.ConfigError,
            "for a binary classifier give the head two outputs [0, z], or use 'temperature' or 'mc-dropout', which "
            "handle one logit",
        ),
    ),
    Habit(
        "binary head",
        "predict",
        lambda h, t: _fitted(h, model="binary").predict(h["test"][0]),
        Same(lambda h, t: _fitted(h, model="twin").predict(h["test"][0]), 1e-6),
    ),
    Habit(
        "binary head",
        "evaluate",
        lambda h, t: posthoc.evaluate(_fitted(h, model="binary"), _loader(h, "binary_test"), progress=False),
        Same(lambda h, t: posthoc.evaluate(_fitted(h, model="twin"), _loader(h, "binary_test"), progress=False), 1e-6),
    ),
    Habit(
        "binary head",
        "calibrate",
        lambda h, t: _calibrated_binary(h, lambda logits: logits),
        Same(lambda h, t: _calibrated_binary(h, _two), 1e-6),
    ),
    Habit(
        "binary head",
        "calibrate",
        lambda h, t: _calibrated_binary(h, lambda logits: logits[:, 0]),
        Same(lambda h, t: _calibrated_binary(h, _two), 1e-6),
    ),
    Habit(
        "binary head",
        "calibrate",
        lambda h, t: posthoc.calibrate(h["binary_logits_val"], h["binary_val"][1].float()[:, None], method="platt")(
            h["binary_logits_test"]
        ),
        Same(
            lambda h, t: posthoc.calibrate(h["binary_logits_val"][:, 0], h["binary_val"][1], method="platt")(
                h["binary_logits_test"][:, 0]
            ),
            0.0,
        ),
    ),
    Habit(
        "binary head",
        "conformal",
        lambda h, t: _cp(h, _fitted(h, model="binary"), _loader(h, "binary_val")),
        Same(lambda h, t: _cp(h, _fitted(h, model="twin"), _loader(h, "binary_val")), 1e-6),
    ),
    Habit(
        "binary head",
        "conformal",
        lambda h, t: _cp(h, h["binary_logits_val"], h["binary_val"][1]),
        Refused(
            InputError,
            "got (24, 1) (a binary classifier's one logit z per row: pass the two-class logits "
            "torch.cat([torch.zeros_like(z), z], 1)",
        ),
    ),
    Habit(
        "binary head",
        "save",
        lambda h, t: _saved_and_loaded(_fitted(h, model="binary"), h["binary"], t),
        Same(lambda h, t: _fitted(h, model="twin"), 1e-6),
    ),
    # ---- labels as strings (a DataFrame's label column)
    Habit(
        "string labels",
        "fit",
        lambda h, t: _fit(h, form="strings"),
        Refused(
            InputError,
            f"{_STRINGS}; yield numbers: class indices for a classifier (e.g. map names with "
            "{name: i for i, name in enumerate(class_names)} in the dataset)",
        ),
    ),
    Habit(
        "string labels",
        "fit",
        lambda h, t: _fit(h, form="strings", method="laplace", val=None),
        Refused(InputError, "are strings (e.g. 'bee'), not numbers"),
    ),
    Habit(
        "string labels",
        "evaluate",
        lambda h, t: posthoc.evaluate(_fitted(h), _loader(h, "test", "strings"), progress=False),
        Refused(InputError, f"{_STRINGS}; yield numbers"),
    ),
    Habit(
        "string labels",
        "conformal",
        lambda h, t: _cp(h, _fitted(h), _loader(h, "val", "strings")),
        Refused(InputError, _STRINGS),
    ),
    Habit(
        "string labels",
        "calibrate",
        lambda h, t: posthoc.calibrate(h["logits_val"], np.array(Rows.NAMES)[h["val"][1].numpy()]),
        Refused(
            InputError,
            f"{_STRINGS}; pass integer class indices 0..C-1 in the order of the logits' columns, e.g. np.unique(labels, return_inverse=True)[1]",
        ),
    ),
    Habit(
        "string labels",
        "calibrate",
        lambda h, t: posthoc.calibrate(h["logits_val"], [Rows.NAMES[int(i)] for i in h["val"][1]]),
        Refused(InputError, _STRINGS),
    ),
    Habit(
        "string labels",
        "conformal",
        lambda h, t: _cp(h, h["logits_val"], np.array(Rows.NAMES)[h["val"][1].numpy()]),
        Refused(InputError, "map them first, e.g. np.unique(labels, return_inverse=True)[1]"),
    ),
    Habit(
        "string labels",
        "selective",
        lambda h, t: posthoc.selective(
            h["logits_val"], [Rows.NAMES[int(i)] for i in h["val"][1]], target_risk=0.5, progress=False
        ),
        Refused(InputError, _STRINGS),
    ),
    # ---- a validation loader that shuffles (a train loader copied): read once, the same examples on every pass
    Habit(
        "shuffled val",
        "fit",
        lambda h, t: _fit(h, shuffle=True, shift=None),
        Same(lambda h, t: _fitted(h, shift=None), 1e-5),
    ),
    Habit(  # the well-formed twin: the same rows in the order the shuffled loader yields them (its first pass): a
        # cross-fitted choice splits its folds by position, so another order may make another (equally valid) choice
        "shuffled val",
        "fit",
        lambda h, t: _fit(h, shuffle=True, method=["none", "dac"], shift=None),
        Same(
            lambda h, t: _fit_on_rows(h, list(_loader(h, "val", shuffle=True)), method=["none", "dac"], shift=None),
            1e-4,
        ),
    ),
    Habit(
        "shuffled val",
        "fit",
        lambda h, t: _stream_held_out(h, 0, lambda: _fit(h, shuffle=True, shift=None)),
        Refused(InputError, "the validation loader yields its examples in another order on each pass (shuffle=True?)"),
    ),
    # ---- an IterableDataset (a stream without len), and a one-shot generator
    Habit(
        "iterable",
        "fit",
        lambda h, t: posthoc.wrap(h["model"], "temperature").fit(
            _loader(h, "train"), _streamed(h, "val"), progress=False
        ),
        Same(lambda h, t: _fitted(h), 0.0),
    ),
    Habit(
        "iterable",
        "fit",
        lambda h, t: posthoc.wrap(h["model"], "laplace").fit(
            DataLoader(StreamedRows(*h["train"]), batch_size=16), progress=False
        ),
        Same(lambda h, t: _fitted(h, method="laplace", val=False), 0.0),
    ),
    Habit(
        "iterable",
        "fit",
        lambda h, t: posthoc.wrap(h["model"], "temperature").fit(
            val_loader=(batch for batch in _loader(h, "val")), progress=False
        ),
        Same(lambda h, t: _fitted(h), 0.0),
    ),
    Habit(
        "iterable",
        "save",
        lambda h, t: _saved_and_loaded(
            posthoc.wrap(h["model"], "temperature").fit(_loader(h, "train"), _streamed(h, "val"), progress=False),
            h["model"],
            t,
        ),
        Same(lambda h, t: _fitted(h), 0.0),
    ),
    # ---- loaders that yield lists, triples or named tuples
    *_fit_rows("lists", "list"),
    Habit("lists", "fit", lambda h, t: _fit(h, form="triple"), Same(lambda h, t: _fitted(h), 0.0)),
    Habit(
        "lists",
        "fit",
        lambda h, t: posthoc.wrap(h["model"], "temperature").fit(
            val_loader=[list(b) for b in _loader(h, "val")], progress=False
        ),
        Same(lambda h, t: _fitted(h), 0.0),
    ),
    Habit("named tuples", "fit", lambda h, t: _fit(h, form="namedtuple"), Same(lambda h, t: _fitted(h), 0.0)),
    Habit(
        "named tuples",
        "fit",
        lambda h, t: _fit(h, form="namedtuple", method=["none", "dac"]),
        Same(lambda h, t: _fitted(h, method=("none", "dac")), 0.0),
    ),
    Habit(
        "named tuples",
        "save",
        lambda h, t: _saved_and_loaded(_fit(h, form="namedtuple"), h["model"], t),
        Same(lambda h, t: _fitted(h), 0.0),
    ),
]

HABITS += [
    *_loader_rows("dict batches", lambda h, part: _loader(h, part, "dict-labels")),
    *_loader_rows("numpy", lambda h, part: _loader(h, part, "numpy")),
    *_loader_rows("float labels", lambda h, part: _loader(h, part, "floats")),
    *_loader_rows("shuffled val", lambda h, part: _loader(h, part, shuffle=True), atol=1e-6),
    *_loader_rows("iterable", _streamed),
    *_loader_rows("lists", lambda h, part: _loader(h, part, "list")),
    *_loader_rows("named tuples", lambda h, part: _loader(h, part, "namedtuple")),
]

#: another device than the inputs (a model moved to the GPU, the batches left on the CPU): needs CUDA
ON_GPU = [
    Habit(
        "another device",
        "wrap",
        lambda h, t: posthoc.wrap(_on_gpu(h["model"]), method="none").predict(h["test"][0]),
        Same(lambda h, t: posthoc.wrap(h["model"], method="none").predict(h["test"][0]), 1e-5),
    ),
    Habit(
        "another device",
        "fit",
        lambda h, t: posthoc.wrap(_on_gpu(h["model"]), "temperature").fit(
            _loader(h, "train"), _loader(h, "val"), progress=False
        ),
        Same(lambda h, t: _fitted(h), 1e-4),
    ),
    Habit(
        "another device",
        "fit",
        lambda h, t: posthoc.wrap(_on_gpu(h["model"]), "laplace").fit(
            _loader(h, "train", batch_size=16), progress=False
        ),
        Same(lambda h, t: _fitted(h, method="laplace", val=False), 1e-4),
    ),
    Habit(
        "another device",
        "predict",
        lambda h, t: _fitted(h).predict(h["test"][0].cuda()),
        Same(lambda h, t: _fitted(h).predict(h["test"][0]), 0.0),
    ),
    Habit(
        "another device",
        "evaluate",
        lambda h, t: posthoc.evaluate(
            posthoc.wrap(_on_gpu(h["model"]), method="none"), _loader(h, "test"), progress=False
        ),
        Same(
            lambda h, t: posthoc.evaluate(posthoc.wrap(h["model"], method="none"), _loader(h, "test"), progress=False),
            1e-5,
        ),
    ),
    Habit(
        "another device",
        "calibrate",
        lambda h, t: posthoc.calibrate(h["logits_val"].cuda(), h["val"][1])(h["logits_test"]),
        Same(lambda h, t: posthoc.calibrate(h["logits_val"], h["val"][1])(h["logits_test"]), 1e-5),
    ),
    Habit(
        "another device",
        "conformal",
        lambda h, t: _cp(h, posthoc.wrap(_on_gpu(h["model"]), method="none"), _loader(h, "val")),
        Same(lambda h, t: _cp(h, posthoc.wrap(h["model"], method="none"), _loader(h, "val")), 1e-5),
    ),
    Habit(
        "another device",
        "load",
        lambda h, t: _saved_and_loaded(
            posthoc.wrap(_on_gpu(h["model"]), "temperature").fit(
                _loader(h, "train"), _loader(h, "val"), progress=False
            ),
            h["model"],
            t,
        ),
        Same(lambda h, t: _fitted(h), 1e-4),
    ),
]


def _on_gpu(model):
    import copy

    return copy.deepcopy(model).cuda()


def _calibrated_binary(h, shape):
    """A temperature fitted on the binary head's validation logits, applied to its test logits, both as ``shape`` gives
    them."""
    return posthoc.calibrate(shape(h["binary_logits_val"]), h["binary_val"][1])(shape(h["binary_logits_test"]))


def _two(logits):
    """A 1-output head's logits ``(N, 1)`` as the two-class logits ``[0, z]`` it stands for."""
    return torch.cat([torch.zeros_like(logits), logits], dim=1)


class _Jitter:
    """A transform as torchvision writes them: ``__call__(self, x)``, one input."""

    def __call__(self, x):
        return x + 0.1


def _out_of_range(h, part):
    """A loader of ``part`` whose labels are shifted past the classes (a label2id that does not match the head)."""
    x, y = h[part]
    return DataLoader(TensorDataset(x, y + 2), batch_size=12)


HABITS += [
    # ---- a one-input transform as a fit-time perturbation (torchvision's transforms take one input)
    Habit(
        "one-input transform",
        "fit",
        lambda h, t: _fit(h, shift=[lambda x: x + 0.1]),
        Refused(ConfigError, "shift[0] (<lambda>) failed when called as f(x, generator)"),
    ),
    Habit(
        "one-input transform",
        "fit",
        lambda h, t: _fit(h, shift=[_Jitter()]),
        Refused(ConfigError, "shift[0] (_Jitter) failed when called as f(x, generator)"),
    ),
    Habit(
        "one-input transform",
        "fit",
        lambda h, t: _fit(h, shift=[lambda x, generator: (x, generator)]),
        Refused(ConfigError, "returns the perturbed inputs alone. Wrap a one-input transform"),
    ),
    Habit(
        "one-input transform",
        "fit",
        lambda h, t: _fit(h, shift=[lambda x, generator: x + 0.0]),
        Same(lambda h, t: _fit(h, shift=[lambda x, generator: x]), 0.0),
    ),
    # ---- labels out of the head's range (a label2id that does not match the model, labels counted from 1)
    Habit(
        "labels out of range",
        "fit",
        lambda h, t: posthoc.wrap(h["model"], ["none", "dac"]).fit(
            _loader(h, "train", batch_size=16), _out_of_range(h, "val"), shift=None, progress=False
        ),
        Refused(InputError, "the validation loader's labels must lie in [0, 3) for a model with 3 classes"),
    ),
    Habit(
        "labels out of range",
        "fit",
        lambda h, t: posthoc.wrap(h["model"], "temperature").fit(val_loader=_out_of_range(h, "val"), progress=False),
        Refused(InputError, "labels must lie in [0, 3) for a model with 3 classes; got values from 2 to 4"),
    ),
    Habit(
        "labels out of range",
        "evaluate",
        lambda h, t: posthoc.evaluate(_fitted(h), _out_of_range(h, "test"), progress=False),
        Refused(InputError, "labels must lie in [0, 3) for a model with 3 classes"),
    ),
    Habit(
        "labels out of range",
        "conformal",
        lambda h, t: _cp(h, _fitted(h), _out_of_range(h, "val")),
        Refused(InputError, "labels must lie in [0, 3) for a model with 3 classes"),
    ),
    Habit(
        "labels out of range",
        "calibrate",
        lambda h, t: posthoc.calibrate(h["logits_val"], h["val"][1] + 1),
        Refused(InputError, "labels must lie in [0, 3) for a model with 3 classes; got values from 1 to 3"),
    ),
]


def _check_habit(habit: Habit, h, tmp) -> None:
    if isinstance(habit.expect, Refused):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(habit.expect.error, match=re_escape(habit.expect.says)):
                habit.call(h, tmp)
        OUTCOMES[f"first hour: {habit.mistake}: refused"] += 1
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = habit.call(h, tmp)
        want = habit.expect.reference(h, tmp)
        if habit.expect.kind is not None:
            assert isinstance(got, habit.expect.kind), f"got a {type(got).__name__}, not a {habit.expect.kind.__name__}"
        mine, theirs = _numbers(got, h).cpu(), _numbers(want, h).cpu()
    assert mine.shape == theirs.shape, (mine.shape, theirs.shape)
    if habit.expect.atol == 0.0:
        assert torch.equal(mine, theirs), f"not bit-exact: largest difference {(mine - theirs).abs().max():.3g}"
    else:
        torch.testing.assert_close(mine, theirs, atol=habit.expect.atol, rtol=0.0)
    OUTCOMES[f"first hour: {habit.mistake}: works"] += 1


@pytest.mark.parametrize(
    "index", range(len(HABITS)), ids=[f"{habit.mistake}-{habit.entry}-{i}" for i, habit in enumerate(HABITS)]
)
def test_a_first_hour_mistake_works_as_the_well_formed_call_or_names_the_fix(first_hour, index, tmp_path):
    _check_habit(HABITS[index], first_hour, tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a model on another device than its inputs needs CUDA")
@pytest.mark.parametrize(
    "index", range(len(ON_GPU)), ids=[f"{habit.mistake}-{habit.entry}-{i}" for i, habit in enumerate(ON_GPU)]
)
def test_a_model_on_another_device_than_its_inputs_works(first_hour, index, tmp_path):
    _check_habit(ON_GPU[index], first_hour, tmp_path)


def test_the_first_hour_battery_covers_every_habit_and_entry_point():
    """At least 100 rows on the CPU; every habit of issue 46 is tried, and every entry point it is crossed with."""
    assert len(HABITS) >= 100, len(HABITS)
    habits = {habit.mistake for habit in HABITS + ON_GPU}
    assert habits >= {
        "tensors",
        "dict batches",
        "numpy",
        "float labels",
        "one row",
        "train mode",
        "another device",
        "binary head",
        "string labels",
        "shuffled val",
        "iterable",
        "lists",
        "named tuples",
    }
    entries = {habit.entry for habit in HABITS}
    assert entries >= {"wrap", "fit", "predict", "evaluate", "calibrate", "conformal", "save", "load"}, entries
