"""The prior ladder scored from factors made once (:mod:`posthoc.methods.laplace.ladder`) against a predict per rung.

Oracle: the predict-based scoring it replaces (``Laplace._scores`` over ``HeldOut.prepared``, the probit predictive's
``(N, C)`` log-probabilities per rung). Both run in float32 with the same variances up to the order of the operations
(a logsumexp against a log-softmax; for ``kron`` ``ψ² @ inverse`` then ``U_G²`` without the square root between):
float32 rounding of scaled logits up to about 50 in size, a few ulps of 4e-6, so per-example NLLs and confidences
agree to 2e-5 absolute and 1e-5 relative (measured: at most 4e-6), and whole fits choose the same prior.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.core.likelihood import Categorical
from posthoc.engine.held_out import HeldOut
from posthoc.methods.laplace.base import Laplace
from posthoc.methods.laplace.last_layer import LastLayerLaplace


def _head(classes: int = 7, width: int = 6, rows: int = 300, seed: int = 0):
    """A linear head on Gaussian features, its checkpoint a noisy (overconfident) copy of the teacher, and loaders."""
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(classes, width, generator=generator)
    x = torch.randn(rows, width, generator=generator)
    y = torch.distributions.Categorical(logits=x @ teacher.T).sample()
    model = nn.Sequential(nn.Identity(), nn.Linear(width, classes)).eval()
    with torch.no_grad():
        model[1].weight.copy_(2.0 * teacher + 0.5 * torch.randn(classes, width, generator=generator))
        model[1].bias.zero_()
    half = rows // 2
    train = DataLoader(TensorDataset(x[:half], y[:half]), batch_size=64)
    val = DataLoader(TensorDataset(x[half:], y[half:]), batch_size=64)
    return model, train, val


def _assert_same(found, expected) -> None:
    for name in ("clean", "shifted", "confidence", "correct", "mistakes"):
        a, b = getattr(found, name), getattr(expected, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5, msg=name)


def test_ladder_scores_equal_a_predict_per_rung() -> None:
    """At rungs across the ladder, for every structure, the scores from the factors equal those of the probit
    predictive's log-probabilities, on the clean rows and their perturbed copies."""
    model, train, val = _head()
    held = HeldOut.read(val, model=model, likelihood=Categorical(), shift="auto", device="cpu")
    for hessian in ("kron", "diag", "kron-diag", "full"):
        method = posthoc.wrap(model, method="laplace", hessian=hessian, prior_precision=1.0).fit(train, progress=False)
        fast = method.method._ladder_scores(held)
        slow = Laplace._ladder_scores(method.method, held)
        for delta in (1e8, 10.0, 1e-2, 1e-4):
            _assert_same(fast(delta), slow(delta))


@pytest.mark.parametrize("hessian, with_val", [("kron", True), ("kron-diag", False)])
def test_default_fit_chooses_as_the_predict_per_rung(hessian: str, with_val: bool, monkeypatch) -> None:
    """The default fit (with a validation loader, and on training rows without one) chooses the prior the predict-based
    scoring chooses, with the same selection record to 1e-6, and predicts the same probabilities."""
    model, train, val = _head(seed=1)
    fits = []
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(LastLayerLaplace, "_ladder_scores", Laplace._ladder_scores)
        um = posthoc.wrap(model, method="laplace", hessian=hessian)
        um.fit(train, val if with_val else None, progress=False)
        fits.append(um)
    fast_um, slow_um = fits
    assert float(fast_um.method.prior_precision) == float(slow_um.method.prior_precision)
    records = [um.summary()["selection"]["candidates"] for um in fits]
    for a, b in zip(*records):
        assert (a["candidate"], a["admissible"], a["chosen"]) == (b["candidate"], b["admissible"], b["chosen"])
        for key in ("clean_nll", "excess", "bound", "shifted_nll", "shifted_ece"):
            if a.get(key) is not None:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=2e-6), key  # the record rounds to 1e-6
    x = next(iter(val))[0]
    torch.testing.assert_close(fast_um.predict(x).probs, slow_um.predict(x).probs)
