"""``posthoc.conformal``: finite-sample coverage over many random splits, LAC against MAPIE, and bad inputs.

Synthetic probabilities are the softmax of Gaussian logits (continuous scores, so coverage follows
the Beta law exactly); labels are drawn from a tempered version of them (a miscalibrated model:
conformal coverage must not depend on calibration).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from scipy import stats

import posthoc
from posthoc.guarantees.bounds import conformal_rank, minimum_calibration_size
from posthoc.guarantees.measures import coverage, mean_set_size
from posthoc.guarantees.scores import ConformityScore
from posthoc_apps.demo import data

SPLITS = 400
NUM_CLASSES = 10


pytestmark = pytest.mark.usefixtures("one_thread")


def synthetic(count: int, generator: torch.Generator, classes: int = NUM_CLASSES) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax probabilities ``(count, classes)`` of Gaussian logits with a bias per class (some classes
    are rarer and harder), and labels drawn from the softmax at temperature 2 (an overconfident model)."""
    bias = torch.linspace(-1.5, 1.5, classes, dtype=torch.float64)
    logits = 2.5 * torch.randn(count, classes, generator=generator, dtype=torch.float64) + bias
    probs = torch.softmax(logits, -1)
    u = torch.rand(count, 1, generator=generator, dtype=torch.float64)
    labels = (torch.softmax(logits / 2, -1).cumsum(-1) < u).sum(-1).clamp_max(classes - 1)
    return probs, labels


def split_coverages(n_cal: int, n_test: int, alpha: float, splits: int = SPLITS, **options) -> np.ndarray:
    """Test coverage of ``posthoc.conformal`` fitted on a fresh calibration draw, for each of ``splits`` draws."""
    generator = torch.Generator().manual_seed(1234)
    out = []
    for split in range(splits):
        probs, labels = synthetic(n_cal + n_test, generator)
        cp = posthoc.conformal(probs[:n_cal], labels[:n_cal], alpha=alpha, seed=split, **options)
        out.append(coverage(cp.sets(probs[n_cal:]), labels[n_cal:]))
    return np.array(out)


@pytest.mark.parametrize("score", ["lac", "aps", "raps", "saps"])
def test_coverage_over_random_splits_lies_in_the_finite_sample_band(score: str) -> None:
    """Mean coverage in [1 - alpha, 1 - alpha + 1/(n + 1)]; per split, the Beta(k, n + 1 - k) law (plus test noise)."""
    n_cal, n_test, alpha = 200, 1000, 0.1
    covered = split_coverages(n_cal, n_test, alpha, score=score)
    k = conformal_rank(n_cal, alpha)
    beta = stats.beta(k, n_cal + 1 - k)
    test_noise = beta.mean() * (1 - beta.mean()) / n_test
    spread = math.sqrt(beta.var() + test_noise)
    slack = 3 * spread / math.sqrt(SPLITS)
    assert 1 - alpha - slack <= covered.mean() <= 1 - alpha + 1 / (n_cal + 1) + slack, covered.mean()
    # the per-split law, loosely: its spread and quantiles (the test set adds a little binomial noise)
    assert 0.8 * spread <= covered.std() <= 1.2 * spread, (covered.std(), spread)
    for q in (0.1, 0.5, 0.9):
        assert abs(np.quantile(covered, q) - beta.ppf(q)) < 0.012, (q, np.quantile(covered, q), beta.ppf(q))


def test_coverage_holds_with_few_calibration_examples() -> None:
    """With n = 20 the finite-sample rank (19) and the plain 1 - alpha quantile's (18) differ, and only 19 covers."""
    n_cal, alpha = 20, 0.1
    assert conformal_rank(n_cal, alpha) == 19 and math.ceil(n_cal * (1 - alpha)) == 18
    covered = split_coverages(n_cal, 1000, alpha, splits=200, score="lac")
    assert covered.mean() >= 1 - alpha - 0.01  # 19/21 = 0.905 expected; rank 18 would give 18/21 = 0.857


def test_mondrian_covers_every_class() -> None:
    generator = torch.Generator().manual_seed(7)
    alpha, per_class = 0.2, [[] for _ in range(NUM_CLASSES)]
    for _ in range(150):
        probs, labels = synthetic(1500, generator)
        cp = posthoc.conformal(probs[:500], labels[:500], alpha=alpha, mondrian=True)
        assert cp.threshold.shape == (NUM_CLASSES,)
        sets, test_labels = cp.sets(probs[500:]), labels[500:]
        for c in range(NUM_CLASSES):
            mask = test_labels == c
            per_class[c].append(float(sets[mask, c].double().mean()))
    means = np.array([np.mean(v) for v in per_class])
    assert (means >= 1 - alpha - 0.01).all(), means
    # a marginal threshold on the same data leaves some class well below 1 - alpha
    probs, labels = synthetic(60000, generator)
    marginal = posthoc.conformal(probs[:30000], labels[:30000], alpha=alpha).sets(probs[30000:])
    worst = min(float(marginal[labels[30000:] == c, c].double().mean()) for c in range(NUM_CLASSES))
    assert worst < 1 - alpha - 0.02


@pytest.mark.parametrize("n_cal", [20, 50, 99, 199, 500])
@pytest.mark.parametrize("alpha", [0.05, 0.1, 0.2])
def test_lac_threshold_and_sets_equal_mapie(n_cal: int, alpha: float) -> None:
    import mapie.classification as mapie
    from sklearn.base import BaseEstimator, ClassifierMixin

    class GivenProbabilities(ClassifierMixin, BaseEstimator):
        """A prefit 'classifier' whose inputs are its predicted probabilities."""

        def __init__(self, num_classes: int = NUM_CLASSES) -> None:
            self.num_classes = num_classes

        def fit(self, x, y):
            self.classes_ = np.arange(self.num_classes)
            return self

        def predict_proba(self, x):
            return np.asarray(x, dtype=np.float64)

        def predict(self, x):
            return np.asarray(x).argmax(1)

    probs, labels = synthetic(n_cal + 400, torch.Generator().manual_seed(n_cal))
    probs_np, labels_np = probs.numpy(), labels.numpy()
    reference = mapie.SplitConformalClassifier(
        GivenProbabilities().fit(probs_np, labels_np), confidence_level=1 - alpha, conformity_score="lac", prefit=True
    )
    reference.conformalize(probs_np[:n_cal], labels_np[:n_cal])
    _, reference_sets = reference.predict_set(probs_np[n_cal:])
    cp = posthoc.conformal(probs_np[:n_cal], labels_np[:n_cal], alpha=alpha, score="lac")
    assert float(cp.threshold) == float(reference._mapie_classifier.conformity_score_function_.quantiles_[0])
    assert np.array_equal(cp.sets(probs_np[n_cal:]), reference_sets[:, :, 0])  # numpy in, numpy out


def test_the_rank_is_the_published_formula() -> None:
    """ceil((n + 1)(1 - alpha)) in exact arithmetic, and an error exactly where it would exceed n."""
    for alpha_text in ("0.01", "0.05", "0.1", "0.2", "0.25", "0.3", "0.5", "0.9"):
        alpha = float(alpha_text)
        for n in range(1, 400):
            exact = math.ceil((n + 1) * (1 - Fraction(alpha_text)))
            if exact > n:
                assert n < minimum_calibration_size(alpha)
                with pytest.raises(posthoc.InputError, match="calibration examples"):
                    conformal_rank(n, alpha)
            else:
                assert n >= minimum_calibration_size(alpha) and conformal_rank(n, alpha) == exact


def test_scores_by_hand() -> None:
    probs = torch.tensor([[0.1, 0.6, 0.3]], dtype=torch.float64)
    assert torch.allclose(ConformityScore("lac")(probs), torch.tensor([[0.9, 0.4, 0.7]], dtype=torch.float64))
    assert torch.allclose(
        ConformityScore("aps", randomized=False)(probs), torch.tensor([[1.0, 0.6, 0.9]], dtype=torch.float64)
    )
    raps = ConformityScore("raps", randomized=False, k_reg=1, lam=0.5)(probs)
    assert torch.allclose(raps, torch.tensor([[2.0, 0.6, 1.4]], dtype=torch.float64))
    # randomised: the true class's own mass enters with a uniform weight u shared across the classes of an example
    u = torch.rand(1, 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    aps = ConformityScore("aps", generator=torch.Generator().manual_seed(3))(probs)
    assert torch.allclose(aps, torch.tensor([[0.9, 0.0, 0.6]], dtype=torch.float64) + u * probs)


def test_aps_sets_are_the_top_classes_and_nonrandomised_ones_are_deterministic() -> None:
    probs, labels = synthetic(3000, torch.Generator().manual_seed(5))
    for randomized in (True, False):
        cp = posthoc.conformal(probs[:1000], labels[:1000], alpha=0.1, score="aps", randomized=randomized)
        sets = cp.sets(probs[1000:])
        ranked = probs[1000:].argsort(-1, descending=True)
        in_rank_order = sets.gather(1, ranked)
        assert torch.equal(in_rank_order, in_rank_order.cummin(-1).values)  # no gap: k top classes
        assert torch.equal(sets, cp.sets(probs[1000:])) != randomized


def test_non_empty_sets_hold_the_top_class_and_cover_at_least_as_often() -> None:
    """LAC sets are empty where no class reaches ``1 - threshold``; ``non_empty`` adds the top class there only."""
    generator, alpha = torch.Generator().manual_seed(21), 0.3
    empty_seen, covered, covered_plain = 0, [], []
    for _ in range(100):
        probs = torch.softmax(3 * torch.randn(400, NUM_CLASSES, generator=generator, dtype=torch.float64), -1)
        labels = torch.distributions.Categorical(probs=probs).sample()  # a calibrated model: confident and right
        plain = posthoc.conformal(probs[:200], labels[:200], alpha=alpha)
        full = posthoc.conformal(probs[:200], labels[:200], alpha=alpha, non_empty=True)
        sets, sets_full = plain.sets(probs[200:]), full.sets(probs[200:])
        empty = ~sets.any(-1)
        empty_seen += int(empty.sum())
        assert sets_full.any(-1).all() and torch.equal(sets_full[~empty], sets[~empty])
        assert torch.equal(sets_full[empty].float().argmax(-1), probs[200:][empty].argmax(-1))
        assert sets_full[empty].sum(-1).eq(1).all()
        covered.append(coverage(sets_full, labels[200:]))
        covered_plain.append(coverage(sets, labels[200:]))
    assert empty_seen > 300  # about 4 %: the threshold 1 - p is below 1 - max p of the least confident points
    assert np.mean(covered) > np.mean(covered_plain) >= 1 - alpha - 0.01
    assert "non_empty=True" in repr(full)


def test_seeded_randomisation_is_reproducible() -> None:
    probs, labels = synthetic(800, torch.Generator().manual_seed(11))
    first = posthoc.conformal(probs[:400], labels[:400], score="aps", seed=3)
    again = posthoc.conformal(probs[:400], labels[:400], score="aps", seed=3)
    other = posthoc.conformal(probs[:400], labels[:400], score="aps", seed=4)
    assert float(first.threshold) == float(again.threshold) != float(other.threshold)
    assert torch.equal(first.sets(probs[400:]), again.sets(probs[400:]))


def test_logits_and_probabilities_give_the_same_sets() -> None:
    probs, labels = synthetic(600, torch.Generator().manual_seed(2))
    logits = probs.log() + 3.0
    from_probs = posthoc.conformal(probs[:300], labels[:300], score="raps", seed=0)
    from_logits = posthoc.conformal(logits[:300].float(), labels[:300], score="raps", seed=0)
    assert from_probs.predictive.kind == "probs" and from_logits.predictive.kind == "logits"
    assert float(from_probs.threshold) == pytest.approx(float(from_logits.threshold), abs=1e-6)
    assert (from_probs.sets(probs[300:]) == from_logits.sets(logits[300:].float())).float().mean() > 0.999
    explicit = posthoc.conformal(probs[:300].log(), labels[:300], inputs="logits", score="raps", seed=0)
    assert float(explicit.threshold) == pytest.approx(float(from_probs.threshold), abs=1e-9)


def test_a_wrapped_model_and_its_predict_sets(digits: data.DigitsSplits, digits_model: torch.nn.Module) -> None:
    um = posthoc.wrap(digits_model, method="none").fit()
    cp = posthoc.conformal(um, data.loader(digits.calibration, 200), alpha=0.05, progress=False)
    assert cp.num_calibration == len(digits.calibration) and cp.model is um
    x, y = digits.test.tensors
    pred = cp.predict(x[:300])
    assert pred.sets.dtype == torch.bool and pred.sets.shape == (300, digits.num_classes)
    assert torch.equal(pred.sets, cp.sets(x[:300])) and torch.equal(pred.sets, cp.sets(um.predict(x[:300])))
    # the same threshold from the model's probabilities as arrays
    probs = um.predict(digits.calibration.tensors[0]).probs
    assert float(posthoc.conformal(probs, digits.calibration.tensors[1], alpha=0.05).threshold) == pytest.approx(
        float(cp.threshold), abs=1e-6
    )
    assert coverage(pred.sets, y[:300]) >= 0.9 and mean_set_size(pred.sets) < 1.5
    report = posthoc.evaluate(um, data.loader(digits.test, 500), conformal=cp, progress=False)
    assert report.alpha == 0.05 and 0.9 <= report.coverage <= 1 and report.set_size < 1.5
    assert "| coverage (alpha=0.05) | set size |" in report.to_markdown()
    with pytest.raises(posthoc.InputError, match="labelled calibration loader"):
        posthoc.conformal(um, digits.calibration.tensors[1])


def test_prediction_sets_default_to_none() -> None:
    pred = posthoc.Prediction.from_probs(torch.tensor([[0.2, 0.8]]))
    assert pred.sets is None


@pytest.mark.parametrize("alpha", [0, 1, -0.1, 1.5, "0.1", True, float("nan")])
def test_alpha_outside_the_unit_interval(alpha: object) -> None:
    probs, labels = synthetic(100, torch.Generator().manual_seed(0))
    with pytest.raises(posthoc.ConfigError, match="alpha must be a number strictly between 0 and 1"):
        posthoc.conformal(probs, labels, alpha=alpha)


def test_too_few_calibration_examples() -> None:
    probs, labels = synthetic(100, torch.Generator().manual_seed(0))
    posthoc.conformal(probs[:9], labels[:9], alpha=0.1)  # 9 is enough: rank ceil(10 * 0.9) = 9
    with pytest.raises(posthoc.InputError, match="at alpha=0.1 need at least 9 calibration examples.*got 8"):
        posthoc.conformal(probs[:8], labels[:8], alpha=0.1)
    with pytest.raises(posthoc.InputError, match="every class; too few for class"):
        posthoc.conformal(probs, labels, alpha=0.05, mondrian=True)


def test_bad_inputs_have_clear_errors() -> None:
    probs, labels = synthetic(100, torch.Generator().manual_seed(0))
    cp = posthoc.conformal(probs, labels)
    cases = [
        (lambda: posthoc.conformal(probs, labels, score="naive"), posthoc.ConfigError, "unknown conformity score"),
        (lambda: posthoc.conformal(probs, labels, score="lac", randomized=True), posthoc.ConfigError, "not randomised"),
        (
            lambda: posthoc.conformal(probs, labels, score="aps", lam=0.1),
            posthoc.ConfigError,
            "lam is an option of score='raps' or 'saps'",
        ),
        (lambda: posthoc.conformal(probs, labels, score="raps", k_reg=-1), posthoc.ConfigError, "k_reg must be"),
        (lambda: posthoc.conformal(probs, labels, inputs="softmax"), posthoc.ConfigError, "inputs must be one of"),
        (lambda: posthoc.conformal(probs, labels[:50]), posthoc.InputError, "100 calibration examples but 50 labels"),
        (lambda: posthoc.conformal(probs, np.array(["cat"] * 100)), posthoc.InputError, "integer class indices"),
        (lambda: posthoc.conformal(probs, labels + NUM_CLASSES), posthoc.InputError, r"labels must lie in \[0, 10\)"),
        (lambda: posthoc.conformal(probs[:, :1], labels), posthoc.InputError, "C >= 2"),
        (lambda: posthoc.conformal(torch.full((100, 3), float("nan")), labels), posthoc.InputError, "NaN or inf"),
        (lambda: posthoc.conformal([[0.5, 0.5]], [0]), posthoc.InputError, "must be a tensor, a numpy array"),
        (
            lambda: cp.sets(probs[:, :5] / probs[:, :5].sum(-1, keepdim=True)),
            posthoc.InputError,
            "calibrated on 10 classes",
        ),
        (lambda: cp.sets(probs.log()), posthoc.InputError, "these rows are not probabilities"),
        (lambda: cp.predict(probs), posthoc.ConfigError, "calibrated on a wrapped model"),
        (lambda: posthoc.conformal(probs.log(), labels).sets(probs), posthoc.InputError, "look like probabilities"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
