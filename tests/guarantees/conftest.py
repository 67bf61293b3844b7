"""TorchCP, the oracle of SAPS, clustered and weighted conformal, imported without its compiled training losses.

TorchCP imports ``torchsort`` when it is imported, for its differentiable-sorting training losses only. torchsort
ships no wheel and its source build needs torch inside pip's isolated build environment, so the README's test
command installs TorchCP with ``--no-deps``. The predictors and scores these tests compare against never call it:
where it is missing, a stand-in module whose functions raise is registered before TorchCP is imported.
"""

from __future__ import annotations

import importlib.util
import sys
import types


def _refuse(*args: object, **kwargs: object) -> None:
    raise RuntimeError("torchsort is not installed: only TorchCP's training losses use it, and no test does")


if importlib.util.find_spec("torchsort") is None:
    stand_in = types.ModuleType("torchsort")
    stand_in.soft_rank = stand_in.soft_sort = _refuse  # type: ignore[attr-defined]
    sys.modules["torchsort"] = stand_in
