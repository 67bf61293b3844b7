import re
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

import posthoc
from posthoc.core.registry import REGISTRY
from posthoc.errors import ConfigError
from posthoc.shift import EVALUATION_KINDS
from posthoc_apps.cli.main import main
from posthoc_apps.demo import data, zoo
from posthoc_apps.demo import run as demo_run
from posthoc_apps.demo.configs import DEMO_CONFIGS
from posthoc_apps.demo.run import (
    SEVERITIES,
    STORY_SEVERITIES,
    DemoRow,
    demo_configs,
    demo_verdict,
    left_out,
    render,
    shift_story,
)
from posthoc_apps.report import figures


def test_digits_splits_are_fixed_stratified_and_disjoint(digits):
    assert (len(digits.fit), len(digits.calibration), len(digits.test)) == (2400, 600, 1000)
    assert torch.bincount(digits.test.tensors[1]).tolist() == [125] * 8
    assert set(digits.ood.tensors[1].unique().tolist()) == {8, 9}
    again = data.load_digits()
    assert torch.equal(again.test.tensors[0], digits.test.tensors[0])
    fit_rows = {row.numpy().tobytes() for row in digits.fit.tensors[0][:200]}
    assert not any(row.numpy().tobytes() in fit_rows for row in digits.test.tensors[0])


def test_rotation_and_noise(digits):
    x = digits.test.tensors[0][:4]
    turned = data.rotated(digits.test, 180).tensors[0][:4]
    assert torch.allclose(turned, x.flip(-1).flip(-2), atol=1e-5)
    noise = data.noise(10)
    assert noise.tensors[0].shape == (10, 1, 28, 28) and (noise.tensors[1] == -1).all()


@pytest.mark.parametrize("name", ["digits_cnn", "digits_bn_cnn"])
def test_bundled_checkpoints_are_good_classifiers(digits, name):
    model = zoo.pretrained(name)
    x, y = digits.test.tensors
    with torch.no_grad():
        accuracy = (model(x).argmax(-1) == y).float().mean()
    assert accuracy > 0.95


def test_second_architecture_has_no_dropout_and_a_batchnorm_body():
    model = zoo.pretrained("digits_bn_cnn")
    kinds = {type(module) for module in model.modules()}
    assert torch.nn.BatchNorm2d in kinds and not any(issubclass(k, torch.nn.Dropout) for k in kinds)


def test_unknown_checkpoint_names_the_available_ones():
    with pytest.raises(FileNotFoundError, match="digits_bn_cnn"):
        zoo.pretrained("resnet50")


def test_demo_command_writes_tables_and_pictures(tmp_path, capsys):
    main(["demo", "--out", str(tmp_path), "--method", "none", "--method", "temperature", "--quiet"])
    printed = capsys.readouterr().out
    report = (tmp_path / "report.md").read_text()
    # the console gets the verdict and where the report is, not the report
    assert "### Digits" not in printed and printed.rstrip().endswith(" s")
    assert f"Report: {tmp_path / 'report.html'}" in printed and printed.startswith(("**Use", "**Keep"))
    # the verdict and its frontier before any table; without an auto row the pick is made on the test digits
    verdict = report.split("## Verdict\n\n")[1].split("\n### ")[0]
    assert report.index("## Verdict") < report.index("| method |") and "![frontier" in verdict
    assert re.match(r"\*\*(Use `temperature`\*\*: picked on the test data|Keep the plain model\*\*)", verdict)
    assert verdict.split("\n\n")[0] in printed
    merged = "`temperature` into `MAP` (its temperature kept T = 1)" in report
    labels = ("MAP",) if merged else ("MAP", "temperature")
    assert merged or "**" in report.split("### Digits")[1].split("\n\n")[1]  # two rows: the best entries in bold
    cells = report.replace("**", "")
    for label in labels:
        row = next(line for line in cells.splitlines() if line.startswith(f"| {label} |"))
        accuracy, low, high = map(
            float, re.match(r"([\d.]+) \[([\d.]+), ([\d.]+)\]", row.split("|")[2].strip()).groups()
        )
        assert 0.95 < low <= accuracy <= high <= 1.0
    assert merged is not any(line.startswith("| temperature |") for line in cells.splitlines())
    shift = cells.split("Under shift")[1]
    header = next(line for line in shift.splitlines() if line.startswith("| method | clean"))
    assert all(f"severity {s}" in header for s in SEVERITIES)
    nll_row = next(line for line in shift.splitlines() if line.startswith("| MAP |"))
    nll = [float(m) for m in re.findall(r"\| (\d+\.\d+) \[", nll_row)]
    assert len(nll) == 1 + len(SEVERITIES) and nll[0] < nll[1] < nll[-1]  # corrupted digits are harder
    ood = report.split("post-hoc scores of the plain model")[1]
    assert all(f"| MAP | {name} |" in ood for name in ("msp", "energy", "mahalanobis", "vim", "knn", "gen"))
    every = ood.split("AUROC of every score, per method")[1].splitlines()
    assert every[2].startswith("| method | entropy |") and all(
        name in every[2] for name in ("msp", "gen", "knn", "vim")
    )
    assert every[4].startswith("| MAP") and every[4].endswith("* |")
    story = report.split("### Does it know when it does not know? MAP against")[1].split("###")[0]
    header = next(line for line in story.splitlines() if line.startswith("| method | clean"))
    assert header == "| method | clean | " + " | ".join(f"severity {s}" for s in STORY_SEVERITIES) + " |"
    plain = next(line for line in story.splitlines() if line.startswith("| MAP |")).split(" | ")[1:]
    confidence, accuracy = zip(*(map(float, cell.strip(" |").split(" / ")) for cell in plain))
    assert len(confidence) == 1 + len(STORY_SEVERITIES) and accuracy[-1] < accuracy[0]
    assert confidence[-1] - accuracy[-1] > confidence[0] - accuracy[0]  # the plain model grows overconfident
    assert "rotation by 15 / 45 / 90 degrees" in report and "translation by 0.04 / 0.12 / 0.22 of the side" in report
    assert "Left out" not in report  # --method runs every row of the methods named
    for name in (
        "frontier.png",
        "reliability.png",
        "reliability_rotated45.png",
        "risk_coverage.png",
        "shift.png",
        "ood_scores.png",
        "confidence.png",
        "reliability_rotated45_best.png",
    ):
        with Image.open(tmp_path / name) as image:
            assert image.size[0] > 300 and image.size[1] > 200
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 8 and "<table>" in page and 'src="reliability' not in page
    assert (
        page.index('<section class="verdict">') < page.index("data:image/png;base64,") < page.index("<th>method</th>")
    )


def test_the_demo_shows_one_bar_on_a_terminal_and_plain_lines_in_a_log(monkeypatch):
    """On a terminal: one tqdm bar whose ETA counts the steps' expected seconds, each step's seconds written above it;
    in a log: one line per step and no carriage return; each warning once, without a source line."""
    import io
    import warnings

    from posthoc_apps.demo.steps import Steps

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream in (Terminal(), io.StringIO()):
        steps = Steps({"load": 1.0, "fit SWAG": 10.0, "fit SWAG last-layer": 5.0}, stream=stream)
        for label in steps.weights:
            with steps.step(label):
                warnings.warn("no SWAG scale keeps the held-out NLL within the tolerance", RuntimeWarning, stacklevel=1)
        steps.close()
        text = stream.getvalue()
        assert text.count("warning: no SWAG scale keeps") == 1 and "warnings.warn" not in text
        assert all(re.search(rf"{label}: \d+\.\d s", text) for label in steps.weights)
        if isinstance(stream, Terminal):
            assert "\r" in text and "%|" in text and "left" in text  # the bar, redrawn in place, with its ETA
        else:
            assert "\r" not in text and text.count("\n") == 4


def test_the_demo_leaves_out_slow_rows_and_says_which():
    quick = [label for label, *_ in demo_configs(every_row=False)]
    every = [label for label, *_ in demo_configs(every_row=True)]
    assert set(quick) < set(every) and "MAP" in quick and "auto" in quick and "SWAG" not in quick
    assert not any(stack for *_, stack in demo_configs(every_row=False))
    said = left_out(every_row=False)
    assert said[:-1] == [label for label in every if label not in quick]
    assert said[-1] == "a `+ temperature` row per method" and left_out(every_row=True) == []


def test_shift_story_draws_the_plain_model_against_the_named_row(digits, digits_model):
    shift_loader = data.loader(data.subset(digits.test, 32), batch_size=32)
    models = {
        "MAP": posthoc.wrap(digits_model, method="none"),
        "temperature": posthoc.wrap(digits_model, method="temperature").fit(
            None, data.loader(data.subset(digits.calibration, 200)), progress=False
        ),
    }
    rows = [
        SimpleNamespace(
            label=label,
            shift=posthoc.evaluate_shift(
                {label: um}, shift_loader, severities=[5], normalization=(data.MEAN, data.STD), progress=False
            ),
        )
        for label, um in models.items()
    ]
    story = shift_story(rows, models, "MAP", shift_loader, best="temperature")
    assert (story.plain, story.best, story.chosen_by) == ("MAP", "temperature", "named")
    assert story.table.kinds == EVALUATION_KINDS and story.table.severities == STORY_SEVERITIES
    # the rows' own severity-5 cells are reused, the severities they lack are evaluated for the two rows
    assert story.table.value("MAP", "mean", 5, "nll") == rows[0].shift.value("MAP", "mean", 5, "nll")
    again = posthoc.evaluate_shift(
        {"MAP": models["MAP"]}, shift_loader, severities=[2], normalization=(data.MEAN, data.STD), progress=False
    )
    assert story.table.value("MAP", "translate", 2, "ece") == pytest.approx(again.value("MAP", "translate", 2, "ece"))
    assert set(story.table.reports["temperature"]) == {
        ("clean", 0),
        *((k, s) for k in EVALUATION_KINDS for s in STORY_SEVERITIES),
    }
    fig = figures.confidence_plot(story.table, None, story.labels)
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == [
        "MAP confidence",
        "MAP accuracy",
        "temperature confidence",
        "temperature accuracy",
    ]
    assert list(lines[0].get_xdata()) == [0, *STORY_SEVERITIES]
    assert lines[0].get_color() == lines[1].get_color() and lines[0].get_linestyle() != lines[1].get_linestyle()
    assert list(lines[1].get_ydata()) == [
        story.table.value("MAP", kind, s, "accuracy")
        for kind, s in [("clean", 0), *(("mean", s) for s in STORY_SEVERITIES)]
    ]
    legend = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    assert legend == [line.get_label() for line in lines]
    assert len(fig.axes[0].collections) == 2  # the shaded confidence-accuracy gaps
    assert "| MAP | " in story.markdown() and "(confidence.png)" in story.markdown()
    with pytest.raises(ConfigError, match="no demo row 'laplace' to compare with; rows: MAP, temperature"):
        shift_story(rows, models, "MAP", shift_loader, best="laplace")


def test_a_stacking_method_registered_later_joins_the_demo_through_the_demo_table(monkeypatch):
    @posthoc.register
    class Stacked(REGISTRY["temperature"]):
        """A stacker another helper registers, shown alone on the plain model and on Laplace."""

        name = "test-stacked"

    rows = (("stacked", {}), ("Laplace + stacked", {"on": ["laplace"]}))
    monkeypatch.setitem(DEMO_CONFIGS, "test-stacked", rows)
    try:
        configs = {label: (spec, stack) for label, spec, _, stack in demo_configs()}
    finally:
        del REGISTRY["test-stacked"]
    assert configs["stacked"] == ([{"name": "test-stacked", "options": {}}], False)
    assert configs["Laplace + stacked"] == (
        [{"name": "laplace", "options": {}}, {"name": "test-stacked", "options": {}}],
        False,
    )
    assert rows[1][1] == {"on": ["laplace"]}  # the table's own rows are left as they were


def test_the_demo_report_opens_with_autos_pick_and_both_frontiers(digits, digits_model, tmp_path):
    """An auto row (here a calibrated model carrying an auto selection record: no auto fit) is what the verdict
    recommends; its held-out record and frontier follow the main table."""
    shift_loader = data.loader(data.subset(digits.test, 64), batch_size=64)
    test_loader = data.loader(data.subset(digits.test, 200), batch_size=200)
    ood_loader = data.loader(data.subset(digits.ood, 100), batch_size=100)
    calibration = data.loader(data.subset(digits.calibration, 200))
    models = {
        "MAP": posthoc.wrap(digits_model, method="none"),
        "auto": posthoc.wrap(digits_model, method=["laplace", "dac"]).fit(
            data.loader(data.subset(digits.fit, 400)), calibration, progress=False
        ),
    }
    record = {
        "knob": "method",
        "chosen": "laplace+dac",
        "tolerance": 0.005,
        "confidence": 0.9,
        "examples": 200,
        "perturbed": 600,
        "folds": None,
        "fallback": False,
        "plain": {"clean_nll": 0.06, "shifted_nll": 3.0, "shifted_ece": 0.2},
        "candidates": [
            {
                "candidate": name,
                "value": i,
                "clean_nll": 0.06,
                "excess": excess,
                "bound": bound,
                "excess_se": 0.001,
                "shifted_nll": shifted,
                "shifted_nll_se": 0.1,
                "shifted_ece": 0.1,
                "seconds": 0.0,
                "admissible": bound <= 0.005,
                "reason": None,
                "chosen": i == 1,
                "fit_seconds": 1.0,
                "predict_cost": 1.5,
            }
            for i, (name, excess, bound, shifted) in enumerate(
                [("none", 0.0, 0.0, 3.0), ("laplace+dac", 0.001, 0.004, 1.7)]
            )
        ],
    }
    rows = []
    for label, um in models.items():
        report = posthoc.evaluate(um, test_loader, ood_loader, name=label, progress=False)
        report.selection = record if label == "auto" else None
        shift = posthoc.evaluate_shift(
            {label: um}, shift_loader, severities=[3], normalization=(data.MEAN, data.STD), progress=False
        )
        rows.append(DemoRow(label, report, shift, 1.0, 2.0 if label == "auto" else 1.0))
    found = demo_verdict(rows, "MAP")
    for row in rows:
        row.verdict = found
    text = render(rows, tmp_path)
    assert found.recommended == "auto" and found.basis == "auto" and found.shifts == ["severity 3"]
    assert text.startswith(
        "# posthoc demo: the bundled digits CNN\n\n## Verdict\n\n**Use `auto`**: on held-out data it picked "
        "`laplace+dac` among 2 candidates.\n\nIt costs "
    )
    assert re.search(
        r"\| NLL at severity 3 \| \d\.\d{4} \| \d\.\d{4} \| [+-]0\.\d{4} \[[+-]0\.\d{4}, [+-]0\.\d{4}\] \| \d\.\d\dx \|",
        text,
    )
    assert "Shifts: each the mean over rotate, contrast, translate, occlude" in text
    assert "OOD AUROC (entropy)" in text and "a prediction costs 2.0x a plain forward" in text
    assert text.index("![frontier") < text.index("| method |") < text.index("### How `auto` chose, on held-out data")
    assert "| laplace+dac | 0.001 (0.004) | 1.7 | 0.1 | 1 | 1.5x | **chosen** |" in text
    for name in ("frontier.png", "selection_frontier.png"):
        with Image.open(tmp_path / name) as image:
            assert image.size[0] > 500 and image.size[1] > 300


def test_a_temperature_row_stacks_on_the_already_fitted_method(digits, digits_model):
    """The demo's "+ temperature" rows (``_with_temperature``) put a temperature on a fitted method without refitting
    it, chosen as ``fit`` of the stacked chain chooses it: the same selection record and the same predictions (the
    demo command above runs no such row; these rows once showed an unchosen temperature, the inner predictive)."""
    from posthoc_apps.demo.run import _with_temperature

    cal_loader, x, chain = data.loader(digits.calibration), digits.test.tensors[0][:64], ["mc-dropout", "temperature"]
    um = posthoc.wrap(digits_model, method="mc-dropout", p=0.3).fit(None, progress=False)
    stacked, seconds = _with_temperature(um, cal_loader)
    reference = posthoc.wrap(digits_model, method=chain, p=0.3).fit(None, cal_loader, progress=False)
    assert [entry["name"] for entry in stacked.spec] == chain and stacked.method.inner is um.method and seconds > 0
    chosen, expected = stacked.method.selection, reference.method.selection
    assert chosen is not None and len(chosen["candidates"]) > 2
    assert [c["clean_nll"] for c in chosen["candidates"]] == [c["clean_nll"] for c in expected["candidates"]]
    assert chosen["chosen"] == expected["chosen"]
    probs = stacked.predict(x, generator=torch.Generator().manual_seed(0)).probs
    assert torch.allclose(probs, reference.predict(x, generator=torch.Generator().manual_seed(0)).probs, atol=1e-6)


# ``posthoc demo --task regression``: both parts run end to end from the command line and write what they say.


def test_the_regression_demo_writes_its_tables_and_pictures(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(demo_run, "SINUSOID_EPOCHS", 60)  # the full demo trains longer; the wiring is the same
    monkeypatch.setattr(demo_run, "AUTO_MPG_EPOCHS", 40)
    main(["demo", "--task", "regression", "--out", str(tmp_path), "--quiet"])
    printed = capsys.readouterr().out
    for name in (
        "regression.md",
        "regression_band.png",
        "regression_calibration.png",
        "regression_error_std.png",
        "regression_shift.png",
    ):
        assert (tmp_path / name).stat().st_size > 0
    markdown = (tmp_path / "regression.md").read_text()
    assert markdown in printed
    labels = [label for label, _, _ in demo_run.REGRESSION_CONFIGS]
    for label in labels:
        assert markdown.count(f"| {label} |") == 2 + 3  # one row in each table, and in each of the shift's three
    assert "| method | random | extrapolation | gap |" in markdown
    # the plain model's predictive is homoscedastic: one std in every region, a gap/training ratio of 1
    plain = re.search(r"\| plain \(noise on val\) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+)x \|", markdown)
    assert plain and plain.group(1) == plain.group(2) == plain.group(3) and plain.group(4) == "1.00"


def test_an_unknown_task_is_refused_by_the_parser(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--task", "detection"])
    assert "invalid choice" in capsys.readouterr().err
