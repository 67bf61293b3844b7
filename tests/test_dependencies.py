"""The suite depends on nothing the README's install (`pip install -e ".[test]"`) does not bring.

Every third-party module a test imports, or asks `pytest.importorskip` for, must come from a distribution
in the requirement closure of `posthoc[test]`, read from the installed metadata (or be installed on its own by the
README's test command, `pip install --no-deps`); and a module that the
closure does bring must be imported plainly, never through `importorskip`, so that a broken install fails
loudly instead of skipping the peer check.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

TESTS = Path(__file__).parent
#: modules of this repository (the package, the test modules, the benchmarks, recipes and tools folders), not
#: distributions
LOCAL = {"posthoc", "posthoc_apps", "benchmarks", "recipes", "tools"} | {
    path.stem
    for folder in (TESTS, TESTS.parent / "benchmarks", TESTS.parent / "recipes", TESTS.parent / "tools")
    for path in (folder.rglob("*.py") if folder == TESTS else folder.glob("*.py"))
}


def _requirement_closure(root: str, extras: set[str]) -> set[str]:
    """Normalised names of ``root`` with ``extras`` and of everything it requires, recursively (installed metadata)."""
    seen: set[str] = set()
    pending = [(root, frozenset(extras))]
    while pending:
        name, wanted = pending.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if (key, wanted) in seen:
            continue
        seen.add((key, wanted))  # type: ignore[arg-type]
        try:
            requirements = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requirements:
            requirement, _, marker = line.partition(";")
            extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
            if extra and extra.group(1) not in wanted:
                continue
            if marker.strip() and not extra and not _marker_holds(marker):
                continue
            match = re.match(r"\s*([A-Za-z0-9._-]+)(\[([^\]]*)\])?", requirement)
            if match:
                nested = {e.strip() for e in (match.group(3) or "").split(",") if e.strip()}
                pending.append((match.group(1), frozenset(nested)))
    return {key for key, _ in seen}  # type: ignore[misc]


def _marker_holds(marker: str) -> bool:
    try:
        from packaging.markers import Marker
    except ImportError:  # packaging is always there with pip; be permissive without it
        return True
    return Marker(marker.strip()).evaluate({"extra": ""})


def _imported_modules() -> dict[str, set[str]]:
    """Top-level modules each test file imports (any depth) or passes to ``pytest.importorskip``, and which by the latter."""
    found: dict[str, set[str]] = {"import": set(), "importorskip": set()}
    for path in TESTS.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found["import"].update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found["import"].add(node.module.split(".")[0])
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "importorskip"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found["importorskip"].add(str(node.args[0].value).split(".")[0])
    return found


def _installed_without_dependencies() -> set[str]:
    """Distributions the README's test command installs on their own (``pip install --no-deps "name..."``)."""
    command = (TESTS.parent / "README.md").read_text().splitlines()[2]
    return {
        re.sub(r"[-_.]+", "-", name).lower()
        for name in re.findall(r"pip install --no-deps \"?([A-Za-z0-9._-]+)", command)
    }


def _distributions_of(module: str) -> set[str]:
    return {re.sub(r"[-_.]+", "-", d).lower() for d in metadata.packages_distributions().get(module, [])}


def test_every_imported_module_comes_with_the_test_extra():
    closure = _requirement_closure("posthoc", {"test"}) | _installed_without_dependencies()
    assert "torch" in closure and "pytest" in closure, "posthoc[test] must be installed to run the suite"
    modules = _imported_modules()
    missing = []
    for module in sorted(modules["import"] | modules["importorskip"]):
        if module in LOCAL or module in sys.stdlib_module_names or module == "__future__":
            continue
        distributions = _distributions_of(module)
        if not distributions & closure:
            missing.append(f"{module} (from {sorted(distributions) or 'no installed distribution'})")
    assert not missing, f"tests import modules that pip install -e '.[test]' does not bring: {missing}"


def test_no_importorskip_hides_a_declared_dependency():
    closure = _requirement_closure("posthoc", {"test"})
    hidden = sorted(m for m in _imported_modules()["importorskip"] if _distributions_of(m) & closure)
    assert not hidden, (
        f"{hidden} come with posthoc[test]: import them plainly, so a broken install fails "
        "instead of skipping the check"
    )
