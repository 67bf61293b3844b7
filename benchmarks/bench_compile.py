"""Does ``torch.compile`` pay off on posthoc's sampling kernels? Eager vs compiled, same inputs.

The kernel is the last-layer Laplace MC predictive at ImageNet shape, per chunk: draw ``S`` logit
samples from a KFAC logit Gaussian (shared ``C x C`` basis), log-softmax them and reduce them to a
:class:`posthoc.Prediction` (mean, entropy, aleatoric / epistemic split). Both versions are traced
with ``fullgraph=True`` in the tests (``tests/engine/test_compile.py``), so they compile without breaks.

Run by hand::

    python benchmarks/bench_compile.py --device cuda      # rows=256, S=100, C=1,000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from timing import measure  # noqa: E402

from posthoc.core.prediction import Prediction  # noqa: E402
from posthoc.methods.laplace.glm_predictive import LogitGaussian, mc_log_probs  # noqa: E402


def kernel(g: LogitGaussian, num_samples: int) -> Prediction:
    return Prediction.from_log_probs(*mc_log_probs(g, num_samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=100)
    args = parser.parse_args()
    generator = torch.Generator(device=args.device).manual_seed(0)
    c = args.classes
    g = LogitGaussian(
        torch.randn(args.rows, c, device=args.device, generator=generator),
        torch.rand(args.rows, c, device=args.device, generator=generator),
        torch.linalg.qr(torch.randn(c, c, device=args.device, generator=generator))[0],
    )
    compiled = torch.compile(kernel, fullgraph=True)
    with torch.no_grad():
        eager_time = measure(lambda: kernel(g, args.samples), repeats=10)
        compile_time = measure(lambda: compiled(g, args.samples), repeats=10, warmup=2)
    print(
        f"rows={args.rows} C={c} S={args.samples} on {args.device}: eager {1e3 * eager_time.wall:.2f} ms, "
        f"compiled {1e3 * compile_time.wall:.2f} ms ({eager_time.wall / compile_time.wall:.2f}x)"
    )


if __name__ == "__main__":
    main()
