"""OOD detectors (``posthoc.detector``) on both bundled digits checkpoints: detection quality and cost.

For ``digits_cnn`` and ``digits_bn_cnn``, every score of the plain model (fitted on the fit split, defaults), and
the entropy / mutual information of MC dropout, are measured on the 1000 test digits (0-7) against
three OOD sets: the held-out digits 8 and 9 (near), and two far ones, normalised like the digits: uniform noise
images and gratings (the sum of two sinusoidal gratings of random orientation, frequency and phase).
Costs: scoring the 1000 test digits, each score alone and all scores together (one shared forward),
as a ratio to the plain forward over the same batch; fitting the statistics as a ratio to one plain
forward pass over the fit split; and pytorch-ood's detectors on the same model for the scores whose
algorithm is shared. Medians of repeats, CPU time beside wall time (``timing.py``).

Run: ``python benchmarks/bench_ood.py [--threads 1] [--out benchmarks/results/ood.md]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from pytorch_ood import detector as pood

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import Timing, measure  # noqa: E402

import posthoc  # noqa: E402
from posthoc.engine.head import FeatureSplit  # noqa: E402
from posthoc.evaluation import metrics  # noqa: E402
from posthoc.ood.detector import SCORES, available_scores  # noqa: E402
from posthoc_apps.demo import data, zoo  # noqa: E402

ARCHITECTURES = ("digits_cnn", "digits_bn_cnn")
PLAIN_SCORES = [name for name in available_scores() if name != "mutual-information"]
FITTED_SCORES = [name for name in PLAIN_SCORES if SCORES[name].fit_passes]
NOISE_SEED = 0
REPEATS = 9
HEADER = "| what | wall s (median) | wall ratio | CPU s (median) | CPU ratio | cpu/wall |\n|---|---|---|---|---|---|"


def row(name: str, timing: Timing, reference: Timing) -> str:
    """Wall and process-CPU medians as ratios to ``reference``: on a shared machine the CPU ratio (one thread) is
    the steadier one; cpu/wall < 0.5 marks a contended wall time."""
    flag = " (contended)" if timing.contended else ""
    return (
        f"| {name} | {timing.wall:.4f} | {timing.wall / reference.wall:.2f}x | {timing.cpu:.4f} | "
        f"{timing.cpu / reference.cpu:.2f}x | {timing.cpu_per_wall:.2f}{flag} |"
    )


def noise_images(count: int) -> torch.Tensor:
    """Uniform noise in pixel space, normalised as the digits are."""
    pixels = torch.rand(count, 1, 28, 28, generator=torch.Generator().manual_seed(NOISE_SEED))
    return (pixels - data.MEAN) / data.STD


def gratings(count: int) -> torch.Tensor:
    """Two sinusoidal gratings per image, of random orientation, frequency (1 to 6 cycles) and phase, in [0, 1],
    normalised as the digits are: a far-OOD texture with the digits' spatial scales."""
    generator = torch.Generator().manual_seed(NOISE_SEED + 1)
    grid = torch.stack(torch.meshgrid(torch.arange(28.0), torch.arange(28.0), indexing="ij")) / 28  # (2, 28, 28)
    angle = torch.rand(count, 2, generator=generator) * torch.pi
    cycles = 1 + 5 * torch.rand(count, 2, generator=generator)
    phase = torch.rand(count, 2, generator=generator) * 2 * torch.pi
    direction = torch.stack([angle.cos(), angle.sin()], -1)  # (count, 2, 2)
    along = torch.einsum("ngd,dhw->nghw", direction, grid)
    waves = torch.sin(2 * torch.pi * cycles[..., None, None] * along + phase[..., None, None]).sum(1, keepdim=True)
    pixels = (waves + 2) / 4
    return (pixels - data.MEAN) / data.STD


OOD_SETS = ("8/9", "noise", "gratings")


def quality(arch: str, splits: data.DigitsSplits) -> list[str]:
    """Markdown rows: AUROC and FPR95 of every score against the held-out digits, noise and gratings."""
    model = zoo.pretrained(arch)
    fit_loader = data.loader(splits.fit, batch_size=256)
    test = splits.test.tensors[0]
    inputs = {
        "test": test,
        "8/9": splits.ood.tensors[0],
        "noise": noise_images(len(test)),
        "gratings": gratings(len(test)),
    }
    detector = posthoc.detector(model, score=PLAIN_SCORES).fit(fit_loader, progress=False)
    um = posthoc.wrap(model, method="mc-dropout").fit(fit_loader, data.loader(splits.calibration), progress=False)
    sampled = posthoc.detector(um, score=["entropy", "mutual-information"])
    rows = []
    for label, scorer in (("plain", detector), ("MC dropout", sampled)):
        on = {name: scorer.scores(x, generator=torch.Generator().manual_seed(0)) for name, x in inputs.items()}
        for name in scorer.names:
            cells = []
            for other in OOD_SETS:
                measured = metrics.ood_metrics(on["test"][name], on[other][name])
                cells += [f"{measured['auroc']:.4f}", f"{measured['fpr95']:.3f}"]
            rows.append(f"| {arch} | {label} | {name} | " + " | ".join(cells) + " |")
    return rows


def costs(arch: str, splits: data.DigitsSplits) -> list[str]:
    """Markdown rows: scoring and fitting time as ratios to a plain forward, ours and pytorch-ood's."""
    model = zoo.pretrained(arch)
    fit_loader = data.loader(splits.fit, batch_size=256)
    x = splits.test.tensors[0]
    with torch.no_grad():
        plain = measure(lambda: model(x), repeats=REPEATS)
        plain_fit = measure(lambda: [model(batch) for batch, _ in fit_loader], repeats=3)
    detector = posthoc.detector(model, score=PLAIN_SCORES).fit(fit_loader, progress=False)
    lines = [f"**{arch}**: scoring 1000 test digits", "", HEADER, row("plain forward", plain, plain)]
    for name in PLAIN_SCORES:
        lines.append(row(f"posthoc {name}", measure(lambda: detector.scores(x, [name]), repeats=REPEATS), plain))
    lines.append(
        row(
            f"posthoc all {len(PLAIN_SCORES)} scores, one forward",
            measure(lambda: detector.scores(x), repeats=REPEATS),
            plain,
        )
    )

    split = FeatureSplit(model)
    head = model.get_submodule(split.head_name)

    def encoder(inputs: torch.Tensor) -> torch.Tensor:
        return split(inputs)[0]

    peers = {
        "mahalanobis": pood.Mahalanobis(encoder),
        "vim": pood.ViM(encoder, d=head.in_features // 2, w=head.weight, b=head.bias),
        "knn": pood.KNN(encoder, k=50),
    }
    with torch.no_grad():
        features = torch.cat([encoder(batch) for batch, _ in fit_loader])
        labels = torch.cat([y for _, y in fit_loader])
        for name, peer in peers.items():
            peer.fit_features(features, labels)
            lines.append(
                row(
                    f"pytorch-ood {name} (forward + predict_features)",
                    measure(lambda: peer.predict_features(encoder(x)), repeats=REPEATS),
                    plain,
                )
            )
    lines += [
        "",
        f"**{arch}**: fitting on the 2400 fit digits, ratio to one plain forward over them",
        "",
        HEADER,
        row("plain forward over the fit split", plain_fit, plain_fit),
    ]
    for name in FITTED_SCORES:
        alone = posthoc.detector(model, score=name)
        lines.append(
            row(f"posthoc fit {name}", measure(lambda: alone.fit(fit_loader, progress=False), repeats=3), plain_fit)
        )
    lines.append(
        row(
            f"posthoc fit all {len(FITTED_SCORES)} fitted scores together",
            measure(lambda: detector.fit(fit_loader, progress=False), repeats=3),
            plain_fit,
        )
    )
    with torch.no_grad():
        for name, peer in peers.items():

            def fit_peer(peer=peer):
                peer.fit_features(
                    torch.cat([encoder(batch) for batch, _ in fit_loader]), torch.cat([y for _, y in fit_loader])
                )

            lines.append(
                row(f"pytorch-ood fit {name} (forward + fit_features)", measure(fit_peer, repeats=3), plain_fit)
            )
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    splits = data.load_digits()
    lines = [
        "### OOD detection on the bundled digits (test digits 0-7 against held-out 8/9, noise and gratings)",
        "",
        "| model | predictive | score | " + " | ".join(f"AUROC {n} | FPR95 {n}" for n in OOD_SETS) + " |",
        "|---|---|---|" + "---|---|" * len(OOD_SETS),
    ]
    for arch in ARCHITECTURES:
        lines += quality(arch, splits)
    lines += ["", f"### Cost ({args.threads} thread(s); medians of {REPEATS} repeats)", ""]
    for arch in ARCHITECTURES:
        lines += costs(arch, splits)
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
