"""The docstring examples of posthoc_apps run as posthoc's do: in an empty namespace, isolated (posthoc/conftest.py)."""

from posthoc.conftest import _isolated_example, pytest_collection_modifyitems  # noqa: F401  (pytest finds them by name)
