"""Conformal sets and selective prediction on the bundled digits CNN's logits, against MAPIE.

The plain model's probabilities on the calibration split (600 digits) calibrate; the test split
(1,000 digits) measures, upright and rotated (a shift under which nothing is guaranteed). Prints

1. coverage and mean set size of LAC / APS / RAPS / SAPS at alpha 0.05 and 0.1 per rotation, and MAPIE's
   LAC / APS on the same probabilities (where installed);
2. coverage, set size and class-conditional coverage gap over 200 random calibration/test re-splits of the
   1,600 upright digits (mean in the band [1 - alpha, 1 - alpha + 1/(n + 1)] expected);
3. many classes: marginal, class-conditional and clustered sets on a synthetic 100-class problem with 10-50
   calibration examples per class (coverage, CovGap, set size over 20 draws), and TorchCP's clustered predictor;
4. covariate shift: sets weighted by the likelihood ratio of rotated to upright digits (estimated on the CNN's
   features from half the rotated test digits, unlabelled) against unweighted sets, on the other half;
5. Learn then Test: FNR <= 0.2 and set size <= 0.4 of six labels, delta 0.1, over 300 calibration draws of a
   synthetic multi-label population: how often a risk is exceeded, against the plug-in threshold;
6. selective prediction at target risk 0.01 and 0.02 (delta 0.05): calibration coverage, test
   deferral and error on the accepted test digits, per rotation;
7. timings (one thread): calibrating and predicting sets / masks, against one plain forward pass
   over the test split.

Run: ``python benchmarks/bench_guarantees.py [--model digits_cnn|digits_bn_cnn]``.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from timing import HEADER, measure, row

import posthoc
from posthoc.guarantees import RiskNotReachableError
from posthoc.guarantees.learn_then_test import DEFAULT_THRESHOLDS, example_losses
from posthoc.guarantees.measures import class_coverage_gap, coverage, deferral_rate, mean_set_size, selective_risk
from posthoc_apps.demo import data, zoo

ROTATIONS = (0, 15, 30, 45, 90)
ALPHAS = (0.05, 0.1)
SCORES = ("lac", "aps", "raps", "saps")
TARGET_RISKS = (0.01, 0.02)
RESPLITS = 200


def mapie_sets(cal_probs: np.ndarray, cal_labels: np.ndarray, alpha: float, score: str):
    """A function ``probs -> sets`` from MAPIE's split conformal classifier on given probabilities, or ``None``."""
    try:
        from mapie.classification import SplitConformalClassifier
        from sklearn.base import BaseEstimator, ClassifierMixin
    except ImportError:
        return None

    class GivenProbabilities(ClassifierMixin, BaseEstimator):
        def fit(self, x, y):
            self.classes_ = np.arange(x.shape[1])
            return self

        def predict_proba(self, x):
            return np.asarray(x, dtype=np.float64)

        def predict(self, x):
            return np.asarray(x).argmax(1)

    classifier = SplitConformalClassifier(
        GivenProbabilities().fit(cal_probs, cal_labels),
        confidence_level=1 - alpha,
        conformity_score=score,
        prefit=True,
        random_state=0,
    )
    classifier.conformalize(cal_probs, cal_labels)
    return lambda probs: torch.as_tensor(classifier.predict_set(probs)[1][:, :, 0])


def conformal_table(
    cal: tuple[torch.Tensor, torch.Tensor], tests: dict[int, tuple[torch.Tensor, torch.Tensor]]
) -> None:
    print("## Conformal sets: coverage / mean set size per rotation (calibrated on 600 upright digits)\n")
    print("| alpha | score | " + " | ".join(f"{deg} deg" for deg in tests) + " |")
    print("|---|---|" + "---|" * len(tests))
    for alpha in ALPHAS:
        for score in SCORES:
            cp = posthoc.conformal(*cal, alpha=alpha, score=score, seed=0)
            cells = [f"{coverage(cp.sets(p), y):.3f} / {mean_set_size(cp.sets(p)):.2f}" for p, y in tests.values()]
            print(f"| {alpha} | posthoc {cp.score.describe()} | " + " | ".join(cells) + " |")
        for score in ("lac", "aps"):
            sets = mapie_sets(cal[0].numpy(), cal[1].numpy(), alpha, score)
            if sets is None:
                print("| – | MAPIE not installed (pip install -e '.[test]') |")
                break
            cells = [
                f"{coverage(sets(p.numpy()), y):.3f} / {mean_set_size(sets(p.numpy())):.2f}" for p, y in tests.values()
            ]
            print(f"| {alpha} | MAPIE {score} | " + " | ".join(cells) + " |")


def resplit_table(probs: torch.Tensor, labels: torch.Tensor, n_cal: int) -> None:
    print(
        f"\n## Coverage over {RESPLITS} random re-splits ({n_cal} calibration / {len(labels) - n_cal} test, upright)\n"
    )
    print("| alpha | score | mean coverage | std | band | mean set size | CovGap |\n|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for alpha in ALPHAS:
        for score in SCORES:
            covered, sizes, gaps = [], [], []
            for split in range(RESPLITS):
                order = torch.randperm(len(labels), generator=generator)
                cal, test = order[:n_cal], order[n_cal:]
                sets = posthoc.conformal(probs[cal], labels[cal], alpha=alpha, score=score, seed=split).sets(
                    probs[test]
                )
                covered.append(coverage(sets, labels[test]))
                sizes.append(mean_set_size(sets))
                gaps.append(class_coverage_gap(sets, labels[test], alpha))
            band = f"[{1 - alpha:.3f}, {1 - alpha + 1 / (n_cal + 1):.3f}]"
            print(
                f"| {alpha} | {score} | {np.mean(covered):.4f} | {np.std(covered):.4f} | {band} | {np.mean(sizes):.2f} "
                f"| {np.mean(gaps):.4f} |"
            )


def many_classes_table(draws: int = 20, alpha: float = 0.1) -> None:
    """Marginal, class-conditional and clustered sets on 100 classes, half easy and half hard, 10-50 examples each."""
    print(f"\n## Many classes: 100 synthetic classes, 10-50 calibration examples each, alpha {alpha}, {draws} draws\n")
    print("| sets (LAC unless named) | coverage | CovGap | mean set size |\n|---|---|---|---|")
    classes, generator = 100, torch.Generator().manual_seed(0)
    boost = torch.tensor([3.0, 1.0], dtype=torch.float64).repeat(classes // 2)

    def draw(labels: torch.Tensor) -> torch.Tensor:
        logits = torch.randn(len(labels), classes, generator=generator, dtype=torch.float64)
        return logits.scatter_add(1, labels[:, None], boost[labels][:, None])

    test_labels = torch.arange(classes).repeat(100)
    results: dict[str, list[dict[str, float]]] = {"marginal": [], "class": [], "cluster": [], "TorchCP cluster": []}
    results.update({f"marginal {score}": [] for score in SCORES[1:]})
    for seed in range(draws):
        labels = torch.repeat_interleave(torch.arange(classes), torch.randint(10, 51, (classes,), generator=generator))
        logits, test_probs = draw(labels), draw(test_labels).softmax(-1)
        test = posthoc.Prediction.from_probs(test_probs)
        for condition in ("marginal", "class", "cluster"):
            cp = posthoc.conformal(logits, labels, alpha=alpha, condition=condition, seed=seed)
            results[condition].append(cp.coverage(test, test_labels))
        for score in SCORES[1:]:
            cp = posthoc.conformal(logits, labels, alpha=alpha, score=score, seed=seed)
            results[f"marginal {score}"].append(cp.coverage(test, test_labels))
        sets = torchcp_clustered_sets(logits, labels, test_probs.log(), alpha, seed)
        if sets is not None:
            results["TorchCP cluster"].append(
                {
                    "coverage": coverage(sets, test_labels),
                    "class_coverage_gap": class_coverage_gap(sets, test_labels, alpha),
                    "set_size": mean_set_size(sets),
                }
            )
    for name, rows in results.items():
        if rows:
            mean = {key: np.mean([r[key] for r in rows]) for key in rows[0]}
            print(f"| {name} | {mean['coverage']:.4f} | {mean['class_coverage_gap']:.4f} | {mean['set_size']:.2f} |")


def torchcp_clustered_sets(logits, labels, test_logits, alpha: float, seed: int):
    """TorchCP's clustered LAC sets (its defaults: an infinite threshold for its null cluster), or ``None``."""
    try:
        import warnings

        from torchcp.classification.predictor import ClusteredPredictor
        from torchcp.classification.score import LAC
    except ImportError:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        predictor = ClusteredPredictor(LAC(), alpha=alpha)
        torch.manual_seed(seed)
        predictor.calculate_threshold(logits.float(), labels)
        return predictor.predict_with_logits(test_logits.float()).bool()


def shift_table(model: torch.nn.Module, splits, alpha: float = 0.1) -> None:
    """Weighted against unweighted sets on rotated digits: half the rotated test digits (unlabelled) estimate the
    likelihood ratio on the CNN's features, the other half measure."""
    print(f"\n## Covariate shift: weighted sets on rotated digits (alpha {alpha}; calibrated on 600 upright digits)\n")
    print(
        "| rotation | unweighted coverage / size | weighted coverage / size | effective sample size | clipped |\n"
        "|---|---|---|---|---|"
    )
    um = posthoc.wrap(model, method="none").fit()
    cal_loader = data.loader(splits.calibration, 300)
    plain = posthoc.conformal(um, cal_loader, alpha=alpha, progress=False)
    for degrees in ROTATIONS:
        x, y = data.rotated(splits.test, degrees).tensors
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(degrees))
        deploy, measured = order[: len(y) // 2], order[len(y) // 2 :]
        cp = posthoc.conformal(um, cal_loader, alpha=alpha, shift_loader=[(x[deploy],)], progress=False)
        weighted, unweighted = cp.sets(x[measured]), plain.sets(x[measured])
        print(
            f"| {degrees} deg | {coverage(unweighted, y[measured]):.3f} / {mean_set_size(unweighted):.2f} | "
            f"{coverage(weighted, y[measured]):.3f} / {mean_set_size(weighted):.2f} | "
            f"{cp.effective_sample_size:.1f} of {cp.num_calibration} | {cp.clipped} |"
        )


def learn_then_test_table(draws: int = 300, alphas=(0.2, 0.4), delta: float = 0.1) -> None:
    """Learn then Test on a synthetic multi-label population: the share of draws whose kept threshold exceeds a risk."""
    print(
        f"\n## Learn then Test: FNR <= {alphas[0]} and size <= {alphas[1]} (6 labels), delta {delta}, {draws} draws "
        "of 1,000 calibration examples\n"
    )
    generator = torch.Generator().manual_seed(0)
    targets = torch.rand(100_000, 6, generator=generator) < 0.25
    probs = torch.sigmoid(1.5 * (2 * targets.double() - 1) + 1.5 * torch.randn(100_000, 6, generator=generator))
    grid = torch.tensor(DEFAULT_THRESHOLDS, dtype=torch.float64)
    masks, valid = probs[None] >= grid[:, None, None], torch.ones_like(targets)
    true = torch.stack([example_losses(name, masks, targets, valid).mean(1) for name in ("fnr", "size")]).numpy()
    rows = {"posthoc ltt": [], "plug-in (calibration risks <= levels)": []}
    for _ in range(draws):
        cal = torch.randint(len(targets), (1000,), generator=generator)
        rc = posthoc.risk_control(probs[cal], targets[cal].long(), alpha=alphas, loss=["fnr", "size"], method="ltt")
        ok = np.flatnonzero((rc.empirical[0] <= alphas[0]) & (rc.empirical[1] <= alphas[1]))
        for name, k in (
            ("posthoc ltt", DEFAULT_THRESHOLDS.index(rc.threshold)),
            (list(rows)[1], ok[rc.empirical[0][ok].argmin()]),
        ):
            rows[name].append((true[0, k] > alphas[0] or true[1, k] > alphas[1], true[0, k], true[1, k], grid[k]))
    print("| threshold rule | draws with a risk exceeded | mean true FNR | mean true size | mean threshold |")
    print("|---|---|---|---|---|")
    for name, values in rows.items():
        failed, fnr, size, threshold = (np.mean([float(v[i]) for v in values]) for i in range(4))
        print(f"| {name} | {failed:.3f} (delta {delta}) | {fnr:.4f} | {size:.4f} | {threshold:.3f} |")


def selective_table(
    cal: tuple[torch.Tensor, torch.Tensor], tests: dict[int, tuple[torch.Tensor, torch.Tensor]]
) -> None:
    print("\n## Selective prediction (delta 0.05): deferral / error on accepted per rotation\n")
    print(
        "| target risk | score | threshold | cal. coverage | risk bound | "
        + " | ".join(f"{deg} deg" for deg in tests)
        + " |"
    )
    print("|---|---|---|---|---|" + "---|" * len(tests))
    for target in TARGET_RISKS:
        for score in ("confidence", "entropy"):
            try:
                sel = posthoc.selective(*cal, target_risk=target, delta=0.05, score=score)
            except RiskNotReachableError as err:
                print(f"| {target} | {score} | unreachable: {err} |")
                continue
            cells = []
            for p, y in tests.values():
                accepted = sel.accept(p)
                risk = selective_risk(accepted, p.argmax(-1) == y)
                cells.append(f"{deferral_rate(accepted):.3f} / {'–' if risk is None else f'{risk:.4f}'}")
            print(
                f"| {target} | {score} | {sel.threshold:.4g} | {sel.coverage:.3f} | {sel.risk_bound:.4f} | "
                + " | ".join(cells)
                + " |"
            )


def timing_table(
    model: torch.nn.Module, x_test: torch.Tensor, cal: tuple[torch.Tensor, torch.Tensor], test_probs: torch.Tensor
) -> None:
    print("\n## Timings (1,000 test digits; ratios to one plain forward pass over them)\n" + HEADER)
    with torch.no_grad():
        plain = measure(lambda: model(x_test))
    print(row("plain forward (test split)", plain, plain))
    for score in SCORES:
        print(
            row(f"posthoc.conformal {score}: calibrate", measure(lambda: posthoc.conformal(*cal, score=score)), plain)
        )
        cp = posthoc.conformal(*cal, score=score)
        print(row(f"posthoc.conformal {score}: sets", measure(lambda: cp.sets(test_probs)), plain))
    for score in ("lac", "aps"):
        if mapie_sets(cal[0].numpy(), cal[1].numpy(), 0.1, score) is None:
            break
        print(
            row(
                f"MAPIE {score}: calibrate",
                measure(lambda: mapie_sets(cal[0].numpy(), cal[1].numpy(), 0.1, score)),
                plain,
            )
        )
        sets = mapie_sets(cal[0].numpy(), cal[1].numpy(), 0.1, score)
        print(row(f"MAPIE {score}: sets", measure(lambda: sets(test_probs.numpy())), plain))
    print(row("posthoc.selective: calibrate", measure(lambda: posthoc.selective(*cal, target_risk=0.02)), plain))
    sel = posthoc.selective(*cal, target_risk=0.02)
    print(row("posthoc.selective: accept", measure(lambda: sel.accept(test_probs)), plain))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="digits_cnn", choices=("digits_cnn", "digits_bn_cnn"))
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny tensors (and MAPIE runs in one numpy thread): compare like with like
    splits = data.load_digits()
    model = zoo.pretrained(args.model)
    with torch.no_grad():
        cal = (model(splits.calibration.tensors[0]).double().softmax(-1), splits.calibration.tensors[1])
        tests = {
            deg: (model(data.rotated(splits.test, deg).tensors[0]).double().softmax(-1), splits.test.tensors[1])
            for deg in ROTATIONS
        }
    print(
        f"# Guarantees on {args.model} (accuracy upright {float((tests[0][0].argmax(-1) == tests[0][1]).double().mean()):.3f})\n"
    )
    conformal_table(cal, tests)
    resplit_table(torch.cat([cal[0], tests[0][0]]), torch.cat([cal[1], tests[0][1]]), n_cal=len(cal[1]))
    many_classes_table()
    shift_table(model, splits)
    learn_then_test_table()
    selective_table(cal, tests)
    timing_table(model, splits.test.tensors[0], cal, tests[0][0])


if __name__ == "__main__":
    main()
