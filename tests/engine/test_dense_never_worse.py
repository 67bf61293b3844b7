"""The "never worse" promise of the dense defaults, tested like a coverage guarantee (as tests/engine/test_never_worse.py
does for one label per input).

A small FCN on digit canvases (posthoc_apps.demo.segmentation); over :data:`DRAWS` random draws of
:data:`VALIDATION` validation canvases and :data:`TEST` test canvases from one pool of held-out canvases, ``auto``
(its dense defaults, and last-layer ``laplace`` beside them) makes its held-out choices again on the draw's
validation canvases (``um.choose``; the curvature is fitted once on the training canvases), and every candidate's
per-pixel test NLL is compared with the plain model's on the draw's test canvases. The promise: it exceeds the plain
model's by more than ``max(2 %, 0.005 nats)`` in at most 5 % of the draws.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import posthoc
from posthoc.core.modules import eval_mode
from posthoc.engine.dense import row_inputs
from posthoc_apps.demo.segmentation import IGNORE, loaders, segmentation_data, trained_fcn

DRAWS = 20
ALLOWED = 0.05
VALIDATION, TEST = 32, 64


def _per_pixel_nll(method: posthoc.Method, rows, images: torch.Tensor, masks: torch.Tensor) -> float:
    keep = masks != IGNORE
    with torch.no_grad(), eval_mode(method):
        log_probs, _ = method.log_predictive(row_inputs(images, keep, rows), generator=torch.Generator().manual_seed(0))
    return float(-log_probs.double().log_softmax(-1).gather(1, masks[keep][:, None]).mean())


@pytest.mark.slow
def test_dense_defaults_and_auto_are_never_worse_in_distribution_over_random_splits() -> None:
    data = segmentation_data(train=256, val=256, test=0, seed=1)
    model = trained_fcn(data.train, epochs=4)
    images, masks = data.val.tensors
    um = posthoc.wrap(
        model, method="auto", dense=True, candidates=["none", "temperature", "laplace"], keep_candidates=True
    )
    um.fit(loaders(data)[0], DataLoader(TensorDataset(images[:VALIDATION], masks[:VALIDATION]), batch_size=64))
    rows = um.position_rows[0]
    exceeded: collections.Counter = collections.Counter()
    worst: dict[str, float] = collections.defaultdict(float)
    chosen: collections.Counter = collections.Counter()
    for draw in range(DRAWS):
        order = torch.randperm(len(masks), generator=torch.Generator().manual_seed(draw))
        val, test = order[:VALIDATION], order[VALIDATION : VALIDATION + TEST]
        um.choose(DataLoader(TensorDataset(images[val], masks[val]), batch_size=64), progress=False)
        chosen[um.summary()["posterior"][0]["selection"]["chosen"]] += 1
        reference = _per_pixel_nll(um.inner.method.fitted_candidates["none"], rows, images[test], masks[test])
        tolerance = max(0.02 * reference, 0.005)
        for label, chain in [("auto", um.inner.method), *um.inner.method.fitted_candidates.items()]:
            excess = _per_pixel_nll(chain, rows, images[test], masks[test]) - reference
            worst[label] = max(worst[label], excess / tolerance)
            exceeded[label] += excess > tolerance
    failing = {label: count for label, count in exceeded.items() if count > ALLOWED * DRAWS}
    assert not failing, (
        f"per-pixel test NLL over the plain model's by more than max(2 %, 0.005 nats) in {failing} of {DRAWS} draws; "
        f"worst excess / tolerance per method: {dict(worst)}; auto chose {dict(chosen)}"
    )
    print(f"worst excess / tolerance: {dict(worst)}; auto chose {dict(chosen)}")
