"""iBNN quality and cost on both bundled checkpoints (run by hand: ``python benchmarks/bench_ibnn.py``).

Quality (the protocol of issue 15): ``posthoc.wrap(model, method="ibnn", recipe=...).fit(loader(fit,
64, shuffle=True), loader(calibration))`` for the default recipe (``"posthoc"``) and the paper's
(``"paper"``), then NLL / ECE on the test digits rotated by 0, 45 and 90 degrees next to
the plain model, and the verdict of section 2 (in-distribution NLL <= 1.02x plain, NLL at 45 and 90
degrees below plain). Cost: the fit's wall and process-CPU seconds, and ``predict`` over the 1,000
test digits as a ratio of medians to one plain forward over them, timed back to back.

Example:
    $ python benchmarks/bench_ibnn.py --threads 2
    $ python benchmarks/bench_ibnn.py --archs digits_bn_cnn --recipes posthoc --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import posthoc
from posthoc.evaluation import metrics
from posthoc_apps.demo import data, zoo

try:
    from timing import measure
except ImportError:  # run from the repository root
    from benchmarks.timing import measure

ANGLES = (0, 45, 90)
ARCHS = ("digits_cnn", "digits_bn_cnn")
#: the recipes compared (``posthoc.methods.ibnn.recipes``)
RECIPES = ("posthoc", "paper")


def checkpoint(arch: str, seed: int) -> torch.nn.Module:
    """The bundled checkpoint for seed 0, a retrained one (``zoo.train``) for any other seed."""
    return zoo.pretrained(arch) if seed == 0 else zoo.train(seed, name=arch, progress=False)


def scores(predict, splits: data.DigitsSplits) -> dict[int, tuple[float, float]]:
    """``angle -> (NLL, ECE)`` of ``predict(x) -> probs`` on the rotated test digits."""
    out = {}
    for angle in ANGLES:
        x, y = data.rotated(splits.test, angle).tensors
        probs = predict(x)
        out[angle] = (metrics.nll(probs, y), metrics.ece(probs, y))
    return out


def run_case(model: torch.nn.Module, splits: data.DigitsSplits, recipe: str, seed: int) -> dict:
    """Fit one recipe on ``model`` and measure it; returns its scores, ratios to plain and costs."""
    torch.manual_seed(seed)
    um = posthoc.wrap(model, method="ibnn", recipe=recipe, seed=seed)
    wall, cpu = time.perf_counter(), time.process_time()
    um.fit(data.loader(splits.fit, 64, shuffle=True, seed=seed), data.loader(splits.calibration), progress=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    generator = torch.Generator().manual_seed(seed)
    result = scores(lambda x: um.predict(x, generator=generator).probs, splits)
    x = splits.test.tensors[0]
    with torch.no_grad():
        plain_time = measure(lambda: model(x), repeats=3)
        predict_time = measure(lambda: um.predict(x), repeats=3)
    return {
        "scores": result,
        "fit_wall": wall,
        "fit_cpu": cpu,
        "predict_ratio": predict_time.wall / plain_time.wall,
        "predict_cpu_per_wall": predict_time.cpu_per_wall,
        "summary": um.method.summary(),
    }


def report(arch: str, recipe: str, plain: list[dict], cases: list[dict], fit_examples: int) -> None:
    """Print one Markdown block: mean (and spread over seeds) of NLL / ECE per angle, the verdict, the costs."""
    print(f"\n### {arch}, iBNN recipe `{recipe}` ({len(cases)} seed(s))\n")
    print("| rotation | plain NLL | iBNN NLL | ratio | plain ECE | iBNN ECE |")
    print("|---|---|---|---|---|---|")
    ratios = {}
    for angle in ANGLES:
        p_nll = [s[angle][0] for s in plain]
        m_nll = [c["scores"][angle][0] for c in cases]
        ratios[angle] = statistics.mean(m / p for m, p in zip(m_nll, p_nll))
        spread = f" ± {statistics.stdev(m_nll):.3f}" if len(m_nll) > 1 else ""
        print(
            f"| {angle} | {statistics.mean(p_nll):.4f} | {statistics.mean(m_nll):.4f}{spread} | {ratios[angle]:.3f} | "
            f"{statistics.mean(s[angle][1] for s in plain):.4f} | {statistics.mean(c['scores'][angle][1] for c in cases):.4f} |"
        )
    meets = ratios[0] <= 1.02 and all(ratios[a] < 1 for a in ANGLES[1:])
    card = cases[0]["summary"]
    print(
        f"\nissue 15 section 2: {'met' if meets else 'NOT met'} (in-distribution ratio {ratios[0]:.3f} <= 1.02, "
        f"45/90 ratios {ratios[45]:.3f} / {ratios[90]:.3f} < 1)"
    )
    print(
        f"fit {statistics.median(c['fit_wall'] for c in cases):.1f} s wall, "
        f"{statistics.median(c['fit_cpu'] for c in cases):.1f} s CPU ({card['epochs']} epochs over {fit_examples} digits); "
        f"predict {statistics.median(c['predict_ratio'] for c in cases):.1f}x a plain forward "
        f"({card['test_samples']} samples, cpu/wall {statistics.median(c['predict_cpu_per_wall'] for c in cases):.2f}); "
        f"{card['random_variables']} node variables per component, K={card['components']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    splits = data.load_digits()
    for arch in args.archs:
        models = {seed: checkpoint(arch, seed) for seed in args.seeds}
        plain = []
        for seed in args.seeds:
            with torch.no_grad():
                plain.append(scores(lambda x: models[seed](x).softmax(-1), splits))
        for recipe in args.recipes:
            cases = [run_case(models[seed], splits, recipe, seed) for seed in args.seeds]
            report(arch, recipe, plain, cases, len(splits.fit))


if __name__ == "__main__":
    main()
