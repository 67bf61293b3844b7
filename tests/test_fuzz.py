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
from posthoc.core.errors import ConfigError, InputError

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
    if c == 1 and method in ("swag", "multiswag") and labels.max() == 1:
        # SWAG's SGD takes the cross-entropy of the raw single logit, so it refuses the label 1 of a
        # binary classifier; drop this line once SWAG trains single-logit heads as sigmoids
        return Refusal("fit", InputError, "labels must lie in [0, 1) for a model with 1 classes")
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
