"""``method="auto"``: what it costs against its candidates, and what it does to a fine-tuned timm model via the CLI.

Two parts (``--part cost timm``, both by default):

- **cost** (issue 34: auto's fit at most 1.5x the sum of its candidates' own fits; its predict the chosen method's):
  on each bundled checkpoint, ``posthoc.wrap(model, method="auto").fit(fit, calibration)`` against every default
  candidate fitted alone on the same loaders (``wrap(model, method=c).fit(...)``), wall and process-CPU seconds,
  medians of ``--repeats``; then ``um.predict`` on the 1,000 test digits of auto against the chosen method wrapped
  alone, timed as alternating pairs (:func:`timing.paired`, median of per-pair ratios).
- **timm** (issue 34: a fine-tuned timm model through ``posthoc evaluate --method auto`` with a rotated folder as
  ``--shift``: in-distribution NLL at most ``max(1.02x, +0.005)`` of ``none``'s, under the shift NLL at most 0.8x and
  ECE at most 0.7x): timm's ``resnet10t`` (random init: no weights can be downloaded here) fine-tuned with Adam on the
  2,400 bundled training digits at 32 px (RGB), written as image folders; ``--val`` the 1,600 calibration + test
  digits (the CLI splits it into calibration and test halves), ``--shift`` the same digits rotated by 60 degrees.
  The CLI runs ``--method auto --method laplace --method none+dac`` and the numbers are read from its
  ``metrics.json``.

Run: ``python benchmarks/bench_auto.py [--part cost timm] [--repeats 3] [--threads 2]``; results are printed as
Markdown and written to ``benchmarks/results/auto.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from timing import paired  # noqa: E402

import posthoc  # noqa: E402
from posthoc.core.likelihood import Categorical  # noqa: E402
from posthoc.methods.auto.method import default_candidates  # noqa: E402
from posthoc_apps.demo import data, zoo  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "auto.md"
CACHE = ROOT / "benchmarks" / ".cache" / "auto_timm"
ROTATION = 60


def _fit_seconds(
    model: torch.nn.Module, method: object, fit: object, val: object, repeats: int
) -> tuple[float, float, object]:
    walls, cpus, um = [], [], None
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        um = posthoc.wrap(model, method=method).fit(fit, val, progress=False)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus), um


def cost(repeats: int) -> list[str]:
    splits = data.load_digits()
    fit, val = data.loader(splits.fit), data.loader(splits.calibration)
    x = splits.test.tensors[0]
    lines = [
        "## Cost: auto against its candidates fitted alone",
        "",
        f"`python benchmarks/bench_auto.py --part cost --repeats {repeats}`; medians of {repeats} fits on 2,400 "
        "training and 600 calibration digits.",
        "",
    ]
    for name in ("digits_cnn", "digits_bn_cnn"):
        model = zoo.pretrained(name)
        rows, total_wall, total_cpu = [], 0.0, 0.0
        for candidate in default_candidates(model, Categorical()):
            wall, cpu, _ = _fit_seconds(model, candidate["method"], fit, val, repeats)
            total_wall, total_cpu = total_wall + wall, total_cpu + cpu
            rows.append(f"| {'+'.join(candidate['method'])} | {wall:.2f} | {cpu:.2f} |")
        wall, cpu, um = _fit_seconds(model, "auto", fit, val, repeats)
        chosen = um.method.chosen_label
        alone = posthoc.wrap(model, method=chosen.split("+")).fit(fit, val, progress=False)
        with torch.no_grad():
            auto_time, alone_time, ratio = paired(lambda: alone.predict(x), lambda: um.predict(x), repeats=9)
        lines += [
            f"### {name}: auto chose `{chosen}`",
            "",
            "| fit | wall s | CPU s |",
            "|---|---|---|",
            *rows,
            f"| **sum of the candidates** | {total_wall:.2f} | {total_cpu:.2f} |",
            f"| **auto** | {wall:.2f} ({wall / total_wall:.2f}x the sum) | {cpu:.2f} ({cpu / total_cpu:.2f}x) |",
            "",
            f"Predict on the 1,000 test digits: auto {auto_time.wall * 1e3:.1f} ms against `{chosen}` alone "
            f"{alone_time.wall * 1e3:.1f} ms: {ratio:.2f}x (median of 9 alternating pairs; target 1x, "
            f"target for the fit: at most 1.5x the sum: {'met' if wall <= 1.5 * total_wall else 'missed'}).",
            "",
        ]
    return lines


# ------------------------------------------------------------------------------------------------ timm via the CLI
def _write_folders(root: Path) -> None:
    """The bundled digits as 32-px RGB PNG folders: train, val (calibration + test) and val rotated by 60 degrees."""
    from PIL import Image
    from torchvision.transforms.functional import resize

    splits = data.load_digits()

    def write(folder: Path, dataset: torch.utils.data.TensorDataset) -> None:
        x, y = dataset.tensors
        pixels = ((x * data.STD + data.MEAN).clamp(0, 1) * 255).round().to(torch.uint8)
        pixels = resize(pixels, [32, 32], antialias=True)
        for index, (image, label) in enumerate(zip(pixels, y)):
            target = folder / f"digit{int(label)}"
            target.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image[0].numpy()).convert("RGB").save(target / f"{index:05d}.png")

    val = torch.utils.data.TensorDataset(
        torch.cat([splits.calibration.tensors[0], splits.test.tensors[0]]),
        torch.cat([splits.calibration.tensors[1], splits.test.tensors[1]]),
    )
    write(root / "train", splits.fit)
    write(root / "val", val)
    write(root / f"rotated{ROTATION}", data.rotated(val, ROTATION))


def _fine_tune(root: Path, checkpoint: Path, epochs: int) -> None:
    """timm resnet10t (8 classes) trained on the train folder through the CLI's own transform, saved as a state_dict."""
    import timm

    from posthoc_apps.loading import folders

    torch.manual_seed(0)
    model = timm.create_model("resnet10t", pretrained=False, num_classes=8)
    transform = folders.model_transform(model, "timm:resnet10t", 32)
    train = folders.loader(folders.image_folder(root / "train", transform), batch_size=64, shuffle=True, seed=0)
    optimiser = torch.optim.Adam(model.parameters(), lr=2e-3)
    for epoch in range(epochs):
        model.train()
        total = 0.0
        for x, y in train:
            optimiser.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimiser.step()
            total += float(loss) * len(y)
        print(f"resnet10t epoch {epoch + 1}/{epochs}: train loss {total / len(train.dataset):.4f}", flush=True)
    torch.save(model.state_dict(), checkpoint)


def timm_cli(epochs: int) -> list[str]:
    CACHE.mkdir(parents=True, exist_ok=True)
    if not (CACHE / "train").exists():
        _write_folders(CACHE)
    checkpoint = CACHE / f"resnet10t-{epochs}ep.pt"
    if not checkpoint.exists():
        _fine_tune(CACHE, checkpoint, epochs)
    out = CACHE / "report"
    command = [
        sys.executable,
        "-m",
        "posthoc_apps.cli.main",
        "evaluate",
        "--model",
        "timm:resnet10t",
        "--pretrained",
        "false",
        "--num-classes",
        "8",
        "--checkpoint",
        str(checkpoint),
        "--image-size",
        "32",
        "--train",
        str(CACHE / "train"),
        "--val",
        str(CACHE / "val"),
        "--shift",
        str(CACHE / f"rotated{ROTATION}"),
        "--method",
        "auto",
        "--method",
        "laplace",
        "--method",
        "none+dac",
        "--workers",
        "0",
        "--no-progress",
        "--out",
        str(out),
    ]
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    found = json.loads((out / "metrics.json").read_text())
    rows = {row["method"]: row for row in found["rows"]}
    plain = rows["none"]
    shift = next(iter(plain["shifts"]))
    lines = [
        "## A fine-tuned timm resnet10t through `posthoc evaluate --method auto`",
        "",
        f"`python benchmarks/bench_auto.py --part timm` ({epochs} epochs of fine-tuning, then "
        f"`{' '.join(['posthoc', *command[3:]])}`, {seconds:.0f} s). Test half of the 1,600 held-out digits; shift: "
        f"the same digits rotated by {ROTATION} degrees. Ratios to `none`.",
        "",
        "| method | NLL in distribution | ECE in distribution | NLL rotated | ECE rotated |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        test, shifted = row["test"], row["shifts"][shift]
        lines.append(
            f"| {name} | {test['nll']:.4f} ({test['nll'] / plain['test']['nll']:.2f}x) | {100 * test['ece']:.1f}% | "
            f"{shifted['nll']:.3f} ({shifted['nll'] / plain['shifts'][shift]['nll']:.2f}x) | "
            f"{100 * shifted['ece']:.1f}% ({shifted['ece'] / plain['shifts'][shift]['ece']:.2f}x) |"
        )
    auto = rows["auto"]
    limit = max(1.02 * plain["test"]["nll"], plain["test"]["nll"] + 0.005)
    checks = {
        "in-distribution NLL <= max(1.02x, +0.005)": auto["test"]["nll"] <= limit,
        "NLL under the shift <= 0.8x": auto["shifts"][shift]["nll"] <= 0.8 * plain["shifts"][shift]["nll"],
        "ECE under the shift <= 0.7x": auto["shifts"][shift]["ece"] <= 0.7 * plain["shifts"][shift]["ece"],
    }
    chosen = (auto.get("summary") or {}).get("selection", {}) or {}
    lines += [
        "",
        f"auto chose `{chosen.get('chosen')}`. Targets: "
        + "; ".join(f"{name}: {'met' if ok else 'missed'}" for name, ok in checks.items())
        + ".",
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", nargs="+", choices=("cost", "timm"), default=["cost", "timm"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6, help="fine-tuning epochs of the timm model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = ['# method="auto": cost and a timm model through the CLI', ""]
    if "cost" in args.part:
        lines += cost(args.repeats)
    if "timm" in args.part:
        lines += timm_cli(args.epochs)
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
