"""The reports as a reader sees them: report.html of the demo and of ``posthoc evaluate`` (a timm model with random
weights) rendered in headless Chromium at 1400 x 900.

Each page must not scroll sideways, no two text boxes of its first screen (the DOM's boxes of every text line) may
overlap, every ``<img>`` must load, no picture may be shrunk to under 3/4 of its drawn width (its text would be too
small to read), no table that starts on the first screen may be cut at its right edge, and the verdict must open with
at most three lines of words (its intervals in its table). The screenshots of the first screen are kept
(``POSTHOC_SCREENSHOTS=dir`` keeps them there; by default in the test's temporary folder). Chromium runs twice per
page, with ``--dump-dom`` (a script put into a copy of the page writes what it measured into the DOM) and with
``--screenshot``; no driver, no extra package.

Skipped, with the reason, when no Chromium is found (``POSTHOC_CHROMIUM=/path/to/chromium`` names one; Debian:
``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_recipes import RANDOM_WEIGHTS, _write_images

from posthoc_apps.cli.evaluate import add_evaluate_arguments, run_evaluate
from posthoc_apps.demo import configs, data
from posthoc_apps.demo import run as demo

WIDTH, HEIGHT = 1400, 900
#: the smallest share of its drawn width a picture may be shown at
LEAST_SCALE = 0.75
#: the script put at the end of a copy of the page: on load, it writes what it measured into <pre id="measured">
MEASURE = """
<script>
window.addEventListener("load", () => {
  const page = document.documentElement;
  const boxes = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (!node.textContent.trim()) continue;
    const range = document.createRange();
    range.selectNodeContents(node);
    for (const r of range.getClientRects()) {
      if (r.width >= 1 && r.height >= 1 && r.top < window.innerHeight)
        boxes.push({text: node.textContent.trim().slice(0, 60), x0: r.left, y0: r.top, x1: r.right, y1: r.bottom});
    }
  }
  const images = Array.from(document.images).map((image) => ({
    alt: image.alt, complete: image.complete, natural: image.naturalWidth, shown: image.getBoundingClientRect().width,
  }));
  const tables = Array.from(document.querySelectorAll(".wide")).map((box) => ({
    top: box.getBoundingClientRect().top, scroll: box.scrollWidth, client: box.clientWidth,
  }));
  const words = [];
  const verdict = document.querySelector("section.verdict");
  for (const block of verdict ? verdict.children : []) {
    if (block.tagName === "H2") continue;
    if (block.tagName !== "P") break;
    words.push(block.textContent);
  }
  const out = document.createElement("pre");
  out.id = "measured";
  out.textContent = JSON.stringify({scroll: page.scrollWidth, client: page.clientWidth, boxes, images, tables, words});
  document.body.appendChild(out);
});
</script>
"""
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--run-all-compositor-stages-before-draw",
    f"--window-size={WIDTH},{HEIGHT}",
    "--virtual-time-budget=10000",
]


def chromium() -> str | None:
    """The Chromium to run: ``POSTHOC_CHROMIUM``, else the first of the usual names on the PATH."""
    named = os.environ.get("POSTHOC_CHROMIUM")
    if named:
        return shutil.which(named)
    names = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
    return next((found for found in map(shutil.which, names) if found), None)


@pytest.fixture(scope="module")
def browser() -> str:
    found = chromium()
    if found is None:
        named = os.environ.get("POSTHOC_CHROMIUM")
        where = f"POSTHOC_CHROMIUM={named} is not an executable" if named else "none of chromium, google-chrome on PATH"
        pytest.skip(f"no Chromium found ({where}; Debian: apt-get install chromium): the browser check did not run")
    return found


def _run(browser: str, profile: Path, *arguments: str) -> str:
    command = [browser, *FLAGS, f"--user-data-dir={profile}", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout


def measure(browser: str, page: Path, screenshot: Path, scratch: Path) -> dict:
    """What the page measures in Chromium at 1400 x 900 (see :data:`MEASURE`); writes the first screen's
    screenshot."""
    probe = scratch / f"measured_{page.parent.name}.html"
    probe.write_text(page.read_text().replace("</body>", MEASURE + "</body>"))
    _run(browser, scratch / "profile-shot", f"--screenshot={screenshot}", page.resolve().as_uri())
    dom = _run(browser, scratch / "profile-dom", "--dump-dom", probe.resolve().as_uri())
    text = dom.split('<pre id="measured">', 1)[1].split("</pre>", 1)[0]
    return json.loads(text.replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"'))


def overlaps(boxes: list[dict]) -> list[tuple[str, str]]:
    """Pairs of text boxes that overlap by more than one pixel each way."""
    found = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if min(a["x1"], b["x1"]) - max(a["x0"], b["x0"]) > 1 and min(a["y1"], b["y1"]) - max(a["y0"], b["y0"]) > 1:
                found.append((a["text"], b["text"]))
    return found


def check_page(browser: str, page: Path, name: str, scratch: Path) -> dict:
    shots = Path(os.environ.get("POSTHOC_SCREENSHOTS", scratch))
    shots.mkdir(parents=True, exist_ok=True)
    screenshot = shots / f"{name}_first_screen.png"
    found = measure(browser, page, screenshot, scratch)
    assert screenshot.stat().st_size > 10_000
    assert found["scroll"] <= found["client"], f"{name}: the page scrolls sideways ({found['scroll']} px)"
    assert found["boxes"] and not overlaps(found["boxes"]), f"{name}: text boxes overlap: {overlaps(found['boxes'])}"
    assert found["images"] and all(image["complete"] and image["natural"] > 0 for image in found["images"])
    small = [image["alt"] for image in found["images"] if image["shown"] < LEAST_SCALE * image["natural"]]
    assert not small, f"{name}: pictures shrunk to under {LEAST_SCALE:.0%} of their width: {small}"
    cut = [table for table in found["tables"] if table["top"] < HEIGHT and table["scroll"] > table["client"]]
    assert not cut, f"{name}: a table of the first screen is cut at its right edge: {cut}"
    # the verdict in at most three lines of words, the numbers' intervals in its table
    assert 1 <= len(found["words"]) <= 3 and not any("[" in line for line in found["words"]), found["words"]
    return found


def test_the_demo_report_reads_in_a_browser(browser: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's page (the same template as ``posthoc demo``) on three rows and fewer shifted digits and resamples,
    so that it runs in seconds: the plain model, temperature (merged into it when it keeps T = 1) and VI."""
    rows = {name: configs.DEMO_CONFIGS[name] for name in ("none", "temperature", "vi")}
    monkeypatch.setattr(configs, "DEMO_CONFIGS", rows)
    monkeypatch.setattr(demo, "DEMO_CONFIGS", rows)
    monkeypatch.setattr(demo, "SHIFT_EXAMPLES", 100)
    monkeypatch.setattr(demo, "BOOTSTRAPS", 200)
    demo.run_demo(tmp_path / "demo", progress=False, every_row=False)
    found = check_page(browser, tmp_path / "demo" / "report.html", "demo", tmp_path)
    first = " ".join(box["text"] for box in found["boxes"])
    assert "Verdict" in first and "NLL in distribution" in first  # the verdict and its table on the first screen
    frontier = next(image for image in found["images"] if image["alt"].startswith("frontier"))
    assert frontier["shown"] >= LEAST_SCALE * frontier["natural"]


@RANDOM_WEIGHTS
def test_a_posthoc_evaluate_report_of_a_timm_model_reads_in_a_browser(
    browser: str, tmp_path: Path, digits: data.DigitsSplits
) -> None:
    for name, split, per_class, options in (
        ("train", digits.fit, 6, {}),
        ("val", digits.test, 8, {}),
        ("rotated", digits.test, 4, {"rotate": 60}),
        ("ood", digits.ood, 16, {"flat": True}),
    ):
        _write_images(split, tmp_path / name, per_class, **options)
    parser = argparse.ArgumentParser()
    add_evaluate_arguments(parser)
    out = tmp_path / "timm"
    argv = ["--model", "timm:resnet18", "--pretrained", "false", "--num-classes", "8", "--image-size", "32"]
    argv += ["--train", str(tmp_path / "train"), "--val", str(tmp_path / "val"), "--shift", str(tmp_path / "rotated")]
    argv += ["--ood", str(tmp_path / "ood"), "--method", "temperature", "--method", "laplace", "--ci", "0.95"]
    argv += ["--workers", "0", "--batch-size", "16", "--out", str(out), "--no-progress"]
    run_evaluate(parser.parse_args(argv))
    check_page(browser, out / "report.html", "evaluate_timm", tmp_path)
