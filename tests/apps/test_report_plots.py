"""Plots read back from their figure objects (lines, legend entries, panels), the files they write, and the HTML
report (html_view, write_html, the Markdown-to-HTML page): posthoc_apps.report."""

import re

import pytest
import torch
from matplotlib.collections import PathCollection
from PIL import Image

import posthoc
from posthoc.evaluation.report import Report
from posthoc.evaluation.shift import ShiftTable, plain_and_best
from posthoc_apps.report import figures, plots
from posthoc_apps.report import page as html_page


def _curves(count: int, n: int = 300) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    curves = {}
    for i in range(count):
        probs = torch.softmax((1 + i / 4) * torch.randn(n, 5, generator=generator), -1)
        curves[f"method {i}"] = (probs, torch.multinomial(probs, 1, generator=generator).squeeze(-1))
    return curves


def test_twenty_methods_get_distinct_styles():
    styles = plots.method_styles(20)
    assert len({(s["color"], s["linestyle"]) for s in styles}) == 20
    assert len({s["color"] for s in styles}) == 20
    assert all(a["linestyle"] != b["linestyle"] for a, b in zip(styles, styles[1:]))


def test_risk_coverage_is_readable_with_twenty_methods(tmp_path):
    curves = _curves(20)
    fig = plots.risk_coverage_curve(curves, tmp_path / "rc.png")
    ax = fig.axes[0]
    lines = ax.get_lines()
    assert len(lines) == 20
    assert len({(line.get_color(), line.get_linestyle()) for line in lines}) == 20
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(texts) == 20 and all(re.search(r"\(AURC \d\.\d{4}\)$", t) for t in texts)
    # the legend sits under the axes, not on the curves, and is no wider than them; no two texts overlap
    assert plots.overlapping_texts(fig) == []
    legend_box, axes_box = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend_box.y1 <= axes_box.y0 and legend_box.width <= axes_box.width
    with Image.open(tmp_path / "rc.png") as image:
        assert image.size[0] > 500 and image.size[1] > 300


def test_risk_coverage_log_scale_and_operating_point(tmp_path):
    curves = _curves(2)
    fig = plots.risk_coverage_curve(
        curves, tmp_path / "rc.png", {"method 0": (0.5, 0.1)}, target_risk=0.2, log_scale=True
    )
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    assert len(ax.get_lines()) == 2 + 1 + 1  # two curves, the operating point, the target line
    assert len(ax.get_legend().get_texts()) == 3


def test_reliability_grid_has_a_count_histogram_under_each_panel_and_shared_axes(tmp_path):
    curves = _curves(7)
    fig = plots.reliability_diagram(curves, tmp_path / "rel.png")
    assert len(fig.axes) == 14  # a reliability panel and a count panel per method
    panels, counts = fig.axes[0::2], fig.axes[1::2]
    assert all(ax.get_shared_y_axes().joined(panels[0], ax) for ax in panels)
    assert all(ax.get_shared_y_axes().joined(counts[0], ax) for ax in counts)
    assert all(ax.get_shared_x_axes().joined(p, ax) for p, ax in zip(panels, counts))
    heights = [sum(bar.get_height() for bar in ax.patches) for ax in counts]
    assert heights == [300] * 7  # every example is counted once
    assert [ax.get_title().split("\n")[0] for ax in panels] == list(curves)
    with Image.open(tmp_path / "rel.png") as image:
        assert image.size[0] > 1000 and image.size[1] > 500


def _shift_table() -> ShiftTable:
    values, bounds = {}, {}
    for i, method in enumerate(["MAP", "laplace", "swag"]):
        row = {"accuracy": 0.9, "nll": 0.1 + i, "ece": 0.01, "brier": 0.1}
        values[method] = {"clean": {0: row}, "rotate": {1: row, 3: row}, "mean": {1: row, 3: row}}
        band = {m: (v - 0.01, v + 0.01) for m, v in row.items()}
        bounds[method] = {"clean": {0: band}, "rotate": {1: band, 3: band}, "mean": {1: band, 3: band}}
    return ShiftTable(("rotate",), (1, 3), values, bounds, 0.95)


def test_shift_plot_has_one_line_per_method_per_metric(tmp_path):
    fig = figures.shift_plot(_shift_table(), tmp_path / "shift.png")
    assert len(fig.axes) == 2
    for ax in fig.axes:
        assert len(ax.get_lines()) == 3
        assert list(ax.get_lines()[0].get_xdata()) == [0, 1, 3]
        assert len(ax.collections) == 3  # the interval bands
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["MAP", "laplace", "swag"]
    assert plots.overlapping_texts(fig) == []
    assert (tmp_path / "shift.png").stat().st_size > 10_000


def test_shift_table_markdown_and_dict():
    table = _shift_table()
    text = table.to_markdown(["nll"], detail=True)
    assert "| laplace | 1.1000 [1.0900, 1.1100] | 1.1000 [1.0900, 1.1100] |" in text
    assert "| swag | rotate | 3 |" in text
    assert table.as_dict()["ci"] == 0.95
    with pytest.raises(posthoc.ConfigError, match="same kinds"):
        ShiftTable.merge([table, ShiftTable(("contrast",), (1, 3), {}, {}, 0.95)])


def test_report_renders_in_jupyter_and_as_one_html_file(tmp_path):
    probs, labels = _curves(1)["method 0"]
    report = Report.from_predictions("MAP", probs, labels)
    view = html_page.html_view(report)
    assert view.count("<table>") == 1 and view.count("data:image/png;base64,") == 2
    path = html_page.write_html(report, tmp_path / "report.html")
    page = path.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<td>MAP</td>" in page
    assert 20_000 < path.stat().st_size < 2_000_000


def test_markdown_page_embeds_its_images(tmp_path):
    plots.risk_coverage_curve(_curves(2), tmp_path / "rc.png")
    text = (
        "# Title\n\n- a **bold** item\n\n| a | b |\n|---|---|\n| 1 | <2> |\n\n![curve](rc.png)\n\n![gone](missing.png)"
    )
    page = html_page.write_markdown_page(text, tmp_path / "report.html").read_text()
    assert "<h1>Title</h1>" in page and "<b>bold</b>" in page and "<td>&lt;2&gt;</td>" in page
    assert page.count("data:image/png;base64,") == 1 and "![gone](missing.png)" in page


def _story_table() -> ShiftTable:
    """Two methods with kept reports: MAP stays confident while its accuracy falls, laplace follows it down."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (200,), generator=generator)
    values, reports = {}, {}
    for method, damping in (("MAP", 0.0), ("laplace", 0.6)):
        values[method], reports[method] = {}, {}
        for kind, severity in [("clean", 0), ("rotate", 1), ("rotate", 3), ("contrast", 1), ("contrast", 3)]:
            sharp = torch.full((200, 4), -4.0)
            noisy = (
                labels
                if severity == 0
                else torch.where(torch.rand(200, generator=generator) < 0.2 * severity, (labels + 1) % 4, labels)
            )
            sharp[torch.arange(200), noisy] = 4.0 * (1 - damping * severity / 3)
            probs = torch.softmax(sharp, -1)
            report = Report.from_predictions(method, probs, labels)
            reports[method][kind, severity] = report
            values[method].setdefault(kind, {})[severity] = {
                "accuracy": report.accuracy,
                "nll": report.nll,
                "ece": report.ece,
                "brier": report.brier,
            }
        values[method]["mean"] = {
            s: {
                m: (values[method]["rotate"][s][m] + values[method]["contrast"][s][m]) / 2
                for m in ("accuracy", "nll", "ece", "brier")
            }
            for s in (1, 3)
        }
    return ShiftTable(("rotate", "contrast"), (1, 3), values, reports=reports)


def test_confidence_plot_shows_confidence_and_accuracy_per_method_with_the_gap_shaded(tmp_path):
    table = _story_table()
    assert table.best_method(exclude=["MAP"]) == "laplace" and table.best_method() == "laplace"
    assert plain_and_best(table) == ["MAP", "laplace"] and plain_and_best(table, "MAP") == ["MAP"]
    severities, confidence, accuracy = table.confidence_series("MAP")
    assert severities == [0, 1, 3] and confidence[-1] - accuracy[-1] > confidence[0] - accuracy[0]
    assert table.confidence("MAP", "mean", 3) == pytest.approx(
        (table.confidence("MAP", "rotate", 3) + table.confidence("MAP", "contrast", 3)) / 2
    )
    fig = figures.confidence_plot(table, tmp_path / "confidence.png", plain_and_best(table))
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines()] == [
        "MAP confidence",
        "MAP accuracy",
        "laplace confidence",
        "laplace accuracy",
    ]
    assert list(ax.get_lines()[0].get_ydata()) == pytest.approx(confidence)
    assert list(ax.get_lines()[1].get_ydata()) == pytest.approx(accuracy)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [line.get_label() for line in ax.get_lines()]
    assert len(ax.collections) == 2 and ax.get_title() == "mean over rotate, contrast"
    with Image.open(tmp_path / "confidence.png") as image:
        assert image.size[0] > 500 and image.size[1] > 300
    rebuilt = ShiftTable(table.kinds, table.severities, table.values)  # as from JSON: no predictions kept
    with pytest.raises(posthoc.ConfigError, match="confidence needs a table made by evaluate_shift"):
        rebuilt.confidence_series("MAP")
    with pytest.raises(posthoc.ConfigError, match="no method 'swag'"):
        plain_and_best(table, "swag")


def test_tables_at_different_severities_join_into_one_without_intervals():
    table = _story_table()
    low = ShiftTable(
        table.kinds,
        (1,),
        {
            m: {k: {s: v for s, v in by.items() if s in (0, 1)} for k, by in kinds.items()}
            for m, kinds in table.values.items()
        },
        reports={m: {key: r for key, r in reports.items() if key[1] in (0, 1)} for m, reports in table.reports.items()},
    )
    high = ShiftTable(
        table.kinds,
        (3,),
        {
            m: {k: {s: v for s, v in by.items() if s in (0, 3)} for k, by in kinds.items()}
            for m, kinds in table.values.items()
        },
        reports={m: {key: r for key, r in reports.items() if key[1] in (0, 3)} for m, reports in table.reports.items()},
    )
    joined = ShiftTable.join([high, low])
    assert joined.severities == (1, 3) and joined.values == table.values and joined.intervals == {}
    assert joined.confidence_series("laplace") == table.confidence_series("laplace")
    with pytest.raises(posthoc.ConfigError, match="same methods and kinds"):
        ShiftTable.join([table, ShiftTable(("rotate",), (1,), {"MAP": {}})])


def test_every_plot_is_legible_at_its_size_no_two_texts_overlap_and_no_legend_is_wider_than_its_plot(tmp_path):
    """The demo's reliability grid once showed "1.00.0" where two panels' ticks met and titles running into each
    other; its risk-coverage and shift legends were wider than their plots."""
    long_names = [
        "MC dropout (own, rate on val) + temperature",
        "MC dropout (head, p=auto)",
        "SWAG last-layer + temperature",
        "Laplace + DAC",
        "iBNN (K=2) + temperature",
    ]
    curves = dict(zip(long_names, _curves(5).values()))
    grid = plots.reliability_diagram(curves, tmp_path / "rel.png")
    assert plots.overlapping_texts(grid) == []
    assert all(len(line) <= 30 for ax in grid.axes[0::2] for line in ax.get_title().splitlines())
    rc = plots.risk_coverage_curve(curves, tmp_path / "rc.png")
    shift = plots.shift_plot(
        {name: {"nll": ([0, 1, 3], [0.1, 0.5 + i, 2.0 + i], None, None)} for i, name in enumerate(long_names)},
        tmp_path / "shift.png",
        ["nll"],
    )
    for fig in (rc, shift):
        assert plots.overlapping_texts(fig) == []
    rc_legend, rc_axes = rc.axes[0].get_legend().get_window_extent(), rc.axes[0].get_window_extent()
    assert rc_legend.width <= rc_axes.width and rc_legend.y1 <= rc_axes.y0
    assert shift.legends[0].get_window_extent().width <= shift.bbox.width


def test_the_frontiers_star_is_drawn_over_its_neighbours_and_numbers_keep_off_the_markers():
    """The demo's frontier once piled the numbers of five points onto one spot and hid the recommended star."""
    points = [
        plots.FrontierPoint("MAP", 0.0, (0.0, 0.0), 2.06, (2.01, 2.11), True),
        plots.FrontierPoint("auto", -0.0031, (-0.007, 0.001), 1.91, (1.87, 1.95), True, chosen=True),
        plots.FrontierPoint("LLLA kron", -0.0030, (-0.007, 0.001), 1.912, (1.87, 1.95), True),
        plots.FrontierPoint("MC dropout", -0.0005, (-0.002, 0.001), 1.97, (1.93, 2.01), True),
        plots.FrontierPoint("DAC", 0.0004, (-0.001, 0.0017), 1.90, (1.85, 1.94), True),
    ]
    fig = plots.frontier(points, tolerance=0.005)
    ax = fig.axes[0]
    star = next(c for c in ax.collections if isinstance(c, PathCollection))  # the one scatter: the star
    others = [c.lines[0].get_zorder() for c, p in zip(ax.containers, points) if not p.chosen]
    assert star.get_zorder() > max(others)
    assert plots.overlapping_texts(fig) == []
    renderer = fig.canvas.get_renderer() if hasattr(fig.canvas, "get_renderer") else None
    if renderer is None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        renderer = FigureCanvasAgg(fig).get_renderer()
    markers = [ax.transData.transform((p.x, p.y)) for p in points]
    for text in ax.texts:
        box = text.get_window_extent(renderer)
        assert not any(box.x0 <= x <= box.x1 and box.y0 <= y <= box.y1 for x, y in markers), text.get_text()


def test_a_page_comparing_regressors_draws_their_calibration_curves(tmp_path):
    """One report class for every kind: a regressor's compared page has the verdict, the table of both rows and the
    regressor's pictures (not a classifier's reliability diagram)."""
    generator = torch.Generator().manual_seed(0)
    targets = torch.randn(60, generator=generator)
    plain = Report.from_gaussian("MAP", torch.zeros(1, 60, 1), torch.ones(1, 60, 1), targets)
    wide = Report.from_gaussian("wide", torch.zeros(1, 60, 1), 3 * torch.ones(1, 60, 1), targets)
    text = html_page.write_html(plain, tmp_path / "compared.html", wide).read_text()
    assert "<h2>Verdict</h2>" in text and "<td>wide</td>" in text and "RMSE" in text
    assert 'alt="calibration curves"' in text and 'alt="reliability diagrams"' not in text
    assert text.count("data:image/png;base64,") == 2
