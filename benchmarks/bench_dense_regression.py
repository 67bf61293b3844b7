"""Per-pixel regression: the 90 % interval coverage, NLL and std of none, laplace and the per-position calibrators, with
the noise fitted and with it set too small.

The network of tests/engine/test_dense_regression.py (a small FCN regressing a smoothed copy of its digit canvas plus
noise of std 0.1, the top two rows without targets) is trained for 8 epochs on 128 canvases by seed; the methods are
fitted on 64 validation canvases and measured on 64 test canvases (49,152 valid pixels).
Run: ``python benchmarks/bench_dense_regression.py``.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc_apps.demo.segmentation import segmentation_data

#: the noise std of the targets; the runs that fix the noise use these instead (too small)
NOISE, TOO_SMALL, SMALLER = 0.1, 0.02, 0.05
RUNS = (
    ("none", "none", None),
    ("laplace", "laplace", None),
    ("auto", "auto", None),
    ("variance-scaling", "variance-scaling", None),
    ("none", "none", TOO_SMALL),
    ("variance-scaling", "variance-scaling", TOO_SMALL),
    ("laplace+variance-scaling", ["laplace", "variance-scaling"], TOO_SMALL),
    ("auto", "auto", TOO_SMALL),
    ("none", "none", SMALLER),
    ("isotonic", "isotonic", SMALLER),
)


def targets(images: torch.Tensor, seed: int) -> torch.Tensor:
    noise = NOISE * torch.randn(images.shape, generator=torch.Generator().manual_seed(seed))
    found = F.avg_pool2d(images, 5, 1, 2) * 2 + noise
    found[..., :2, :] = float("nan")
    return found


def main() -> None:
    data = segmentation_data(train=128, val=64, test=64)
    sets = [
        TensorDataset(d.tensors[0], targets(d.tensors[0], i)) for i, d in enumerate((data.train, data.val, data.test))
    ]
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Dropout(0.1),
        nn.Conv2d(8, 1, 1),
    )  # fmt: skip
    optimiser = torch.optim.Adam(net.parameters(), 1e-2)
    for _ in range(8):
        for x, t in DataLoader(sets[0], batch_size=32, shuffle=True):
            loss = (net(x) - torch.nan_to_num(t))[torch.isfinite(t)].pow(2).mean()
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    net.eval()
    train, val, test = (DataLoader(s, batch_size=32) for s in sets)
    print("| method | noise | chosen | coverage 90% | NLL | mean std | fit s |")
    print("|---|---|---|---:|---:|---:|---:|")
    for label, method, noise in RUNS:
        likelihood = "regression" if noise is None else posthoc.Gaussian(noise_std=noise)
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            um = posthoc.wrap(net, method=method, dense=True, likelihood=likelihood).fit(train, val, progress=False)
        seconds = time.perf_counter() - start
        row = next(iter(posthoc.evaluate(um, test).rows.values()))
        chosen = um.summary().get("calibration", {}).get("chosen", "")
        print(
            f"| {label} | {'fitted' if noise is None else noise} | {chosen} | {row['coverage 90%']:.3f} | "
            f"{row['NLL']:.4f} | {row['mean std']:.4f} | {seconds:.1f} |"
        )


if __name__ == "__main__":
    main()
