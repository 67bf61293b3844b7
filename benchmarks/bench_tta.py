"""Test-time augmentation on the bundled BatchNorm checkpoint: NLL in distribution and under the evaluation kinds per
strength, what the selection step picks, and the cost of predict against a plain forward.

Run by hand (not by pytest)::

    python benchmarks/bench_tta.py                    # digits_bn_cnn, V=8
    python benchmarks/bench_tta.py --out benchmarks/results/tta.md

The shifts are :data:`posthoc.shift.EVALUATION_KINDS` (rotate, contrast, translate, occlude) at severity 3, one
fixed draw: kinds that neither the augmentations (noise, blur, zoom) nor the fit-time perturbations (noise, blur,
impulse) use. Predict cost: medians of 5 timings of ``um.predict`` over the 1,000 test digits against a plain
forward over them, wall and process CPU beside it (``benchmarks/timing.py``).
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
from posthoc.shift import EVALUATION_KINDS  # noqa: E402
from posthoc_apps.demo import data, zoo  # noqa: E402

warnings.filterwarnings("ignore")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="digits_bn_cnn")
    parser.add_argument("--views", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    splits = data.load_digits()
    model = zoo.pretrained(args.arch)
    fit, val = data.loader(splits.fit, batch_size=256), data.loader(splits.calibration, batch_size=256)
    x, y = splits.test.tensors
    shifted = {
        kind: posthoc.shift.corrupt_images(
            x, kind, 3, torch.Generator().manual_seed(0), normalization=(data.MEAN, data.STD)
        )
        for kind in EVALUATION_KINDS
    }

    def scores(predict) -> list[float]:
        return [nll(predict(x), y), *[nll(predict(shifted[kind]), y) for kind in EVALUATION_KINDS]]

    with torch.no_grad():
        plain = scores(lambda inputs: torch.softmax(model(inputs), -1))
    head = (
        "| predictive | NLL in distribution | ratio | " + " | ".join(EVALUATION_KINDS) + " | mean over kinds | ratio |"
    )
    lines = [head, "|" + "---|" * (len(EVALUATION_KINDS) + 5)]

    def row(label: str, values: list[float]) -> str:
        mean, plain_mean = sum(values[1:]) / len(EVALUATION_KINDS), sum(plain[1:]) / len(EVALUATION_KINDS)
        return (
            f"| {label} | {values[0]:.4f} | {values[0] / plain[0]:.3f}x | "
            + " | ".join(f"{v:.3f}" for v in values[1:])
            + f" | {mean:.3f} | {mean / plain_mean:.3f}x |"
        )

    lines.append(row("plain", plain))
    for strength in (0.125, 0.25, 0.5, 1.0, 2.0, 4.0):
        um = posthoc.wrap(model, method="tta", views=args.views, strength=strength).fit(fit, progress=False)
        lines.append(row(f"strength {strength:g}", scores(lambda inputs: um.predict(inputs).probs)))
    um = posthoc.wrap(model, method="tta", views=args.views).fit(fit, val, progress=False)
    chosen = um.summary()["selection"]["chosen"]
    lines.append(row(f"auto (chose {chosen})", scores(lambda inputs: um.predict(inputs).probs)))

    timed = posthoc.wrap(model, method="tta", views=args.views, strength=1.0).fit(fit, progress=False)
    forward = measure(lambda: model(x), repeats=5)
    predict = measure(lambda: timed.predict(x), repeats=5)
    text = "\n".join(
        [
            *lines,
            "",
            f"predict with V={args.views} views on {len(x)} digits (one thread): "
            f"{predict.wall / forward.wall:.1f}x a plain forward in wall time ({predict.wall:.3f} s against "
            f"{forward.wall:.3f} s), {predict.cpu / forward.cpu:.1f}x in CPU time ({predict.cpu:.3f} s "
            f"against {forward.cpu:.3f} s)",
            "",
            f"command: python benchmarks/bench_tta.py --arch {args.arch}",
        ]
    )
    print(text)
    if args.out:
        args.out.write_text(f"# Test-time augmentation on {args.arch}\n\n" + text + "\n")


if __name__ == "__main__":
    main()
