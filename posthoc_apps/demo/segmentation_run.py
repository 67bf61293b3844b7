"""``posthoc demo --task segmentation``: a small FCN on digit canvases, calibrated per pixel, shifted, and its
foreground mask's false-negative rate bounded by conformal risk control.

Steps: the digit canvases and their masks (:mod:`posthoc_apps.demo.segmentation`), the FCN trained by seed, the plain
model, ``temperature`` and ``auto`` wrapped with ``dense=True`` and fitted on the validation canvases, the per-pixel
metrics on the test canvases (digits no fit saw) in distribution and under two corruptions of ``posthoc.shift``
(applied to the pixels in [0, 1], the masks unchanged), ``posthoc.risk_control`` on the foreground, and the pictures:
input, label, prediction, error and entropy maps of a few test canvases, clean and corrupted. The report is
``segmentation.md`` and ``segmentation.html`` (the pictures embedded).

Example:
    >>> from posthoc_apps.demo.segmentation_run import run_segmentation_demo
    >>> print(run_segmentation_demo("out/segmentation", progress=False, quick=True).splitlines()[0])
    Use ...
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.evaluation.dense import DenseReport, evaluate_dense
from posthoc.shift.kinds import CORRUPTIONS
from posthoc_apps.demo.segmentation import loaders, segmentation_data, trained_fcn
from posthoc_apps.demo.steps import Steps
from posthoc_apps.report.dense_maps import dense_maps
from posthoc_apps.report.page import write_markdown_page

#: the corruptions the test canvases are shown under (no fit sees them), at :data:`SEVERITY`
KINDS = ("contrast", "gaussian-noise")
SEVERITY = 3
#: the level of the foreground mask's expected false-negative rate
ALPHA = 0.1
#: test canvases drawn in each picture
SHOWN = 4
#: the steps and their expected seconds on two cores (the progress bar's ETA)
STEP_SECONDS = {
    "digit canvases and masks": 1.0,
    "training the FCN": 6.0,
    "fitting none, temperature and auto (dense=True)": 18.0,
    "per-pixel metrics, in distribution and under shift": 4.0,
    "conformal risk control of the foreground mask": 1.0,
    "pictures and the report": 1.0,
}
#: the wrapped methods, plain first
METHODS = ("none", "temperature", "auto")


def corrupted(data: TensorDataset, kind: str, severity: int = SEVERITY) -> TensorDataset:
    """``data``'s canvases under ``kind`` of ``posthoc.shift`` at ``severity``: the corruption acts on the pixels in
    [0, 1] (the canvases are normalised as ``(pixel - 0.1) / 0.3``), then they are normalised again; masks unchanged."""
    images, masks = data.tensors
    pixels = (images * 0.3 + 0.1).clamp(0, 1)
    shifted = CORRUPTIONS[kind](pixels, severity, torch.Generator().manual_seed(0))
    return TensorDataset((shifted - 0.1) / 0.3, masks)


def _probs(um: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    return um.predict(images).probs


def _verdict(chosen: str, clean: DenseReport, shifted: dict[str, DenseReport], fnr: float, threshold: float) -> str:
    plain, auto = clean.rows["none"]["NLL"], clean.rows["auto"]["NLL"]
    under = ", ".join(
        f"{report.rows['none']['NLL']:.4f} -> {report.rows['auto']['NLL']:.4f} on {kind}"
        for kind, report in shifted.items()
    )
    return (
        f"Use auto (picked {chosen} on held-out canvases, judged per image): per-pixel NLL {plain:.4f} -> {auto:.4f} "
        f"in distribution ({auto / plain:.2f}x).\n"
        f"Under shift no fit saw: {under}.\n"
        f"Foreground mask at threshold {threshold:.3f} (conformal risk control, alpha {ALPHA}): it misses "
        f"{fnr:.3f} of a test canvas's digit pixels on average."
    )


def run_segmentation_demo(
    out_dir: str | Path = "posthoc-demo-segmentation", *, progress: bool = True, quick: bool = False
) -> str:
    """Run the steps of the module docs, write ``segmentation.md``, ``segmentation.html`` and the maps' PNGs into
    ``out_dir``, and return the verdict (three lines). ``quick`` uses fewer canvases and epochs (for tests)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sizes = dict(train=128, val=96, test=48) if quick else dict(train=512, val=256, test=256)
    steps = Steps(STEP_SECONDS, enabled=progress)
    with steps.step("digit canvases and masks"):
        data = segmentation_data(**sizes)
    with steps.step("training the FCN"):
        model = trained_fcn(data.train, epochs=2 if quick else 8)
    train, val, test = loaders(data)
    models = {}
    with steps.step("fitting none, temperature and auto (dense=True)"):
        for method in METHODS:
            models[method] = posthoc.wrap(model, method=method, dense=True).fit(train, val, progress=False)
    chosen = models["auto"].summary()["posterior"][0]["selection"]["chosen"]
    with steps.step("per-pixel metrics, in distribution and under shift"):
        clean = evaluate_dense(models, test)
        shifted_data = {kind: corrupted(data.test, kind) for kind in KINDS}
        shifted = {kind: evaluate_dense(models, DataLoader(d, batch_size=64)) for kind, d in shifted_data.items()}
    with steps.step("conformal risk control of the foreground mask"):
        val_images, val_masks = data.val.tensors
        controller = posthoc.risk_control(_probs(models["auto"], val_images), val_masks, alpha=ALPHA)
        images, masks = data.test.tensors
        fnr = float(controller.risk(_probs(models["auto"], images), masks).mean())
    with steps.step("pictures and the report"):
        files = []
        for name, (shown, shown_masks) in {
            "clean": (images[:SHOWN], masks[:SHOWN]),
            **{kind: (d.tensors[0][:SHOWN], d.tensors[1][:SHOWN]) for kind, d in shifted_data.items()},
        }.items():
            path = out / f"segmentation_maps_{name}.png"
            dense_maps(shown, models["auto"].predict(shown), shown_masks, str(path))
            files.append((name, path.name))
        verdict = _verdict(chosen, clean, shifted, fnr, controller.threshold)
        sections = [
            "# posthoc demo: segmentation",
            "## Verdict\n\n" + verdict.replace("\n", "\n\n"),
            f"## In distribution ({clean.positions:,} valid test pixels)\n\n{clean.to_markdown()}",
            *(f"## {kind}, severity {SEVERITY}\n\n{report.to_markdown()}" for kind, report in shifted.items()),
            f"## Risk control\n\n`posthoc.risk_control(probs, masks, alpha={ALPHA})` on the {len(val_masks)} "
            f"validation canvases: threshold {controller.threshold:.4f} on P(foreground); mean test false-negative "
            f"rate {fnr:.4f} (the guarantee: at most {ALPHA} in expectation over calibration draws).",
            "## Maps (auto): input, label, prediction, error, entropy\n\n"
            + "\n\n".join(f"**{name}**\n\n![{name}]({file})" for name, file in files),
        ]
        (out / "segmentation.md").write_text("\n\n".join(sections) + "\n")
        write_markdown_page("\n\n".join(sections), out / "segmentation.html", title="posthoc demo: segmentation")
    steps.close()
    return verdict


def elapsed_line(out_dir: str | Path, start: float) -> str:
    """The console's last line: where the report is and how long the demo took."""
    return (
        f"Report: {Path(out_dir) / 'segmentation.html'} (and segmentation.md, the maps' PNGs beside it), "
        f"written in {time.perf_counter() - start:.0f} s"
    )
