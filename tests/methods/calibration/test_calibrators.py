"""The calibrator suite of ``posthoc.calibrate`` (issue 20, sections 2 and 5): each calibrator improves a
miscalibrated model, agrees with its peers where one exists, saves and loads, refuses what it cannot fit;
``"auto"`` chooses by cross-validated NLL and is never worse than no calibration; the stacked methods."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import posthoc
from posthoc.core.calibration_error import top_label_ece
from posthoc.engine.selection import Scores, select
from posthoc.evaluation import metrics
from posthoc.methods.calibration import calibrators

MULTICLASS = ["temperature", "vector", "matrix", "dirichlet", "ets", "histogram", "isotonic", "auto"]


@pytest.fixture(scope="module")
def overconfident(digits):
    """The digits CNN's logits x3 on the calibration (fit) and test splits."""
    from posthoc_apps.demo import zoo

    model = zoo.pretrained()
    with torch.no_grad():
        return {
            split: (model(ds.tensors[0]) * 3, ds.tensors[1])
            for split, ds in (("fit", digits.calibration), ("test", digits.test))
        }


def _synthetic(n=3000, seed=0, fit=2000):
    """Per-class miscalibrated logits: scales and shifts per class, labels drawn from the true logits;
    the first ``fit`` examples to fit on, the rest to test on."""
    generator = torch.Generator().manual_seed(seed)
    true = torch.randn(n, 5, generator=generator) * 2
    labels = torch.multinomial(true.softmax(-1), 1, generator=generator).squeeze(-1)  # not the global RNG
    logits = true * torch.tensor([3.0, 1.0, 2.0, 0.5, 1.5]) + torch.tensor([0.5, 0.0, -0.5, 1.0, 0.0])
    return (logits[:fit], labels[:fit]), (logits[fit:], labels[fit:])


@pytest.mark.parametrize("method", MULTICLASS)
def test_each_calibrator_improves_an_overconfident_model(method, overconfident, tmp_path):
    (logits, labels), (test_logits, test_labels) = overconfident["fit"], overconfident["test"]
    # the map itself (tolerance=inf: the clean fit, as the peers make it): with 11 errors among the 600 held-out
    # examples the guarded default keeps the identity for the maps with per-class parameters, whose out-of-fold NLL
    # is worse than none there (tests/bench/test_selection_errors.py covers the guard)
    calibrator = posthoc.calibrate(logits, labels, method=method, tolerance=math.inf)
    probs = calibrator(test_logits)
    assert probs.shape == test_logits.shape and torch.allclose(probs.sum(-1), torch.ones(len(probs)), atol=1e-5)
    assert metrics.nll(probs, test_labels) < 0.75 * metrics.nll(test_logits.softmax(-1), test_labels)
    assert torch.allclose(calibrator.log_probs(test_logits).exp(), probs)
    assert torch.allclose(calibrator.predict(test_logits.numpy()).probs, probs)
    assert calibrator.chosen_name in calibrators() and (calibrator.scores != {}) == (method == "auto")
    calibrator.save(tmp_path / "cal.pt")
    loaded = posthoc.calibrate.load(tmp_path / "cal.pt")
    assert loaded.chosen_name == calibrator.chosen_name and loaded.scores == calibrator.scores
    assert torch.allclose(loaded(test_logits), probs)
    with pytest.raises(posthoc.InputError, match="fitted on 8 classes but got logits with 5"):
        loaded(test_logits[:, :5])


def test_peers_agree_on_the_same_logits():
    """matrix (no penalty) = torch-uncertainty's MatrixScaler; histogram (no smoothing) = netcal's HistogramBinning;
    isotonic = scikit-learn's IsotonicRegression per class, renormalised (and netcal's to 2e-3); vector (no penalty)
    reaches a lower NLL than torch-uncertainty's VectorScaler, whose LBFGS without line search stops early."""
    from netcal.binning import HistogramBinning, IsotonicRegression
    from sklearn.isotonic import IsotonicRegression as SklearnIsotonic

    (logits, labels), (test_logits, test_labels) = _synthetic()
    probs, test_probs = logits.softmax(-1).double().numpy(), test_logits.softmax(-1).double().numpy()
    ours = posthoc.calibrate(logits, labels, method="histogram", smoothing=0.0)(test_logits).numpy()
    theirs = np.asarray(HistogramBinning(bins=15).fit(probs, labels.numpy()).transform(test_probs))
    assert np.abs(ours - theirs).max() < 1e-5
    ours = posthoc.calibrate(logits, labels, method="isotonic")(test_logits).double().numpy()
    # the inputs ours sees: posthoc.calibrate works on the logits in float64
    fit_probs = torch.softmax(logits.double(), -1).numpy()
    transform_probs = torch.softmax(test_logits.double(), -1).numpy()
    per_class = np.stack(
        [
            SklearnIsotonic(y_min=0, y_max=1, out_of_bounds="clip")
            .fit(fit_probs[:, c], labels.numpy() == c)
            .predict(transform_probs[:, c])
            for c in range(5)
        ],
        -1,
    ).clip(1e-6)
    assert np.abs(ours - per_class / per_class.sum(-1, keepdims=True)).max() < 1e-6
    theirs = np.asarray(IsotonicRegression().fit(probs, labels.numpy()).transform(test_probs))
    assert np.abs(ours - theirs).max() < 2e-3
    import torch_uncertainty.post_processing as tu

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(logits, labels), batch_size=len(labels))
    scaler = tu.MatrixScaler(num_classes=5, model=None)
    scaler.fit(loader, progress=False)
    with torch.no_grad():
        theirs = scaler(test_logits).softmax(-1)
    ours = posthoc.calibrate(logits, labels, method="matrix", off_diagonal=0.0, intercept=0.0)(test_logits)
    assert (ours - theirs).abs().max() < 5e-3
    scaler = tu.VectorScaler(num_classes=5, model=None)
    scaler.fit(loader, progress=False)
    with torch.no_grad():
        theirs = scaler(logits).log_softmax(-1)
    ours = posthoc.calibrate(logits, labels, method="vector", spread=0.0, intercept=0.0).log_probs(logits)
    assert metrics.nll(ours.exp(), labels) <= metrics.nll(theirs.exp(), labels) + 1e-6


def test_platt_matches_logistic_regression_on_one_logit():
    from sklearn.linear_model import LogisticRegression

    generator = torch.Generator().manual_seed(1)
    z = torch.randn(2000, generator=generator) * 2
    labels = torch.bernoulli(torch.sigmoid(0.4 * z - 0.5), generator=generator).long()
    calibrator = posthoc.calibrate(z.numpy(), labels.numpy(), method="platt")
    reference = LogisticRegression(C=1e10, tol=1e-10, max_iter=1000).fit(z[:, None].double().numpy(), labels.numpy())
    assert float(calibrator.weight) == pytest.approx(float(reference.coef_[0, 0]), rel=1e-3)
    assert float(calibrator.bias) == pytest.approx(float(reference.intercept_[0]), rel=1e-3)
    assert calibrator(z).shape == (2000, 2)


def test_auto_is_never_worse_than_identity_on_the_folds_and_reports_its_table():
    """Over random draws of a miscalibrated and of a calibrated set (the true logits): the choice's
    cross-validated NLL is at most the identity's; on the miscalibrated sets the held-out NLL improves."""
    for seed in range(4):
        (logits, labels), (test_logits, test_labels) = _synthetic(n=900, seed=seed, fit=600)
        truth = (logits - torch.tensor([0.5, 0.0, -0.5, 1.0, 0.0])) / torch.tensor([3.0, 1.0, 2.0, 0.5, 1.5])
        for fit_logits, miscalibrated in ((logits, True), (truth, False)):
            calibrator = posthoc.calibrate(fit_logits, labels, method="auto", seed=seed)
            scores = calibrator.scores
            assert {"none", "temperature", "vector", "matrix"} <= set(scores) and "platt" not in scores
            assert scores[calibrator.chosen_name]["nll"] <= scores["none"]["nll"]
            if miscalibrated:
                assert calibrator.chosen_name != "none"
                assert metrics.nll(calibrator(test_logits), test_labels) < metrics.nll(
                    test_logits.softmax(-1), test_labels
                )


def test_auto_skips_calibrators_without_enough_examples_per_class():
    (logits, labels), _ = _synthetic()
    keep = torch.cat([torch.nonzero(labels == c).reshape(-1)[: (6 if c == 0 else 200)] for c in range(5)])
    with pytest.warns(
        RuntimeWarning, match=r"auto calibration skips 'matrix': .*at least 10 held-out examples of every class"
    ):
        calibrator = posthoc.calibrate(logits[keep], labels[keep], method="auto")
    assert "matrix" not in calibrator.scores and "temperature" in calibrator.scores


def test_too_few_examples_per_class_names_the_minimum():
    (logits, labels), _ = _synthetic()
    keep = torch.cat([torch.nonzero(labels == c).reshape(-1)[: (3 if c == 2 else 50)] for c in range(5)])
    for method, minimum in (("vector", 5), ("matrix", 10), ("dirichlet", 10), ("histogram", 10), ("isotonic", 10)):
        with pytest.raises(
            posthoc.InputError,
            match=rf"'{method}' .*needs at least {minimum} held-out examples of every class \(class 2: 3\)",
        ):
            posthoc.calibrate(logits[keep], labels[keep], method=method)


def test_guardrails_one_example_one_class_probabilities_and_strings():
    (logits, labels), _ = _synthetic()
    with pytest.raises(posthoc.InputError, match="'temperature' needs at least 10 held-out examples, got 1"):
        posthoc.calibrate(logits[:1], labels[:1])
    with pytest.raises(posthoc.InputError, match=r"all \d+ held-out labels are class 3: .*at least two classes"):
        posthoc.calibrate(logits[labels == 3][:400], labels[labels == 3][:400])
    with pytest.raises(posthoc.InputError, match="look like probabilities: every row lies in \\[0, 1\\] and sums to 1"):
        posthoc.calibrate(logits.softmax(-1).numpy(), labels.numpy())
    with pytest.warns(RuntimeWarning, match="every binary logit lies in \\[0, 1\\]"):
        posthoc.calibrate(torch.sigmoid(logits[:, 0]), (labels == 0).long())
    names = np.array(["cat", "dog", "owl", "emu", "elk"])[labels.numpy()]
    for given in (names, names.tolist()):
        with pytest.raises(
            posthoc.InputError, match="labels are strings \\(e.g. '.*'\\), not numbers; .*return_inverse"
        ):
            posthoc.calibrate(logits, given)
    with pytest.raises(posthoc.ConfigError, match="unknown option\\(s\\) \\['bins'\\] for calibrator 'vector'"):
        posthoc.calibrate(logits, labels, method="vector", bins=3)


def test_ece_matches_the_report_metric():
    (logits, labels), _ = _synthetic()
    probs = logits.softmax(-1)
    confidence, predicted = probs.max(-1)
    assert top_label_ece(confidence, predicted == labels) == pytest.approx(metrics.ece(probs, labels), abs=1e-9)


@pytest.mark.parametrize("method", ["vector", "histogram", "auto-calibration"])
def test_stacked_calibrators_fit_on_the_inner_predictive(method, small, tmp_path):
    from posthoc_apps.demo import zoo

    model = zoo.pretrained()
    um = posthoc.wrap(model, method=["laplace", method]).fit(small["fit"], small["val"], progress=False)
    probs = um.predict(small["x"]).probs
    assert torch.allclose(probs.sum(-1), torch.ones(len(probs)), atol=1e-5)
    card = um.method.summary()
    assert card["random_variables"] == um.method.calibrator.num_parameters() and card["calibrator"] in {
        *calibrators(),
        "none",
    }  # "none": the fit kept the plain predictive
    um.save(tmp_path / "stacked.pt")
    loaded = posthoc.load(tmp_path / "stacked.pt", zoo.pretrained())
    assert torch.allclose(loaded.predict(small["x"]).probs, probs, atol=1e-6)


def test_auto_needs_a_candidate_to_beat_the_identity_by_more_than_noise():
    """A regressor's auto judges CRPS by the selection step: a candidate whose per-example losses are the identity's
    plus zero-mean noise (slightly lower on average by luck) is not admissible; one that is clearly better is."""
    generator = torch.Generator().manual_seed(0)
    identity = torch.rand(600, generator=generator, dtype=torch.float64)
    noise = torch.randn(600, generator=generator, dtype=torch.float64)
    lucky = identity + noise - noise.mean() - 1e-3  # 1e-3 lower on average, standard error ~0.04
    better = identity - 0.2 + 0.01 * noise
    choose = lambda *losses: select(  # noqa: E731
        [("identity", 0), *((f"c{i}", i + 1) for i in range(len(losses)))],
        [Scores(identity), *map(Scores, losses)],
        plain=Scores(identity),
        tolerance=0.02 * float(identity.mean()),
        knob="calibrator",
        rank_without_shift="first",
        score="CRPS",
    )
    assert choose(lucky).label == "identity" and not choose(lucky).records[1].admissible
    assert choose(lucky, better).label == "c1"


@pytest.fixture(scope="module")
def nearly_separable(digits):
    """Per bundled checkpoint: its logits and labels on the calibration and test digits together, and which it gets wrong."""
    from posthoc_apps.demo import zoo

    x = torch.cat([digits.calibration.tensors[0], digits.test.tensors[0]])
    y = torch.cat([digits.calibration.tensors[1], digits.test.tensors[1]])
    out = {}
    for name in ("digits_cnn", "digits_bn_cnn"):
        with torch.no_grad():
            logits = zoo.pretrained(name)(x)
        out[name] = (logits, y, logits.argmax(-1) != y)
    return out


#: how much worse than no calibration auto's test NLL may be on average over the halvings, and at worst
AUTO_MEAN_TOLERANCE, AUTO_WORST = 1.05, 1.5


@pytest.mark.parametrize("name", ["digits_cnn", "digits_bn_cnn"])
def test_auto_is_no_worse_than_no_calibration_on_nearly_separable_sets(nearly_separable, name):
    """792 digits with 5 errors, halved at random 20 times: fitted on 396 examples with 0-5 errors, tested on the
    other 396. Per-class calibrators picked on such folds by cross-validated NLL alone cost 1.5x the test NLL of no
    calibration on average and 8.5x at worst; the selection step's bound keeps auto within the tolerance."""
    logits, labels, wrong = nearly_separable[name]
    wrong_rows, right_rows = wrong.nonzero().flatten(), (~wrong).nonzero().flatten()
    ratios = []
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        pick = torch.cat(
            [
                wrong_rows[torch.randperm(len(wrong_rows), generator=generator)[:5]],
                right_rows[torch.randperm(len(right_rows), generator=generator)[:787]],
            ]
        )
        pick = pick[torch.randperm(len(pick), generator=generator)]
        fit, test = pick[:396], pick[396:]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # halvings with no error keep the identity, and say so
            calibrator = posthoc.calibrate(logits[fit], labels[fit], method="auto", seed=seed)
        plain = metrics.nll(logits[test].softmax(-1), labels[test])
        ratios.append(metrics.nll(calibrator(logits[test]), labels[test]) / plain)
    assert np.mean(ratios) <= AUTO_MEAN_TOLERANCE and max(ratios) <= AUTO_WORST, ratios


#: calibrators that extend temperature: "auto" admits one only where its gain over temperature is sure
FLEXIBLE = {name for name, cls in calibrators().items() if cls.extends == "temperature"}


@pytest.mark.parametrize("name", ["digits_cnn", "digits_bn_cnn"])
def test_auto_never_elects_a_flexible_calibrator_on_a_few_mistakes(nearly_separable, name):
    """The same halvings (396 digits with 0-5 of the plain model's mistakes): ``auto`` never picks a calibrator that
    extends temperature (its gain over temperature would rest on two or three mistakes). Without the nested comparison
    (``extends`` ignored) a flexible map wins some halvings and this fails."""
    logits, labels, wrong = nearly_separable[name]
    wrong_rows, right_rows = wrong.nonzero().flatten(), (~wrong).nonzero().flatten()
    flexible = []
    for seed in range(20):
        generator = torch.Generator().manual_seed(100 + seed)
        pick = torch.cat([wrong_rows[torch.randperm(len(wrong_rows), generator=generator)[:5]], right_rows])
        pick = pick[torch.randperm(len(pick), generator=generator)]
        fit = pick[: len(pick) // 2]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            calibrator = posthoc.calibrate(logits[fit], labels[fit], method="auto", seed=seed)
        if calibrator.chosen_name in FLEXIBLE:
            flexible.append((calibrator.chosen_name, int(wrong[fit].sum())))
    assert not flexible, f"flexible calibrators chosen (name, held-out mistakes): {flexible}"


@pytest.mark.parametrize("method", sorted(set(calibrators()) - {"platt"}))
def test_every_calibrator_fits_float_labels_of_whole_numbers_and_a_binary_classifiers_one_logit(method):
    """A calibrator's own ``fit`` reads its inputs as ``posthoc.calibrate`` does (methods.calibration.base.held_out_logits):
    float labels holding whole numbers are class indices, and ``(N,)`` logits a binary classifier's ``[0, z]`` (was:
    bincount's NotImplementedError or cross-entropy's RuntimeError on float labels, a ValueError on 1-D logits)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 3, generator=generator) * 2
    labels = torch.distributions.Categorical(logits=logits).sample()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from_floats = calibrators()[method]().fit(logits, labels.float())
        from_ints = calibrators()[method]().fit(logits, labels)
        torch.testing.assert_close(from_floats(logits), from_ints(logits))
        z = logits[:, 1] - logits[:, 0]
        binary = (labels == 1).long()
        one_logit = calibrators()[method]().fit(z, binary)
        two_logits = calibrators()[method]().fit(torch.stack([torch.zeros_like(z), z], 1), binary)
        torch.testing.assert_close(one_logit(z), two_logits(z))
    with pytest.raises(posthoc.InputError, match="labels are not whole numbers"):
        calibrators()[method]().fit(logits, labels.float() + 0.5)
