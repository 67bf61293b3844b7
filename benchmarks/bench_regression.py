"""Regression: quality of every method that does it, on Auto MPG at random, under extrapolation and in a gap, the seed 004
sinusoid's band, and the cost of last-layer Laplace against a plain forward pass.

- **Quality** (``--splits`` random seeds, default 10): an MLP trained per split on Auto MPG
  (:func:`posthoc_apps.demo.data.auto_mpg`), wrapped by each method with its defaults and
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
- **Tools** (``--parts tools``): ``none`` against ``["none", "dac"]`` and ``laplace`` against ``["laplace", "dac"]``
  (every fit shift-aware: feature-noise copies graded by the rise in RMSE), test NLL in distribution, under
  feature noise on the test inputs (:data:`TEST_NOISE` of each feature's std; also the kind the fits perturb with,
  so not a held-out kind), and under the held-out shifts: the sinusoid's gap and beyond the data (targets drawn
  from the sinusoid itself), Auto MPG's band of middle weights and its heaviest 30 % (``split="shift"``); the
  predictive std ratio to the inner method's by region; OOD AUROC (``posthoc.detector``: knn and mahalanobis
  on the head's input, the predictive variance) of far inputs (the sinusoid at ``|x| >= 3``) and of the heavy cars
  against the in-distribution test inputs. Means over ``--splits`` seeds (training seeds on the sinusoid).

Run: ``python benchmarks/bench_regression.py --splits 10 --out benchmarks/results/regression.md``;
``python benchmarks/bench_regression.py --parts tools --splits 3 --out benchmarks/results/regression_tools.md``.
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
from posthoc.engine.perturb import feature_noise  # noqa: E402
from posthoc.evaluation import gaussian_metrics as rm  # noqa: E402
from posthoc.evaluation.metrics import ood_auroc  # noqa: E402
from posthoc_apps.demo.data import _sinusoid_targets, auto_mpg, sinusoid, train_mlp  # noqa: E402

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
    return {
        "nll": rm.nll(means, stds, y),
        "rmse": rm.rmse(means, y),
        "crps": rm.crps(means, stds, y),
        "cov90": coverage,
        "width90": width,
        "mace": rm.calibration_error(means, stds, y),
        "ence": rm.ence(means, stds, y, bins=5),
    }


def quality(splits: int) -> dict[str, dict[str, list[dict[str, float]]]]:
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for name, (split, test_set) in TEST_SETS.items():
        for seed in range(splits):
            data = auto_mpg(seed, split=split)
            test = data.test if test_set == "test" else data.shifted[test_set]
            members = [train_mlp(data.train, seed=100 * seed + m, epochs=EPOCHS) for m in range(MEMBERS)]
            for label, method, options in METHODS:
                model = members if method == "ensemble" else members[0]
                wrapped = posthoc.wrap(
                    model, method="none" if method == "ensemble" else method, likelihood="regression", **options
                )
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    start = time.perf_counter()
                    wrapped.fit(data.train_loader(), data.val_loader(), progress=False)
                    seconds = time.perf_counter() - start
                results.setdefault(name, {}).setdefault(label, []).append(
                    {**_metrics(wrapped, *test), "fit_s": seconds}
                )
            print(f"{name} split {seed}: done", file=sys.stderr)
    return results


def quality_table(results: dict[str, dict[str, list[dict[str, float]]]]) -> list[str]:
    lines = []
    for split, by_method in results.items():
        plain = [m["nll"] for m in by_method[METHODS[0][0]]]
        lines += [
            f"**{split}** ({len(plain)} splits; means over splits)",
            "",
            "| method | NLL | ΔNLL vs plain (mean / worst) | RMSE | CRPS | 90% coverage | 90% width | MACE | ENCE |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for label, runs in by_method.items():
            mean = {k: statistics.fmean(r[k] for r in runs) for k in runs[0]}
            deltas = [r["nll"] - p for r, p in zip(runs, plain)]
            lines.append(
                f"| {label} | {mean['nll']:.3f} | {statistics.fmean(deltas):+.3f} / {max(deltas):+.3f} | "
                f"{mean['rmse']:.3f} | {mean['crps']:.3f} | {mean['cov90']:.3f} | {mean['width90']:.3f} | "
                f"{mean['mace']:.3f} | {mean['ence']:.3f} |"
            )
        lines.append("")
    return lines


def verdicts(results: dict[str, dict[str, list[dict[str, float]]]]) -> list[str]:
    """Per method: no worse than the plain model in distribution (mean ΔNLL <= NO_WORSE on ``random``) and better
    under shift (mean ΔNLL < 0 on ``extrapolate`` and on ``gap``)."""

    def delta(split: str, label: str) -> float:
        plain = results[split][METHODS[0][0]]
        return statistics.fmean(r["nll"] - p["nll"] for r, p in zip(results[split][label], plain))

    lines = [
        f"| method | ΔNLL random | ΔNLL extrapolate | ΔNLL gap | no worse in distribution (<= {NO_WORSE:+.2f}) | "
        "better under shift (both < 0) | fit s (median) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, _, _ in METHODS[1:]:
        random, extrapolate, gap = (delta(split, label) for split in TEST_SETS)
        fit = statistics.median(r["fit_s"] for runs in results.values() for r in runs[label])
        lines.append(
            f"| {label} | {random:+.3f} | {extrapolate:+.3f} | {gap:+.3f} | {'yes' if random <= NO_WORSE else 'no'} | "
            f"{'yes' if extrapolate < 0 and gap < 0 else 'no'} | {fit:.2f} |"
        )
    return lines + [""]


def band() -> list[str]:
    data = sinusoid()
    net = train_mlp(data.train, epochs=1000)
    members = [net] + [train_mlp(data.train, epochs=1000, seed=s) for s in (1, 2)]
    lines = [
        "| method | noise σ | std on training points | std in the gap | std beyond the data |",
        "|---|---|---|---|---|",
    ]
    for label, method, options in METHODS:
        model = members if method == "ensemble" else net
        um = posthoc.wrap(model, method="none" if method == "ensemble" else method, likelihood="regression", **options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            um.fit(data.train_loader(), data.val_loader(), progress=False)
        std = {
            name: float(um.predict(x, generator=torch.Generator().manual_seed(0)).std.mean())
            for name, x in data.regions.items()
        }
        noise = float(
            um.predict(data.regions["train"][:1], generator=torch.Generator().manual_seed(0)).aleatoric.sqrt().mean()
        )
        lines.append(f"| {label} | {noise:.3f} | {std['train']:.3f} | {std['gap']:.3f} | {std['beyond']:.3f} |")
    return lines


def cost(rows: int = 20000, features: int = 32, width: int = 512, penultimate: int = 64) -> list[str]:
    """Last-layer Laplace's extra work per row grows with the square of the head's input width (here
    ``penultimate``), the plain forward with the backbone's size: the ratios are for this MLP."""
    torch.manual_seed(0)
    x, y = torch.randn(rows, features), torch.randn(rows, 1)
    net = nn.Sequential(
        nn.Linear(features, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, penultimate),
        nn.ReLU(),
        nn.Linear(penultimate, 1),
    ).eval()
    loader = DataLoader(TensorDataset(x, y), batch_size=1000)
    lines = ["| step | plain | laplace | ratio | cpu/wall (laplace) |", "|---|---|---|---|---|"]
    for hessian in ("kron", "full", "diag"):

        def fit() -> posthoc.UncertainModel:
            return posthoc.wrap(net, method="laplace", likelihood="regression", hessian=hessian).fit(
                loader, progress=False
            )

        def forward() -> list[torch.Tensor]:
            with torch.no_grad():
                return [net(batch) for batch, _ in loader]

        plain, fitted, ratio = paired(forward, fit)
        lines.append(
            f"| fit, {hessian} (one pass over {rows} rows) | {plain.wall:.4f} s | {fitted.wall:.4f} s | "
            f"{ratio:.2f}x | {fitted.cpu_per_wall:.2f} |"
        )
        um = fit()
        test = x[:10000]

        def plain_forward() -> torch.Tensor:
            with torch.no_grad():
                return net(test)

        plain, predicted, ratio = paired(plain_forward, lambda: um.predict(test))
        lines.append(
            f"| predict, {hessian} (10,000 rows) | {plain.wall:.4f} s | {predicted.wall:.4f} s | "
            f"{ratio:.2f}x | {predicted.cpu_per_wall:.2f} |"
        )
    return lines


#: the tools part's chains: the inner method, then DAC stacked on it
TOOL_CHAINS = (
    ("none", ["none"]),
    ("none + dac", ["none", "dac"]),
    ("laplace", ["laplace"]),
    ("laplace + dac", ["laplace", "dac"]),
)
#: feature noise on the test inputs, in units of each feature's std over the test set
TEST_NOISE = 0.5
#: the OOD scores of the tools part
TOOL_SCORES = ("knn", "mahalanobis", "variance")


def _nll(um: posthoc.UncertainModel, x: torch.Tensor, y: torch.Tensor) -> float:
    return float(-um.predict(x, generator=torch.Generator().manual_seed(0)).log_prob(y).mean())


def _tool_runs(
    net: nn.Module,
    data,
    sets: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ood: torch.Tensor,
    regions: dict[str, torch.Tensor],
) -> dict[str, dict[str, float]]:
    """Per chain: NLL per test set, std ratio to the inner method per region, OOD AUROC per score, fit seconds."""
    found: dict[str, dict[str, float]] = {}
    inner_std: dict[str, torch.Tensor] = {}
    for label, chain in TOOL_CHAINS:
        um = posthoc.wrap(net, method=chain, likelihood="regression")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            um.fit(data.train_loader(), data.val_loader(), progress=False)
            row = {"fit_s": time.perf_counter() - start}
            row |= {f"nll {name}": _nll(um, x, y) for name, (x, y) in sets.items()}
            std = {
                name: um.predict(x, generator=torch.Generator().manual_seed(0)).std.mean(-1)
                for name, x in regions.items()
            }
            if len(chain) == 1:
                inner_std = std
            row |= {f"std {name}": float((std[name] / inner_std[name]).mean()) for name in regions}
            det = posthoc.detector(um, score=list(TOOL_SCORES), k=5).fit(data.train_loader(), progress=False)
            near, far = det.scores(sets["in distribution"][0]), det.scores(ood)
            row |= {f"auroc {name}": ood_auroc(near[name], far[name]) for name in TOOL_SCORES}
        found[label] = row
    return found


def _noisy(x: torch.Tensor, seed: int) -> torch.Tensor:
    return feature_noise(x, TEST_NOISE, torch.Generator().manual_seed(seed))


def tools(splits: int) -> list[str]:
    """DAC, shift-aware selection and OOD scores on the sinusoid and Auto MPG (module docs)."""
    runs: dict[str, list[dict[str, dict[str, float]]]] = {"sinusoid": [], "auto-mpg": []}
    for seed in range(splits):
        data = sinusoid()
        net = train_mlp(data.train, epochs=1000, seed=seed)
        gap, beyond = data.regions["gap"], data.regions["beyond"]
        truth = lambda x: _sinusoid_targets(x[:, 0] / 4 + 0.5, torch.Generator().manual_seed(1))[:, None]  # noqa: E731
        sets = {
            "in distribution": data.test,
            "feature noise": (_noisy(data.test[0], seed), data.test[1]),
            "gap": (gap, truth(gap)),
            "beyond": (beyond, truth(beyond)),
        }
        far = torch.cat([torch.linspace(3, 6, 40), -torch.linspace(3, 6, 40)])[:, None]
        runs["sinusoid"].append(
            _tool_runs(net, data, sets, far, {"train": data.regions["train"], "gap": gap, "beyond": beyond})
        )
        data = auto_mpg(seed, split="shift")
        net = train_mlp(data.train, seed=100 * seed, epochs=EPOCHS)
        heavy, band = data.shifted["extrapolation"], data.shifted["gap"]
        sets = {
            "in distribution": data.test,
            "feature noise": (_noisy(data.test[0], seed), data.test[1]),
            "gap": band,
            "heavy": heavy,
        }
        runs["auto-mpg"].append(
            _tool_runs(net, data, sets, heavy[0], {"test": data.test[0], "gap": band[0], "heavy": heavy[0]})
        )
        print(f"tools seed {seed}: done", file=sys.stderr)
    lines = []
    for problem, found in runs.items():
        columns = [key for key in found[0][TOOL_CHAINS[0][0]] if key != "fit_s"] + ["fit_s"]
        ood = "|x| >= 3" if problem == "sinusoid" else "the heavy cars"
        lines += [
            f"**{problem}** ({len(found)} seeds; means; NLL in nats per point, std as a ratio to the inner "
            f"method's, OOD AUROC of {ood} against the test inputs)",
            "",
            "| chain | " + " | ".join(columns) + " |",
            "|---" * (len(columns) + 1) + "|",
        ]
        for label, _ in TOOL_CHAINS:
            mean = {key: statistics.fmean(run[label][key] for run in found) for key in columns}
            lines.append(f"| {label} | " + " | ".join(f"{mean[key]:.3f}" for key in columns) + " |")
        lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--parts", nargs="+", default=["quality", "band", "cost"], choices=["quality", "band", "cost", "tools"]
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    command = " ".join(["python benchmarks/bench_regression.py", *sys.argv[1:]])
    lines = ["# Regression", "", f"`{command}` (torch threads: {args.threads})", ""]
    if "quality" in args.parts:
        results = quality(args.splits)
        lines += [
            "## Quality on Auto MPG",
            "",
            *quality_table(results),
            "### Against the targets",
            "",
            *verdicts(results),
        ]
    if "band" in args.parts:
        lines += ["## The seed 004 sinusoid: predictive std by region", "", *band(), ""]
    if "cost" in args.parts:
        lines += [
            "## Cost of last-layer Laplace (MLP 32-512-512-64-1; targets: fit <= 1.1x, predict <= 1.1x)",
            "",
            *cost(),
            "",
        ]
    if "tools" in args.parts:
        lines += ["## Regressors' tools: dac, shift-aware selection, OOD scores", "", *tools(args.splits)]
    lines.append(f"Wall time: {time.perf_counter() - start:.0f} s.")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
