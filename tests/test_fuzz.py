"""Property-based checks over the public API: every call returns a valid Prediction or raises a
posthoc error with a message — never NaN, never a raw internal exception.

The number of cases tried per method is printed in pytest's terminal summary.
"""

from __future__ import annotations

import collections
import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc

CASES: collections.Counter = collections.Counter()
OUTCOMES: collections.Counter = collections.Counter()

#: fit options that keep each method's fit small on these toy problems
FAST_FIT: dict[str, dict] = {"swag": {"epochs": 3, "collect_per_epoch": 1}, "ibnn": {"epochs": 1}}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _methods() -> list[str]:
    return sorted(posthoc.available_methods())


def _check_prediction(pred: posthoc.Prediction, n: int, c: int) -> None:
    num_classes = max(c, 2)
    assert pred.probs.shape == (n, num_classes)
    assert (pred.probs >= 0).all()
    assert torch.allclose(pred.probs.double().sum(-1), torch.ones(n, dtype=torch.float64, device=pred.probs.device), atol=1e-5)
    for field in (pred.entropy, pred.aleatoric, pred.epistemic, pred.confidence):
        assert field.shape == (n,) and torch.isfinite(field).all()
    assert (pred.epistemic >= 0).all()
    assert (pred.entropy <= math.log(num_classes) + 1e-4).all()


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


@pytest.mark.parametrize("method", _methods())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(problem=problems())
def test_every_call_is_valid_or_a_clear_error(method, problem):
    c, d, n_train, batch, dtype, device, n_test, corrupt, seed = problem
    model, loader, x = _build(*problem)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    CASES[method] += 1
    stage = "fit"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            um = posthoc.wrap(model, method=method).fit(loader, loader, progress=False, **FAST_FIT.get(method, {}))
            stage = "predict"
            pred = um.predict(x, generator=torch.Generator(device=device).manual_seed(0))
    except posthoc.PosthocError as err:
        assert str(err), "a posthoc error must say what is wrong"
        OUTCOMES[f"{method}: {type(err).__name__} in {stage}"] += 1
        if stage == "predict" and corrupt in ("nan", "inf"):
            assert "NaN or inf" in str(err), str(err)
        return
    finally:
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), "the user's model was modified"
    assert corrupt not in ("nan", "inf"), "NaN/inf inputs must be refused, not predicted"
    _check_prediction(pred, n_test, c)
    OUTCOMES[f"{method}: valid prediction"] += 1
