"""The one selection step (``posthoc.engine.selection``): the bound, the rule, the walk, cross-fitting, and the records."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

import posthoc
import posthoc_apps.demo.zoo
from posthoc.core.likelihood import Categorical
from posthoc.engine.held_out import HeldOut
from posthoc.engine.selection import (
    CONFIDENCE,
    Layout,
    Rows,
    Scores,
    Tolerance,
    cross_fitted,
    excess_bound,
    out_of_fold,
    select,
)
from posthoc.errors import ConfigError


def _scores(excess: float, shifted: float | None = None, n: int = 400, noise: float = 0.01, seed: int = 0) -> Scores:
    generator = torch.Generator().manual_seed(seed)
    clean = 0.1 + excess + noise * torch.randn(n, generator=generator, dtype=torch.float64)
    return Scores(clean, None if shifted is None else torch.full((3 * n,), shifted, dtype=torch.float64))


PLAIN = Scores(torch.full((400,), 0.1, dtype=torch.float64), torch.full((1200,), 2.0, dtype=torch.float64))


def test_the_bound_of_one_stratum_is_the_paired_normal_one_sided_bound() -> None:
    """Without the plain model's mistakes (a regressor), checked against scipy: mean + Φ⁻¹(c) · s / √n of the paired
    differences for the mean, times √2 for the excess on a new sample of the same size."""
    generator = np.random.default_rng(0)
    candidate, plain = generator.gamma(2.0, 0.1, 300), generator.gamma(2.0, 0.1, 300)
    differences = candidate - plain
    spread = stats.norm.ppf(CONFIDENCE) * differences.std(ddof=1) / math.sqrt(len(differences))
    mean, upper = excess_bound(torch.tensor(candidate), torch.tensor(plain))
    assert mean == pytest.approx(differences.mean(), abs=1e-12)
    assert upper == pytest.approx(differences.mean() + math.sqrt(2) * spread, abs=1e-12)
    _, on_mean = excess_bound(torch.tensor(candidate), torch.tensor(plain), new_sample=math.inf)
    assert on_mean == pytest.approx(differences.mean() + spread, abs=1e-12)
    assert excess_bound(torch.tensor([math.inf, 1.0]), torch.tensor([0.0, 0.0])) == (math.inf, math.inf)


def test_the_bound_covers_the_true_excess_as_often_as_it_claims() -> None:
    """Over 2,000 draws of 600 per-example excesses, the bound of the mean lies below the true mean excess in about 5 %
    of draws when they are symmetric (a t distribution; binomial standard error 0.5 %), and less often when they are
    skewed as held-out NLL differences are: most examples a little worse, a few misclassified ones much better."""
    generator = np.random.default_rng(1)
    misses = {"symmetric": 0, "like NLL differences": 0}
    for _ in range(2000):
        symmetric = 0.002 + 0.05 * generator.standard_t(5, 600)
        rare = generator.random(600) < 0.03
        skewed = np.where(rare, -generator.exponential(0.3, 600), generator.exponential(0.012, 600))
        true_skewed = 0.97 * 0.012 - 0.03 * 0.3
        on_mean = {"confidence": 0.95, "new_sample": math.inf}  # its claim is about the true mean
        misses["symmetric"] += excess_bound(torch.tensor(symmetric), torch.zeros(600), **on_mean)[1] < 0.002
        bound = excess_bound(torch.tensor(skewed), torch.zeros(600), mistakes=torch.tensor(rare), **on_mean)[1]
        misses["like NLL differences"] += bound < true_skewed
    assert 0.035 <= misses["symmetric"] / 2000 <= 0.065
    assert misses["like NLL differences"] / 2000 <= 0.05


def test_the_bound_on_new_data_holds_for_a_new_sample_of_the_same_size() -> None:
    """The bound speaks for the excess measured on a new sample as large as the held-out one: over 2,000 pairs of
    samples of 600 drawn from one distribution at its boundary, the new sample's mean exceeds the first one's 95 %
    bound in about 5 % of pairs (binomial standard error 0.5 %)."""
    generator = np.random.default_rng(2)
    misses = 0
    for _ in range(2000):
        held, new = (0.002 + 0.05 * generator.standard_t(5, 600) for _ in range(2))
        misses += excess_bound(torch.tensor(held), torch.zeros(600), 0.95)[1] < new.mean()
    assert 0.035 <= misses / 2000 <= 0.065


@pytest.mark.parametrize("rate", [0.01, 0.03, 0.1])
def test_the_two_strata_bound_holds_for_a_new_sample_where_the_mistakes_carry_the_gain(rate: float) -> None:
    """What a calibrator does to an overconfident model: a small cost on every example the plain model gets right, a
    gain of several nats on each of its few mistakes. Over 1,000 pairs of held-out and new samples of 300 from such a
    population, the new sample's mean excess exceeds the held-out sample's 90 % bound in at most 10 % of pairs (+3
    binomial standard errors), at error rates where a new sample often holds a mistake or two fewer; and the bound is
    below the tolerance of 0.005 nats in most pairs where the mistakes hold a gain of ~0.05 nats per example or more
    (the old capped normal bound admitted it in almost none)."""
    generator = np.random.default_rng(3)

    def sample() -> tuple[np.ndarray, np.ndarray]:
        wrong = generator.random(300) < rate
        return np.where(wrong, -generator.gamma(2.0, 2.5, 300), generator.gamma(2.0, 0.01, 300)), wrong

    misses = admitted = 0
    for _ in range(1000):
        (held, wrong), (new, _) = sample(), sample()
        bound = excess_bound(torch.tensor(held), torch.zeros(300), 0.9, mistakes=torch.tensor(wrong))[1]
        misses += bound < new.mean()
        admitted += bound <= 0.005
    assert misses / 1000 <= 0.1 + 3 * math.sqrt(0.09 / 1000)
    if rate >= 0.03:  # a gain of 5 nats x 3 % - 0.02 = 0.13 nats per example, plainly there
        assert admitted / 1000 >= 0.8


def test_admissible_candidates_compete_on_the_perturbed_copies() -> None:
    candidates = [("a", 1), ("b", 2), ("c", 3)]
    found = select(
        candidates,
        [_scores(0.0, 1.8), _scores(0.002, 1.5), _scores(0.02, 1.0)],
        plain=PLAIN,
        tolerance=0.005,
        knob="scale",
    )
    assert found.value == 2 and [r.admissible for r in found.records] == [True, True, False]
    assert "bound" in found.records[2].reason and found.records[1].chosen and not found.fallback


def test_without_perturbed_copies_the_last_admissible_or_the_lowest_clean_nll_wins() -> None:
    candidates = [("a", 1), ("b", 2), ("c", 3)]
    ladder = [_scores(0.001), _scores(-0.001), _scores(0.003)]
    assert select(candidates, ladder, plain=PLAIN, tolerance=0.005, knob="k").value == 3
    assert select(candidates, ladder, plain=PLAIN, tolerance=0.005, knob="k", rank_without_shift="clean").value == 2


def test_nothing_admissible_keeps_the_most_conservative_candidate_and_says_so() -> None:
    found = select([("a", 1), ("b", 2)], [_scores(0.1, 1.0), _scores(0.2, 0.5)], plain=PLAIN, tolerance=0.005, knob="k")
    assert found.value == 1 and found.fallback and not any(r.admissible for r in found.records)
    with pytest.warns(RuntimeWarning, match="no SWAG k keeps the held-out NLL within"):
        posthoc.engine.selection.warn_fallback(found, method="SWAG", fallback="the SWA mean", advice="Raise tolerance")


def test_the_walk_widens_while_admissible_and_never_steps_over_a_refused_spread() -> None:
    excesses = [0.0, 0.001, 0.02, 0.001, 0.001]  # a wide spread past a costly one looks cheap: it is not taken
    tried = []

    def scores(index: int) -> Scores:
        tried.append(index)
        return _scores(excesses[index])

    candidates = [(str(i), i) for i in range(5)]
    found = select(candidates, scores, plain=PLAIN, tolerance=0.005, knob="k", walk=True)
    assert found.value == 1 and tried == [0, 1, 2]
    assert found.records[4].reason.startswith("not tried")
    tried.clear()
    found = select(candidates, scores, plain=PLAIN, tolerance=0.005, knob="k", walk=True, start=4)
    assert found.value == 4 and tried == [4]  # the top of the ladder admissible: nothing else is tried
    tried.clear()
    excesses[3:] = [0.02, 0.02]
    found = select(candidates, scores, plain=PLAIN, tolerance=0.005, knob="k", walk=True, start=4)
    assert found.value == 2 - 1 and tried == [4, 3, 2, 1]  # from a refused start, narrower until one is admissible
    with pytest.raises(ConfigError, match="outside"):
        select(candidates, scores, plain=PLAIN, tolerance=0.005, knob="k", walk=True, start=5)


def test_tolerance_rule() -> None:
    assert Tolerance().nats(0.1) == 0.005 and Tolerance().nats(1.0) == pytest.approx(0.02)
    assert Tolerance.of(0.01) == Tolerance(relative=0.0, absolute=0.01) and Tolerance.of(None) == Tolerance()
    wide = select(
        [("a", 1), ("b", 2)],
        [_scores(0.0), _scores(5.0)],
        plain=PLAIN,
        tolerance=Tolerance.of(math.inf).nats(0.1),
        knob="k",
    )
    assert wide.value == 2  # no limit: every finite candidate is admissible
    for bad in (-1, "1%", True, float("nan")):
        with pytest.raises(ConfigError, match="tolerance"):
            Tolerance.of(bad)


def test_folds_split_the_examples_and_keep_each_copy_with_its_example() -> None:
    layout = Layout(50, torch.arange(50).repeat(3))
    folds = layout.folds(5)
    assert len(folds) == 5
    scored = torch.cat([rows.clean for _, rows in folds])
    assert sorted(scored.tolist()) == list(range(50))
    for fitting, rows in folds:
        assert set(fitting.clean.tolist()).isdisjoint(rows.clean.tolist())
        assert set(layout.source[rows.shifted].tolist()) == set(rows.clean.tolist())
        assert set(layout.source[fitting.shifted].tolist()) == set(fitting.clean.tolist())
    assert len(Layout(10).folds(5)) == 2 and len(Layout(5).folds(5)) == 1  # at least 4 examples a fold


def test_folds_over_units_keep_each_input_s_examples_together() -> None:
    """The positions of one image (its unit) fall in one fold; the fold count follows the images, not the positions;
    images without a position (a gap in the unit indices) change nothing."""
    units = torch.tensor([0] * 30 + [2] * 7 + [3] * 12 + [5] * 20 + [6] * 9 + [7] * 4 + [8] * 15 + [9] * 3 + [11] * 8)
    units = torch.cat([units, torch.tensor([12] * 5 + [13] * 6)])
    units = units[torch.randperm(len(units), generator=torch.Generator().manual_seed(0))]
    folds = Layout(len(units), units=units).folds(5)
    assert len(folds) == 2  # 11 images, at least 4 a fold
    scored = torch.cat([rows.clean for _, rows in folds])
    assert sorted(scored.tolist()) == list(range(len(units)))
    for fitting, rows in folds:
        assert set(units[fitting.clean].tolist()).isdisjoint(units[rows.clean].tolist())
    assert len(Layout(len(units), units=units % 3).folds(5)) == 1  # 3 images: too few to split


def test_cross_fitting_never_scores_an_example_with_a_fit_it_took_part_in() -> None:
    """A candidate that memorises its fitting examples (NLL 0 on them, 1 elsewhere) scores 1 everywhere out of fold."""
    layout = Layout(40, torch.arange(40).repeat(2))

    def memorising(fitting: Rows, scored: Rows) -> list[Scores]:
        seen = set(fitting.clean.tolist())
        clean = torch.tensor([0.0 if int(i) in seen else 1.0 for i in scored.clean])
        shifted = torch.tensor([0.0 if int(layout.source[j]) in seen else 1.0 for j in scored.shifted])
        return [Scores(clean, shifted)]

    [out] = cross_fitted(memorising, layout)
    assert torch.equal(out.clean, torch.ones(40, dtype=torch.float64)) and torch.equal(
        out.shifted, torch.ones(80, dtype=torch.float64)
    )


def test_out_of_fold_re_makes_the_choice_on_the_other_folds() -> None:
    """A knob whose second value costs more in one half of the examples: the choice made on the other folds is scored
    on each fold, example by example."""
    n = 100
    layout = Layout(n, torch.arange(n).repeat(3))
    plain = Scores(torch.zeros(n, dtype=torch.float64), torch.ones(3 * n, dtype=torch.float64))
    cheap = Scores(torch.zeros(n, dtype=torch.float64), torch.full((3 * n,), 0.9, dtype=torch.float64))
    wide = Scores(torch.where(torch.arange(n) < 50, 0.0, 0.02).double(), torch.full((3 * n,), 0.5, dtype=torch.float64))
    selection = select([("cheap", 0), ("wide", 1)], [cheap, wide], plain=plain, tolerance=0.015, knob="k")
    assert selection.value == 1  # mean excess 0.01, bound just within
    judged = out_of_fold(selection, plain, layout)
    for fitting, scored in layout.folds():
        again = select(
            [("cheap", 0), ("wide", 1)],
            [cheap.take(fitting), wide.take(fitting)],
            plain=plain.take(fitting),
            tolerance=0.015,
            knob="k",
        )
        assert torch.equal(judged.clean[scored.clean], [cheap, wide][again.value].take(scored).clean)


def test_a_held_out_subset_keeps_the_copies_and_the_plain_scores_of_its_examples(digits) -> None:
    model = posthoc_apps.demo.zoo.pretrained("digits_bn_cnn")
    x, y = digits.calibration.tensors
    held = HeldOut.read(
        [(x[:256], y[:256]), (x[256:400], y[256:400])],
        model=model,
        likelihood=Categorical(),
        shift="auto",
        device="cpu",
    )
    rows = torch.randperm(400, generator=torch.Generator().manual_seed(0))[:150]
    part = held.subset(rows)
    again = part.scores(lambda inputs, generator: model(inputs).log_softmax(-1))
    torch.testing.assert_close(again.clean, part.plain.clean, rtol=0, atol=1e-6)
    torch.testing.assert_close(again.shifted, part.plain.shifted, rtol=0, atol=1e-6)
    torch.testing.assert_close(part.plain.clean, held.plain.clean[rows], rtol=0, atol=0)
    assert part.layout.count == 150 and len(part.layout.source) == 450 and part.description == held.description
