"""The shift harness on the bundled digits: posthoc.evaluate_shift for a few methods, and what corrupting costs.

1. Corruption overhead: for every kind at severity 3, one pass of the plain model over the 1000 test digits
   corrupted on the fly (``posthoc.shift.corrupt``), as a ratio to the same pass without corruption.
2. The bootstrap of ``evaluate(ci=0.95, bootstraps=1000)`` (every metric), as a ratio to the same plain pass.
3. ``evaluate_shift`` table (NLL / ECE, mean over kinds, 95% intervals) for MAP, temperature, Laplace and
   MC dropout fitted as in the quality protocol.

Run: ``python benchmarks/bench_shift.py [--kinds gaussian-noise,contrast,rotate] [--severities 1,3,5]``.
"""

from __future__ import annotations

import argparse

import torch
from timing import HEADER, measure, row

import posthoc
from posthoc.engine.predictions import collect
from posthoc.evaluation import bootstrap
from posthoc_apps.demo import data, zoo

NORMALIZATION = (data.MEAN, data.STD)


def overhead(model: torch.nn.Module, test_loader) -> None:
    print("### Corruption overhead (plain forward over 1000 corrupted test digits, severity 3)\n")
    print(HEADER)
    with torch.no_grad():
        plain = measure(lambda: [model(x) for x, _ in test_loader])
        print(row("plain forward", plain, plain))
        for kind in posthoc.shift.KINDS:
            corrupted = posthoc.shift.corrupt(test_loader, kind, 3, normalization=NORMALIZATION)
            print(row(f"{kind} + forward", measure(lambda: [model(x) for x, _ in corrupted]), plain))
        um = posthoc.wrap(model, method="none")
        predicted = collect(um, test_loader, progress=False)

        def intervals() -> object:
            return bootstrap.report_intervals(predicted["probs"], predicted["labels"], ci=0.95, bootstraps=1000)

        print(row("bootstrap of every metric (1000 resamples)", measure(intervals, repeats=3), plain))
    print()


def table(model: torch.nn.Module, splits: data.DigitsSplits, kinds: list[str], severities: list[int]) -> None:
    fit, calibration = data.loader(splits.fit, 64, shuffle=True), data.loader(splits.calibration)
    methods = {}
    for method in ("none", "temperature", "laplace", "mc-dropout"):
        torch.manual_seed(0)
        methods[method] = posthoc.wrap(model, method=method).fit(fit, calibration, progress=False)
    result = posthoc.evaluate_shift(
        methods,
        data.loader(splits.test, 500),
        kinds=kinds,
        severities=severities,
        normalization=NORMALIZATION,
        ci=0.95,
        progress=False,
    )
    print(f"### evaluate_shift on the digits (kinds {', '.join(kinds)})\n")
    print(result.to_markdown())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="gaussian-noise,contrast,gaussian-blur,rotate")
    parser.add_argument("--severities", default="1,3,5")
    args = parser.parse_args()
    splits, model = data.load_digits(), zoo.pretrained()
    overhead(model, data.loader(splits.test, 500))
    table(model, splits, args.kinds.split(","), [int(s) for s in args.severities.split(",")])


if __name__ == "__main__":
    main()
