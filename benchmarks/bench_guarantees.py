"""Conformal sets and selective prediction on the bundled digits CNN's logits, against MAPIE.

The plain model's probabilities on the calibration split (600 digits) calibrate; the test split
(1,000 digits) measures, upright and rotated (a shift under which nothing is guaranteed). Prints

1. coverage and mean set size of LAC / APS / RAPS at alpha 0.05 and 0.1 per rotation, and MAPIE's
   LAC / APS on the same probabilities (where installed);
2. coverage over 200 random calibration/test re-splits of the 1,600 upright digits (mean in the
   band [1 - alpha, 1 - alpha + 1/(n + 1)] expected);
3. selective prediction at target risk 0.01 and 0.02 (delta 0.05): calibration coverage, test
   deferral and error on the accepted test digits, per rotation;
4. timings (one thread): calibrating and predicting sets / masks, against one plain forward pass
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
from posthoc.guarantees.measures import coverage, deferral_rate, mean_set_size, selective_risk
from posthoc_apps.demo import data, zoo

ROTATIONS = (0, 15, 30, 45, 90)
ALPHAS = (0.05, 0.1)
SCORES = ("lac", "aps", "raps")
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
    print("| alpha | score | mean coverage | std | band | mean set size |\n|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for alpha in ALPHAS:
        for score in SCORES:
            covered, sizes = [], []
            for split in range(RESPLITS):
                order = torch.randperm(len(labels), generator=generator)
                cal, test = order[:n_cal], order[n_cal:]
                sets = posthoc.conformal(probs[cal], labels[cal], alpha=alpha, score=score, seed=split).sets(
                    probs[test]
                )
                covered.append(coverage(sets, labels[test]))
                sizes.append(mean_set_size(sets))
            band = f"[{1 - alpha:.3f}, {1 - alpha + 1 / (n_cal + 1):.3f}]"
            print(
                f"| {alpha} | {score} | {np.mean(covered):.4f} | {np.std(covered):.4f} | {band} | {np.mean(sizes):.2f} |"
            )


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
    selective_table(cal, tests)
    timing_table(model, splits.test.tensors[0], cal, tests[0][0])


if __name__ == "__main__":
    main()
