"""Property-based checks over the public API: every problem the fuzzer draws either gives a valid
Prediction or is refused with the one error, at the one stage, and the message that name what is
wrong — never NaN, never a raw internal exception.

The number of cases tried per method is printed in pytest's terminal summary.
"""

from __future__ import annotations

import collections
import warnings
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.core.errors import ConfigError, InputError, PosteriorFileError
from posthoc.guarantees.selective import RiskNotReachableError

CASES: collections.Counter = collections.Counter()
OUTCOMES: collections.Counter = collections.Counter()

#: fit options that keep each method's fit small on these toy problems
FAST_FIT: dict[str, dict] = {"swag": {"epochs": 3, "collect_per_epoch": 1}, "multiswag": {"epochs": 3, "collect_per_epoch": 1},
                             "ibnn": {"epochs": 1}}
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
    assert torch.allclose(pred.probs.double().sum(-1), torch.ones(n, dtype=torch.float64, device=pred.probs.device), atol=1e-5)
    for field in (pred.entropy, pred.aleatoric, pred.epistemic, pred.confidence):
        assert field.shape == (n,) and torch.isfinite(field).all()
    total = _entropy64(pred.probs)
    assert torch.allclose(pred.entropy.double(), total, atol=1e-4)
    if pred.samples is None:
        assert torch.equal(pred.aleatoric, pred.entropy) and not pred.epistemic.any()
        return
    assert pred.samples.shape[1:] == (n, num_classes)
    assert torch.allclose(pred.samples.double().mean(0), pred.probs.double(), atol=1e-3), "probs must average the samples"
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


def _expected_refusal(method: str, c: int, labels: torch.Tensor, corrupt: str) -> Refusal | None:
    """The refusal the fuzzer's problem calls for, or ``None`` when it must give a valid prediction."""
    if c == 1 and method == "laplace":
        return Refusal("fit", ConfigError, "needs a head with at least 2 outputs; this head has 1")
    if corrupt in ("nan", "inf"):
        return Refusal("predict", InputError, "inputs contain NaN or inf")
    return None


def _refused_as_too_few_for_a_calibrator(method: str, refusal: Refusal) -> bool:
    """Calibrators refuse held-out sets below their documented minimum (examples, examples per class, two
    classes; platt: binary classifiers only) with an error that names it."""
    if not hasattr(posthoc.api.REGISTRY[method], "calibrator_class"):
        return False
    return refusal.error in (InputError, ConfigError) and ("held-out" in refusal.says or "binary classifiers" in refusal.says)


@pytest.mark.parametrize("method", _methods())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(problem=problems())
def test_every_call_is_valid_or_the_expected_error(method, problem):
    c, d, n_train, batch, dtype, device, n_test, corrupt, seed = problem
    model, loader, x = _build(*problem)
    expected = _expected_refusal(method, c, loader.dataset.tensors[1], corrupt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    CASES[method] += 1
    stage, refusal = "fit", None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            um = posthoc.wrap(model, method=method).fit(loader, loader, progress=False, **FAST_FIT.get(method, {}))
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
    return {"model": model, "x": x, "y": y, "loader": loader, "um": um, "detector": detector,
            "report": posthoc.evaluate(um, loader, progress=False)}


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
    batches = [(x[:rows], y[:rows]), (x[rows:2 * rows], y[rows:2 * rows])]
    bx, by = batches[where]
    if damage == "mismatch":
        by = by[:-1]
    else:
        bx = _damaged_batch(bx, damage, rows)
    batches[where] = (bx, by)
    return batches


#: the entry points that take a loader, each called on one
LOADER_ENTRY_POINTS = {
    "UncertainModel.fit": lambda w, data: posthoc.wrap(w["model"], method="temperature").fit(val_loader=data, progress=False),
    "evaluate": lambda w, data: posthoc.evaluate(w["um"], data, progress=False),
    "evaluate_shift": lambda w, data: posthoc.evaluate_shift(w["um"], data, kinds=["contrast"], severities=[1], progress=False),
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
    ("wrap", lambda w, tmp: posthoc.wrap(w["model"], method=["laplace", "variance-scaling"], likelihood="regression"),
     ConfigError, "wrap without it and fit posthoc.calibrate(mean=pred.mean, std=pred.std, targets=y_val"),
    ("load", lambda w, tmp: posthoc.load(tmp, w["model"]), PosteriorFileError, "is a directory, not a posterior file"),
    ("load", lambda w, tmp: posthoc.load(_saved(w, tmp, "calibrator"), w["model"]), PosteriorFileError,
     "is a calibrator file"),
    ("load", lambda w, tmp: posthoc.load(tmp / "missing.pt", w["model"]), PosteriorFileError, "no posterior file at"),
    ("UncertainModel.save", lambda w, tmp: w["um"].save(_saved(w, tmp, "posterior") / "x.pt"), PosteriorFileError,
     "cannot be created or written"),
    ("calibrate", lambda w, tmp: posthoc.calibrate(_probabilities(w), w["y"]), InputError, "look like probabilities"),
    ("calibrate", lambda w, tmp: posthoc.calibrate(w["x"].flatten(1)[:, :3], w["y"][:-1]), InputError,
     "different lengths"),
    ("calibrate", lambda w, tmp: posthoc.calibrate(torch.zeros(0, 3), torch.zeros(0)), InputError, "got no examples"),
    ("calibrate", lambda w, tmp: posthoc.calibrate(torch.full((24, 3), float("nan")), w["y"]), InputError,
     "NaN or inf logits"),
    ("calibrate", lambda w, tmp: posthoc.calibrate(w["x"].flatten(1)[:, :3], w["y"], method="nope"), ConfigError,
     "unknown calibration method 'nope'"),
    ("calibrate.load", lambda w, tmp: posthoc.calibrate.load(_saved(w, tmp, "posterior")), PosteriorFileError,
     "is a posterior file"),
    ("Calibrator.__call__", lambda w, tmp: posthoc.calibrate(w["model"](w["x"]).detach() * 3, w["y"])(_probabilities(w)),
     InputError, "look like probabilities"),
    ("compare", lambda w, tmp: posthoc.compare(w["report"], "a report"), InputError, "compare takes two posthoc.Report"),
    ("compare", lambda w, tmp: posthoc.compare(w["report"], w["report"], metric="nope"), ConfigError, "cannot compare 'nope'"),
    ("evaluate_shift", lambda w, tmp: posthoc.evaluate_shift(w["um"], w["loader"], kinds=["nope"], progress=False),
     ConfigError, "unknown corruption kind 'nope'"),
    ("shift.corrupt", lambda w, tmp: posthoc.shift.corrupt(w["loader"], "contrast", 1, normalization=(0.5, 0.0)),
     ConfigError, "std must be finite and > 0"),
    ("shift.corrupt", lambda w, tmp: posthoc.shift.corrupt(w["loader"], "contrast", 9), ConfigError,
     "severity must be an integer from 1 to 5"),
    ("shift.extrapolation_split", lambda w, tmp: posthoc.shift.extrapolation_split(w["x"].flatten(1), w["y"]),
     ConfigError, "features: name the one to split by, feature="),
    ("shift.gap_split", lambda w, tmp: posthoc.shift.gap_split(w["x"], w["y"], feature=0), InputError,
     "for images use the corruption kinds (posthoc.shift.corrupt)"),
    ("conformal", lambda w, tmp: posthoc.conformal(w["um"], w["loader"], alpha=2, progress=False), ConfigError,
     "alpha must be a number strictly between 0 and 1"),
    ("conformal", lambda w, tmp: posthoc.conformal(w["um"], w["y"], progress=False), InputError,
     "takes a loader of (x, y) batches"),
    ("selective", lambda w, tmp: posthoc.selective(w["um"], w["loader"], target_risk=0, progress=False), ConfigError,
     "target_risk must be a number strictly between 0 and 1"),
    ("detector", lambda w, tmp: posthoc.detector(w["model"], score="nope"), ConfigError, "unknown OOD score(s) ['nope']"),
    ("detector", lambda w, tmp: posthoc.detector(_nan_model(w), score="knn", k=3).fit(w["loader"], progress=False),
     posthoc.NumericalError, "hold NaN or inf for these inputs"),
    ("detector", lambda w, tmp: posthoc.detector(_nan_model(w), score="energy").score(w["x"]), posthoc.NumericalError,
     "hold NaN or inf for these inputs"),
    ("Detector.score", lambda w, tmp: posthoc.detector(w["model"], score="knn").score(w["x"]), posthoc.NotFittedError,
     "needs statistics of the training data"),
    ("UncertainModel.predict", lambda w, tmp: posthoc.wrap(w["model"], method="laplace").predict(w["x"]),
     posthoc.NotFittedError, "must be fitted before predicting"),
    ("UncertainModel.sparsity", lambda w, tmp: posthoc.wrap(w["model"], method="sparse-vd").sparsity(),
     posthoc.NotFittedError, "um.sparsity() reads the fitted posterior of 'sparse-vd'"),
    ("UncertainModel.prune", lambda w, tmp: posthoc.wrap(w["model"], method="sparse-vd").prune(),
     posthoc.NotFittedError, "um.prune() reads the fitted posterior of 'sparse-vd'"),
    ("UncertainModel.fit", lambda w, tmp: posthoc.wrap(w["model"], method="sgld", cycles=50, num_samples=2)
     .fit(w["loader"], progress=False), ConfigError, "never reach the sampling phase"),
    ("evaluate", lambda w, tmp: posthoc.evaluate(w["um"], [(torch.rand(64, 1, 8, 8), torch.arange(60) % 3)], progress=False),
     InputError, "batch 0 (0-based) of the loader for 'evaluate' has 64 inputs but 60 labels"),
    ("UncertainModel.fit", lambda w, tmp: posthoc.wrap(w["model"], method="sgld", cycles=4, num_samples=2)
     .fit([(w["x"][:3], w["y"][:3])] * 8, progress=False), ConfigError, "cycles=4 over 16 steps"),
    ("register", lambda w, tmp: posthoc.register(42), ConfigError, "takes a subclass of posthoc.Method"),
    # the newest API: ensembles registered as "ensemble", the calibrators read from the method registry, dac
    ("wrap", lambda w, tmp: posthoc.wrap(w["model"], method=5), ConfigError, "method must be a method name or a list of them"),
    ("wrap", lambda w, tmp: posthoc.wrap(w["model"], method="ensemble"), ConfigError,
     "'ensemble' is built from a list of models: pass posthoc.wrap([model_a, model_b, ...]"),
    ("wrap", lambda w, tmp: posthoc.wrap([w["model"]], method="ensemble"), ConfigError, "'ensemble' is built from a list of models"),
    ("wrap", lambda w, tmp: posthoc.wrap([w["model"], w["model"]], method=["none", "ensemble"]), ConfigError,
     "'ensemble' is built from a list of models"),
    ("wrap", lambda w, tmp: posthoc.wrap([], method="none"), ConfigError, "an ensemble needs at least one model; got an empty list"),
    ("wrap", lambda w, tmp: posthoc.wrap([w["model"], 3]), ConfigError, "ensemble member 1 must be a torch.nn.Module, got int"),
    ("calibrate", lambda w, tmp: posthoc.calibrate(w["model"](w["x"]).detach(), w["y"], method="ensemble"), ConfigError,
     "unknown calibration method 'ensemble'; valid: identity, temperature"),
    ("Calibrator.__call__", lambda w, tmp: posthoc.calibrate(w["model"](w["x"]).detach() * 3, w["y"], method="auto")
     (_probabilities(w)), InputError, "look like probabilities"),
    ("UncertainModel.fit", lambda w, tmp: posthoc.wrap(w["model"], method="dac").fit(w["loader"], progress=False), InputError,
     "'dac' is fitted on held-out data: call um.fit(train_loader, val_loader)"),
    ("UncertainModel.fit", lambda w, tmp: posthoc.wrap(w["model"], method=["laplace", "dac"]).fit(w["loader"], progress=False),
     InputError, "'dac' is fitted on held-out data"),
    ("UncertainModel.fit", lambda w, tmp: posthoc.wrap(w["model"], method="dac").fit(val_loader=w["loader"], progress=False),
     InputError, "'dac' compares features with the training features"),
    ("wrap", lambda w, tmp: posthoc.wrap(w["model"], method="dac", layers=["nope"]), ConfigError,
     "layers: the model has no module named 'nope'"),
    ("wrap", lambda w, tmp: posthoc.wrap(w["model"], method="dac", layers="3"), ConfigError,
     "layers must be None (found automatically) or a list of module names"),
    ("wrap", lambda w, tmp: posthoc.wrap(w["model"], method="dac", k=0), ConfigError, "k must be a positive integer, got 0"),
    ("UncertainModel.fit", lambda w, tmp: posthoc.wrap(w["model"], method="dac", head="nope").fit(w["loader"], w["loader"], progress=False),
     posthoc.HeadNotFoundError, "the model has no module named 'nope'"),
    ("UncertainModel.predict", lambda w, tmp: posthoc.wrap(w["model"], method="dac").predict(w["x"]), posthoc.NotFittedError,
     "method 'dac' must be fitted before predicting"),
    # non-finite intermediate results while fitting: features and the inner predictive's log-probabilities
    ("UncertainModel.fit", lambda w, tmp: posthoc.wrap(_nan_model(w), method="dac").fit(w["loader"], w["loader"], progress=False),
     posthoc.NumericalError, "(read by dac for its feature bank) hold NaN or inf although the inputs are finite"),
    ("UncertainModel.fit", lambda w, tmp: posthoc.wrap(_nan_model(w), method="temperature").fit(val_loader=w["loader"], progress=False),
     posthoc.NumericalError, "the log-probabilities of the model that 'temperature' is fitted on hold NaN or inf"),
    ("UncertainModel.fit", lambda w, tmp: posthoc.wrap(_nan_model(w), method="isotonic").fit(val_loader=w["loader"], progress=False),
     posthoc.NumericalError, "the log-probabilities of the model that 'isotonic' is fitted on hold NaN or inf"),
    ("UncertainModel.fit", lambda w, tmp: posthoc.wrap(_nan_model(w), method="auto-calibration")
     .fit(val_loader=w["loader"], progress=False), posthoc.NumericalError, "that 'auto-calibration' is fitted on hold NaN or inf"),
    ("settings", lambda w, tmp: posthoc.settings.override(chunk_size=0).__enter__(), ConfigError,
     "posthoc.settings.chunk_size must be a positive integer"),
    ("available_methods", lambda w, tmp: posthoc.wrap(w["model"], method="laplace", **{"nope": 1}), ConfigError,
     "unknown option(s) ['nope']"),
]


@pytest.mark.parametrize("entry", sorted(LOADER_ENTRY_POINTS))
def test_every_loader_entry_point_accepts_the_same_loader_shapes(world, entry):
    """A plain list of (x, y) pairs, a DataLoader and a generator: wherever a loader is taken (evaluate_shift reads
    its loader once per corruption, which a generator cannot give)."""
    x, y = world["x"], world["y"]
    shapes = {"list": world["loader"], "DataLoader": DataLoader(TensorDataset(x, y), batch_size=12)}
    if entry != "evaluate_shift":
        shapes["generator"] = ((x[k:k + 12], y[k:k + 12]) for k in (0, 12))
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
    """Every function (and public module) of ``posthoc.__all__`` is misused above; classes are reached through
    their instances (``UncertainModel.*``, ``Detector.*``, ``Calibrator``), exceptions are what is checked."""
    tried = {name.split(".")[0] for name, *_ in MISUSES} | set(LOADER_ENTRY_POINTS) | set(BATCH_ENTRY_POINTS)
    tried = {name.split(".")[0] for name in tried}
    public = {name for name in posthoc.__all__ if not (isinstance(getattr(posthoc, name), type)
                                                       and issubclass(getattr(posthoc, name), BaseException))}
    untried = public - tried - {"Prediction", "Report", "Comparison", "ShiftTable", "Method"}
    assert not untried, f"public names with no misuse tried: {sorted(untried)}"
