"""SGLD and IVON: fit and predict cost as ratios to a plain forward pass, and quality on the bundled digits.

Cost (``--part cost``), on the bundled checkpoints, back to back in one process: a plain forward
pass over the 1,000 test digits, then ``um.predict`` over them (medians of ``--repeats``, wall and
process CPU beside it, see ``benchmarks/timing.py``), and ``um.fit`` on the 2,400 fit digits (one
run each, as a ratio to a plain forward pass over the fit digits) for every configuration of
:data:`CONFIGS`.

Quality (``--part quality``), issue 15's protocol: ``um.fit(loader(fit, 64, shuffle=True),
loader(calibration))`` then NLL / ECE at 0, 45 and 90 degrees (``posthoc.evaluate``) against the
plain model on the same checkpoint, for each configuration, on both bundled models; the verdict
column says whether in-distribution NLL <= 1.02x plain and NLL at 45 and 90 degrees < plain.

Run: ``python benchmarks/bench_sgld_ivon.py [--part cost quality] [--archs digits_cnn digits_bn_cnn]
[--configs sgld ivon ...] [--repeats 3] [--threads 1]``
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import Timing, measure  # noqa: E402

import posthoc  # noqa: E402
from posthoc_apps.demo import data, zoo  # noqa: E402

#: label -> (wrap options, fit options); the first of each method is its default
CONFIGS = {
    "sgld": ("sgld", {}, {}),
    "sgld cyclical (4 cycles, 4 epochs)": ("sgld", {"cycles": 4}, {"epochs": 4}),
    "sgld head": ("sgld", {"layers": "head"}, {}),
    "sgld head cyclical (4 cycles, 10 epochs)": ("sgld", {"layers": "head", "cycles": 4}, {"epochs": 10}),
    "ivon": ("ivon", {}, {}),
    "ivon head": ("ivon", {"layers": "head"}, {}),
    "ivon hess_init=1 (ivon-opt's default)": ("ivon", {}, {"hess_init": 1.0}),
}
ROTATIONS = (0, 45, 90)
HEADER = "| what | wall s (median) | wall ratio to plain forward | CPU ratio | cpu/wall |\n|---|---|---|---|---|"
SHIFTED = (45, 90)
SLACK = 1.02


def _fitted(model: torch.nn.Module, label: str, splits: data.DigitsSplits) -> tuple[posthoc.UncertainModel, float]:
    method, options, fit_options = CONFIGS[label]
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        um = posthoc.wrap(model, method=method, **options).fit(
            data.loader(splits.fit, 64, shuffle=True, seed=0),
            data.loader(splits.calibration, 256),
            progress=False,
            **fit_options,
        )
    return um, time.perf_counter() - start


def row(name: str, timing: Timing, reference: Timing) -> str:
    """A Markdown row: the wall ratio and, beside it, the process-CPU ratio (steadier on a shared machine)."""
    flag = " (contended)" if timing.contended else ""
    return (
        f"| {name} | {timing.wall:.4f} | {timing.wall / reference.wall:.2f}x | {timing.cpu / reference.cpu:.2f}x | "
        f"{timing.cpu_per_wall:.2f}{flag} |"
    )


def cost(archs: list[str], labels: list[str], repeats: int) -> None:
    splits = data.load_digits()
    x_test, x_fit = splits.test.tensors[0], splits.fit.tensors[0]
    for arch in archs:
        model = zoo.pretrained(arch)
        with torch.no_grad():
            plain = measure(lambda: model(x_test), repeats=repeats)
            plain_fit = measure(lambda: model(x_fit), repeats=repeats)
        print(f"\n### {arch}: predict over 1,000 test digits (plain forward {plain.wall * 1e3:.1f} ms)\n\n{HEADER}")
        print(row("plain forward", plain, plain))
        fits = []
        for label in labels:
            um, _ = _fitted(model, label, splits)
            print(row(f"{label}: predict", measure(lambda: um.predict(x_test), repeats=repeats), plain))
            fit = measure(lambda: _fitted(model, label, splits), repeats=1, warmup=0)
            fits.append(row(f"{label}: fit", fit, plain_fit))
        print(
            f"\n### {arch}: fit on 2,400 digits, as a ratio to a plain forward over them ({plain_fit.wall * 1e3:.1f} ms)\n\n{HEADER}"
        )
        print("\n".join(fits))


def quality(archs: list[str], labels: list[str]) -> None:
    splits = data.load_digits()
    loaders = {deg: data.loader(data.rotated(splits.test, deg), 500) for deg in ROTATIONS}
    for arch in archs:
        model = zoo.pretrained(arch)
        plain = {
            deg: posthoc.evaluate(posthoc.wrap(model, method="none"), loader, progress=False)
            for deg, loader in loaders.items()
        }
        print(f"\n### {arch} (bundled checkpoint)\n")
        print(
            "| method | fit s | " + " | ".join(f"NLL {d}° (x plain)" for d in ROTATIONS) + " | ECE 0° (%) | verdict |"
        )
        print("|---|---|" + "---|" * len(ROTATIONS) + "---|---|")
        cells = " | ".join(f"{plain[d].nll:.4f}" for d in ROTATIONS)
        print(f"| none | 0 | {cells} | {100 * plain[0].ece:.2f} | reference |")
        for label in labels:
            um, seconds = _fitted(model, label, splits)
            reports = {deg: posthoc.evaluate(um, loader, progress=False) for deg, loader in loaders.items()}
            ratios = {d: reports[d].nll / plain[d].nll for d in ROTATIONS}
            meets = ratios[0] <= SLACK and all(ratios[d] < 1 for d in SHIFTED)
            cells = " | ".join(f"{reports[d].nll:.4f} ({ratios[d]:.3f})" for d in ROTATIONS)
            print(
                f"| {label} | {seconds:.1f} | {cells} | {100 * reports[0].ece:.2f} | {'meets' if meets else 'fails'} |",
                flush=True,
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", nargs="+", choices=["cost", "quality"], default=["cost", "quality"])
    parser.add_argument(
        "--archs", nargs="+", default=["digits_cnn", "digits_bn_cnn"], choices=["digits_cnn", "digits_bn_cnn"]
    )
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), metavar="CONFIG")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if "quality" in args.part:
        quality(args.archs, args.configs)
    if "cost" in args.part:
        cost(args.archs, args.configs, args.repeats)


if __name__ == "__main__":
    main()
