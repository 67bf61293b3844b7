"""Fit-time perturbations and the evaluation kinds of shift stay apart, and the evaluation-only kinds do what they say.

A shift-aware fit (``um.fit(..., shift="auto")``) perturbs the validation batches with the kinds of
``posthoc.engine.perturb.FIT_KINDS``; the demo, the quality benchmark and ``posthoc.evaluate_shift`` report
``posthoc.shift.EVALUATION_KINDS``. If one kind were in both, a fit would be judged on the shift it was tuned on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from posthoc.engine import perturb
from posthoc.evaluation import shift as evaluation_shift
from posthoc.shift import EVALUATION_KINDS, KINDS, SEVERITIES, corrupt_images
from posthoc.shift.kinds import CORRUPTIONS
from posthoc_apps.demo import data
from posthoc_apps.demo import run as demo

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import quality  # noqa: E402

#: the harness kind each fit-time kind is a version of (``None``: no image counterpart); a new fit-time kind
#: must be added here, which makes whoever adds it say which harness kind it resembles
HARNESS_TWIN = {
    "noise": "gaussian-noise",
    "blur": "gaussian-blur",
    "impulse": "salt-pepper",
    "token-replace": None,
    "feature-noise": None,
}


def test_every_fit_time_kind_is_classified_and_none_is_or_resembles_an_evaluation_kind() -> None:
    assert set(perturb.FIT_KINDS) == set(HARNESS_TWIN)
    twins = {twin for twin in HARNESS_TWIN.values() if twin is not None}
    assert twins <= set(KINDS)
    assert not set(perturb.FIT_KINDS) & set(EVALUATION_KINDS)
    assert not twins & set(EVALUATION_KINDS)
    assert set(EVALUATION_KINDS) <= set(KINDS) and len(set(EVALUATION_KINDS)) == len(EVALUATION_KINDS)


@pytest.mark.parametrize(
    "x",
    [
        torch.rand(4, 1, 28, 28),
        {"pixel_values": torch.rand(2, 3, 8, 8)},
        torch.randint(0, 100, (3, 7)),
        torch.randn(5, 6),
    ],
)
def test_what_shift_auto_perturbs_with_is_a_fit_time_kind_for_every_input(x) -> None:
    family = perturb.family_for(x)
    assert family and set(family) <= set(perturb.FIT_KINDS)
    assert all(family[name] is perturb.FIT_KINDS[name] for name in family)


def test_the_demo_the_benchmark_and_evaluate_shift_report_exactly_the_evaluation_kinds(digits) -> None:
    assert tuple(demo.SHIFT_KINDS) == EVALUATION_KINDS
    assert tuple(evaluation_shift.DEFAULT_KINDS) == EVALUATION_KINDS
    assert tuple(quality.shifted_tests(data.subset(digits.test, 8))) == EVALUATION_KINDS
    keys = [
        f"{m}@{k}:{quality.SHIFT_SEVERITY}"
        for m in ("nll", "ece")
        for k in (*EVALUATION_KINDS, quality.MEAN_OVER_KINDS)
    ]
    plain = quality.Summary("digits_cnn", "none", "none", {k: quality.Stat.of([1.0]) for k in keys}, {}, 1, 0, [], [])
    assert f"| method | {' | '.join(EVALUATION_KINDS)} | mean |" in quality.shift_tables([plain])


@pytest.mark.parametrize("kind", ["translate", "occlude"])
@pytest.mark.parametrize("severity", [1, 3, 5])
def test_translate_and_occlude_are_seeded_and_keep_shape_dtype_and_range(kind: str, severity: int) -> None:
    x = torch.rand(16, 3, 20, 24, generator=torch.Generator().manual_seed(1))
    once = corrupt_images(x, kind, severity, torch.Generator().manual_seed(7))
    again = corrupt_images(x, kind, severity, torch.Generator().manual_seed(7))
    other = corrupt_images(x, kind, severity, torch.Generator().manual_seed(8))
    assert torch.equal(once, again) and not torch.equal(once, other)
    assert once.shape == x.shape and once.dtype == x.dtype and 0 <= once.min() and once.max() <= 1
    as_bytes = corrupt_images((x * 255).round().to(torch.uint8), kind, severity, torch.Generator().manual_seed(7))
    assert as_bytes.dtype == torch.uint8 and as_bytes.shape == x.shape
    normalised = (x - 0.5) / 0.25
    back = corrupt_images(normalised, kind, severity, torch.Generator().manual_seed(7), normalization=(0.5, 0.25))
    assert torch.allclose(back * 0.25 + 0.5, once, atol=1e-5)


@pytest.mark.parametrize("severity", [1, 2, 3, 4, 5])
def test_translate_moves_every_image_by_the_stated_pixels_along_both_axes(severity: int) -> None:
    height, width = 28, 32
    x = torch.zeros(40, 1, height, width)
    x[:, :, 14, 16] = 1.0  # one bright pixel in the middle: far enough from the edges for every severity
    moved = CORRUPTIONS["translate"](x, severity, torch.Generator().manual_seed(0))
    fraction = SEVERITIES["translate"][severity - 1]
    steps = (round(fraction * height), round(fraction * width))
    where = moved[:, 0].flatten(1).argmax(1)
    rows, cols = where // width - 14, where % width - 16
    assert (moved.flatten(1).sum(1) == 1).all()  # the pixel moved, nothing else appeared
    assert set(rows.abs().tolist()) == {steps[0]} and set(cols.abs().tolist()) == {steps[1]}
    assert {-1, 1} <= set(rows.sign().tolist()) and {-1, 1} <= set(cols.sign().tolist())  # directions drawn per image


@pytest.mark.parametrize("severity", [1, 2, 3, 4, 5])
def test_occlude_blanks_one_square_of_the_stated_side_per_image(severity: int) -> None:
    height, width = 28, 36
    x = torch.ones(30, 2, height, width)
    out = CORRUPTIONS["occlude"](x, severity, torch.Generator().manual_seed(0))
    side = round(SEVERITIES["occlude"][severity - 1] * min(height, width))
    blank = out == 0
    assert torch.equal(blank[:, 0], blank[:, 1])  # the same square in every channel
    assert (blank[:, 0].flatten(1).sum(1) == side * side).all()
    for image in blank[:, 0]:
        rows, cols = image.any(1).nonzero().squeeze(1), image.any(0).nonzero().squeeze(1)
        assert len(rows) == len(cols) == side and rows[-1] - rows[0] == cols[-1] - cols[0] == side - 1
    assert len({tuple(image.nonzero()[0].tolist()) for image in blank[:, 0]}) > 1  # placed per image
