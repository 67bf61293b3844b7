"""Batch throughput before and after the single-call fast path: ``um.predict`` of a batch against a plain forward.

Issue 37 made one request at a time cheaper (:mod:`benchmarks.bench_serving`) and asked that batch throughput not get
worse for it. This benchmark measures, for the code of a baseline commit and for the working tree, the ratio of
``um.predict(x)`` on a batch of test digits to the plain forward on the same batch (medians over interleaved calls,
one process per tree and round, the rounds of the two trees alternating so that a busy neighbour slows both alike),
and prints the ratios side by side. A ratio, not a time, is compared: each process times its own plain forward.

Run by hand (not by pytest)::

    python benchmarks/bench_batch_throughput.py                          # baseline 688ba74: before this wave
    python benchmarks/bench_batch_throughput.py --baseline HEAD~5 --batch 512 --rounds 3

The baseline's code is checked out with ``git worktree add`` into a temporary folder (removed afterwards).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the last commit before the predict-path and runner work of issues 36 and 37
BASELINE = "688ba74"
METHODS = {
    "temperature": ("temperature", {}),
    "laplace": ("laplace", {}),
    "laplace+dac": (["laplace", "dac"], {}),
    "mc-dropout S=20 (head)": ("mc-dropout", {"p": 0.1, "where": "head", "num_samples": 20}),
}

#: what each process runs, with the tree under test first on sys.path (so it works on any commit's code)
CHILD = r"""
import json, statistics, sys, time, warnings
sys.path.insert(0, sys.argv[1])
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
import posthoc
from posthoc_apps.demo import data, zoo
batch, calls, methods = int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
splits = data.load_digits()
model = zoo.pretrained("digits_bn_cnn").eval()
fit, val = data.loader(splits.fit, batch_size=256), data.loader(splits.calibration, batch_size=256)
x = splits.test.tensors[0][:batch]
def once(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu
out = {}
for label, (method, options) in methods.items():
    um = posthoc.wrap(model, method=method, **options).fit(fit, val, progress=False, shift=None)
    plains, walls, cpus = [], [], []
    with torch.no_grad():
        for _ in range(2):
            model(x), um.predict(x)
        for _ in range(calls):
            plains.append(once(lambda: model(x))[0])
            wall, cpu = once(lambda: um.predict(x))
            walls.append(wall); cpus.append(cpu)
    out[label] = {"ratio": statistics.median(walls) / statistics.median(plains), "ms": statistics.median(walls) * 1e3,
                  "plain_ms": statistics.median(plains) * 1e3, "cpu_per_wall": sum(cpus) / sum(walls)}
print(json.dumps(out))
"""


def measure(tree: Path, batch: int, calls: int) -> dict[str, dict[str, float]]:
    """One process on ``tree``'s code: each method's median predict time and its ratio to the plain forward."""
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree), str(batch), str(calls), json.dumps(METHODS)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=BASELINE, help=f"git ref of the code before (default {BASELINE})")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--calls", type=int, default=20, help="timed calls per method and process")
    parser.add_argument("--rounds", type=int, default=2, help="processes per tree, alternating")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"baseline": [], "now": []}
    with tempfile.TemporaryDirectory() as scratch:
        old = Path(scratch) / "baseline"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old), args.baseline], check=True
        )
        try:
            for _ in range(args.rounds):
                runs["baseline"].append(measure(old, args.batch, args.calls))
                runs["now"].append(measure(ROOT, args.batch, args.calls))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=True)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    lines = [
        f"One thread, batch {args.batch} test digits, bundled digits_bn_cnn; medians over {args.calls} interleaved "
        f"calls per process, {args.rounds} processes per tree alternating; the ratio is the median of the "
        f"processes' ratios. Baseline {args.baseline}, now {head.stdout.strip()} (+ working tree). Command: "
        f"python benchmarks/bench_batch_throughput.py --baseline {args.baseline} --batch {args.batch} "
        f"--calls {args.calls} --rounds {args.rounds}",
        "",
        "| method | baseline ×plain | now ×plain | now / baseline | now ms (plain ms) | cpu/wall |",
        "|---|---|---|---|---|---|",
    ]
    for label in METHODS:
        before = statistics.median(run[label]["ratio"] for run in runs["baseline"])
        after = statistics.median(run[label]["ratio"] for run in runs["now"])
        ms = statistics.median(run[label]["ms"] for run in runs["now"])
        plain = statistics.median(run[label]["plain_ms"] for run in runs["now"])
        cpu = statistics.median(run[label]["cpu_per_wall"] for run in runs["now"])
        lines.append(
            f"| {label} | {before:.3f}x | {after:.3f}x | {after / before:.3f} | {ms:.2f} ({plain:.2f}) | {cpu:.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text("# Batch throughput before and after the single-call fast path\n\n" + text + "\n")


if __name__ == "__main__":
    main()
