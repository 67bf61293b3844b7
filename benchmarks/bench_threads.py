"""What the runner's narrow-thread trick buys, and what turning it off costs (``posthoc.settings.narrow_threads``).

Run by hand (not by pytest)::

    python benchmarks/bench_threads.py                 # digits CNN, the machine's threads
    python benchmarks/bench_threads.py --rounds 7 --out benchmarks/results/threads.md

``torch.set_num_threads`` changes the whole process, so the runner narrows small dense work (a small predict chunk,
the ``eigh`` of a curvature factor, a calibrator's LBFGS on a few hundred rows) to one thread only as the setting
allows: ``"auto"`` (the default) while no other Python thread is alive, ``False`` never, ``True`` always. For each
task below, on the bundled digits CNN, the policies run alternately in one process (medians over rounds, CPU time
beside wall): a last-layer Laplace fit with its prior choice (2,400 fit + 600 held-out digits), a temperature fit,
a predict of 500 digits, and 200 single-example predicts. The "server" row runs ``"auto"`` while a second Python
thread is alive: it must not narrow (and so costs what ``False`` costs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import posthoc  # noqa: E402
from benchmarks.timing import once  # noqa: E402
from posthoc_apps.demo import data, zoo  # noqa: E402

warnings.filterwarnings("ignore")
POLICIES = ("auto", False)


def tasks() -> dict[str, Callable[[], object]]:
    splits = data.load_digits()
    model = zoo.pretrained()
    fit, val = data.loader(splits.fit, batch_size=256), data.loader(splits.calibration, batch_size=256)
    x = splits.test.tensors[0][:500]
    laplace = posthoc.wrap(model, method="laplace").fit(fit, val, progress=False, shift=None)
    one = x[:1]
    return {
        "laplace fit + prior choice": lambda: posthoc.wrap(model, method="laplace").fit(
            fit, val, progress=False, shift=None
        ),
        "temperature fit": lambda: posthoc.wrap(model, method="temperature").fit(
            val_loader=val, progress=False, shift=None
        ),
        "laplace predict, 500 digits": lambda: laplace.predict(x),
        "laplace predict, 200 single examples": lambda: [laplace.predict(one) for _ in range(200)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    work = tasks()
    lines = [
        f"torch threads: {torch.get_num_threads()}; rounds: {args.rounds}; command: "
        f"python benchmarks/bench_threads.py --rounds {args.rounds}",
        "",
        "| task | auto: wall s | off: wall s | off / auto | auto cpu/wall | off cpu/wall | server (auto, 2 "
        "threads alive): wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, fn in work.items():
        fn()  # warm-up
        times: dict[str, list[tuple[float, float]]] = {"auto": [], "False": [], "server": []}
        for _ in range(args.rounds):
            for policy in POLICIES:
                with posthoc.settings.override(narrow_threads=policy):
                    times[str(policy)].append(once(fn))
            stop = threading.Event()
            neighbour = threading.Thread(target=stop.wait)
            neighbour.start()
            try:
                times["server"].append(once(fn))
            finally:
                stop.set()
                neighbour.join()
        wall = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
        cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
        lines.append(
            f"| {name} | {wall['auto']:.4f} | {wall['False']:.4f} | {wall['False'] / wall['auto']:.2f}x | "
            f"{cpu['auto'] / wall['auto']:.2f} | {cpu['False'] / wall['False']:.2f} | {wall['server']:.4f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text("# The runner's thread policy\n\n" + text + "\n")


if __name__ == "__main__":
    main()
