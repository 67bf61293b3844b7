"""The docstring examples of posthoc_apps run as posthoc's do: the same namespace and isolation (posthoc/conftest.py)."""

from posthoc.conftest import _doctest_namespace  # noqa: F401  (an autouse fixture: pytest finds it by name here)
