"""``posthoc.calibrate(method="auto")`` on nearly separable held-out sets, against no calibration and temperature.

For each bundled checkpoint, the calibration and test digits are pooled; each of ``--halvings`` random draws takes
``--errors`` misclassified and ``792 - errors`` correctly classified digits and halves them: the calibrator is fitted
on one half (396 examples, 0 to ``errors`` of them wrong) and tested on the other. Prints, per checkpoint, the test
NLL of ``auto`` and of ``temperature`` relative to no calibration (mean and worst over the halvings) and what
``auto`` chose. ``tests/methods/calibration/test_calibrators.py`` runs 20 halvings with a tolerance.

Run: ``python benchmarks/bench_auto_calibration.py [--halvings 40] [--errors 5]``.
"""

from __future__ import annotations

import argparse
import collections
import warnings

import numpy as np
import torch

import posthoc
from posthoc.evaluation import metrics
from posthoc_apps.demo import data, zoo


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--halvings", type=int, default=40)
    parser.add_argument("--errors", type=int, default=5)
    args = parser.parse_args(argv)
    splits = data.load_digits()
    x = torch.cat([splits.calibration.tensors[0], splits.test.tensors[0]])
    y = torch.cat([splits.calibration.tensors[1], splits.test.tensors[1]])
    for name in ("digits_cnn", "digits_bn_cnn"):
        with torch.no_grad():
            logits = zoo.pretrained(name)(x)
        wrong = (logits.argmax(-1) != y).nonzero().flatten()
        right = (logits.argmax(-1) == y).nonzero().flatten()
        ratios: dict[str, list[float]] = collections.defaultdict(list)
        chosen: collections.Counter = collections.Counter()
        for seed in range(args.halvings):
            generator = torch.Generator().manual_seed(seed)
            pick = torch.cat(
                [
                    wrong[torch.randperm(len(wrong), generator=generator)[: args.errors]],
                    right[torch.randperm(len(right), generator=generator)[: 792 - args.errors]],
                ]
            )
            pick = pick[torch.randperm(len(pick), generator=generator)]
            fit, test = pick[:396], pick[396:]
            plain = metrics.nll(logits[test].softmax(-1), y[test])
            for method in ("auto", "temperature"):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    calibrator = (
                        posthoc.calibrate(logits[fit], y[fit], method=method, seed=seed)
                        if method == "auto"
                        else posthoc.calibrate(logits[fit], y[fit], method=method)
                    )
                ratios[method].append(metrics.nll(calibrator(logits[test]), y[test]) / plain)
                if method == "auto":
                    chosen[calibrator.chosen_name] += 1
        summary = "; ".join(
            f"{method} / none: mean {np.mean(v):.3f}, worst {np.max(v):.3f}" for method, v in ratios.items()
        )
        print(
            f"{name} ({len(wrong)} errors among {len(y)} digits, {args.halvings} halvings): {summary}; "
            f"auto chose {dict(chosen)}"
        )


if __name__ == "__main__":
    main()
