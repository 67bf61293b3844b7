"""The backbone runs once per example of a fit: a forward hook on the first layer counts the rows it sees.

Every default method and ``auto`` may show the first layer each training row once (if it reads the training data) and
each held-out row and perturbed copy once, plus the rows that grade the perturbations' strengths and a few probe rows.
A change that runs the backbone again for another candidate, stage, knob or rate fails here.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import posthoc
from posthoc.engine import held_out as held_out_module
from posthoc.engine.feature_store import FeatureStore, features_of
from posthoc_apps.demo.examples import model as demo_model
from posthoc_apps.demo.examples import train_loader, val_loader

MARK = "_test_counts_rows"
TRAIN = sum(len(y) for _, y in train_loader)
VAL = sum(len(y) for _, y in val_loader)
LEVELS = len(held_out_module.STRENGTHS)
#: rows a fit may run besides its data: probes of a few rows (MC dropout's plan, DAC's trace of one batch, auto's
#: timing of a predict)
PROBES = 2 * VAL


class Rows:
    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> Rows:
        def hook(module: nn.Module, args: tuple, out: object) -> None:
            if getattr(module, MARK, False):
                self.count += args[0].shape[0]

        self.handle = torch.nn.modules.module.register_module_forward_hook(hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()


def rows_of_fit(method, wrap=None, **fit) -> int:
    model = demo_model  # a fresh copy on every import of the examples module's attribute is not guaranteed: mark it
    setattr(model[0], MARK, True)
    held_out_module._GRADED.clear()  # each fit grades its strengths, as a first fit does
    with Rows() as rows, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        posthoc.wrap(model, method=method, **(wrap or {})).fit(train_loader, val_loader, progress=False, **fit)
    return rows.count


@pytest.fixture(scope="module")
def calibrator_rows() -> int:
    """A calibrator reads the held-out rows and their copies once, and grades the perturbations."""
    return rows_of_fit("temperature")


def test_a_calibrator_reads_each_held_out_row_and_copy_once_beside_the_grading(calibrator_rows):
    clean_only = rows_of_fit("temperature", shift=None)
    assert clean_only == VAL
    grading = calibrator_rows - VAL * (1 + LEVELS)
    assert 0 <= grading <= 12 * VAL  # the strengths' ladder, on at most GRADING_ROWS rows


@pytest.mark.parametrize(
    "method, wrap",
    [
        ("vector", {}),
        ("laplace", {}),
        ("mc-dropout", {}),
        (["none", "dac"], {}),
        ("swag", {"subset": "last_layer"}),
        ("auto", {}),
    ],
)
def test_every_default_runs_the_backbone_once_per_example(method, wrap, calibrator_rows):
    reads_training_rows = method != "vector"
    allowed = calibrator_rows + (TRAIN if reads_training_rows else 0) + PROBES
    assert rows_of_fit(method, wrap) <= allowed


def test_auto_without_shift_reads_train_and_val_once():
    assert rows_of_fit("auto", shift=None) <= TRAIN + VAL + PROBES


def test_the_store_computes_a_batch_once_and_stops_when_the_weights_change():
    net = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)).eval()
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    with FeatureStore(net, net[2]).scope() as store:
        list(store.track([(x, y)], "held-out"))
        first = features_of(net, x)
        assert features_of(net, x) is first
        assert features_of(net, torch.randn(4, 3)) is None  # a batch it does not know
        with torch.no_grad():
            net[0].weight.mul_(2)
        assert features_of(net, x) is None  # the weights changed: nothing stored describes them
    assert store.record["rows_computed"] == 4


def test_past_the_budget_the_store_maps_its_features_to_a_file():
    net = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)).eval()
    batches = [(torch.randn(4, 3), torch.tensor([0, 1, 0, 1])) for _ in range(3)]
    with FeatureStore(net, net[2], max_bytes=100).scope() as store:
        for x, _ in store.track(batches, "held-out"):
            expected = net(x)
            assert torch.allclose(features_of(net, x).output, expected)
        assert store.record["mode"] == "memory-mapped"
        assert torch.allclose(features_of(net, batches[2][0]).output, net(batches[2][0]))
