"""How the docstring examples run in the test suite: as pasted into a fresh notebook, one at a time.

Each example starts from an empty namespace (not its module's), so it imports what it uses; the models and data
it needs come from :mod:`posthoc_apps.demo.examples`. It runs in an empty temporary folder after
``torch.manual_seed(0)``, on one thread, and ``posthoc.settings``, the method registry and open figures are
restored after it, so no example sees another's side effects.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _pytest.doctest import DoctestItem

os.environ.setdefault("MPLBACKEND", "Agg")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Empty each example's namespace: a name it does not import is an error, as in a notebook."""
    for item in items:
        if isinstance(item, DoctestItem) and item.dtest is not None:
            item.dtest.globs.clear()


@pytest.fixture(autouse=True)
def _isolated_example(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[None]:
    """Run a docstring example in a temporary folder, seeded, on one thread; restore what it may change."""
    if not isinstance(request.node, DoctestItem):
        yield
        return
    import torch

    from posthoc import settings
    from posthoc.core import registry

    saved_settings = {name: getattr(settings, name) for name in ("chunk_size", "max_memory")}
    saved_registry = dict(registry.REGISTRY)
    cwd, threads = os.getcwd(), torch.get_num_threads()
    torch.set_num_threads(1)  # examples hold tiny tensors: more threads only fight over a busy CPU
    os.chdir(tmp_path)
    torch.manual_seed(0)
    try:
        yield
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)
        for name, value in saved_settings.items():
            setattr(settings, name, value)
        registry.REGISTRY.clear()
        registry.REGISTRY.update(saved_registry)
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")
