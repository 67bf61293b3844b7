"""The verdict that opens every report comparing methods (posthoc.evaluation.verdict), the frontier plot, the best
entries in bold, the HTML page's width, and the model card of a chain chosen by ``method="auto"``.

Everything here runs on synthetic per-example numbers or tiny reports: no fit, no browser.
"""

from __future__ import annotations

import math
import re
from html.parser import HTMLParser

import numpy as np
import pytest
import torch

import posthoc
from posthoc.core.model_card import ModelCard, selection_table
from posthoc.engine.selection import excess_bound
from posthoc.evaluation.comparison import candidate, compared_verdict, example_nll
from posthoc.evaluation.report import Report, markdown_table
from posthoc.evaluation.shift import ShiftTable
from posthoc.evaluation.table import best_rows, bold_best
from posthoc.evaluation.verdict import Candidate, cost_cell, judge, selection_points
from posthoc_apps.report import page as html_page
from posthoc_apps.report import plots

N = 600


def _nll(mean: float, seed: int, spread: float = 0.05, n: int = N) -> torch.Tensor:
    """Per-example NLLs around ``mean`` (positive), seeded."""
    generator = torch.Generator().manual_seed(seed)
    return (mean + spread * torch.randn(n, generator=generator, dtype=torch.float64)).abs()


def _rows(with_auto: bool = False) -> list[Candidate]:
    """The plain model, a cheap row that buys a lot under shift, a costly row that buys more, and a row with no gain."""
    plain = _nll(0.10, 0)
    shifted = _nll(2.0, 1, 0.5)
    rows = [
        Candidate("none", plain, {"rotated": shifted}),
        Candidate("laplace", plain + _nll(0.0005, 2, 0.002), {"rotated": shifted * 0.7}, predict_cost=1.4),
        Candidate("costly", plain + _nll(0.03, 3, 0.01), {"rotated": shifted * 0.5}, predict_cost=3.0),
        Candidate("temperature", plain + 0.0001, {"rotated": shifted * 0.98}, predict_cost=1.0),
    ]
    if with_auto:
        record = {
            "knob": "method",
            "chosen": "laplace+dac",
            "tolerance": 0.005,
            "perturbed": 90,
            "plain": {"clean_nll": 0.1, "shifted_nll": 2.0},
            "candidates": [
                {"candidate": "none", "chosen": False, "shifted_nll": 2.0},
                {"candidate": "laplace", "chosen": False, "shifted_nll": 1.6},
                {"candidate": "laplace+dac", "chosen": True, "shifted_nll": 1.5},
            ],
        }
        rows.append(
            Candidate(
                "auto", plain + _nll(0.0004, 4, 0.002), {"rotated": shifted * 0.75}, predict_cost=2.0, selection=record
            )
        )
    return rows


def test_the_test_data_pick_is_the_lowest_shift_nll_among_rows_within_the_tolerance_and_says_so():
    found = judge(_rows(), plain="none")
    assert (found.recommended, found.basis) == ("laplace", "test")
    assert found.tolerance == pytest.approx(0.005)  # max(2 % of 0.1, 0.005)
    costly, laplace = found.row("costly"), found.row("laplace")
    assert not costly.admissible and laplace.admissible and found.row("none").admissible
    assert costly.shift_nll < laplace.shift_nll  # the better shift NLL is refused for its in-distribution cost
    use, costs, buys = found.lines()
    assert use.startswith("**Use `laplace`**: picked on the test data, the lowest NLL under shift")
    assert '`method="auto"` makes this choice on held-out data' in use
    assert costs.startswith("It costs +0.0") and "within the 0.0050-nat tolerance" in costs
    assert "a prediction costs 1.4x a plain forward" in costs and "[" not in costs  # the intervals are in the table
    assert buys.startswith("It buys -0.") and "(0.70x on `rotated`)" in buys
    assert "| NLL on `rotated` | " in found.table() and "| predict cost | 1.0x | 1.4x | – | 1.4x |" in found.table()
    markdown = found.markdown("frontier.png")
    assert markdown.startswith("## Verdict\n\n**Use `laplace`**") and "![frontier" in markdown


def test_the_one_sided_bound_is_the_paired_bootstrap_quantile_near_the_normal_bound():
    found = judge(_rows(), plain="none", bootstraps=2000)
    rows = _rows()
    for row in rows[1:]:
        judged = found.row(row.label)
        mean, normal = excess_bound(row.clean, rows[0].clean, new_sample=math.inf, capped_gains=0)  # on these examples
        assert judged.clean.difference == pytest.approx(mean)
        assert judged.clean.upper == pytest.approx(normal, abs=0.15 * (normal - mean) + 1e-9)
        assert judged.clean.band[1] == judged.clean.upper  # the frontier's bar ends at the bound
        low, high = judged.clean.interval
        assert low <= judged.clean.difference <= high and high >= judged.clean.upper


def test_changes_are_paired_an_identical_row_has_a_zero_width_interval():
    plain = _nll(0.2, 5)
    ood = (_nll(0.3, 6, 0.2, 300).float(), _nll(0.6, 7, 0.3, 200).float())
    rows = [
        Candidate("none", plain, {"s": plain * 3}, ood=ood),
        Candidate("same", plain.clone(), {"s": plain * 3}, ood=ood),
    ]
    found = judge(rows, plain="none")
    same = found.row("same")
    for change in (same.clean, same.shifts["s"], same.ood):
        assert change.difference == 0 and change.interval == (0.0, 0.0)
    shift_only = judge([rows[0], Candidate("shift-only", plain.clone(), {"s": plain * 2})], plain="none")
    assert "It leaves the NLL in distribution as it was (1.00x" in shift_only.sentence()
    assert (
        "| NLL in distribution | 0.2" in shift_only.table()
        and "±0.0000 [±0.0000, ±0.0000] | 1.00x |" in shift_only.table()
    )
    # a small paired change has a far narrower interval than the plain model's own NLL
    nudged = judge([rows[0], Candidate("nudged", plain + _nll(0.001, 8, 0.001), {"s": plain * 3})], plain="none")
    low, high = nudged.row("nudged").clean.interval
    own = np.quantile([float(plain[torch.randint(N, (N,))].mean()) for _ in range(200)], [0.025, 0.975])
    assert 0 < high - low < 0.1 * (own[1] - own[0])


def test_ood_auroc_change_matches_the_metric_and_appears_in_the_sentence():
    plain = _nll(0.1, 9)
    generator = torch.Generator().manual_seed(0)
    test_h, ood_h = torch.rand(300, generator=generator), torch.rand(200, generator=generator) + 0.3
    rows = [
        Candidate("none", plain, {"s": plain * 2}, ood=(test_h, ood_h)),
        Candidate("better", plain, {"s": plain * 1.5}, ood=(test_h, ood_h + 0.2), predict_cost=1.2),
    ]
    found = judge(rows, plain="none")
    change = found.row("better").ood
    expected = posthoc.evaluation.metrics.ood_auroc(test_h, ood_h + 0.2) - posthoc.evaluation.metrics.ood_auroc(
        test_h, ood_h
    )
    assert change.difference == pytest.approx(expected) and change.interval[0] > 0
    assert re.search(r"and \+0\.\d{3} OOD AUROC \(0\.\d{3} -> 0\.\d{3}\)\.$", found.lines()[2])
    assert re.search(
        r"\| OOD AUROC \(entropy\) \| 0\.\d{3} \| 0\.\d{3} \| \+0\.\d{3} \[\+0\.\d{3}, \+0\.\d{3}\] \| – \|",
        found.table(),
    )


def test_an_auto_row_is_recommended_with_what_it_picked_on_held_out_data():
    found = judge(_rows(with_auto=True), plain="none")
    assert (found.recommended, found.basis) == ("auto", "auto")
    sentence = found.sentence()
    assert found.lines()[0] == "**Use `auto`**: on held-out data it picked `laplace+dac` among 3 candidates."
    assert "picked on the test data" not in sentence and "2.0x a plain forward" in sentence
    assert [p.label for p in found.frontier_points() if p.chosen] == ["auto"]


def test_auto_over_the_tolerance_on_the_test_examples_is_said_plainly():
    rows = _rows(with_auto=True)
    costly_auto = Candidate(
        "auto", rows[0].clean + _nll(0.02, 10, 0.01), rows[-1].shifted, selection=rows[-1].selection
    )
    sentence = judge([*rows[:-1], costly_auto], plain="none").sentence()
    assert re.search(r"its 95% bound \+0\.0\d{3} is over the 0\.0050-nat tolerance on these test examples", sentence)


def test_without_a_test_shift_auto_reports_its_held_out_perturbations_and_others_ask_for_a_shift():
    rows = [Candidate(r.label, r.clean, {}, r.ood, r.predict_cost, r.selection) for r in _rows(with_auto=True)]
    sentence = judge(rows, plain="none", shift_hint="pass `--shift DIR`").sentence()
    assert "It buys -0.5000 nats of NLL on the 90 fit-time perturbed copies of the held-out data (0.75x" in sentence
    plain_only = judge(rows[:4], plain="none", shift_hint="pass `--shift DIR`")
    assert plain_only.basis == "test-clean" and plain_only.frontier_points() == []
    assert "no shift was given (pass `--shift DIR` to see what it buys under shift)" in plain_only.sentence()


def test_keep_the_plain_model_when_nothing_within_the_tolerance_beats_it_under_shift():
    plain, shifted = _nll(0.1, 0), _nll(2.0, 1, 0.5)
    rows = [
        Candidate("none", plain, {"s": shifted}),
        Candidate("worse", plain, {"s": shifted * 1.1}),
        Candidate("costly", plain + 0.05, {"s": shifted * 0.5}),
    ]
    found = judge(rows, plain="none")
    assert found.keeps_plain and found.recommended == "none"
    assert found.sentence().startswith(
        "**Keep the plain model**: no method lowers the NLL under shift while its "
        "in-distribution excess stays within 0.0050 nats at 95% confidence"
    )
    assert found.lines()[1].startswith("`costly` would buy 0.50x under shift but costs +0.0500")
    assert found.table().splitlines()[0] == "| | `none` (plain) | `costly` | change [95% interval] | ratio |"
    picked_none = dict(_rows(with_auto=True)[-1].selection, chosen="none")
    auto = judge([rows[0], Candidate("auto", plain, {"s": shifted}, selection=picked_none)], plain="none")
    assert auto.keeps_plain and auto.sentence().startswith("**Keep the plain model**: `auto` found no candidate")


def test_bad_rows_are_refused_with_what_to_do():
    rows = _rows()
    with pytest.raises(posthoc.ConfigError, match="no row 'MAP' to judge the others against; rows: none, laplace"):
        judge(rows, plain="MAP")
    with pytest.raises(posthoc.InputError, match="evaluate every method on the same test loader"):
        judge([rows[0], Candidate("short", rows[1].clean[:10])], plain="none")


def test_frontier_points_of_a_selection_record_end_their_excess_bar_at_the_bound():
    record = {
        "tolerance": 0.005,
        "candidates": [
            {
                "candidate": "none",
                "excess": 0.0,
                "bound": 0.0,
                "shifted_nll": 3.0,
                "shifted_nll_se": 0.1,
                "admissible": True,
                "chosen": False,
            },
            {
                "candidate": "laplace",
                "excess": 0.001,
                "bound": 0.004,
                "shifted_nll": 2.0,
                "shifted_nll_se": 0.05,
                "admissible": True,
                "chosen": True,
            },
            {
                "candidate": "158",
                "excess": math.nan,
                "bound": math.nan,
                "shifted_nll": None,
                "admissible": False,
                "chosen": False,
            },
        ],
    }
    points = selection_points(record)
    assert [p.label for p in points] == ["none", "laplace"]
    laplace = points[1]
    assert laplace.chosen and laplace.x_interval == pytest.approx((-0.002, 0.004))
    assert laplace.y_interval == pytest.approx((2.0 - 1.6449 * 0.05, 2.0 + 1.6449 * 0.05), abs=1e-4)


def _overlapping(boxes) -> bool:
    return any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])


def test_frontier_of_twenty_close_points_has_no_overlapping_text_and_marks_the_pick(tmp_path):
    generator = torch.Generator().manual_seed(0)
    points = []
    for i in range(20):  # a tight cluster: most numbers cannot all find room
        x, y = (
            0.012 * float(torch.rand(1, generator=generator)) - 0.01,
            1.0 + 0.05 * float(torch.rand(1, generator=generator)),
        )
        points.append(
            plots.FrontierPoint(
                f"row {i}",
                x,
                (x - 0.001, x + 0.002),
                y,
                (y - 0.01, y + 0.01),
                admissible=x + 0.002 <= 0.0,
                chosen=i == 7,
            )
        )
    fig = plots.frontier(points, tmp_path / "frontier.png", tolerance=0.005)
    ax = fig.axes[0]
    numbers = [text.get_window_extent() for text in ax.texts]
    assert 0 < len(numbers) <= 20 and not _overlapping(numbers)
    ticks = [label.get_window_extent() for label in ax.get_xticklabels() if label.get_text()]
    assert len(ticks) >= 3 and not _overlapping(ticks)
    assert all(ax.bbox.contains(box.x0, box.y0) and ax.bbox.contains(box.x1, box.y1) for box in numbers)
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert legend[0].startswith("admissible: excess bound <= 0.005") and legend[8] == "8  row 7 (recommended)"
    legend_box, axes_box = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert len(legend) == 21 and legend_box.y1 <= axes_box.y0 and legend_box.width <= axes_box.width  # under, no wider
    assert plots.overlapping_texts(fig) == []
    span = next(patch for patch in ax.patches if patch.get_label().startswith("admissible"))
    assert span.get_x() + span.get_width() == pytest.approx(0.005)
    refused = [c for c, p in zip(ax.containers, points) if not p.admissible]
    assert refused and all(c.lines[0].get_markerfacecolor() == "white" for c in refused)
    assert len(ax.collections) >= 1 and (tmp_path / "frontier.png").stat().st_size > 20_000


def test_frontier_turns_symmetric_log_when_one_point_costs_far_more_than_the_tolerance():
    points = [
        plots.FrontierPoint("none", 0.0, None, 1.0, None, True),
        plots.FrontierPoint("swag", 0.4, (0.3, 0.5), 0.8, None, False),
    ]
    assert plots.frontier(points, tolerance=0.005).axes[0].get_xscale() == "symlog"
    assert plots.frontier(points[:1], tolerance=0.005).axes[0].get_xscale() == "linear"


def _report(name: str, probs: torch.Tensor, labels: torch.Tensor) -> Report:
    return Report.from_predictions(name, probs, labels)


def reports_of(
    scales: tuple[tuple[str, float, float], ...], n: int = 400, margin: float = 3.0
) -> tuple[list[Report], dict[str, list[Report]]]:
    """One report per ``(name, clean scale, shift scale)``: the softmax of the same seeded logits (the label's logit
    raised by ``margin``) times the clean scale, and of shifted logits times the shift scale, on ``n`` examples."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (n,), generator=generator)
    logits = torch.randn(n, 4, generator=generator)
    logits[torch.arange(n), labels] += margin
    shifted = torch.randn(n, 4, generator=generator)
    shifted[torch.arange(n), labels] += 1.0
    reports, rotated = [], []
    for name, clean, shift in scales:
        reports.append(_report(name, torch.softmax(logits * clean, -1), labels))
        rotated.append(_report(name, torch.softmax(shifted * shift, -1), labels))
    return reports, {"rotated": rotated}


def _three_reports() -> tuple[list[Report], dict[str, list[Report]]]:
    return reports_of((("none", 1.2, 3.0), ("temperature", 1.2, 2.85), ("laplace", 1.25, 2.1)))


def test_report_comparisons_open_with_the_verdict_and_mark_the_best_entries(tmp_path):
    reports, shifts = _three_reports()
    text = reports[0].to_markdown(*reports[1:], shifts=shifts)
    assert (
        text.startswith("## Verdict\n\n**Use `laplace`**: picked on the test data") and "| NLL on `rotated` |" in text
    )
    assert text.endswith("times are not ranked).")
    nll = {
        line.split(" | ")[0][2:]: line.split(" | ")[2]
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("| method")
    }
    best = min(reports, key=lambda r: r.nll).name
    assert nll[best].startswith("**") and sum(cell.startswith("**") for cell in nll.values()) == 1
    assert reports[0].to_markdown() == markdown_table(reports[:1]) and "**" not in reports[0].to_markdown()
    page = html_page.write_html(reports[0], tmp_path / "compared.html", *reports[1:], shifts=shifts).read_text()
    # a title; the verdict's table and its frontier side by side, then the table of every report
    title = "posthoc report: 3 methods on one test set, against the plain model `none`"
    assert f"<title>{title}</title>" in page and page.index("<h1>") < page.index('<section class="verdict">')
    verdict_table = page.index("<table>")
    assert page.index('<div class="side">') < verdict_table < page.index("data:image/png;base64,")
    assert page.index("data:image/png;base64,") < page.index("<table>", verdict_table + 1)
    assert page.count("data:image/png;base64,") == 3  # the frontier, reliability diagrams, risk-coverage curves
    # every figure its caption names is on the page, and every figure has a caption
    assert "Frontier: the plain model, the recommended row" in page and page.count("<figcaption>") == 2
    unshifted = html_page.write_html(reports[0], tmp_path / "plain.html", *reports[1:]).read_text()
    assert "Frontier" not in unshifted and "frontier" not in unshifted.split("<figure>")[0].split("</section>")[0]
    assert unshifted.count("data:image/png;base64,") == 2
    assert compared_verdict(reports, shifts).recommended == text.split("`")[1]
    with pytest.raises(posthoc.ConfigError, match="has 1 reports for 3 methods"):
        reports[0].to_markdown(*reports[1:], shifts={"rotated": shifts["rotated"][:1]})


def test_best_entries_follow_each_metrics_direction_and_count_ties():
    assert best_rows([0.9, 0.95, 0.95], "accuracy") == {1, 2} and best_rows([0.3, 0.1], "ece") == {1}
    assert best_rows([0.9, 0.8], "coverage_90") == set() and best_rows([0.1], "nll") == set()
    assert bold_best(["0.1000 [0.0, 0.2]", "–"], [0.1, None], "nll") == ["0.1000 [0.0, 0.2]", "–"]
    table = ShiftTable(
        ("rotate",),
        (1,),
        {
            m: {
                "clean": {0: {"accuracy": a, "nll": n, "ece": 0.1, "brier": 0.1}},
                "rotate": {1: {"accuracy": a, "nll": 2 * n, "ece": 0.2, "brier": 0.2}},
                "mean": {1: {"accuracy": a, "nll": 2 * n, "ece": 0.2, "brier": 0.2}},
            }
            for m, a, n in (("MAP", 0.9, 0.3), ("laplace", 0.8, 0.2))
        },
    )
    text = table.to_markdown(["nll", "accuracy"], detail=True)
    assert "| laplace | **0.2000** | **0.4000** |" in text and "| MAP | **0.9000** | 0.9000 |" not in text
    assert "| MAP | **0.9000** | **0.9000** |" in text  # accuracy: higher is better
    assert "| laplace | rotate | 1 | 0.8000 | **0.4000** | **0.2000** | **0.2000** |" in text  # ties in bold


def test_per_example_nll_averages_to_the_reports_nll():
    reports, _ = _three_reports()
    assert float(example_nll(reports[1]).mean()) == pytest.approx(reports[1].nll, rel=1e-6)
    generator = torch.Generator().manual_seed(0)
    means, stds = torch.randn(1, 50, 1, generator=generator), torch.rand(1, 50, 1, generator=generator) + 0.5
    targets = torch.randn(50, 1, generator=generator)
    regression = Report.from_gaussian("laplace", means, stds, targets)
    assert float(example_nll(regression).mean()) == pytest.approx(regression.nll, rel=1e-5)
    assert candidate(regression).clean.shape == (50,)


class _Tree(HTMLParser):
    """Each table's enclosing element and the page's style sheet."""

    def __init__(self) -> None:
        super().__init__()
        self.stack, self.table_parents, self.style, self.in_style = [], [], "", False

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.table_parents.append(self.stack[-1] if self.stack else None)
        self.in_style = tag == "style"
        if tag not in ("img", "br", "meta"):
            self.stack.append((tag, dict(attrs).get("class")))

    def handle_endtag(self, tag):
        self.in_style = False
        while self.stack and self.stack.pop()[0] != tag:
            pass

    def handle_data(self, data):
        if self.in_style:
            self.style += data


def test_a_written_page_is_never_wider_than_its_window(tmp_path):
    """Structural: every table sits in a container that scrolls sideways itself, images shrink to the page, long
    words wrap, and no element has a fixed width (checked in Chromium at 1400 px: scrollWidth == clientWidth)."""
    reports, shifts = _three_reports()
    wide_row = "| " + " | ".join(f"column {i} with a long header" for i in range(40)) + " |"
    text = "# T\n\n" + wide_row + "\n|" + "---|" * 40 + "\n" + wide_row + "\n\n" + "a" * 3000
    pages = [
        html_page.write_markdown_page(text, tmp_path / "md.html").read_text(),
        html_page.write_html(reports[0], tmp_path / "report.html", *reports[1:], shifts=shifts).read_text(),
    ]
    for page in pages:
        tree = _Tree()
        tree.feed(page)
        assert tree.table_parents and all(parent == ("div", html_page.WIDE) for parent in tree.table_parents)
        style = re.sub(r"\s+", " ", tree.style)
        assert f".{html_page.WIDE} {{ max-width: 100%; overflow-x: auto;" in style
        assert "img { max-width: 100%;" in style and "overflow-wrap: anywhere" in style
        assert not re.search(r"(width|min-width)\s*:\s*\d{4,}px", page.replace("max-width: 1400px", ""))
        assert 'style="' not in page and "width=" not in page


def test_a_chain_chosen_by_auto_renders_as_subsections_and_untried_candidates_as_one_line():
    knob = {
        "knob": "prior_precision",
        "chosen": "10",
        "tolerance": 0.005,
        "confidence": 0.9,
        "examples": 100,
        "perturbed": 300,
        "folds": None,
        "fallback": False,
        "plain": {"clean_nll": 0.1, "shifted_nll": 2.0, "shifted_ece": 0.2},
        "candidates": [
            {
                "candidate": "10",
                "excess": 0.001,
                "bound": 0.003,
                "shifted_nll": 1.8,
                "shifted_ece": 0.1,
                "seconds": 0.1,
                "admissible": True,
                "reason": None,
                "chosen": True,
            }
        ]
        + [
            {
                "candidate": str(v),
                "excess": math.nan,
                "bound": math.nan,
                "shifted_nll": None,
                "shifted_ece": None,
                "seconds": None,
                "admissible": False,
                "reason": "not tried: the walk stopped at a refused candidate",
                "chosen": False,
            }
            for v in (5, 2, 1)
        ],
    }
    method = dict(
        knob,
        knob="method",
        chosen="laplace",
        candidates=[dict(knob["candidates"][0], candidate="laplace", fit_seconds=3.0, predict_cost=1.4)],
    )
    entry = {
        "method": "auto",
        "options": {},
        "fitted": True,
        "random_variables": 5,
        "layers": [],
        "chosen": "laplace",
        "selection": method,
        "chosen_posterior": [{"method": "laplace", "random_variables": 5, "prior_precision": 10.0, "selection": knob}],
    }
    text = ModelCard.of([entry], None, model_class="Net", fingerprint=None, version="0").to_markdown()
    assert "chosen_posterior" not in text and "selection=" not in text
    assert "### 1.1 laplace (in the chosen chain)" in text and "| prior_precision | 10 |" in text
    assert "| laplace | 0.001 (0.003) | 1.8 | 0.1 | 3 | 1.4x | **chosen** |" in text
    assert "| fit s | predict x fwd | verdict |" in text
    lines = selection_table(knob)
    assert (
        lines[-1] == "| 5 ... 1 (3 candidates) | - | - | - | - | not tried: the walk stopped at a refused candidate |"
    )
    assert sum("not tried" in line for line in lines) == 1


def test_the_verdict_section_of_a_page_ends_at_the_next_heading():
    body = html_page.markdown_to_html("# T\n\n## Verdict\n\n**Use `auto`** now\n\n### Tables\n\n| a |\n|---|\n| 1 |")
    assert body.index('<section class="verdict">') < body.index("<h2>Verdict</h2>") < body.index("</section>")
    assert body.index("</section>") < body.index("<h3>Tables</h3>") and "<code>auto</code>" in body


def test_a_plain_nll_near_zero_reads_as_a_difference_not_a_ratio():
    """A plain model with an NLL of 1e-8 once read "(24438.84x the plain model's 0.0000)"."""
    plain = torch.full((N,), 1e-8, dtype=torch.float64)
    rotated = _nll(2.0, 16, 0.3)
    rows = [
        Candidate("none", plain, {"rotated": rotated, "blur": plain.clone()}),
        Candidate("laplace", plain + _nll(0.0002, 11, 0.0001), {"rotated": rotated * 0.75, "blur": plain + 0.001}),
    ]
    found = judge(rows, plain="none", tolerance=0.005)
    text = found.text()
    assert found.recommended == "laplace"
    assert "x the plain model's" not in text and not re.search(r"\d{3,}\.\d\dx", text)
    assert "It costs +0.0002 nats of NLL in distribution (within the 0.0050-nat tolerance)" in text
    assert "of NLL under shift (on `blur` to 0.75x on `rotated`)" in text
    table = found.table().splitlines()
    assert table[2].startswith("| NLL in distribution | 0.0000 | 0.0002 | +0.0002 [") and table[2].endswith("| – |")
    assert table[3].endswith("| 0.75x |") and table[4].startswith("| NLL on `blur` |") and table[4].endswith("| – |")
    assert "No ratio where the plain model's NLL is under 0.01" in text
    # a plain NLL of 0.5 keeps its ratio, and no note
    ordinary = judge([Candidate("none", plain + 0.5), Candidate("laplace", plain + 0.45)], plain="none")
    assert "0.90x the plain model's 0.5000" in ordinary.text() and "No ratio" not in ordinary.text()


def test_a_predict_cost_on_a_fast_forward_gives_its_microseconds_beside_the_ratio():
    """On a model whose forward takes microseconds the ratio alone read "mc-dropout 2314x"."""
    plain = _nll(0.1, 12)
    fast = judge(
        [
            Candidate("none", plain, forward_seconds=8e-7),
            Candidate("mc", plain * 0.9, predict_cost=2314.0, forward_seconds=8e-7),
        ],
        plain="none",
    )
    assert "; a prediction costs 2,314x a plain forward (1,851 µs against 0.8 µs)." in fast.lines()[1]
    assert "| predict cost | 1.0x (0.8 µs) | 2,314x (1,851 µs) | – | 2,314x |" in fast.table()
    slow = judge(
        [
            Candidate("none", plain, forward_seconds=0.02),
            Candidate("mc", plain * 0.9, predict_cost=3.2, forward_seconds=0.02),
        ],
        plain="none",
    )
    assert "; a prediction costs 3.2x a plain forward." in slow.lines()[1] and "µs" not in slow.text()
    assert cost_cell(101.2, 2e-5) == "101.2x (2,024 µs)" and cost_cell(101.2, 2e-3) == "101.2x"


def _auto_record(laplace_excess: float, laplace_bound: float, chosen: str = "none") -> dict:
    """A selection record between methods: ``none`` (the plain model) and ``laplace``."""
    return {
        "knob": "method",
        "chosen": chosen,
        "tolerance": 0.005,
        "plain": {"clean_nll": 0.36},
        "candidates": [
            {"candidate": "none", "excess": 0.0, "bound": 0.0, "admissible": True, "chosen": chosen == "none"},
            {
                "candidate": "laplace",
                "excess": laplace_excess,
                "bound": laplace_bound,
                "admissible": laplace_bound <= 0.005,
                "reason": None if laplace_bound <= 0.005 else "bound over the tolerance",
                "chosen": chosen == "laplace",
            },
        ],
    }


def test_a_candidate_auto_refused_though_better_on_held_out_data_is_named_with_the_tolerance_that_takes_it():
    """Issue 44: auto refused laplace (held-out excess -0.034, bound +0.0052 > 0.0050) and the verdict only read
    "Keep the plain model"."""
    plain = _nll(0.36, 13)
    record = _auto_record(-0.034, 0.00523)
    found = judge([Candidate("none", plain), Candidate("auto", plain.clone(), selection=record)], plain="none")
    assert found.keeps_plain and len(found.lines()) == 1
    note = next(note for note in found.notes() if note.startswith("Refused on held-out data although better there"))
    assert "`laplace`, held-out NLL 0.0340 nats below the plain model's" in note
    assert "its 95% bound +0.0052 is over the tolerance 0.0050" in note
    tolerance = float(re.search(r"tolerance=([\d.]+)\)", note).group(1))
    assert 0.00523 <= tolerance <= 0.0053  # a candidate is admitted when its bound <= the tolerance: this one takes it
    assert note in found.markdown() and "Refused" in found.as_dict()["notes"][0]
    # nothing is said when the refused candidate was worse, or when the better one was taken
    for worse in (_auto_record(0.01, 0.02), _auto_record(-0.034, 0.004, chosen="laplace")):
        quiet = judge([Candidate("none", plain), Candidate("auto", plain.clone(), selection=worse)], plain="none")
        assert not any(note.startswith("Refused") for note in quiet.notes())


def test_a_test_table_that_disagrees_with_autos_pick_is_said_in_one_line():
    """Issue 44: "Keep the plain model: auto found no candidate worth its cost", directly above a table in which
    laplace halves the NLL."""
    plain = _nll(0.36, 14)
    auto = Candidate("auto", plain.clone(), selection=_auto_record(-0.034, 0.0052))
    halves = Candidate("laplace", plain * 0.5)
    found = judge([Candidate("none", plain), auto, halves], plain="none")
    assert found.keeps_plain and found.disagreement[0] == "laplace"
    line = next(note for note in found.notes() if note.startswith("The test table disagrees"))
    assert line.startswith("The test table disagrees: `laplace` has a lower test NLL than the plain model by 0.1")
    low, high = found.disagreement[1].interval
    assert high < 0 and f"[{low:+.4f}, {high:+.4f}]" in line
    # a row within the noise of auto's pick is no disagreement; nor is any row when the pick is made on the test data
    close = Candidate("laplace", plain + _nll(0.0, 15, 0.01) - 0.004)
    assert judge([Candidate("none", plain), auto, close], plain="none").disagreement is None
    assert judge([Candidate("none", plain), halves], plain="none").disagreement is None


def test_the_candidates_auto_left_out_are_named_in_the_verdict():
    """Issue 44: auto dropped laplace on a 1-output head with its reason only under left_out in the model card."""
    plain = _nll(0.36, 16)
    record = {**_auto_record(0.01, 0.02), "left_out": {"laplace+dac": "laplace needs a head with at least 2 outputs."}}
    found = judge([Candidate("none", plain), Candidate("auto", plain.clone(), selection=record)], plain="none")
    note = next(note for note in found.notes() if note.startswith("Left out by auto"))
    assert note == "Left out by auto before it chose: `laplace+dac` (laplace needs a head with at least 2 outputs)."
    assert note in found.markdown()
    quiet = judge(
        [Candidate("none", plain), Candidate("auto", plain.clone(), selection=_auto_record(0.01, 0.02))], "none"
    )
    assert not any(note.startswith("Left out") for note in quiet.notes())
