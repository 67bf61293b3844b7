"""Does ``tests/test_never_worse.py`` catch a selection step that judges on a point estimate?

Runs that test file with :func:`posthoc.engine.selection.excess_bound` replaced by the mean excess alone (the bound
equal to the mean, no cap on the gains): what the selection step did before issue 34. The test must fail; its
assertion messages give, per default, the number of the 20 draws over the tolerance.

Run: ``python benchmarks/never_worse_point_estimate.py`` (about ten minutes on 2 cores). Measured 2026-11-26: fails on
both checkpoints (``digits_cnn``: auto and laplace 9 of 20 draws; ``digits_bn_cnn``: auto 5, laplace 10).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import posthoc.engine.selection as selection  # noqa: E402

original = selection.excess_bound


def point_estimate(candidate, plain, *args, **kwargs):  # noqa: ANN001, ANN201 (the patched function's signature)
    mean, _ = original(candidate, plain, capped_gains=0)
    return mean, mean


if __name__ == "__main__":
    selection.excess_bound = point_estimate
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-W", "ignore", str(ROOT / "tests" / "test_never_worse.py")])
    print(
        "the never-worse test FAILS with a point estimate, as it must"
        if code == 1
        else f"unexpected: pytest exit {code} (0 would mean the test cannot tell a point estimate from the bound)"
    )
    sys.exit(0 if code == 1 else 1)
