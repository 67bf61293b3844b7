"""``posthoc demo --task regression``: every method that does regression on the seed 004 sinusoid and on Auto MPG.

1. **The sinusoid** (:func:`~posthoc_apps.demo.regression.sinusoid`): an MLP trained on 40 points in two
   clusters, wrapped by each method; the mean predictive std on the training points, in the gap between
   the clusters and beyond the data, and the band plot (``regression_band.png``).
2. **Auto MPG, extrapolating to heavier cars** (:func:`~posthoc_apps.demo.regression.auto_mpg`): trained and
   validated on the lighter 70 %, tested on the heavier 30 %; NLL, RMSE, CRPS, 90 % coverage and width,
   MACE and ENCE per method, the calibration curves (``regression_calibration.png``) and the error
   against the predicted std (``regression_error_std.png``).
3. **Auto MPG under shift** (``split="shift"``): one model per method fitted on the lighter cars outside a band
   of middle weights, scored by ``posthoc.evaluate_shift`` on random held-out cars, the heavier 30 % and
   the band (``regression_shift.png``).

Example:
    >>> markdown = run_regression_demo("posthoc-demo")  # the whole demo (minutes)  # doctest: +SKIP
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import torch

from posthoc.api import wrap
from posthoc.engine.uncertain_model import UncertainModel
from posthoc.evaluation import regression_metrics as rm
from posthoc.evaluation import regression_plots
from posthoc.evaluation.shift import ShiftTable, evaluate_shift
from posthoc.evaluation.table import markdown_rows
from posthoc_apps.demo.regression import RegressionData, auto_mpg, sinusoid, train_mlp

#: (label, method, wrap options) of the rows; "ensemble" wraps three members trained with other seeds
CONFIGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("plain (noise on val)", "none", {}),
    ("Laplace (last layer, kron)", "laplace", {}),
    ("MC dropout", "mc-dropout", {}),
    ("VI (head)", "vi", {}),
    ("ensemble of 3", "ensemble", {}),
)
MEMBER_SEEDS = (0, 1, 2)
#: Adam epochs of the trained MLPs (full batch) on the sinusoid and on Auto MPG
SINUSOID_EPOCHS, AUTO_MPG_EPOCHS = 1000, 400


def _fitted(
    label: str,
    method: str,
    options: dict[str, Any],
    members: list[torch.nn.Module],
    data: RegressionData,
    progress: bool,
) -> UncertainModel:
    if progress:
        print(f"fitting {label} ...", flush=True)
    model = members if method == "ensemble" else members[0]
    um = wrap(model, method="none" if method == "ensemble" else method, likelihood="regression", **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # small data: the curvature warnings say what the table shows
        return um.fit(data.train_loader(), data.val_loader(), progress=False)


def _sinusoid_part(out: Path, progress: bool) -> list[str]:
    data = sinusoid()
    members = [train_mlp(data.train, seed=seed, epochs=SINUSOID_EPOCHS) for seed in MEMBER_SEEDS]
    grid = torch.linspace(-2.4, 3.4, 300)[:, None]
    rows, bands = [], {}
    for label, method, options in CONFIGS:
        um = _fitted(label, method, options, members, data, progress)
        std = {
            name: float(um.predict(x, generator=torch.Generator().manual_seed(0)).std.mean())
            for name, x in data.regions.items()
        }
        rows.append(
            [
                label,
                f"{std['train']:.3f}",
                f"{std['gap']:.3f}",
                f"{std['beyond']:.3f}",
                f"{std['gap'] / std['train']:.2f}x",
            ]
        )
        bands[label] = rm.components(um.predict(grid, generator=torch.Generator().manual_seed(0)))
    regression_plots.predictive_band(
        grid[:, 0], bands, (data.train[0][:, 0], data.train[1][:, 0]), out / "regression_band.png"
    )
    return [
        "### The seed 004 sinusoid: does the predictive widen where the data ends?",
        "",
        "40 training points in two clusters; mean predictive std (targets' units):",
        "",
        *markdown_rows(
            ["method", "on the training points", "in the gap", "beyond the data", "gap / training"], rows
        ).splitlines(),
        "",
        "![the predictive band of each method over the training points](regression_band.png)",
        "",
    ]


def _auto_mpg_part(out: Path, progress: bool) -> list[str]:
    data = auto_mpg(0, split="extrapolate")
    members = [train_mlp(data.train, seed=seed, epochs=AUTO_MPG_EPOCHS) for seed in MEMBER_SEEDS]
    x, y = data.test
    rows, curves = [], {}
    for label, method, options in CONFIGS:
        um = _fitted(label, method, options, members, data, progress)
        means, stds = rm.components(um.predict(x, generator=torch.Generator().manual_seed(0)))
        coverage, width = rm.interval_coverage(means, stds, y, 0.9)
        rows.append(
            [
                label,
                f"{rm.nll(means, stds, y):.3f}",
                f"{rm.rmse(means, y):.3f}",
                f"{rm.crps(means, stds, y):.3f}",
                f"{coverage:.3f}",
                f"{width:.2f}",
                f"{rm.calibration_error(means, stds, y):.3f}",
                f"{rm.ence(means, stds, y, bins=5):.3f}",
            ]
        )
        curves[label] = (means, stds, y)
    regression_plots.calibration_curves(curves, out / "regression_calibration.png")
    regression_plots.error_against_std(curves, out / "regression_error_std.png", bins=5)
    return [
        "### Auto MPG: tested on the heaviest 30 % of the cars, trained on the lighter 70 %",
        "",
        "Standardised miles per gallon; lower NLL, RMSE, CRPS, MACE and ENCE are better; a calibrated 90 % "
        "interval covers 0.9 of the cars.",
        "",
        *markdown_rows(
            ["method", "NLL", "RMSE", "CRPS", "90% coverage", "90% width", "MACE", "ENCE"], rows
        ).splitlines(),
        "",
        "![observed against expected interval coverage](regression_calibration.png)",
        "",
        "![RMSE against predicted std, per bin](regression_error_std.png)",
        "",
    ]


def _shift_part(out: Path, progress: bool) -> list[str]:
    data = auto_mpg(0, split="shift")
    members = [train_mlp(data.train, seed=seed, epochs=AUTO_MPG_EPOCHS) for seed in MEMBER_SEEDS]
    tables = [
        evaluate_shift(
            {label: _fitted(label, method, options, members, data, progress)}, data.shift_loaders(), progress=False
        )
        for label, method, options in CONFIGS
    ]
    table = ShiftTable.merge(tables)
    table.plot(out / "regression_shift.png")
    return [
        "### Auto MPG under shift: random cars, heavier cars, and a gap of middle weights",
        "",
        "Fitted on the lighter 70 % of the cars without those between the 0.4 and 0.6 quantiles of their weight; "
        "scored by posthoc.evaluate_shift on random held-out cars, on the heavier 30 % (extrapolation) and on the "
        "left-out band (gap).",
        "",
        table.to_markdown(),
        "",
        "![NLL, CRPS and 90 % coverage per test set](regression_shift.png)",
        "",
    ]


def run_regression_demo(out_dir: str | Path = "posthoc-demo", *, progress: bool = True) -> str:
    """Fit every regression row on both data sets, write the PNGs and ``regression.md`` into ``out_dir`` and return the
    Markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    lines = [
        "## Regression: posthoc on a trained MLP",
        "",
        *_sinusoid_part(out, progress),
        *_auto_mpg_part(out, progress),
        *_shift_part(out, progress),
    ]
    lines.append(f"Fitted and evaluated in {time.perf_counter() - start:.0f} s.")
    markdown = "\n".join(lines) + "\n"
    (out / "regression.md").write_text(markdown)
    return markdown
