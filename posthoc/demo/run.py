"""``posthoc demo``: every registered method retrofitted onto the bundled digits checkpoint.

The bundled CNN (``posthoc.demo.zoo``) is wrapped by each method's demo configurations (and, for
each method, once more with temperature scaling fitted on top of the fitted method); every row is fitted on the fit split,
calibrated on the calibration split, and evaluated on the test digits rotated by 0–180 degrees
and on the held-out digits 8 and 9 as OOD. Times are ratios to a plain forward pass over the
same data.

Example:
    >>> rows = run_demo(out_dir="posthoc-demo", progress=False)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posthoc.demo import data, zoo
from posthoc.evaluation import plots
from posthoc.core.registry import REGISTRY
from posthoc.api import wrap_spec
from posthoc.core.uncertain_model import UncertainModel
from posthoc.evaluation.report import Report, collect, evaluate, markdown_table

ANGLES = (0, 30, 60, 90, 120, 180)


@dataclass
class DemoRow:
    """One fitted configuration: its report at 0 degrees, per-angle reports and costs."""

    label: str
    report: Report
    by_angle: dict[int, Report]
    fit_ratio: float
    predict_ratio: float


def _split_options(name: str, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    fit_names = REGISTRY[name].fit_option_defaults()
    return ({k: v for k, v in options.items() if k not in fit_names}, {k: v for k, v in options.items() if k in fit_names})


def _timed(fn) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def demo_configs(only: list[str] | None = None) -> list[tuple[str, list[dict[str, Any]], dict[str, Any], bool]]:
    """``(label, spec, fit_options, add_temperature)`` for every registered method's demo rows.

    The first row of each method (other than MAP and temperature) also gets a ``+ temperature``
    row, fitted on top of the already fitted method.
    """
    configs = []
    reference_first = sorted(REGISTRY.items(), key=lambda item: (item[0] != "none", item[0] != "temperature", item[0]))
    for name, cls in reference_first:
        if only and name not in only:
            continue
        for position, (label, options) in enumerate(cls.demo_configs):
            wrap_options, fit_options = _split_options(name, options)
            stack = position == 0 and not cls.stacks and name != "none"
            configs.append((label, [{"name": name, "options": wrap_options}], fit_options, stack))
    return configs


def _plain_forward_seconds(model: torch.nn.Module, loader) -> float:
    with torch.no_grad():
        _, seconds = _timed(lambda: [model(x) for x, _ in loader])
    return seconds


def _with_temperature(um: UncertainModel, cal_loader) -> tuple[UncertainModel, float]:
    """Temperature fitted on top of an already fitted ``um`` (its inner method is not refitted)."""
    top = REGISTRY["temperature"](um.method)
    stacked = UncertainModel(top, [*um.spec, {"name": "temperature", "options": {}}], fingerprint=um.fingerprint)
    _, seconds = _timed(lambda: top.fit(None, cal_loader, progress=False))
    top.fitted.fill_(True)
    return stacked, seconds


def run_demo(out_dir: str | Path = "posthoc-demo", *, methods: list[str] | None = None, progress: bool = True,
             seed: int = 0) -> list[DemoRow]:
    """Fit and evaluate every demo configuration; write PNGs and ``report.md`` to ``out_dir``."""
    torch.manual_seed(seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = data.load_digits()
    model = zoo.pretrained()
    fit_loader = data.loader(splits.fit, batch_size=256)
    cal_loader = data.loader(splits.calibration, batch_size=256)
    test_loaders = {angle: data.loader(data.rotated(splits.test, angle), batch_size=500) for angle in ANGLES}
    ood_loader = data.loader(splits.ood, batch_size=500)
    forward_fit = _plain_forward_seconds(model, fit_loader)
    forward_test = min(_plain_forward_seconds(model, test_loaders[0]) for _ in range(3))

    def row(label: str, um: UncertainModel, fit_seconds: float) -> DemoRow:
        predict_seconds = min(
            _timed(lambda: collect(um, test_loaders[0], progress=False, generator=torch.Generator().manual_seed(seed)))[1]
            for _ in range(2)
        )
        report = evaluate(um, test_loaders[0], ood_loader, name=label, progress=False, seed=seed)
        by_angle = {0: report} | {
            angle: evaluate(um, loader, name=label, progress=False, seed=seed)
            for angle, loader in test_loaders.items() if angle
        }
        return DemoRow(label, report, by_angle, fit_seconds / forward_fit, predict_seconds / forward_test)

    rows = []
    for label, spec, fit_options, add_temperature in demo_configs(methods):
        if progress:
            print(f"fitting {label} ...", flush=True)
        torch.manual_seed(seed)
        um: UncertainModel = wrap_spec(model, spec)
        _, fit_seconds = _timed(lambda: um.fit(fit_loader, cal_loader, progress=False, **fit_options))
        rows.append(row(label, um, fit_seconds))
        if add_temperature:
            stacked, temperature_seconds = _with_temperature(um, cal_loader)
            rows.append(row(f"{label} + temperature", stacked, fit_seconds + temperature_seconds))
    _write_outputs(rows, out_dir)
    return rows


def render(rows: list[DemoRow]) -> str:
    """The demo's Markdown: the in-distribution table with costs, then NLL / ECE by rotation."""
    main = markdown_table(
        [row.report for row in rows],
        {"fit × fwd": [f"{row.fit_ratio:.1f}" for row in rows], "predict × fwd": [f"{row.predict_ratio:.1f}" for row in rows]},
    )
    header = "| method | " + " | ".join(f"{a}°" for a in ANGLES) + " |"
    lines = [header, "|" + "---|" * (len(ANGLES) + 1)]
    for row in rows:
        cells = [f"{row.by_angle[a].nll:.3f} / {row.by_angle[a].ece:.3f}" for a in ANGLES]
        lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
    return (
        "### Digits 0–7, bundled CNN (OOD: held-out digits 8 and 9)\n\n" + main
        + "\n\n### NLL / ECE by rotation of the test digits\n\n" + "\n".join(lines) + "\n"
    )


def _write_outputs(rows: list[DemoRow], out_dir: Path) -> None:
    curves = {row.label: (row.report.probs, row.report.labels) for row in rows}
    plots.reliability_diagram(curves, out_dir / "reliability.png")
    rotated = {row.label: (row.by_angle[60].probs, row.by_angle[60].labels) for row in rows}
    plots.reliability_diagram(rotated, out_dir / "reliability_rotated60.png")
    plots.risk_coverage_curve(curves, out_dir / "risk_coverage.png")
    (out_dir / "report.md").write_text(render(rows))
