"""The predict path's cost as ratios to a plain forward pass, and single-example latency per method.

Run by hand (not by pytest)::

    python benchmarks/bench_predict_path.py                   # every part
    python benchmarks/bench_predict_path.py llla --threads 1 --rounds 41 --out benchmarks/results/predict_path.md
    python benchmarks/bench_predict_path.py tiny              # one part: llla | digits | tiny

Parts:

- ``llla``: last-layer Laplace probit predict (``hessian="kron"`` and ``"full"``, fitted with the
  defaults on the 2,400 fit digits and 600 validation digits) on the 1,000 test digits against one
  plain forward ``model(x)`` of the bundled LeNet-sized digits CNN (targets <= 1.05x kron, <= 1.1x
  full). Plain, kron and full run one call each per round, in a rotating order, so that a busy
  neighbour slows all three alike; the ratios are medians over rounds of each round's ratio.
- ``digits`` / ``tiny``: the bundled digits CNN (28x28, dropout) and a tiny CNN (~29k parameters,
  8x8 inputs) trained here in seconds on scikit-learn's digits. For each, back to back in one
  process: last-layer Laplace fit (KFAC + marglik) over the fit data / one plain forward over it
  (target <= 1.1x); last-layer Laplace probit predict / plain forward on a batch of 500 (target
  <= 1.1x); head MC dropout, S=100, shared masks / plain forward on the same batch (target <= 1.2x);
  single-example latency, p50 and p99 over 1,000 calls, for the plain model and every method. A
  "floor" row times one log-softmax and exp over ``(S=100, N, C)`` random logits: where the model's
  forward pass costs less than that (the tiny CNN), no sampling method can come near 1.2x of it.

Medians of repeats, CPU time beside wall time (a cpu/wall far below the thread count was contended).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import posthoc  # noqa: E402
from benchmarks.timing import HEADER, measure, row  # noqa: E402

warnings.filterwarnings("ignore")
TARGETS = {"laplace fit": 1.1, "laplace probit predict": 1.1, "mc-dropout head S=100 predict": 1.2}
LLLA_TARGETS = {"kron": 1.05, "full": 1.1}


def digits_cnn() -> tuple[nn.Module, DataLoader, DataLoader, torch.Tensor]:
    from posthoc_apps.demo import data, zoo

    splits = data.load_digits()
    return (
        zoo.pretrained(),
        data.loader(splits.fit, batch_size=256),
        data.loader(splits.calibration, batch_size=256),
        splits.test.tensors[0][:500],
    )


def tiny_cnn() -> tuple[nn.Module, DataLoader, DataLoader, torch.Tensor]:
    """A ~29k-parameter CNN on scikit-learn's 8x8 digits, trained here for a few seconds (seeded)."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels)
    torch.manual_seed(0)
    order = torch.randperm(len(y))
    x, y = x[order], y[order]
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 6 * 6, 48), nn.ReLU(), nn.Linear(48, 10)
    )
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(15):
        for start in range(0, 1000, 100):
            loss = nn.functional.cross_entropy(model(x[start : start + 100]), y[start : start + 100])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    model.eval()
    fit = DataLoader(TensorDataset(x[:1000], y[:1000]), batch_size=250)
    val = DataLoader(TensorDataset(x[1000:1297], y[1000:1297]), batch_size=250)
    return model, fit, val, x[1297:1797]


def latency(fn, x: torch.Tensor, calls: int = 1000) -> tuple[float, float]:
    """p50 and p99 milliseconds of ``fn`` on one example at a time."""
    times = []
    for i in range(calls):
        one = x[i % len(x) : i % len(x) + 1]
        start = time.perf_counter()
        fn(one)
        times.append(time.perf_counter() - start)
    times.sort()
    return 1e3 * statistics.median(times), 1e3 * times[int(0.99 * len(times)) - 1]


def run(name: str, build) -> None:
    model, fit, val, x = build()
    params = sum(p.numel() for p in model.parameters())
    print(
        f"\n### {name} ({params:,} parameters; fit: {len(fit.dataset):,} examples; predict: batch of {len(x)}; "
        f"{torch.get_num_threads()} threads)\n"
    )
    print(HEADER)

    def forward_fit_data() -> None:
        with torch.no_grad():
            for xb, _ in fit:
                model(xb)

    def forward() -> None:
        with torch.no_grad():
            model(x)

    plain_fit, plain = measure(forward_fit_data), measure(forward, repeats=9)
    laplace = posthoc.wrap(model, method="laplace")
    fitting = measure(lambda: laplace.fit(fit, progress=False))
    predicting = measure(lambda: laplace.predict(x), repeats=9)
    dropout = posthoc.wrap(model, method="mc-dropout", where="head", p=0.1, num_samples=100, masks="shared")
    generator = torch.Generator().manual_seed(0)
    dropping = measure(lambda: dropout.predict(x, generator=generator), repeats=9)
    print(row("plain forward over the fit data", plain_fit, plain_fit))
    print(row("laplace fit", fitting, plain_fit))
    print(row("plain forward (batch)", plain, plain))
    print(row("laplace probit predict", predicting, plain))
    print(row("mc-dropout head S=100 predict", dropping, plain))
    classes = model(x[:1]).shape[-1]
    sample_logits = torch.randn(100, len(x), classes)
    floor = measure(lambda: sample_logits.log_softmax(-1).exp(), repeats=9)
    print(row("floor: one log-softmax + exp over S=100 samples (no model)", floor, plain))
    ratios = {
        "laplace fit": fitting.wall / plain_fit.wall,
        "laplace probit predict": predicting.wall / plain.wall,
        "mc-dropout head S=100 predict": dropping.wall / plain.wall,
    }
    print(
        "\ntargets: "
        + "; ".join(
            f"{k} {v:.2f}x (<= {TARGETS[k]}x: {'met' if v <= TARGETS[k] else 'MISSED'})" for k, v in ratios.items()
        )
    )

    fitted = {
        "none": posthoc.wrap(model, method="none"),
        "temperature": posthoc.wrap(model, method="temperature").fit(fit, val, progress=False),
        "laplace": laplace,
        "mc-dropout (head, S=100, shared masks)": dropout,
        "swag (last layer)": posthoc.wrap(model, method="swag", subset="last_layer").fit(
            fit, val, epochs=1, progress=False
        ),
        "ibnn": posthoc.wrap(model, method="ibnn").fit(fit, val, epochs=1, progress=False),
    }
    print("\n| single example | p50 ms | p99 ms | p50 ratio to plain |\n|---|---|---|---|")
    with torch.no_grad():
        base50, base99 = latency(model, x)
    print(f"| plain forward | {base50:.3f} | {base99:.3f} | 1.00x |")
    for label, um in fitted.items():
        p50, p99 = latency(um.predict, x)
        print(f"| {label} | {p50:.3f} | {p99:.3f} | {p50 / base50:.2f}x |")


def timed(fn) -> tuple[float, float]:
    """Wall and process-CPU seconds of one call of ``fn``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def run_llla(rounds: int) -> str:
    """LLLA probit predict (kron, full) against a plain forward on the 1,000 test digits; returns the Markdown."""
    from posthoc_apps.demo import data, zoo

    splits = data.load_digits()
    model = zoo.pretrained()
    x = splits.test.tensors[0][:1000]
    fit, val = data.loader(splits.fit, batch_size=256), data.loader(splits.calibration, batch_size=256)
    calls = {"plain forward model(x)": lambda: model(x)}
    for hessian in LLLA_TARGETS:
        um = posthoc.wrap(model, method="laplace", hessian=hessian).fit(fit, val, progress=False)
        calls[f"LLLA {hessian} probit predict"] = lambda um=um: um.predict(x)
    times = {name: [] for name in calls}
    names = list(calls)
    with torch.no_grad():
        for fn in calls.values():  # warm up
            fn()
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(timed(calls[name]))
    plain = times[names[0]]
    threads = torch.get_num_threads()
    lines = [
        f"### LLLA probit predict on the 1,000 test digits, bundled digits CNN ({threads} thread{'s' * (threads > 1)}, "
        f"{rounds} rounds)\n",
        "| what | wall s (median) | ratio to plain (median over rounds) | CPU s (median) | CPU ratio | cpu/wall | target |",
        "|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for name in names:
        walls, cpus = [t[0] for t in times[name]], [t[1] for t in times[name]]
        ratio = statistics.median(w / p[0] for w, p in zip(walls, plain))
        cpu_ratio = statistics.median(c / p[1] for c, p in zip(cpus, plain))
        cpu_per_wall = statistics.median(c / w for w, c in zip(walls, cpus))
        hessian = name.split()[1] if name.startswith("LLLA") else None
        target = (
            f"<= {LLLA_TARGETS[hessian]}x: {'met' if ratio <= LLLA_TARGETS[hessian] else 'MISSED'}" if hessian else ""
        )
        if hessian:
            verdicts.append(f"{hessian} {ratio:.3f}x")
        lines.append(
            f"| {name} | {statistics.median(walls):.4f} | {ratio:.3f}x | {statistics.median(cpus):.4f} | {cpu_ratio:.3f}x | "
            f"{cpu_per_wall:.2f} | {target} |"
        )
    lines.append(f"\nratios to a plain forward: {'; '.join(verdicts)}")
    return "\n".join(lines)


MODELS = {"digits": ("bundled digits CNN", digits_cnn), "tiny": ("tiny CNN on 8x8 digits", tiny_cnn)}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", choices=["llla", *MODELS], help="parts to run (default: all)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=41, help="rounds of the llla part (one call of each per round)")
    parser.add_argument("--out", default=None, help="also write the llla part's Markdown here, with the command")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for part in args.parts or ["llla", *MODELS]:
        if part != "llla":
            run(*MODELS[part])
            continue
        table = run_llla(args.rounds)
        print(table)
        if args.out:
            command = "python " + " ".join(["benchmarks/bench_predict_path.py", *sys.argv[1:]])
            Path(args.out).write_text(f"command: {command}\n\n{table}\n")
