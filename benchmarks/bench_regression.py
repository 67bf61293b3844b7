"""Regression: quality of every method that does it, on Auto MPG at random, under extrapolation and in a gap, the seed 004
sinusoid's band, and the cost of last-layer Laplace against a plain forward pass.

- **Quality** (``--splits`` random seeds, default 10): an MLP trained per split on Auto MPG
  (:func:`posthoc.demo.regression.auto_mpg`), wrapped by each method with its defaults and
  ``fit(train, val)``. ``random``: a random test split; ``extrapolate``: trained and validated on the
  lighter 70 % of the cars, tested on the heavier 30 % (no fit-time choice sees a heavy car); ``gap``:
  fitted without the heaviest 30 % and a band of middle weights, tested on that band. The
  reference is the plain model with its noise fitted on the validation residuals (``none``). Each
  cell is the mean over splits; ``ΔNLL`` is the method's test NLL minus the plain model's on the same
  split (nats per car on standardised targets; negative is better), with the worst split beside it.
  A last table checks each method against the targets: no worse in distribution, better under both shifts.
- **Band** (seed 004 sinusoid, 40 training points in two clusters): the mean predictive std on the
  training inputs, in the gap between the clusters and beyond the data.
- **Cost**: last-layer Laplace ``fit`` against one forward pass over the fit data, and its closed-form
  predictive against a plain forward, in one process: 11 alternating pairs, the medians of each and the
  median of the per-pair ratios (``timing.paired``), CPU time beside wall.

Run: ``python benchmarks/bench_regression.py --splits 10 --out benchmarks/results/regression.md``.
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

sys.path.insert(0, str(Path(__file__).parent))
from timing import paired  # noqa: E402

import posthoc  # noqa: E402
from posthoc.demo.regression import auto_mpg, sinusoid, train_mlp  # noqa: E402
from posthoc.evaluation import regression_metrics as rm  # noqa: E402

#: (label, method, wrap options); "ensemble" wraps the split's members
METHODS = (
    ("none (plain, noise on val)", "none", {}),
    ("laplace (kron)", "laplace", {}),
    ("laplace (full)", "laplace", {"hessian": "full"}),
    ("mc-dropout", "mc-dropout", {}),
    ("vi (head)", "vi", {}),
    ("sparse-vd", "sparse-vd", {}),
    ("swag (last layer)", "swag", {}),
    ("multiswag", "multiswag", {}),
    ("ivon", "ivon", {}),
    ("sgld", "sgld", {}),
    ("ibnn", "ibnn", {}),
    ("ensemble of 3", "ensemble", {}),
)
#: the quality table's test sets: name -> (the ``auto_mpg`` split, which of its test sets)
TEST_SETS = {"random": ("random", "test"), "extrapolate": ("extrapolate", "test"), "gap": ("shift", "gap")}
#: the mean ΔNLL (nats per car) a method may cost in distribution and still count as no worse than the plain model
NO_WORSE = 0.01
MEMBERS = 3
EPOCHS = 400


def _metrics(um: posthoc.UncertainModel, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    pred = um.predict(x, generator=torch.Generator().manual_seed(0))
    means, stds = rm.components(pred)
    coverage, width = rm.interval_coverage(means, stds, y, 0.9)
    return {"nll": rm.nll(means, stds, y), "rmse": rm.rmse(means, y), "crps": rm.crps(means, stds, y),
            "cov90": coverage, "width90": width, "mace": rm.calibration_error(means, stds, y),
            "ence": rm.ence(means, stds, y, bins=5)}


def quality(splits: int) -> dict[str, dict[str, list[dict[str, float]]]]:
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for name, (split, test_set) in TEST_SETS.items():
        for seed in range(splits):
            data = auto_mpg(seed, split=split)
            test = data.test if test_set == "test" else data.shifted[test_set]
            members = [train_mlp(data.train, seed=100 * seed + m, epochs=EPOCHS) for m in range(MEMBERS)]
            for label, method, options in METHODS:
                model = members if method == "ensemble" else members[0]
                wrapped = posthoc.wrap(model, method="none" if method == "ensemble" else method,
                                       likelihood="regression", **options)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    start = time.perf_counter()
                    wrapped.fit(data.train_loader(), data.val_loader(), progress=False)
                    seconds = time.perf_counter() - start
                results.setdefault(name, {}).setdefault(label, []).append({**_metrics(wrapped, *test), "fit_s": seconds})
            print(f"{name} split {seed}: done", file=sys.stderr)
    return results


def quality_table(results: dict[str, dict[str, list[dict[str, float]]]]) -> list[str]:
    lines = []
    for split, by_method in results.items():
        plain = [m["nll"] for m in by_method[METHODS[0][0]]]
        lines += [f"**{split}** ({len(plain)} splits; means over splits)", "",
                  "| method | NLL | ΔNLL vs plain (mean / worst) | RMSE | CRPS | 90% coverage | 90% width | MACE | ENCE |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for label, runs in by_method.items():
            mean = {k: statistics.fmean(r[k] for r in runs) for k in runs[0]}
            deltas = [r["nll"] - p for r, p in zip(runs, plain)]
            lines.append(f"| {label} | {mean['nll']:.3f} | {statistics.fmean(deltas):+.3f} / {max(deltas):+.3f} | "
                         f"{mean['rmse']:.3f} | {mean['crps']:.3f} | {mean['cov90']:.3f} | {mean['width90']:.3f} | "
                         f"{mean['mace']:.3f} | {mean['ence']:.3f} |")
        lines.append("")
    return lines


def verdicts(results: dict[str, dict[str, list[dict[str, float]]]]) -> list[str]:
    """Per method: no worse than the plain model in distribution (mean ΔNLL <= NO_WORSE on ``random``) and better
    under shift (mean ΔNLL < 0 on ``extrapolate`` and on ``gap``)."""
    def delta(split: str, label: str) -> float:
        plain = results[split][METHODS[0][0]]
        return statistics.fmean(r["nll"] - p["nll"] for r, p in zip(results[split][label], plain))

    lines = [f"| method | ΔNLL random | ΔNLL extrapolate | ΔNLL gap | no worse in distribution (<= {NO_WORSE:+.2f}) | "
             "better under shift (both < 0) | fit s (median) |", "|---|---|---|---|---|---|---|"]
    for label, _, _ in METHODS[1:]:
        random, extrapolate, gap = (delta(split, label) for split in TEST_SETS)
        fit = statistics.median(r["fit_s"] for runs in results.values() for r in runs[label])
        lines.append(f"| {label} | {random:+.3f} | {extrapolate:+.3f} | {gap:+.3f} | {'yes' if random <= NO_WORSE else 'no'} | "
                     f"{'yes' if extrapolate < 0 and gap < 0 else 'no'} | {fit:.2f} |")
    return lines + [""]


def band() -> list[str]:
    data = sinusoid()
    net = train_mlp(data.train, epochs=1000)
    members = [net] + [train_mlp(data.train, epochs=1000, seed=s) for s in (1, 2)]
    lines = ["| method | noise σ | std on training points | std in the gap | std beyond the data |", "|---|---|---|---|---|"]
    for label, method, options in METHODS:
        model = members if method == "ensemble" else net
        um = posthoc.wrap(model, method="none" if method == "ensemble" else method, likelihood="regression", **options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            um.fit(data.train_loader(), data.val_loader(), progress=False)
        std = {name: float(um.predict(x, generator=torch.Generator().manual_seed(0)).std.mean()) for name, x in data.regions.items()}
        noise = float(um.predict(data.regions["train"][:1], generator=torch.Generator().manual_seed(0)).aleatoric.sqrt().mean())
        lines.append(f"| {label} | {noise:.3f} | {std['train']:.3f} | {std['gap']:.3f} | {std['beyond']:.3f} |")
    return lines


def cost(rows: int = 20000, features: int = 32, width: int = 512, penultimate: int = 64) -> list[str]:
    """Last-layer Laplace's extra work per row grows with the square of the head's input width (here
    ``penultimate``), the plain forward with the backbone's size: the ratios are for this MLP."""
    torch.manual_seed(0)
    x, y = torch.randn(rows, features), torch.randn(rows, 1)
    net = nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                        nn.Linear(width, penultimate), nn.ReLU(), nn.Linear(penultimate, 1)).eval()
    loader = DataLoader(TensorDataset(x, y), batch_size=1000)
    lines = ["| step | plain | laplace | ratio | cpu/wall (laplace) |", "|---|---|---|---|---|"]
    for hessian in ("kron", "full", "diag"):
        def fit() -> posthoc.UncertainModel:
            return posthoc.wrap(net, method="laplace", likelihood="regression", hessian=hessian).fit(loader, progress=False)

        def forward() -> list[torch.Tensor]:
            with torch.no_grad():
                return [net(batch) for batch, _ in loader]

        plain, fitted, ratio = paired(forward, fit)
        lines.append(f"| fit, {hessian} (one pass over {rows} rows) | {plain.wall:.4f} s | {fitted.wall:.4f} s | "
                     f"{ratio:.2f}x | {fitted.cpu_per_wall:.2f} |")
        um = fit()
        test = x[:10000]

        def plain_forward() -> torch.Tensor:
            with torch.no_grad():
                return net(test)

        plain, predicted, ratio = paired(plain_forward, lambda: um.predict(test))
        lines.append(f"| predict, {hessian} (10,000 rows) | {plain.wall:.4f} s | {predicted.wall:.4f} s | "
                     f"{ratio:.2f}x | {predicted.cpu_per_wall:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--parts", nargs="+", default=["quality", "band", "cost"], choices=["quality", "band", "cost"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    command = " ".join(["python benchmarks/bench_regression.py", *sys.argv[1:]])
    lines = ["# Regression", "", f"`{command}` (torch threads: {args.threads})", ""]
    if "quality" in args.parts:
        results = quality(args.splits)
        lines += ["## Quality on Auto MPG", "", *quality_table(results), "### Against the targets", "", *verdicts(results)]
    if "band" in args.parts:
        lines += ["## The seed 004 sinusoid: predictive std by region", "", *band(), ""]
    if "cost" in args.parts:
        lines += ["## Cost of last-layer Laplace (MLP 32-512-512-64-1; targets: fit <= 1.1x, predict <= 1.1x)", "",
                  *cost(), ""]
    lines.append(f"Wall time: {time.perf_counter() - start:.0f} s.")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
