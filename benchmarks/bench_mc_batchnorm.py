"""MC BatchNorm on the bundled BatchNorm checkpoint: NLL in distribution and under shift per mini-batch size, what the
selection step picks, and the cost against a plain forward.

Run by hand (not by pytest)::

    python benchmarks/bench_mc_batchnorm.py            # digits_bn_cnn, S=16
    python benchmarks/bench_mc_batchnorm.py --out benchmarks/results/mc_batchnorm.md

The shift is a 45-degree rotation (severity 3) of the test digits (a kind no fit-time perturbation uses: those are noise, blur and
impulse). Medians of 3 timings, CPU time beside wall.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import posthoc  # noqa: E402
from benchmarks.timing import measure  # noqa: E402
from posthoc.evaluation.metrics import nll  # noqa: E402
from posthoc_apps.demo import data, zoo  # noqa: E402

warnings.filterwarnings("ignore")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    splits = data.load_digits()
    model = zoo.pretrained("digits_bn_cnn")
    fit, val = data.loader(splits.fit, batch_size=256), data.loader(splits.calibration, batch_size=256)
    x, y = splits.test.tensors
    rotated = posthoc.shift.corrupt_images(
        x, "rotate", 3, torch.Generator().manual_seed(0), normalization=(data.MEAN, data.STD)
    )
    with torch.no_grad():
        plain, plain_shift = torch.softmax(model(x), -1), torch.softmax(model(rotated), -1)
    lines = [
        "| predictive | NLL in distribution | ratio | NLL under shift | ratio |",
        "|---|---|---|---|---|",
        f"| plain | {nll(plain, y):.4f} | 1.00x | {nll(plain_shift, y):.4f} | 1.00x |",
    ]
    for size in (128, 64, 32, 16):
        um = posthoc.wrap(model, method="mc-batchnorm", batch_size=size).fit(fit, progress=False)
        p, q = um.predict(x).probs, um.predict(rotated).probs
        lines.append(
            f"| b={size} | {nll(p, y):.4f} | {nll(p, y) / nll(plain, y):.2f}x | {nll(q, y):.4f} | "
            f"{nll(q, y) / nll(plain_shift, y):.2f}x |"
        )
    fitted = measure(
        lambda: posthoc.wrap(model, method="mc-batchnorm").fit(fit, val, progress=False), repeats=1, warmup=0
    )
    um = posthoc.wrap(model, method="mc-batchnorm").fit(fit, val, progress=False)
    p, q = um.predict(x).probs, um.predict(rotated).probs
    chosen = um.summary()["selection"]["chosen"]
    lines.append(
        f"| auto (chose {chosen}) | {nll(p, y):.4f} | {nll(p, y) / nll(plain, y):.2f}x | {nll(q, y):.4f} | "
        f"{nll(q, y) / nll(plain_shift, y):.2f}x |"
    )
    forward = measure(lambda: model(x), repeats=3)
    sampled = posthoc.wrap(model, method="mc-batchnorm", batch_size=32).fit(fit, progress=False)
    predict = measure(lambda: sampled.predict(x), repeats=3)
    text = "\n".join(
        [
            *lines,
            "",
            f"fit with the choice (batch_size='auto'): {fitted.wall:.1f} s wall, "
            f"{fitted.cpu:.1f} s CPU; predict S=16 on {len(x)} digits: {predict.wall / forward.wall:.1f}x "
            f"a plain forward ({predict.wall:.3f} s against {forward.wall:.3f} s; cpu/wall "
            f"{predict.cpu_per_wall:.2f})",
            "",
            "command: python benchmarks/bench_mc_batchnorm.py",
        ]
    )
    print(text)
    if args.out:
        args.out.write_text("# MC BatchNorm on digits_bn_cnn\n\n" + text + "\n")


if __name__ == "__main__":
    main()
