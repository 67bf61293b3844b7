import re

import pytest
import torch
from PIL import Image

from posthoc.demo import data, zoo
from posthoc.cli.main import main
from posthoc.demo.run import ANGLES


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
        accuracy = float(row.split("|")[2])
        assert 0.95 < accuracy <= 1.0
    header = next(line for line in report.splitlines() if "0°" in line)
    assert all(f"{a}°" in header for a in ANGLES)
    nll_by_angle = [float(m) for m in re.findall(r"\| (\d+\.\d+) / ", report.split("by rotation")[1].splitlines()[4])]
    assert nll_by_angle[0] < nll_by_angle[2]  # rotated digits are harder
    for name in ("reliability.png", "reliability_rotated60.png", "risk_coverage.png"):
        with Image.open(tmp_path / name) as image:
            assert image.size[0] > 300 and image.size[1] > 200
