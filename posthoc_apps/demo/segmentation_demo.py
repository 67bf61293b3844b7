"""``posthoc demo --task segmentation``: dense outputs end to end on the digit canvases, in well under two minutes.

What it does, one step line each (:class:`~posthoc_apps.demo.steps.Steps`):

1. **Canvases and FCN.** :func:`~posthoc_apps.demo.segmentation.segmentation_data` makes canvases of two MNIST digits
   with their masks (a digit's pixels labelled with its class plus one, the background 0, the boundary band ignored,
   255); :func:`~posthoc_apps.demo.segmentation.trained_fcn` trains the small FCN on the training canvases
   (seeded, :data:`EPOCHS` epochs).
2. **Wrap.** ``posthoc.wrap(model, method=..., dense=True)`` with ``none``, ``temperature``, last-layer ``laplace``
   (on the FCN's 1x1-conv head, KFAC over the training pixels) and ``auto`` (whose candidates are ``none`` and
   ``temperature``), fitted on the training and validation canvases.
3. **Evaluate.** Per-pixel NLL, ECE, Brier, accuracy, mIoU and the entropy's AUROC for errors
   (``posthoc.evaluate``) on test canvases made from digits no fit saw, and on the same canvases corrupted by
   ``posthoc.shift.corrupt_images`` (:data:`SHIFT_KINDS` at :data:`SEVERITY`; they move no pixel, so the masks
   stay right). Auto against the plain model: the mean per-image NLL difference with a 95 % paired bootstrap
   interval over the canvases (the canvas is the unit: its pixels are not independent).
4. **Risk control.** ``posthoc.risk_control`` on auto's foreground probability (``1 - p(background)``) over a
   calibration half of the held-out canvases at ``alpha`` :data:`ALPHA`: the mask's false-negative rate on the
   other half, in distribution and under each shift (where the guarantee no longer applies).
5. **Report.** ``report.md`` and one self-contained ``report.html`` with the tables and the maps (input, label,
   prediction, error, entropy and the risk-controlled mask) of a few test canvases, clean and shifted.

Example:
    >>> result = run_segmentation_demo("posthoc-demo", progress=False)  # about 30 s on 2 cores  # doctest: +SKIP
    >>> result.chosen, round(result.test_fnr, 2)  # doctest: +SKIP
    ('temperature', 0.1)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.core.prediction import Prediction
from posthoc.evaluation.dense import DenseReport, evaluate_dense
from posthoc.evaluation.table import markdown_rows
from posthoc.guarantees.risk_control import RiskController
from posthoc.shift.kinds import SEVERITIES as PARAMETERS
from posthoc_apps.demo import segmentation
from posthoc_apps.demo.steps import Steps
from posthoc_apps.report import page
from posthoc_apps.report.dense_maps import dense_maps

#: canvases of the training, validation (methods) and held-out splits; the held-out split is halved into the risk
#: control's calibration canvases and the test canvases
CANVASES = (512, 256, 512)
#: Adam epochs of the FCN
EPOCHS = 30
#: the methods wrapped, in the order of the tables (auto's candidates are none and temperature)
METHODS = ("none", "temperature", "laplace", "auto")
#: the corruptions of posthoc.shift that move no pixel (the masks stay right), and their severity
SHIFT_KINDS, SEVERITY = ("contrast", "gaussian-noise"), 3
#: the level of the risk-controlled foreground mask: expected false-negative rate at most ALPHA
ALPHA = 0.1
#: the canvases drawn in the maps, and the resamples of the paired bootstrap
EXAMPLES, BOOTSTRAPS = 4, 1000
#: the canvases' normalisation (:func:`posthoc_apps.demo.segmentation.canvases`): pixels in [0, 1] are (x - 0.1) / 0.3
NORMALIZATION = (0.1, 0.3)
#: the normalised values of pixels 0 and 1 (the maps' grey scale), and the classes' names (the maps' legend)
PIXEL_RANGE = ((0 - NORMALIZATION[0]) / NORMALIZATION[1], (1 - NORMALIZATION[0]) / NORMALIZATION[1])
CLASS_NAMES = ("background", *(f"digit {d}" for d in range(10)))
STEP_SECONDS = {
    "canvases and FCN": 9.0,
    "wrap none, temperature, laplace, auto": 8.0,
    "evaluate (test and shifted)": 3.0,
    "risk control": 1.0,
    "maps and report": 4.0,
}


@dataclass
class SegmentationDemo:
    """What the demo measured: the tables per test set, auto's pick, the paired NLL differences and the risk control."""

    tables: dict[str, DenseReport]
    chosen: str
    #: test set -> (mean per-canvas NLL of auto minus none, low, high of its 95 % bootstrap interval)
    difference: dict[str, tuple[float, float, float]]
    controller: RiskController
    #: test set -> (mean test FNR, its standard error, mean fraction of valid pixels in the mask)
    fnr: dict[str, tuple[float, float, float]]
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)

    @property
    def test_fnr(self) -> float:
        """The risk-controlled mask's mean false-negative rate on the clean test canvases."""
        return self.fnr[CLEAN][0]

    def verdict(self) -> list[str]:
        """The verdict in a few lines (the console's and the page's)."""
        none, auto = self.tables[CLEAN].rows["none"]["NLL"], self.tables[CLEAN].rows["auto"]["NLL"]
        mean, low, high = self.difference[CLEAN]
        margin = max(0.02 * none, 0.005)
        kept = "within" if high <= margin else "NOT shown within"
        shifted = "; ".join(
            f"{name}: {self.tables[name].rows['none']['NLL']:.4f} -> {self.tables[name].rows['auto']['NLL']:.4f} "
            f"({'better' if self.difference[name][2] < 0 else 'worse' if self.difference[name][1] > 0 else 'no clear change'})"
            for name in self.tables
            if name != CLEAN
        )
        fnr, se, size = self.fnr[CLEAN]
        moved = ", ".join(f"{name} {self.fnr[name][0]:.3f}" for name in self.fnr if name != CLEAN)
        return [
            f"auto chose {self.chosen}. In distribution, per-pixel NLL {none:.4f} (plain) -> {auto:.4f} (auto): "
            f"per-canvas difference {mean:+.4f} [{low:+.4f}, {high:+.4f}], {kept} max(2 %, 0.005 nats) = {margin:.4f}.",
            f"Under shift (severity {SEVERITY}), per-pixel NLL plain -> auto: {shifted}.",
            f"Risk control of the foreground mask at alpha = {ALPHA:g}: test FNR {fnr:.3f} ± {se:.3f} (alpha {ALPHA:g}), "
            f"threshold {self.controller.threshold:.3f}, the mask holds {size:.1%} of the pixels; under shift, "
            f"where the guarantee does not apply, the FNR is {moved}.",
        ]


#: the name of the in-distribution test set in the tables
CLEAN = "in distribution"


def _shift_name(kind: str) -> str:
    return f"{kind} {SEVERITY}"


def per_image_nll(prediction: Prediction, masks: Tensor) -> Tensor:
    """The mean NLL over each canvas's valid pixels ``(N,)`` (canvases without one give 0)."""
    valid = masks != segmentation.IGNORE
    picked = prediction.probs.gather(1, masks.clamp_max(prediction.probs.shape[1] - 1)[:, None])[:, 0]
    nll = -picked.clamp_min(1e-12).log() * valid
    return nll.flatten(1).sum(1) / valid.flatten(1).sum(1).clamp_min(1)


def paired_difference(a: Tensor, b: Tensor, *, seed: int = 0, ci: float = 0.95) -> tuple[float, float, float]:
    """The mean of ``b - a`` over the canvases and its percentile bootstrap interval (``BOOTSTRAPS`` resamples).

    Example:
        >>> import torch
        >>> from posthoc_apps.demo.segmentation_demo import paired_difference
        >>> mean, low, high = paired_difference(torch.zeros(50), torch.full((50,), 0.1))
        >>> round(mean, 3), round(low, 3), round(high, 3)
        (0.1, 0.1, 0.1)
    """
    delta = (b - a).double()
    index = torch.randint(len(delta), (BOOTSTRAPS, len(delta)), generator=torch.Generator().manual_seed(seed))
    means = delta[index].mean(1)
    tail = (1 - ci) / 2
    return float(delta.mean()), float(means.quantile(tail)), float(means.quantile(1 - tail))


def _split(data: TensorDataset, first: int) -> tuple[TensorDataset, TensorDataset]:
    images, masks = data.tensors
    return TensorDataset(images[:first], masks[:first]), TensorDataset(images[first:], masks[first:])


def _corrupted(data: TensorDataset, kind: str, seed: int) -> TensorDataset:
    images, masks = data.tensors
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(
        posthoc.shift.corrupt_images(images, kind, SEVERITY, generator, normalization=NORMALIZATION), masks
    )


def _markdown(result: SegmentationDemo, test_canvases: int, calibration_canvases: int, train: int) -> str:
    kinds = ", ".join(
        f"{kind} ({'factor' if kind == 'contrast' else 'std'} {PARAMETERS[kind][SEVERITY - 1]:g})"
        for kind in SHIFT_KINDS
    )
    lines = [
        "# posthoc demo: segmentation of digit canvases",
        "",
        "## Verdict",
        "",
        *(f"- {line}" for line in result.verdict()),
        "",
        "### Setup",
        "",
        f"A small FCN trained on {train} canvases of two MNIST digits (32 x 32 pixels, 11 classes: the background "
        "and the digits; the pixels just outside each digit are unlabelled, 255) and wrapped with "
        "`posthoc.wrap(model, method=..., dense=True)`; Laplace reads the training canvases, every method the validation canvases; every "
        f"number below is on {test_canvases} test canvases made from digits no fit saw. The shifted sets are "
        f"the same canvases corrupted by `posthoc.shift` at severity {SEVERITY}: {kinds}.",
        "",
    ]
    for name, table in result.tables.items():
        mean, low, high = result.difference[name]
        lines += [
            f"### {name} ({table.positions:,} valid pixels)",
            "",
            table.to_markdown(),
            "",
            f"auto minus none, mean per-canvas NLL: {mean:+.4f} (95 % paired bootstrap over the canvases: "
            f"[{low:+.4f}, {high:+.4f}]).",
            "",
        ]
    rows = [
        [name, f"{fnr:.3f}", f"{se:.3f}", f"{ALPHA:g}", f"{size:.1%}"] for name, (fnr, se, size) in result.fnr.items()
    ]
    rc = result.controller
    lines += [
        f"### Risk control of the foreground mask (alpha = {ALPHA:g})",
        "",
        f"`posthoc.risk_control(probs, masks, alpha={ALPHA:g})` on auto's foreground probability "
        f"(1 - p(background)) over {calibration_canvases} calibration canvases (drawn like the test canvases, "
        f"exchangeable with them): threshold {rc.threshold:.4f}, calibration FNR {rc.calibration_risk:.4f}. "
        "The guarantee is E[FNR] <= alpha on exchangeable canvases: the clean test set; under shift it does not "
        "apply, and the rows show how far it moves.",
        "",
        markdown_rows(["test set", "FNR (mean over canvases)", "standard error", "alpha", "pixels in the mask"], rows),
        "",
        "### Maps",
        "",
        f"The first {EXAMPLES} test canvases, clean and shifted: the input (one grey scale for all), the label "
        "(grey: unlabelled), auto's prediction, its errors (red), its entropy (one scale, 0 to ln 11 nats) and the "
        f"risk-controlled foreground mask (blue, threshold {rc.threshold:.3f} on 1 - p(background)).",
        "",
    ]
    for name in result.tables:
        lines += [
            f"#### {name}",
            "",
            f"![{name}: input, label, prediction, error, entropy, mask]({_maps_file(name)})",
            "",
        ]
    lines.append(f"Fitted, evaluated and drawn in {result.seconds:.0f} s.")
    return "\n".join(lines) + "\n"


def _maps_file(name: str) -> str:
    return "maps_" + name.replace(" ", "_") + ".png"


def run_segmentation_demo(
    out_dir: str | Path = "posthoc-demo",
    *,
    progress: bool = True,
    stream: IO[str] | None = None,
    seed: int = 0,
) -> SegmentationDemo:
    """Run the segmentation demo (see the module docs); write ``report.md``, ``report.html`` and the maps' PNGs to
    ``out_dir`` and return what it measured."""
    start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = Steps(STEP_SECONDS, enabled=progress, stream=stream)
    train_count, val_count, held_count = CANVASES
    with steps.step("canvases and FCN"):
        data = segmentation.segmentation_data(train=train_count, val=val_count, test=held_count, seed=seed)
        model = segmentation.trained_fcn(data.train, epochs=EPOCHS, seed=seed)
        calibration, test = _split(data.test, held_count // 2)
        train_loader, val_loader = (DataLoader(split, batch_size=64) for split in (data.train, data.val))
    with steps.step("wrap none, temperature, laplace, auto"):
        models = {
            method: posthoc.wrap(model, method=method, dense=True).fit(train_loader, val_loader, progress=False)
            for method in METHODS
        }
        chosen = models["auto"].summary()["posterior"][0]["selection"]["chosen"]
    with steps.step("evaluate (test and shifted)"):
        sets = {CLEAN: test, **{_shift_name(kind): _corrupted(test, kind, seed) for kind in SHIFT_KINDS}}
        tables = {name: evaluate_dense(models, DataLoader(one, batch_size=64)) for name, one in sets.items()}
        with torch.no_grad():
            predictions = {name: {m: models[m].predict(one.tensors[0]) for m in METHODS} for name, one in sets.items()}
        difference = {
            name: paired_difference(
                per_image_nll(predictions[name]["none"], one.tensors[1]),
                per_image_nll(predictions[name]["auto"], one.tensors[1]),
                seed=seed,
            )
            for name, one in sets.items()
        }
    with steps.step("risk control"):
        with torch.no_grad():
            calibration_probs = models["auto"].predict(calibration.tensors[0]).probs
        controller = posthoc.risk_control(calibration_probs, calibration.tensors[1], alpha=ALPHA)
        fnr = {}
        for name, one in sets.items():
            probs, masks = predictions[name]["auto"].probs, one.tensors[1]
            risk = controller.risk(probs, masks)
            valid = masks != segmentation.IGNORE
            size = float(((controller.mask(probs) & valid).flatten(1).sum(1) / valid.flatten(1).sum(1)).mean())
            fnr[name] = (float(risk.mean()), float(risk.std() / math.sqrt(len(risk))), size)
    with steps.step("maps and report"):
        result = SegmentationDemo(tables, chosen, difference, controller, fnr)
        for name, one in sets.items():
            images, masks = (t[:EXAMPLES] for t in one.tensors)
            with torch.no_grad():
                prediction = models["auto"].predict(images)
            figure = dense_maps(
                images,
                prediction,
                masks,
                str(out / _maps_file(name)),
                mask=controller.mask(prediction.probs),
                input_range=PIXEL_RANGE,
                class_names=CLASS_NAMES,
            )
            del figure
            result.files.append(_maps_file(name))
        result.seconds = time.perf_counter() - start
        markdown = _markdown(result, len(test), len(calibration), train_count)
        (out / "report.md").write_text(markdown)
        page.write_markdown_page(markdown, out / "report.html", title="posthoc demo: segmentation")
        result.files += ["report.md", "report.html"]
    steps.close()
    return result
