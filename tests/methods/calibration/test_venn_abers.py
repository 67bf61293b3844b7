"""Venn-Abers calibration against MAPIE's implementation (the `test` extra), on the same held-out split."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from mapie._venn_abers import VennAbers, predict_proba_prefitted_va
from mapie.calibration import VennAbersCalibrator
from sklearn.base import BaseEstimator, ClassifierMixin

import posthoc
from posthoc.errors import ConfigError, InputError
from posthoc.methods.calibration import calibrators
from posthoc.methods.calibration.venn_abers import (
    VennAbersCalibration,
    isotonic_at_insertion,
    problem_scores,
    venn_abers_probs,
)

#: the merged probabilities agree to float64 rounding; what is compared is our float32 output
TOLERANCE = 1e-6


class _Softmax(ClassifierMixin, BaseEstimator):
    """A prefitted "classifier" whose inputs are its logits, for MAPIE's ``VennAbersCalibrator(cv="prefit")``."""

    def fit(self, x: np.ndarray, y: np.ndarray) -> _Softmax:
        self.classes_, self.n_features_in_ = np.unique(y), x.shape[1]
        return self

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        return torch.softmax(torch.as_tensor(x, dtype=torch.float64), -1).numpy()

    def predict(self, x: np.ndarray) -> np.ndarray:
        return x.argmax(1)


def _split(classes: int, seed: int, n: int = 400, ties: bool = False) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(n + 200, classes, generator=generator)
    if ties:  # scores repeated, as a coarse classifier gives: the tie conventions matter
        logits = (logits * 2).round() / 2
    labels = torch.multinomial(torch.softmax(logits / 2, -1), 1, generator=generator).squeeze(-1)
    return logits[:n], labels[:n], logits[n:]


def _probs(logits: torch.Tensor) -> np.ndarray:
    return torch.softmax(logits.double(), -1).numpy()


def _inside(calibrator: VennAbersCalibration, test: torch.Tensor) -> np.ndarray:
    """The test rows whose every score is at most the largest held-out one of its problem. Above it MAPIE's ``p1``
    is not the isotonic fit with the example added (which is 1 there: the example is alone at the top; the tables
    test checks this against scikit-learn), so the comparison leaves those rows out."""
    scores = problem_scores(torch.softmax(test.double(), -1), calibrator.multiclass)
    largest = torch.where(torch.isinf(calibrator.points), -torch.inf, calibrator.points).max(-1).values
    inside = (scores <= largest).all(-1).numpy()
    assert inside.mean() > 0.9
    return inside


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ties", [False, True])
def test_binary_equals_mapie_venn_abers(seed: int, ties: bool) -> None:
    val, labels, test = _split(2, seed, ties=ties)
    oracle = VennAbers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # MAPIE divides 0 by 0 on its way
        oracle.fit(_probs(val), labels.numpy())
    expected, bounds = oracle.predict_proba(_probs(test))
    calibrator = VennAbersCalibration().fit(val, labels)
    inside = _inside(calibrator, test)
    assert np.abs(calibrator(test).double().numpy() - expected)[inside].max() < TOLERANCE
    lower, upper = calibrator.interval(test)
    assert np.abs(lower[:, 1].double().numpy() - bounds[:, 0]).max() < TOLERANCE
    assert np.abs(upper[:, 1].double().numpy() - bounds[:, 1])[inside].max() < TOLERANCE
    # a binary classifier's single logit z is the two-class [0, z]
    single = VennAbersCalibration().fit(val[:, 1] - val[:, 0], labels)
    assert torch.allclose(single(test[:, 1] - test[:, 0]), calibrator(test), atol=TOLERANCE)


@pytest.mark.parametrize("classes", [3, 5])
@pytest.mark.parametrize("ties", [False, True])
def test_one_vs_rest_equals_mapie(classes: int, ties: bool) -> None:
    val, labels, test = _split(classes, classes, ties=ties)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected, bounds = predict_proba_prefitted_va(_probs(val), labels.numpy(), _probs(test), va_tpe="one_vs_all")
    calibrator = VennAbersCalibration().fit(val, labels)
    inside = _inside(calibrator, test)
    assert np.abs(calibrator(test).double().numpy() - expected)[inside].max() < TOLERANCE
    lower, upper = calibrator.interval(test)
    assert np.abs(lower.double().numpy() - np.stack([b[:, 0] for b in bounds], 1)).max() < TOLERANCE
    assert np.abs(upper.double().numpy() - np.stack([b[:, 1] for b in bounds], 1))[inside].max() < TOLERANCE


@pytest.mark.parametrize("classes", [3, 4])
def test_pairwise_equals_mapie_prefit_calibrator(classes: int) -> None:
    val, labels, test = _split(classes, 10 + classes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        oracle = VennAbersCalibrator(estimator=_Softmax().fit(val.numpy(), labels.numpy()), cv="prefit")
        expected = oracle.fit(val.numpy(), labels.numpy()).predict_proba(test.numpy())
    calibrator = VennAbersCalibration(multiclass="pairwise").fit(val, labels)
    assert np.abs(calibrator(test).double().numpy() - expected)[_inside(calibrator, test)].max() < TOLERANCE
    probs, lower, upper = venn_abers_probs(
        test.double(), calibrator.points, calibrator.low, calibrator.high, "pairwise"
    )
    assert bool((lower <= upper).all()) and bool((lower >= 0).all()) and bool((upper <= 1).all())


def test_tables_are_the_isotonic_fit_with_the_test_example_added() -> None:
    """p0 and p1 at every gap equal scikit-learn's isotonic regression refitted with the test example added."""
    from sklearn.isotonic import IsotonicRegression

    generator = torch.Generator().manual_seed(3)
    scores = torch.rand(60, generator=generator).double()
    events = (torch.rand(60, generator=generator).double() < scores).double()
    points, p0, p1 = isotonic_at_insertion(scores, events)
    edges = torch.cat([points[:1] - 1, points, points[-1:] + 1])
    for gap in range(len(points) + 1):
        test = float((edges[gap] + edges[gap + 1]) / 2)
        for event, table in ((0.0, p0), (1.0, p1)):
            fit = IsotonicRegression().fit(np.append(scores.numpy(), test), np.append(events.numpy(), event))
            assert abs(fit.predict([test])[0] - float(table[gap])) < 1e-12


def test_calibrate_entry_point_export_and_file(tmp_path) -> None:
    val, labels, test = _split(3, 7, n=600)
    assert calibrators()["venn-abers"] is VennAbersCalibration
    calibrator = posthoc.calibrate(val, labels, method="venn-abers", tolerance=math.inf)
    assert not bool(calibrator.passthrough)
    probs = calibrator(test)
    assert torch.allclose(probs.sum(-1), torch.ones(len(test)), atol=1e-6)
    assert torch.allclose(calibrator.to_module()(test), probs, atol=1e-6)
    calibrator.save(tmp_path / "va.pt")
    assert torch.equal(posthoc.calibrate.load(tmp_path / "va.pt")(test), probs)
    lower, upper = calibrator.interval(test.numpy())  # numpy in, numpy out
    assert isinstance(lower, np.ndarray) and bool((lower <= upper).all())


def test_overconfident_model_gains_on_new_data() -> None:
    """Fitted on 1,000 held-out examples of a model three times too sharp, it lowers the NLL of new data."""
    generator = torch.Generator().manual_seed(5)
    logits = 6 * torch.randn(2000, 4, generator=generator)
    labels = torch.multinomial(torch.softmax(logits / 3, -1), 1, generator=generator).squeeze(-1)
    calibrator = posthoc.calibrate(logits[:1000], labels[:1000], method="venn-abers")
    assert calibrator.selection["chosen"] != "uncalibrated"
    nll = torch.nn.functional.nll_loss
    plain = nll(torch.log_softmax(logits[1000:], -1), labels[1000:])
    calibrated = nll(calibrator(logits[1000:]).log(), labels[1000:])
    assert calibrated < 0.8 * plain


def test_clear_errors() -> None:
    val, labels, _ = _split(3, 0)
    with pytest.raises(ConfigError, match="multiclass"):
        posthoc.calibrate(val, labels, method="venn-abers", multiclass="one-vs-one")
    calibrator = VennAbersCalibration().fit(val, labels)
    with pytest.raises(InputError, match="fitted on 3 classes"):
        calibrator.interval(torch.zeros(4, 5))
