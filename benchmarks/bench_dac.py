"""``"dac"`` (density-aware calibration) on both bundled digits checkpoints: predict cost, bank memory, quality.

Cost: ``um.predict`` on the 1000 test digits as a ratio to the plain forward ``model(x)`` over the same
batch, for ``["none"]``, ``["temperature"]``, ``["none", "dac"]`` and ``["laplace", "dac"]``; medians of
repeats in one process, process CPU time beside wall time (``timing.py``). With ``--threads 1`` (the
default) the CPU ratio is the one to read on a shared machine.

Quality: test NLL and ECE (15 bins) in distribution, under rotation by 45 degrees (severity 3) and under
contrast severity 3 (``posthoc.shift.corrupt``; neither is a fit-time perturbation), for the plain model,
``["none", "dac"]``, ``["laplace"]`` and ``["laplace", "dac"]``, each fitted with ``shift="auto"`` (the
default) on the fit and calibration splits; plus the fitted ``T0``, layer weights, bank rows and bytes.

Run: ``python benchmarks/bench_dac.py [--threads 1] [--repeats 9]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import Timing, measure  # noqa: E402

import posthoc  # noqa: E402
from posthoc import shift  # noqa: E402
from posthoc.evaluation import metrics  # noqa: E402
from posthoc_apps.demo import data, zoo  # noqa: E402

ARCHITECTURES = ("digits_cnn", "digits_bn_cnn")
CONFIGS = (["none"], ["none", "dac"], ["laplace"], ["laplace", "dac"])
TIMED = (["none"], ["temperature"], ["none", "dac"], ["laplace", "dac"])
SHIFTS = (("rotate 45", "rotate", 3), ("contrast 3", "contrast", 3))
HEADER = "| what | wall s (median) | wall ratio | CPU s (median) | CPU ratio | cpu/wall |\n|---|---|---|---|---|---|"


def row(name: str, timing: Timing, reference: Timing) -> str:
    flag = " (contended: re-run)" if timing.contended else ""
    return (
        f"| {name} | {timing.wall:.4f} | {timing.wall / reference.wall:.2f}x | {timing.cpu:.4f} | "
        f"{timing.cpu / reference.cpu:.2f}x | {timing.cpu_per_wall:.2f}{flag} |"
    )


def corrupted(test_loader, kind: str, severity: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*shift.corrupt(test_loader, kind, severity, normalization=(data.MEAN, data.STD)))
    return torch.cat(xs), torch.cat(ys)


def costs(name: str, splits: data.DigitsSplits, fit_loader, cal_loader, repeats: int) -> None:
    model = zoo.pretrained(name)
    x = splits.test.tensors[0]
    wrapped = {"+".join(c): posthoc.wrap(model, method=c).fit(fit_loader, cal_loader, progress=False) for c in TIMED}
    with torch.no_grad():
        plain = measure(lambda: model(x), repeats=repeats)
        timings = {key: measure(lambda um=um: um.predict(x), repeats=repeats) for key, um in wrapped.items()}
        plain_after = measure(lambda: model(x), repeats=repeats)
    print(f"\n### {name}: predict on the {len(x)} test digits against one plain forward `model(x)`\n\n{HEADER}")
    print(row("plain forward model(x)", plain, plain))
    for key, timing in timings.items():
        print(row(f"predict {key}", timing, plain))
    print(row("plain forward again (drift check)", plain_after, plain))
    for key in ("none+dac", "laplace+dac"):
        card = wrapped[key].summary()["posterior"][-1]
        print(
            f"\n{key}: bank {card['bank_rows']} rows x {sum(_widths(wrapped[key]))} floats = {card['bank_bytes']:,} bytes "
            f"({card['bank_bytes'] / 2**20:.2f} MiB), layers {card['layers']}"
        )


def _widths(um: posthoc.UncertainModel) -> list[int]:
    return [int(w) for w in um.method.widths]


def quality(name: str, splits: data.DigitsSplits, fit_loader, cal_loader, test_loader) -> None:
    model = zoo.pretrained(name)
    sets = {
        "in distribution": splits.test.tensors,
        **{label: corrupted(test_loader, kind, severity) for label, kind, severity in SHIFTS},
    }
    print(f"\n### {name}: NLL / ECE (fit with shift='auto')\n")
    print("| method | " + " | ".join(f"{label} NLL | {label} ECE" for label in sets) + " | fit s | T0 | weights |")
    print("|---|" + "---|" * (2 * len(sets) + 3))
    for config in CONFIGS:
        start = time.perf_counter()
        um = posthoc.wrap(model, method=config).fit(fit_loader, cal_loader, progress=False)
        seconds = time.perf_counter() - start
        cells = []
        for x, y in sets.values():
            probs = um.predict(x).probs
            cells += [f"{metrics.nll(probs, y):.3f}", f"{metrics.ece(probs, y):.3f}"]
        card = um.summary()["posterior"][-1]
        t0 = f"{card['temperature']:.3f}" if "dac" in config else ""
        weights = ", ".join(f"{w:.3f}" for w in card["weights"]) if "dac" in config else ""
        print(f"| {'+'.join(config)} | " + " | ".join(cells) + f" | {seconds:.1f} | {t0} | {weights} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: CPU ratios comparable on a shared machine)"
    )
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"command: python benchmarks/bench_dac.py --threads {args.threads} --repeats {args.repeats}")
    splits = data.load_digits()
    fit_loader, cal_loader = data.loader(splits.fit, batch_size=256), data.loader(splits.calibration, batch_size=256)
    test_loader = data.loader(splits.test, batch_size=256)
    for name in ARCHITECTURES:
        costs(name, splits, fit_loader, cal_loader, args.repeats)
    for name in ARCHITECTURES:
        quality(name, splits, fit_loader, cal_loader, test_loader)


if __name__ == "__main__":
    main()
