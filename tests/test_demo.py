import re

import pytest
import torch
from PIL import Image

from posthoc.demo import data, zoo
from posthoc.cli.main import main
from posthoc.demo.run import SEVERITIES


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
    assert report in printed
    for label in ("MAP", "temperature"):
        row = next(line for line in report.splitlines() if line.startswith(f"| {label} |"))
        accuracy, low, high = map(float, re.match(r"([\d.]+) \[([\d.]+), ([\d.]+)\]", row.split("|")[2].strip()).groups())
        assert 0.95 < low <= accuracy <= high <= 1.0
    shift = report.split("Under shift")[1]
    header = next(line for line in shift.splitlines() if line.startswith("| method | clean"))
    assert all(f"severity {s}" in header for s in SEVERITIES)
    nll_row = next(line for line in shift.splitlines() if line.startswith("| MAP |"))
    nll = [float(m) for m in re.findall(r"\| (\d+\.\d+) \[", nll_row)]
    assert len(nll) == 1 + len(SEVERITIES) and nll[0] < nll[1] < nll[-1]  # corrupted digits are harder
    ood = report.split("post-hoc scores of the plain model")[1]
    assert all(f"| MAP | {name} |" in ood for name in ("msp", "energy", "mahalanobis", "vim", "knn", "gen"))
    assert "| temperature | " in ood.split("next to the best post-hoc score")[1]
    every = ood.split("AUROC of every score, per method")[1].splitlines()
    assert every[2].startswith("| method | entropy |") and all(name in every[2] for name in ("msp", "gen", "knn", "vim"))
    plain, temperature = (line.split(" | ") for line in every[4:6])
    assert plain[0] == "| MAP" and temperature[0] == "| temperature" and plain[-1].endswith("* |")
    for name in ("reliability.png", "reliability_rotated45.png", "risk_coverage.png", "shift.png", "ood_scores.png"):
        with Image.open(tmp_path / name) as image:
            assert image.size[0] > 300 and image.size[1] > 200
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 5 and "<table>" in page and 'src="reliability' not in page
