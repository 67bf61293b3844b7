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

from torch.utils.data import DataLoader

import posthoc
from posthoc_apps.demo.segmentation import trained_pixel_regressor

#: the noise std the runs that fix the noise use instead of the targets' 0.1 (too small)
TOO_SMALL, SMALLER = 0.02, 0.05
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


def main() -> None:
    net, sets = trained_pixel_regressor()
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
