"""What a report's tables hold: rows that predict the same merged into one with a note, and an estimate that lies
outside its own bootstrap interval marked and explained. Synthetic reports (no fit) and one small real regressor."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import scipy.stats
import torch
from test_report_verdict import reports_of

import posthoc
from posthoc.evaluation import bootstrap
from posthoc.evaluation.duplicates import Merged, merge_identical
from posthoc.evaluation.report import Compared, Report, markdown_table
from posthoc.evaluation.table import OUTSIDE, OUTSIDE_NOTE
from posthoc_apps.report import page as html_page


def _reports() -> tuple[list[Report], dict[str, list[Report]]]:
    """The plain model, a calibrator that kept T = 1 (the same probabilities), laplace, and laplace configured again
    (the same choice made twice), on one test set and one shifted set."""
    scales = (("none", 1.5, 3.0), ("temperature", 1.5, 3.0), ("laplace", 1.2, 2.0), ("laplace kron", 1.2, 2.0))
    return reports_of(scales, n=300, margin=2.5)


def test_rows_that_predict_the_same_are_merged_into_one_with_a_note(tmp_path):
    """The demo's tables were about twice as long as the information in them: every "+ temperature" row identical to
    its base row, the two MC-dropout rows identical to each other."""
    reports, shifts = _reports()
    compared = Compared.of(reports, shifts)
    assert [m.label for m in compared.merged] == ["temperature", "laplace kron"]
    assert [(m.into, m.why) for m in compared.merged] == [
        ("none", "the same predictions"),
        ("laplace", "the same predictions"),
    ]
    text = reports[0].to_markdown(*reports[1:], shifts=shifts)
    rows = [line.split(" | ")[0][2:] for line in text.splitlines() if line.startswith("| ") and " | acc" not in line]
    assert "temperature" not in rows and "laplace kron" not in rows and {"none", "laplace"} <= set(rows)
    assert "Merged rows (the same predictions, within 1e-06, on every example): `temperature` into `none`" in text
    assert [row.label for row in compared.verdict.rows] == ["none", "laplace"]
    page = html_page.write_html(reports[0], tmp_path / "page.html", *reports[1:], shifts=shifts).read_text()
    assert "Merged rows" in page and "<td>laplace kron</td>" not in page
    # a row that differs anywhere (here only under shift) is kept
    other = replace(shifts["rotated"][3], probs=torch.softmax(torch.log(shifts["rotated"][3].probs) * 1.1, -1))
    kept = Compared.of(reports, {"rotated": [*shifts["rotated"][:3], other]})
    assert [m.label for m in kept.merged] == ["temperature"]


def test_the_plain_row_and_autos_row_are_never_merged_away():
    probs = torch.softmax(torch.randn(50, 3, generator=torch.Generator().manual_seed(1)), -1)
    rows = {"MAP": [probs], "LLLA kron": [probs * 0.5 + 0.5 / 3], "auto": [probs * 0.5 + 0.5 / 3], "copy": [probs]}
    found = merge_identical(rows, keep=["MAP", "auto"])
    assert found == [Merged("LLLA kron", "auto"), Merged("copy", "MAP")]
    assert merge_identical({"MAP": [probs], "auto": [probs.clone()]}, keep=["MAP", "auto"]) == []


def test_an_estimate_outside_its_bootstrap_interval_is_marked_and_the_report_says_why(tmp_path):
    """ENCE once printed as "0.1018 [0.1356, 0.3352]": the estimate outside its own interval, without a word. A mean
    of absolute gaps grows under resampling; BCa and basic intervals contain the estimate exactly when the percentile
    one does (checked here on such a statistic, and against scipy), so the report marks the cell and says why."""
    # a statistic of that kind: |mean| of values whose mean is nearly 0 (the resamples' |mean| lie above it)
    values = torch.randn(200, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    values = values - values.mean() + 0.0005
    statistic = {"gap": lambda index: values[index].mean(-1).abs()}
    estimate = float(values.mean().abs())
    for method in ("percentile", "bca"):
        low, high = bootstrap.intervals(statistic, 200, ci=0.95, bootstraps=2000, method=method)["gap"]
        assert not low <= estimate <= high, method
    for method in ("basic", "BCa"):
        found = scipy.stats.bootstrap(
            (values.numpy(),), lambda x, axis=-1: np.abs(x.mean(axis)), method=method, n_resamples=2000, random_state=0
        ).confidence_interval
        assert not found.low <= estimate <= found.high, method
    # the table marks the cell and explains it once; a cell whose interval holds its estimate is left alone
    reports, _ = _reports()
    marked = replace(reports[2], intervals={"ece": (reports[2].ece + 0.01, reports[2].ece + 0.05), "nll": (0.0, 9.0)})
    text = markdown_table([reports[0], marked])
    assert text.count(OUTSIDE) == 2 and text.endswith(OUTSIDE_NOTE)  # the cell, and the note
    assert re.search(rf"\| \*?\*?{marked.ece:.4f}\*?\*? \[[\d.]+, [\d.]+\]{OUTSIDE} \|", text)
    assert f"{marked.nll:.4f} [0.0000, 9.0000] |" in text
    assert markdown_table([reports[0]]).count(OUTSIDE) == 0
    html = html_page.markdown_to_html(text)
    assert f'<span class="ci">[{marked.ece + 0.01:.4f}, {marked.ece + 0.05:.4f}]{OUTSIDE}</span>' in html


def test_a_real_regressors_mace_outside_its_interval_is_marked(tmp_path):
    """Auto MPG at random, a small MLP: its MACE (a mean of absolute gaps) lies under every resample's."""
    from posthoc_apps.demo.data import auto_mpg, train_mlp

    cars = auto_mpg(0)
    um = posthoc.wrap(train_mlp(cars.train, epochs=400), method="none", likelihood="regression")
    report = posthoc.evaluate(
        um.fit(cars.train_loader(), cars.val_loader(), progress=False), cars.test_loader(), ci=0.95, progress=False
    )
    low, high = report.intervals["mace"]
    assert report.mace < low <= high  # the measured case: 0.0213 [0.0233, 0.0770]
    assert report.kind == "gaussian"
    text = markdown_table([report])
    assert f"{report.mace:.4f} [{low:.4f}, {high:.4f}]{OUTSIDE}" in text and text.endswith(OUTSIDE_NOTE)
