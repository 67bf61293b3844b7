"""One request at a time: the per-call cost of ``um.predict(x[i:i+1])`` and of ``um.to_module()`` against a plain forward.

Run by hand (not by pytest)::

    python benchmarks/bench_serving.py                       # the bundled BN digits CNN and a timm resnet10t
    python benchmarks/bench_serving.py --calls 400 --out benchmarks/results/serving.md

On one thread (``torch.set_num_threads(1)``), batch 1, every model in eval mode. For each method the plain forward,
``um.predict`` and the exported module run alternately, one call each per round (so a busy neighbour slows all alike);
the table gives medians over the calls of wall time (µs), the ratio to the plain forward's median, and CPU time beside
wall. Targets (issue 37): calibrators <= 1.5x, last-layer Laplace with probit <= 2x, ``["laplace", "dac"]`` <= 3x, MC
dropout at the head with S = 20 <= 3x. The timm model is randomly initialised (no downloads here) and fine-tuned for a
few steps on 32-px digits so that its fitted predictives are not trivial.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import posthoc  # noqa: E402
from benchmarks.timing import once  # noqa: E402
from posthoc_apps.demo import data, zoo  # noqa: E402

warnings.filterwarnings("ignore")
TARGETS = {"temperature": 1.5, "vector": 1.5, "laplace": 2.0, "laplace+dac": 3.0, "mc-dropout S=20 (head)": 3.0}
METHODS = {
    "temperature": ("temperature", {}),
    "vector": ("vector", {}),
    "laplace": ("laplace", {}),
    "laplace+dac": (["laplace", "dac"], {}),
    "mc-dropout S=20 (head)": ("mc-dropout", {"p": 0.1, "where": "head", "num_samples": 20}),
}


def digits_bn_cnn() -> tuple[nn.Module, object, object, torch.Tensor]:
    splits = data.load_digits()
    return (
        zoo.pretrained("digits_bn_cnn").eval(),
        data.loader(splits.fit, batch_size=256),
        data.loader(splits.calibration, batch_size=256),
        splits.test.tensors[0][:64],
    )


def timm_resnet() -> tuple[nn.Module, object, object, torch.Tensor]:
    import timm

    splits = data.load_digits()
    up = lambda x: F.interpolate(x, size=32, mode="bilinear").expand(-1, 3, -1, -1)  # noqa: E731
    torch.manual_seed(0)
    model = timm.create_model("resnet10t", pretrained=False, num_classes=8)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    x, y = splits.fit.tensors
    for step in range(60):  # a short fine-tune, so the predictives have something to calibrate
        rows = torch.randint(0, len(x), (64,), generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        F.cross_entropy(model(up(x[rows])), y[rows]).backward()
        optimizer.step()
    model.eval()

    def loader(split):
        xs, ys = split.tensors
        return [(up(xs[i : i + 256]), ys[i : i + 256]) for i in range(0, len(xs), 256)]

    return model, loader(splits.fit), loader(splits.calibration), up(splits.test.tensors[0][:64])


def bench(name: str, model: nn.Module, fit, val, x: torch.Tensor, calls: int) -> list[str]:
    lines = [
        f"### {name}",
        "",
        "| method | predict µs | ratio | target | to_module µs | ratio | predict cpu/wall |",
        "|---|---|---|---|---|---|---|",
    ]
    with torch.no_grad():
        plain_samples = [once(lambda: model(x[:1])) for _ in range(calls)]
    plain = statistics.median(w for w, _ in plain_samples)
    lines.append(f"| plain forward | {plain * 1e6:.0f} | 1.00x | | | | |")
    for label, (method, options) in METHODS.items():
        um = posthoc.wrap(model, method=method, **options).fit(fit, val, progress=False, shift=None)
        try:
            exported = um.to_module(num_samples=20 if "mc-dropout" in label else None)
        except posthoc.PosthocError:
            exported = None
        walls, cpus, plains, exports = [], [], [], []
        for i in range(calls):
            row = x[i % len(x) : i % len(x) + 1]
            with torch.no_grad():
                plains.append(once(lambda: model(row))[0])
                if exported is not None:
                    exports.append(once(lambda: exported(row))[0])
            wall, cpu = once(lambda: um.predict(row))
            walls.append(wall)
            cpus.append(cpu)
        base = statistics.median(plains)
        ratio = statistics.median(walls) / base
        target = TARGETS[label]
        verdict = "met" if ratio <= target else f"missed by {ratio - target:.2f}"
        export_cell = (
            f"{statistics.median(exports) * 1e6:.0f} | {statistics.median(exports) / base:.2f}x"
            if exports
            else "refused | "
        )
        lines.append(
            f"| {label} | {statistics.median(walls) * 1e6:.0f} | {ratio:.2f}x | <= {target}x ({verdict}) | "
            f"{export_cell} | {statistics.median(cpus) / statistics.median(walls):.2f} |"
        )
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [
        f"One thread, batch 1, medians over {args.calls} calls; command: python benchmarks/bench_serving.py "
        f"--calls {args.calls}",
        "",
    ]
    lines += bench("digits_bn_cnn (bundled)", *digits_bn_cnn(), args.calls)
    lines += bench("timm resnet10t (random init, 60 fine-tune steps on 32-px digits)", *timm_resnet(), args.calls)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text("# Serving: one request at a time\n\n" + text + "\n")


if __name__ == "__main__":
    main()
