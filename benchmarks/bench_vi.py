"""Cost of ``"vi"`` and ``"sparse-vd"`` on both bundled checkpoints, as ratios to a plain forward pass.

Run by hand (not by pytest)::

    python benchmarks/bench_vi.py                      # 1 thread, 3 repeats
    python benchmarks/bench_vi.py --threads 2 --repeats 5

For each checkpoint and configuration: the fit on the 2,400 fit digits (batch 64, the method's
default epochs), wall and process-CPU seconds, also as a ratio to one plain forward pass over
those digits; and ``um.predict`` over the 1,000 test digits as a ratio of medians to a plain
forward over them, timed back to back in this process (:mod:`benchmarks.timing`; a row whose
CPU/wall is below 0.5 was contended and is flagged for a re-run).

Example:
    $ python benchmarks/bench_vi.py --archs digits_cnn --cases vi
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import posthoc  # noqa: E402
from benchmarks.timing import measure  # noqa: E402
from posthoc_apps.demo import data, zoo  # noqa: E402

#: label -> (method, wrap options)
CASES = {
    "vi": ("vi", {}),
    "vi layers=all": ("vi", {"layers": "all"}),
    "sparse-vd": ("sparse-vd", {}),
}


def run(arch: str, case: str, splits: data.DigitsSplits, repeats: int) -> str:
    method, options = CASES[case]
    model = zoo.pretrained(arch)
    fit_x = splits.fit.tensors[0]
    x = splits.test.tensors[0]
    with torch.no_grad():
        plain_fit = measure(lambda: model(fit_x), repeats=repeats)
    torch.manual_seed(0)
    wall, cpu = time.perf_counter(), time.process_time()
    um = posthoc.wrap(model, method=method, **options).fit(data.loader(splits.fit, 64, shuffle=True), progress=False)
    fit_wall, fit_cpu = time.perf_counter() - wall, time.process_time() - cpu
    with torch.no_grad():
        plain = measure(lambda: model(x), repeats=repeats)
    predicted = measure(lambda: um.predict(x), repeats=repeats)
    flag = " (contended: re-run)" if predicted.contended or plain.contended else ""
    samples = um.method.num_samples
    return (
        f"| {arch} | {case} | {fit_wall:.1f} s ({fit_wall / plain_fit.wall:.0f}x) | {fit_cpu / fit_wall:.2f} | "
        f"{predicted.wall / plain.wall:.1f}x (S={samples}) | {predicted.cpu_per_wall:.2f} / {plain.cpu_per_wall:.2f}{flag} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", nargs="+", default=["digits_cnn", "digits_bn_cnn"])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    splits = data.load_digits()
    print(
        f"threads={args.threads}, repeats={args.repeats} (medians); fit on {len(splits.fit)} digits, predict on {len(splits.test)}"
    )
    print(
        "| checkpoint | method | fit wall (ratio to a forward over the fit digits) | fit cpu/wall | "
        "predict / plain forward (medians) | predict cpu/wall / plain cpu/wall |"
    )
    print("|---|---|---|---|---|---|")
    for arch in args.archs:
        for case in args.cases:
            print(run(arch, case, splits, args.repeats), flush=True)


if __name__ == "__main__":
    main()
