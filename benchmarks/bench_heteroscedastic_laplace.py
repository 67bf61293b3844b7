"""Heteroscedastic last-layer Laplace: a network that predicts a mean and a log-variance, with a posterior on its head.

Both targets of issue 38, against the plain heteroscedastic network (``method="none"``, its own mean and variance):

- **Growing noise** (``--seeds`` seeds, default 3): ``y = sin(2x) + (0.05 + 0.15 (x + 2)) ε`` for ``x ~ U(-2, 2)``,
  200 training, 100 validation and 2,000 test points; a ``1-64-64-2`` tanh MLP trained per seed on the Gaussian
  NLL (:func:`train_heteroscedastic_mlp`). Each Laplace variant is ``fit(train, val)`` with its defaults (the prior
  ``"auto"``, which is the evidence's under this likelihood), and two with ``prior_precision="val"`` (the selection
  step on held-out NLL); the table gives the test NLL per seed and its mean, and ``ΔNLL`` against the plain network
  on the same seed (negative is better). Target: no worse than the plain network.
- **The seed 004 sinusoid with a gap** (:func:`posthoc_apps.demo.data.sinusoid`, 40 training points in two
  clusters): the mean predictive std in the gap between the clusters over that on the training inputs (and beyond
  the data), for the plain network and each Laplace variant. Target: the ratio above 1, and above the plain
  network's.

Every fit runs with its ``link``: ``"probit"`` (the default: the Gaussian of the predictive's moments) or ``"mc"``
(the mixture over 200 draws of the mean and log-variance).

Run: ``python benchmarks/bench_heteroscedastic_laplace.py --seeds 3
--out benchmarks/results/heteroscedastic_laplace.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc_apps.demo.data import sinusoid

#: (label, wrap options) of the Laplace variants; the plain network is the reference row
VARIANTS = (
    ("laplace (kron)", {}),
    ("laplace (full)", {"hessian": "full"}),
    ("laplace (diag)", {"hessian": "diag"}),
    ("laplace (kron, link='mc')", {"link": "mc", "num_samples": 200}),
    ("laplace (full, link='mc')", {"hessian": "full", "link": "mc", "num_samples": 200}),
    ("laplace (kron, prior 'val')", {"prior_precision": "val"}),
    ("laplace (full, prior 'val')", {"hessian": "full", "prior_precision": "val"}),
)
EPOCHS, HIDDEN = 2000, 64


def growing_noise(seed: int, *, train: int = 200, val: int = 100, test: int = 2000) -> dict[str, tuple[Tensor, Tensor]]:
    """``y = sin(2x) + (0.05 + 0.15 (x + 2)) ε``, ``x ~ U(-2, 2)``: the noise std grows from 0.05 to 0.65."""
    generator = torch.Generator().manual_seed(seed)
    parts = {}
    for name, rows in (("train", train), ("val", val), ("test", test)):
        x = torch.rand(rows, 1, generator=generator) * 4 - 2
        parts[name] = (x, torch.sin(2 * x) + (0.05 + 0.15 * (x + 2)) * torch.randn(rows, 1, generator=generator))
    return parts


def train_heteroscedastic_mlp(
    train: tuple[Tensor, Tensor], *, seed: int = 0, epochs: int = EPOCHS, hidden: int = HIDDEN, lr: float = 5e-3
) -> nn.Module:
    """A ``Linear-Tanh-Linear-Tanh-Linear`` MLP with outputs ``(mean, log-variance)`` fitted full-batch by Adam: the
    first quarter of the epochs on the squared error of the mean (the log-variance held at 0), then the Gaussian NLL
    of both (the usual warm-up, so the variance does not absorb a mean not yet fitted). In eval mode."""
    x, y = train
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Linear(x.shape[1], hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, 2 * y.shape[1]),
    )
    optimiser = torch.optim.Adam(net.parameters(), lr)
    width = y.shape[1]
    for epoch in range(epochs):
        optimiser.zero_grad()
        out = net(x)
        means, log_variances = out[:, :width], out[:, width:]
        if epoch < epochs // 4:
            loss = (y - means).square().mean() + log_variances.square().mean()
        else:
            loss = 0.5 * (log_variances + (y - means).square() * (-log_variances).exp()).mean()
        loss.backward()
        optimiser.step()
    return net.eval()


def _loader(pair: tuple[Tensor, Tensor], batch_size: int = 256) -> DataLoader:
    return DataLoader(TensorDataset(*pair), batch_size=batch_size)


def _fit(
    net: nn.Module, train: tuple[Tensor, Tensor], val: tuple[Tensor, Tensor] | None, options: dict
) -> posthoc.UncertainModel:
    um = posthoc.wrap(net, method="laplace", likelihood="heteroscedastic", **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return um.fit(_loader(train), None if val is None else _loader(val), progress=False)


def _nll(um: posthoc.UncertainModel, pair: tuple[Tensor, Tensor]) -> float:
    return float(-um.predict(pair[0], generator=torch.Generator().manual_seed(0)).log_prob(pair[1]).mean())


def growing(seeds: int) -> list[str]:
    rows: dict[str, list[float]] = {}
    priors: dict[str, list[float]] = {}
    for seed in range(seeds):
        data = growing_noise(seed)
        net = train_heteroscedastic_mlp(data["train"], seed=seed)
        rows.setdefault("none (plain heteroscedastic network)", []).append(
            _nll(posthoc.wrap(net, method="none", likelihood="heteroscedastic"), data["test"])
        )
        for label, options in VARIANTS:
            um = _fit(net, data["train"], data["val"], options)
            rows.setdefault(label, []).append(_nll(um, data["test"]))
            priors.setdefault(label, []).append(float(um.method.prior_precision))
        print(f"growing noise, seed {seed}: done", file=sys.stderr)
    plain = rows["none (plain heteroscedastic network)"]
    seed_columns = " | ".join(f"NLL seed {s}" for s in range(seeds))
    lines = [
        f"| method | {seed_columns} | mean NLL | ΔNLL vs plain (mean / worst seed) | prior precision (median) |",
        "|---|" + "---|" * (seeds + 4),
    ]
    for label, values in rows.items():
        deltas = [v - p for v, p in zip(values, plain)]
        prior = f"{statistics.median(priors[label]):.3g}" if label in priors else "–"
        lines.append(
            f"| {label} | {' | '.join(f'{v:.4f}' for v in values)} | {statistics.fmean(values):.4f} | "
            f"{statistics.fmean(deltas):+.4f} / {max(deltas):+.4f} | {prior} |"
        )
    verdict = all(max(v - p for v, p in zip(values, plain)) <= 0 for label, values in rows.items() if label in priors)
    answer = "yes" if verdict else "no"
    return lines + ["", f"Every Laplace variant no worse than the plain network on every seed: **{answer}**.", ""]


def gap() -> list[str]:
    data = sinusoid()
    net = train_heteroscedastic_mlp(data.train, seed=0)
    lines = [
        "| method | prior | prior precision | std on training inputs | std in the gap | std beyond | "
        "gap / train | beyond / train | epistemic std in the gap |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    plain = posthoc.wrap(net, method="none", likelihood="heteroscedastic")
    entries = [("none (plain heteroscedastic network)", "–", plain)]
    for label, options in VARIANTS:
        entries.append((label, options.get("prior_precision", "auto"), _fit(net, data.train, data.val, options)))
    ratios = {}
    for label, prior, um in entries:
        preds = {name: um.predict(x, generator=torch.Generator().manual_seed(0)) for name, x in data.regions.items()}
        std = {name: float(pred.std.mean()) for name, pred in preds.items()}
        delta = f"{float(um.method.prior_precision):.3g}" if prior != "–" else "–"
        ratios[label] = std["gap"] / std["train"]
        prior = "auto (= marglik)" if prior == "auto" else prior
        lines.append(
            f"| {label} | {prior} | {delta} | {std['train']:.4f} | {std['gap']:.4f} | {std['beyond']:.4f} | "
            f"{ratios[label]:.2f} | {std['beyond'] / std['train']:.2f} | "
            f"{float(preds['gap'].epistemic.sqrt().mean()):.4f} |"
        )
    plain = ratios.pop(entries[0][0])
    met = [label for label, ratio in ratios.items() if 1 < ratio < float("inf") and ratio > plain]
    missed = [label for label in ratios if label not in met]
    return lines + [
        "",
        f"gap / train above 1, finite and above the plain network's {plain:.2f}: met by "
        f"{', '.join(met) or 'none'}; missed by {', '.join(missed) or 'none'}.",
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--parts", nargs="+", default=["growing", "gap"], choices=["growing", "gap"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    command = " ".join(["python benchmarks/bench_heteroscedastic_laplace.py", *sys.argv[1:]])
    lines = ["# Heteroscedastic last-layer Laplace", "", f"`{command}` (torch threads: {args.threads})", ""]
    if "growing" in args.parts:
        lines += [
            f"## Noise growing with x: test NLL over {args.seeds} seeds (target: no worse than the plain network)",
            "",
            *growing(args.seeds),
        ]
    if "gap" in args.parts:
        lines += [
            "## The seed 004 sinusoid: predictive std by region (target: gap / train > 1, above the plain network's)",
            "",
            *gap(),
        ]
    lines.append(f"Wall time: {time.perf_counter() - start:.0f} s.")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
