"""The quickstart notebook runs top to bottom and shows what it claims (so it cannot rot); and a small notebook of
one's own shows what a practitioner expects: figures as images, reports and model cards as HTML tables, a progress
bar without warnings, the matplotlib backend left alone."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "recipes" / "notebook_quickstart.ipynb"


def _execute(notebook, workdir: Path) -> str:
    """Run every code cell in a fresh Jupyter kernel (nbclient); return all printed and displayed text."""
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    ).execute()
    parts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts.extend(str(v) for k, v in output.get("data", {}).items() if k.startswith("text/"))
    return "\n".join(parts)


#: a practitioner's first cells: fit with the progress bar on, evaluate, show the card and draw
SMALL_NOTEBOOK = [
    "import matplotlib\nbefore = matplotlib.get_backend()\nimport posthoc\nimport posthoc_apps.report as present\n"
    "print('backend', before == matplotlib.get_backend())",
    "from posthoc_apps.demo.examples import model, train_loader, val_loader, test_loader\n"
    "um = posthoc.wrap(model, method='laplace').fit(train_loader, val_loader, shift=None)\num",
    "report = posthoc.evaluate(um, test_loader)\nreport",
    "um.summary()",
    "present.reliability_diagram(report)",
]


def test_a_small_notebook_shows_figures_tables_and_a_quiet_bar(tmp_path: Path) -> None:
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in SMALL_NOTEBOOK])
    _execute(notebook, tmp_path)
    outputs = [cell.get("outputs", []) for cell in notebook.cells]
    printed = "".join(o.get("text", "") for o in outputs[0] if o["output_type"] == "stream")
    assert "backend True" in printed, "importing posthoc_apps.report must not switch the notebook's backend"
    stderr = "".join(o.get("text", "") for cell in outputs for o in cell if o.get("name") == "stderr")
    assert "Warning" not in stderr and "IProgress" not in stderr, stderr  # tqdm's text bar, no TqdmWarning
    results = [next((o["data"] for o in cell if o["output_type"] == "execute_result"), {}) for cell in outputs]
    assert results[1]["text/plain"].startswith("UncertainModel('laplace' on a Sequential, chose prior_precision")
    assert "Sequential(" not in results[1]["text/plain"], "the repr names the model, not its modules"
    assert "<table>" in results[2]["text/html"] and "<td>laplace</td>" in results[2]["text/html"]
    card = results[3]["text/html"]
    assert "<table>" in card and "Model card: laplace" in card and "(<code>none</code>, the baseline)" in card
    image = next(o["data"] for o in outputs[4] if "image/png" in o.get("data", {}))
    assert base64.b64decode(image["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"


def test_quickstart_notebook_executes(tmp_path: Path) -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(not cell.get("outputs") for cell in code), "store the notebook without outputs"
    assert any('posthoc.wrap(model, method="temperature")' in cell.source for cell in code)

    text = _execute(notebook, tmp_path)

    kept, wrapped = re.search(r"kept: ([a-z0-9. ]+); fitted temperature T = ([0-9.]+)", text).groups()
    from_logits = float(re.search(r"temperature from logits alone T = ([0-9.]+)", text).group(1))
    assert 0.2 < from_logits < 5
    # one rule for both entry points (shift=None): the same choice, fitted on the same rows, the same temperature
    assert abs(float(wrapped) - from_logits) < 2e-3, (kept, wrapped, from_logits)
    if kept == "none":  # the cross-fitted temperature cost more than the tolerance: the reason is shown
        assert float(wrapped) == 1.0 and "'clean fit': 'in-distribution NLL excess" in text
    assert "rows sum to 1.0" in text
    in_dist, unseen = map(float, re.search(r"digits 0-7 ([0-9.]+), unseen digits 8-9 ([0-9.]+)", text).groups())
    assert unseen > in_dist, "unseen digits should be more uncertain"
    eces = re.search(r"ECE: \{'plain softmax': ([0-9.]+), 'temperature': ([0-9.]+)", text)
    assert all(0 <= float(value) <= 1 for value in eces.groups())
    assert "| plain softmax |" in text and "| temperature |" in text  # the displayed Markdown table
    laplace = re.search(r"\| laplace \| \**([0-9.]+)\** \| \**([0-9.]+)\** \| \**([0-9.]+)\** \|", text)  # best in bold
    assert laplace and 0.9 < float(laplace.group(1)) <= 1 and 0 <= float(laplace.group(3)) <= 1  # acc, ECE
    with open(tmp_path / "reliability.png", "rb") as image:
        assert image.read(8) == b"\x89PNG\r\n\x1a\n"
