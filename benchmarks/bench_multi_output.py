"""Multi-output regression: the noise fitted per output against the true one, and each output's conformal coverage.

The data (``--seeds`` seeds, default 3): 4 inputs, 3 outputs ``y_d = f_d(x) + σ_d ε`` with true noise
``σ = (0.1, 0.5, 3.0)`` (a 30x spread); an MLP (4-64-64-3) trained per seed on 2,000 rows, the noise fitted on
1,000 held-out rows, and a pool of 2,000 further rows. Per method with a noise per output (``none``, last-layer
``laplace``, ``mc-dropout``, an ensemble of 3 plain members):

- **Noise**: each output's fitted ``σ_d`` over the true one (mean over seeds, with the smallest and largest seed),
  and the test NLL per output against the same predictive with ONE noise shared by the outputs (fitted by maximum
  likelihood on the same held-out rows, what every method did before).
- **Coverage**: ``--splits`` (default 200) random calibration/test halves of the pool; per output the mean coverage
  of the 90 % split-conformal interval (normalised score), its 5th-95th percentiles over the splits against the
  finite-sample law's (Beta-binomial(1000, k, 1001 - k), ``k = ceil(1001 · 0.9)``), and the coverage of the
  predictive's own central 90 % interval (no conformal step). Target: each output's mean conformal coverage in
  0.88-0.92.

Run: ``python benchmarks/bench_multi_output.py --out benchmarks/results/multi_output.md``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.core.likelihood import Gaussian
from posthoc.core.prediction import RegressionPrediction

TRUE_STD = (0.1, 0.5, 3.0)
METHODS = (
    ("none", "none", {}),
    ("laplace (kron)", "laplace", {}),
    ("mc-dropout", "mc-dropout", {}),
    ("ensemble of 3", "ensemble", {}),
)
TRAIN, VAL, POOL = 2000, 1000, 2000
ALPHA = 0.1
EPOCHS = 3000


def _data(rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.rand(rows, 4, generator=generator) * 4 - 2
    means = torch.stack([torch.sin(2 * x[:, 0]) + x[:, 1], x[:, 2] * x[:, 3], 3 * torch.cos(x[:, 0] + x[:, 3])], 1)
    return x, means + torch.randn(rows, 3, generator=generator) * torch.tensor(TRUE_STD)


def _mlp(x: torch.Tensor, y: torch.Tensor, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.05), nn.Linear(64, 3))
    optimiser = torch.optim.Adam(net.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, EPOCHS)
    scale = torch.tensor(TRUE_STD)  # every output's noise weighted alike in the training loss
    for _ in range(EPOCHS):
        optimiser.zero_grad()
        ((net(x) - y) / scale).square().mean().backward()
        optimiser.step()
        schedule.step()
    return net.eval()


def _loader(x: torch.Tensor, y: torch.Tensor) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=500)


def _shared(pred: RegressionPrediction, val: RegressionPrediction, y_val: torch.Tensor) -> RegressionPrediction:
    """``pred``'s components with one noise shared by the outputs, fitted on the held-out rows as before."""
    gaussian = Gaussian()
    gaussian.fit_noise(val.component_means.double(), val.model_variances.double(), y_val.double())
    return RegressionPrediction.from_components(
        pred.component_means, pred.model_variances, torch.full((1, 1, 3), gaussian.dispersion, dtype=pred.mean.dtype)
    )


def _marginal_nll(pred: RegressionPrediction, y: torch.Tensor) -> torch.Tensor:
    """``(D,)``: each output's mean NLL under its marginal predictive."""
    return -pred.distribution.marginal_log_prob(y).mean(0)


def run_seed(seed: int, splits: int) -> dict[str, dict[str, list[float]]]:
    generator = torch.Generator().manual_seed(seed)
    x, y = _data(TRAIN + VAL + POOL, generator)
    train, val, pool = slice(0, TRAIN), slice(TRAIN, TRAIN + VAL), slice(TRAIN + VAL, None)
    nets = [_mlp(x[train], y[train], 10 * seed + member) for member in range(3)]
    found = {}
    for label, method, options in METHODS:
        model = nets if method == "ensemble" else nets[0]
        um = posthoc.wrap(model, method="none" if method == "ensemble" else method, likelihood="regression", **options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            um.fit(_loader(x[train], y[train]), _loader(x[val], y[val]), progress=False)
        noise = (
            torch.stack([m.likelihood.noise_std for m in um.method.members]).square().mean(0).sqrt()
            if method == "ensemble"
            else um.likelihood.noise_std
        )
        predict = lambda rows: um.predict(x[rows], generator=torch.Generator().manual_seed(0))  # noqa: E731
        pred, held_out = predict(pool), predict(val)
        shared = _shared(pred, held_out, y[val])
        gain = (_marginal_nll(shared, y[pool]) - _marginal_nll(pred, y[pool])).tolist()
        lower, upper = pred.interval(1 - ALPHA)
        raw = ((lower <= y[pool]) & (y[pool] <= upper)).double().mean(0).tolist()
        coverage = torch.empty(splits, 3, dtype=torch.float64)
        order_generator = torch.Generator().manual_seed(1000 + seed)
        for split in range(splits):
            order = torch.randperm(POOL, generator=order_generator)
            cal, test = order[: POOL // 2], order[POOL // 2 :]
            part = lambda rows: RegressionPrediction.from_components(
                pred.mean[rows][None],
                None,  # noqa: E731
                pred.variance[rows][None],
            )
            cp = posthoc.conformal(part(cal), y[pool][cal], alpha=ALPHA)
            low, high = cp.intervals(part(test))
            coverage[split] = ((low <= y[pool][test]) & (y[pool][test] <= high)).double().mean(0)
        residual = (pred.mean - y[pool]).square().mean(0).sqrt().double() / torch.tensor(TRUE_STD, dtype=torch.float64)
        found[label] = {
            "residual": residual.tolist(),
            "ratio": (noise.double() / torch.tensor(TRUE_STD, dtype=torch.float64)).tolist(),
            "gain": gain,
            "raw": raw,
            "mean": coverage.mean(0).tolist(),
            "p5": coverage.quantile(0.05, dim=0).tolist(),
            "p95": coverage.quantile(0.95, dim=0).tolist(),
        }
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--splits", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    runs = [run_seed(seed, args.splits) for seed in range(args.seeds)]
    half = POOL // 2
    k = math.ceil((half + 1) * (1 - ALPHA))
    law = stats.betabinom(half, k, half + 1 - k)
    low, high = law.ppf(0.05) / half, law.ppf(0.95) / half
    command = " ".join(["python benchmarks/bench_multi_output.py", *sys.argv[1:]])
    lines = [
        "# Multi-output regression: a noise per output",
        "",
        f"`{command}` (torch threads: {args.threads}; "
        f"{args.seeds} seeds, {args.splits} calibration/test splits of {half}/{half} rows per seed)",
        "",
        f"True noise σ = {TRUE_STD}.",
        "",
        "## The fitted noise per output",
        "",
        "σ_d fitted / true: mean over seeds [smallest, largest]; ΔNLL: each output's test NLL with one shared "
        "noise minus with the noise per output (nats per row, mean over seeds; positive: the noise per output is "
        "better).",
        "",
        "| method | σ₁/true | σ₂/true | σ₃/true | ΔNLL₁ | ΔNLL₂ | ΔNLL₃ |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, _, _ in METHODS:
        cells = []
        for d in range(3):
            ratios = [run[label]["ratio"][d] for run in runs]
            cells.append(f"{statistics.mean(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]")
        cells += [f"{statistics.mean(run[label]['gain'][d] for run in runs):+.3f}" for d in range(3)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    plain = [statistics.mean(run["none"]["residual"][d] for run in runs) for d in range(3)]
    lines += [
        "",
        "The plain network's test RMSE over the true σ_d (its own error adds to the noise, most on the quietest "
        f"output): {', '.join(f'{value:.3f}' for value in plain)}.",
        "",
        "## Coverage of each output's 90 % interval",
        "",
        f"Conformal: mean over all splits and seeds [5th-95th percentile of the per-split coverage; the "
        f"finite-sample law's: {low:.3f}-{high:.3f}, mean {law.mean() / half:.4f}]. Raw: the predictive's own "
        "central 90 % interval on the whole pool, mean over seeds. Target: conformal mean in 0.88-0.92.",
        "",
        "| method | conformal y₁ | conformal y₂ | conformal y₃ | raw y₁ | raw y₂ | raw y₃ | target met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, _, _ in METHODS:
        means = [statistics.mean(run[label]["mean"][d] for run in runs) for d in range(3)]
        cells = [
            f"{means[d]:.4f} [{np.mean([run[label]['p5'][d] for run in runs]):.3f}-"
            f"{np.mean([run[label]['p95'][d] for run in runs]):.3f}]"
            for d in range(3)
        ]
        cells += [f"{statistics.mean(run[label]['raw'][d] for run in runs):.3f}" for d in range(3)]
        met = all(0.88 <= m <= 0.92 for m in means)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {'yes' if met else 'no'} |")
    lines += ["", f"Wall time: {time.perf_counter() - start:.0f} s."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
