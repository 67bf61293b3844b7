"""The package's import structure, read from the source with ``ast`` (every import statement, at any depth).

Two top-level packages: the library ``posthoc`` and its applications ``posthoc_apps`` (the command line, the demo, the
loaders, the Lightning callback). The library never imports the applications, not even inside a function, nor by a
module name in a string (``importlib.import_module``); the applications import only the library and themselves.

Layers of the library, bottom to top: ``core`` < (``engine``, ``export``) < ``methods`` < (``api``, ``calibrate``,
``guarantees``, ``ood``, ``shift``) < ``evaluation``; ``posthoc/__init__.py`` gathers the public API and is exempt as
an importer (as an import target it sits in the top layer). Imports point down or stay in their layer; a method
(``methods/X.py`` or ``methods/X/``) imports only ``core``, ``engine``, ``export``, itself and the methods it is declared to build
on (:data:`BUILDS_ON`); no import circle between modules, and none between the subpackages either (two packages of one
layer must not import each other); no import of posthoc inside a function (in either package).

Every folder of both packages is named in the layout of ``docs/architecture.md``.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

REPO = next(folder for folder in Path(__file__).resolve().parents if (folder / "pyproject.toml").is_file())
PACKAGE = REPO / "posthoc"
ROOT = "posthoc"
APPS = REPO / "posthoc_apps"
APPS_ROOT = "posthoc_apps"
ARCHITECTURE = REPO / "docs" / "architecture.md"
LAYERS = {
    "errors": 0,
    "settings": 0,
    "core": 0,
    "engine": 1,
    "methods": 2,
    "api": 3,
    "calibrate": 3,
    "label_shift": 3,
    "export": 1,
    "guarantees": 3,
    "shift": 3,
    "ood": 3,
    "evaluation": 4,
}
TOP = max(LAYERS.values())
#: the other methods a method is made of, imported by name: MultiSWAG is an ensemble of SWAG runs
BUILDS_ON = {"ensemble": {"swag"}}


@dataclass(frozen=True)
class Import:
    """One import of a posthoc module: who imports what, where, and whether inside a function."""

    importer: str
    target: str
    line: int
    in_function: bool

    def __str__(self) -> str:
        where = " (inside a function)" if self.in_function else ""
        return f"{self.importer} -> {self.target} (line {self.line}){where}"


def module_names(package: Path = PACKAGE, root: str = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name, ``posthoc.methods.laplace`` for a package's ``__init__.py``."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        if path.name == "conftest.py":  # how pytest runs the doctests, not part of the package
            continue
        parts = (root, *path.relative_to(package).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


class _ImportVisitor(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, modules: set[str]) -> None:
        self.module, self.modules = module, modules
        self.package = module if is_package else module.rpartition(".")[0]
        self.depth = 0
        self.found: list[Import] = []

    def _add(self, target: str, node: ast.stmt) -> None:
        if target.split(".")[0] in (ROOT, APPS_ROOT):
            self.found.append(Import(self.module, target, node.lineno, self.depth > 0))

    def _in_function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _in_function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            anchor = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            self._add(submodule if submodule in self.modules else base, node)


def imports(package: Path = PACKAGE, root: str = ROOT) -> list[Import]:
    """Every import of a posthoc or posthoc_apps module made anywhere in the package."""
    modules = module_names(package, root)
    found = []
    for name, path in modules.items():
        visitor = _ImportVisitor(name, path.name == "__init__.py", set(modules))
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        found += visitor.found
    return found


def layer(module: str) -> int:
    """The layer of a posthoc module; the package root counts as the top layer, the applications above it."""
    parts = module.split(".")
    if parts[0] == APPS_ROOT:
        return TOP + 1
    return TOP if len(parts) == 1 else LAYERS[parts[1]]


def method_of(module: str) -> str | None:
    """``"laplace"`` for ``posthoc.methods.laplace.curvature``; ``None`` outside a method."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "methods" else None


def violations(found: list[Import]) -> list[str]:
    """Upward imports, and methods importing anything beyond core, engine and their own folder."""
    bad = []
    for edge in found:
        if edge.importer == ROOT:
            continue
        if layer(edge.target) > layer(edge.importer):
            bad.append(f"upward import: {edge}")
        method, target = method_of(edge.importer), method_of(edge.target)
        if (
            method is not None
            and layer(edge.target) >= LAYERS["methods"]
            and target != method
            and target not in BUILDS_ON.get(method, set())
        ):
            bad.append(f"method '{method}' imports outside core, engine and itself: {edge}")
    return bad


def package(module: str) -> str:
    """The subpackage (or top-level module) a module belongs to: ``posthoc.evaluation`` for
    ``posthoc.evaluation.report``; the root for ``posthoc`` itself."""
    return ".".join(module.split(".")[:2])


def package_imports(found: list[Import]) -> list[Import]:
    """The imports between subpackages (an import inside one subpackage is not one), the root excluded as importer."""
    return [
        Import(package(edge.importer), package(edge.target), edge.line, edge.in_function)
        for edge in found
        if edge.importer != ROOT and package(edge.importer) != package(edge.target)
    ]


def cycles(found: list[Import]) -> list[list[str]]:
    """One import circle (as ``[a, b, ..., a]``) per strongly connected group of modules."""
    graph: dict[str, set[str]] = {}
    for edge in found:
        graph.setdefault(edge.importer, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while node not in group:
                group.add(stack.pop())
            if len(group) > 1 or node in graph[node]:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_circle(graph, min(group), group) for group in groups]


def _circle(graph: dict[str, set[str]], start: str, group: set[str]) -> list[str]:
    """The shortest path from ``start`` back to itself inside ``group``."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for nxt in sorted(graph[node] & group):
            if nxt == start:
                return paths[node] + [start]
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                frontier.append(nxt)
    raise AssertionError(f"{start} is in a strongly connected group but on no circle")


FOUND = imports()
#: the imports made in the applications (of posthoc_apps and of posthoc modules)
APPS_FOUND = imports(APPS, APPS_ROOT)


def _circles() -> set[str]:
    return {" -> ".join(circle) for circle in cycles(FOUND)}


def _package_circles() -> set[str]:
    return {" -> ".join(circle) for circle in cycles(package_imports(FOUND))}


def _function_level() -> set[str]:
    return {f"{edge.importer} -> {edge.target}" for edge in FOUND if edge.in_function}


def plant(root: Path, files: dict[str, str]) -> None:
    """Write ``files`` (path below ``root`` -> text): a made-up package for a rule to catch its breaches in."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_analysis_sees_the_package():
    assert {"posthoc.errors", "posthoc.methods.laplace"} <= set(module_names())
    assert {"posthoc_apps.cli.main", "posthoc_apps.demo.zoo"} <= set(module_names(APPS, APPS_ROOT))
    targets = {(edge.importer, edge.target) for edge in FOUND}
    assert ("posthoc.api", "posthoc.core.registry") in targets
    assert ("posthoc.methods", "posthoc.methods.laplace") in targets  # ``from package import submodule``


def test_the_analysis_catches_each_kind_of_breakage(tmp_path: Path):
    files = {
        "__init__.py": "from posthoc import evaluation\n",
        "core/__init__.py": "",
        "core/a.py": "from . import b\n",
        "core/b.py": "def f():\n    from posthoc.core.a import f\n",
        "engine/__init__.py": "",
        "engine/hooks.py": "import posthoc.evaluation\n",
        "methods/__init__.py": "from posthoc.methods import laplace, temperature\n",
        "methods/temperature.py": "from posthoc.core import a\n",
        "methods/laplace/__init__.py": "from .fit import fit\nfrom ..temperature import scale\n",
        "methods/laplace/fit.py": "from posthoc.engine import hooks\n",
        "api.py": "from posthoc.methods import laplace\n",
        "evaluation/__init__.py": "",
        "ood/__init__.py": "",
        "ood/folders.py": "",
        "ood/hub.py": "from posthoc.shift import noise\n",
        "shift/__init__.py": "",
        "shift/noise.py": "",
        "shift/kinds.py": "from posthoc.ood.folders import read\n",
    }
    plant(tmp_path, files)
    found = imports(tmp_path)
    assert cycles(found) == [["posthoc.core.a", "posthoc.core.b", "posthoc.core.a"]]
    # two packages of one layer that import each other: no module circle, no upward import, one package circle
    assert cycles(package_imports(found)) == [["posthoc.ood", "posthoc.shift", "posthoc.ood"]]
    assert violations(found) == [
        "upward import: posthoc.engine.hooks -> posthoc.evaluation (line 1)",
        "method 'laplace' imports outside core, engine and itself: "
        "posthoc.methods.laplace -> posthoc.methods.temperature (line 2)",
    ]
    assert [str(edge) for edge in found if edge.in_function] == [
        "posthoc.core.b -> posthoc.core.a (line 2) (inside a function)"
    ]


def test_no_import_circle():
    assert not _circles(), "import circles:\n" + "\n".join(sorted(_circles()))


def test_no_import_circle_between_subpackages():
    assert not _package_circles(), "import circles between subpackages:\n" + "\n".join(sorted(_package_circles()))


def test_imports_point_down_and_methods_stay_in_their_folder():
    bad = violations(FOUND)
    assert not bad, "\n".join(bad)


def test_no_function_level_imports():
    assert not _function_level(), f"posthoc modules imported inside functions: {sorted(_function_level())}"


# --- a library and its applications: posthoc never imports posthoc_apps; every folder is in the layout ---


def named_apps(package: Path = PACKAGE) -> list[str]:
    """Every string in the package's code (docstrings left out: their examples may use the demo's data) that names a
    ``posthoc_apps`` module, as ``importlib.import_module`` or ``__import__`` would take it."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "conftest.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and re.fullmatch(rf"{APPS_ROOT}(\.\w+)*", node.value)
            ):
                found.append(f"{path.relative_to(package).as_posix()} (line {node.lineno}): {node.value!r}")
    return found


def library_imports_of_apps(found: list[Import]) -> list[str]:
    """The imports of ``posthoc_apps`` made by ``posthoc`` modules (at module level or inside a function)."""
    return [str(edge) for edge in found if edge.importer.split(".")[0] == ROOT and layer(edge.target) > TOP]


def test_the_library_rule_catches_an_import_of_the_apps(tmp_path: Path):
    files = {
        "__init__.py": "",
        "evaluation/report.py": "def to_html(report):\n    from posthoc_apps.pages import page\n    return page(report)\n",
        "api.py": "import importlib\nimport posthoc_apps.cli\n"
        'def plot():\n    """posthoc_apps.demo in a docstring is fine"""\n'
        "    return importlib.import_module('posthoc_apps.plots')\n",
    }
    plant(tmp_path, files)
    assert library_imports_of_apps(imports(tmp_path)) == [
        "posthoc.api -> posthoc_apps.cli (line 2)",
        "posthoc.evaluation.report -> posthoc_apps.pages (line 2) (inside a function)",
    ]
    assert named_apps(tmp_path) == ["api.py (line 5): 'posthoc_apps.plots'"]


def test_the_library_never_imports_the_applications():
    bad = library_imports_of_apps(FOUND) + named_apps()
    assert not bad, "posthoc imports posthoc_apps (the library must not know its applications):\n" + "\n".join(bad)


def test_the_applications_import_only_the_library_and_themselves():
    assert {edge.target.split(".")[0] for edge in APPS_FOUND} == {ROOT, APPS_ROOT}
    assert any(edge.target.startswith("posthoc.evaluation") for edge in APPS_FOUND)  # the analysis sees them
    inside = sorted(str(edge) for edge in APPS_FOUND if edge.in_function)
    assert not inside, "posthoc modules imported inside functions in posthoc_apps:\n" + "\n".join(inside)
    circles = {" -> ".join(circle) for circle in cycles(APPS_FOUND)}
    assert not circles, "import circles in posthoc_apps:\n" + "\n".join(sorted(circles))


#: libraries that draw: the applications' (``posthoc_apps/report``), never the library's
DRAWING = ("matplotlib",)


def drawing_imports(package: Path = PACKAGE) -> list[str]:
    """Every import of a drawing library (:data:`DRAWING`) in ``package``'s modules, at any depth, and every module
    name of one in a string of code (``importlib.import_module("matplotlib")``); docstrings left out."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "conftest.py":  # how pytest runs the doctests (it closes their figures), not the package
            continue
        where = path.relative_to(package).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif (
                isinstance(node, ast.Call)
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__")
            ):
                names = [node.args[0].value]
            found += [f"{where} (line {node.lineno}): {name}" for name in names if name.split(".")[0] in DRAWING]
    return found


def test_the_drawing_rule_catches_matplotlib_in_the_library(tmp_path: Path):
    files = {
        "__init__.py": "",
        "evaluation/report.py": "import os\nfrom matplotlib.figure import Figure\n",
        "evaluation/page.py": "import importlib\ndef f():\n    import matplotlib.pyplot as plt\n"
        "    return importlib.import_module('matplotlib')\n",
        "evaluation/table.py": '"""matplotlib in a docstring is fine"""\nfrom posthoc.core import checks\n',
    }
    plant(tmp_path, files)
    assert drawing_imports(tmp_path) == [
        "evaluation/page.py (line 3): matplotlib.pyplot",
        "evaluation/page.py (line 4): matplotlib",
        "evaluation/report.py (line 2): matplotlib.figure",
    ]


def test_only_the_applications_draw():
    """matplotlib is the applications' (the figures and the HTML page of ``posthoc_apps/report``): a notebook that
    imports the library imports no drawing library."""
    bad = drawing_imports()
    assert not bad, "posthoc modules import matplotlib (pictures belong in posthoc_apps/report):\n" + "\n".join(bad)
    assert drawing_imports(APPS)  # the analysis sees the applications' figures


def folders(package: Path) -> list[str]:
    """Every folder of ``package`` (``__pycache__`` left out), as a path below the package's parent."""
    return sorted(
        path.relative_to(package.parent).as_posix()
        for path in package.rglob("*")
        if path.is_dir() and "__pycache__" not in path.parts
    )


def layout(text: str) -> dict[str, str]:
    """The layout drawn in ``docs/architecture.md`` (the first code block under ``## The layout``), one section per
    top-level package: ``{"posthoc": "...", "posthoc_apps": "..."}``; a section starts at a line ``<package>/``."""
    block = text.split("## The layout", 1)[1].split("```", 2)[1]
    sections: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        heading = re.match(r"(\w+)/(\s|$)", line)
        if heading:
            current = heading.group(1)
        if current is not None:
            sections[current] = sections.get(current, "") + line + "\n"
    return sections


def unlisted(text: str, found: list[str]) -> list[str]:
    """The folders of ``found`` (``posthoc/methods/laplace``) whose name, followed by ``/``, is missing from their
    top-level package's section of the layout (a nested folder is drawn by its own name, under its parent's)."""
    sections = layout(text)
    return [
        folder
        for folder in found
        if not re.search(rf"(?<![\w/.]){re.escape(folder.rsplit('/', 1)[-1])}/", sections.get(folder.split("/")[0], ""))
    ]


def test_the_layout_rule_catches_an_unlisted_folder(tmp_path: Path):
    plant(tmp_path, {"posthoc/core/a.py": "", "posthoc/methods/laplace/b.py": "", "posthoc_apps/cli/c.py": ""})
    found = folders(tmp_path / "posthoc") + folders(tmp_path / "posthoc_apps")
    drawn = (
        "# A\n\n## The layout\n\n```\nposthoc/\n  core/   a\n  methods/  laplace/  b\nposthoc_apps/\n  cli/  c\n```\n"
    )
    assert unlisted(drawn, found) == []
    assert unlisted(drawn.replace("  cli/  c\n", ""), found) == ["posthoc_apps/cli"]
    # a folder named under the other package does not count
    assert unlisted(drawn.replace("  core/   a\n", "").replace("cli/", "cli/ core/"), found) == ["posthoc/core"]


def test_every_folder_is_in_the_layout():
    missing = unlisted(ARCHITECTURE.read_text(), folders(PACKAGE) + folders(APPS))
    assert not missing, "folders missing from the layout in docs/architecture.md:\n" + "\n".join(missing)


# --- the runner owns the cross-cutting concerns; a method is its mathematics (issue "One house, third pass") ---

#: what a method must not carry, read from the source with ``ast``: the runner (``posthoc.engine.runner``) owns them
MAX_MEMORY_MENTIONS = 10


@dataclass(frozen=True)
class Concern:
    """One runner concern found in a method's source."""

    module: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.module} (line {self.line}): {self.what}"


def runner_concerns(package: Path = PACKAGE) -> tuple[list[Concern], int]:
    """Every reduction over ranks, thread switch and import-time rewrite in ``methods/``, and the count of
    ``max_memory`` names there (identifiers, attributes, keywords and string mentions in code)."""
    found, memory = [], 0
    methods = package / "methods"
    for path in sorted(methods.rglob("*.py")):
        module = ".".join((ROOT, *path.relative_to(package).with_suffix("").parts))
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ("posthoc.core.distributed", "posthoc.core.threads"):
                found.append(Concern(module, node.lineno, f"imports {node.module}"))
            elif isinstance(node, ast.ImportFrom) and node.module == "posthoc.core":
                for alias in node.names:
                    if alias.name in ("distributed", "threads"):
                        found.append(Concern(module, node.lineno, f"imports posthoc.core.{alias.name}"))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("torch.distributed"):
                        found.append(Concern(module, node.lineno, f"imports {alias.name}"))
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("distributed", "dist")
            ):
                found.append(Concern(module, node.lineno, f"calls {node.value.id}.{node.attr}"))
            elif isinstance(node, ast.Name) and node.id in ("single_thread_if", "set_num_threads"):
                found.append(Concern(module, node.lineno, f"switches threads ({node.id})"))
            elif isinstance(node, ast.Attribute) and node.attr == "set_num_threads":
                found.append(Concern(module, node.lineno, "switches threads (torch.set_num_threads)"))
            if (
                (isinstance(node, ast.Name) and node.id == "max_memory")
                or (isinstance(node, ast.Attribute) and node.attr == "max_memory")
                or (isinstance(node, ast.arg) and node.arg == "max_memory")
                or (isinstance(node, ast.keyword) and node.arg == "max_memory")
            ):
                memory += 1
    return found, memory


def import_time_rewrites(package: Path = PACKAGE) -> list[str]:
    """Module-level assignments to ``sys.modules[...]`` or to a ``__doc__`` in the package: rewriting at import time (a
    function that loads a user's model file may register it in ``sys.modules`` when called)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                else []
            )
            for target in targets:
                text = ast.unparse(target)
                if text.startswith("sys.modules[") or text.endswith(".__doc__"):
                    found.append(f"{path.relative_to(package)} (line {node.lineno}): {text} = ...")
    return found


def test_the_runner_rules_catch_a_concern_put_back(tmp_path: Path):
    files = {
        "methods/__init__.py": "",
        "methods/good/__init__.py": "from posthoc.engine.runner import sum_over_ranks\n",
        "methods/bad/method.py": (
            "from posthoc.core import distributed, settings\n"
            "from posthoc.core.threads import single_thread_if\n"
            "import torch\n"
            "def fit(stats, max_memory=None):\n"
            "    stats = distributed.all_reduce_sum(stats)\n"
            "    torch.set_num_threads(1)\n"
            "    return settings.memory_budget(max_memory)\n"
        ),
        "api.py": "import sys\nfrom posthoc.core import settings\nsys.modules['posthoc.settings'] = settings\n"
        "def wrap():\n    pass\nwrap.__doc__ = 'more'\n",
    }
    plant(tmp_path, files)
    found, memory = runner_concerns(tmp_path)
    assert [str(c) for c in found] == [
        "posthoc.methods.bad.method (line 1): imports posthoc.core.distributed",
        "posthoc.methods.bad.method (line 2): imports posthoc.core.threads",
        "posthoc.methods.bad.method (line 5): calls distributed.all_reduce_sum",
        "posthoc.methods.bad.method (line 6): switches threads (torch.set_num_threads)",
    ] and memory == 2
    assert import_time_rewrites(tmp_path) == [
        "api.py (line 3): sys.modules['posthoc.settings'] = ...",
        "api.py (line 6): wrap.__doc__ = ...",
    ]


def test_methods_carry_no_ranks_or_threads():
    found, _ = runner_concerns()
    assert not found, "runner concerns in posthoc/methods/ (use posthoc.engine.runner):\n" + "\n".join(map(str, found))


def test_methods_barely_mention_the_memory_budget():
    _, memory = runner_concerns()
    assert memory <= MAX_MEMORY_MENTIONS, (
        f"{memory} mentions of max_memory in posthoc/methods/ (at most "
        f"{MAX_MEMORY_MENTIONS}): the runner's budget scope plans the chunks"
    )


def test_nothing_is_rewritten_at_import_time():
    assert not import_time_rewrites(), "\n".join(import_time_rewrites())


#: reading a function's signature: options are declared as ``Options`` dataclasses (methods, calibrators, OOD scores,
#: likelihoods), never found by probing an ``__init__``
SIGNATURE_READERS = ("signature", "getfullargspec")
#: the one module allowed to read a signature: it inspects a user's model factory, which declares nothing to us
READS_A_USERS_SIGNATURE = {"loading/models.py"}


def signature_reads(package: Path = PACKAGE) -> list[str]:
    """Every ``inspect.signature`` / ``inspect.getfullargspec`` (called, or imported by name) in the package outside
    :data:`READS_A_USERS_SIGNATURE`."""
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package).as_posix()
        if where in READS_A_USERS_SIGNATURE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in SIGNATURE_READERS
                and isinstance(node.value, ast.Name)
                and node.value.id == "inspect"
            ):
                found.append(f"{where} (line {node.lineno}): inspect.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module == "inspect":
                found += [
                    f"{where} (line {node.lineno}): from inspect import {alias.name}"
                    for alias in node.names
                    if alias.name in SIGNATURE_READERS
                ]
    return found


def test_the_signature_rule_catches_a_signature_read_put_back(tmp_path: Path):
    files = {
        "loading/models.py": "import inspect\ndef accepts(factory):\n    return inspect.signature(factory).parameters\n",
        "ood/base.py": "import inspect\ndef defaults(cls):\n    return inspect.signature(cls.__init__).parameters\n",
        "core/likelihood.py": "from inspect import getfullargspec, isclass\nimport inspect\nspec = inspect.getfullargspec\n",
    }
    plant(tmp_path, files)
    assert signature_reads(tmp_path) == [
        "core/likelihood.py (line 1): from inspect import getfullargspec",
        "core/likelihood.py (line 3): inspect.getfullargspec",
        "ood/base.py (line 3): inspect.signature",
    ]


def test_options_are_declared_not_read_from_signatures():
    found = signature_reads() + [f"posthoc_apps/{where}" for where in signature_reads(APPS)]
    assert not found, (
        "signature reads in posthoc/ or posthoc_apps/ (declare the options as an Options dataclass, "
        "posthoc.core.options):\n" + "\n".join(found)
    )


# --- the source says what and why; figures and history live in docs/ and benchmarks/results/ ---

#: a mention of the benchmarks folder, or of an issue by number ("issue 34", "issue #153", "Issues 12")
HISTORY = re.compile(r"benchmarks/|\bissues?\s+#?\d+", re.IGNORECASE)


def history_mentions(package: Path = PACKAGE) -> list[str]:
    """Every line of the package's source that points at a benchmark script or an issue, as ``path:line: text``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{path.relative_to(package.parent)}:{number}: {line.strip()}")
    return found


def test_the_source_names_no_benchmark_script_or_issue():
    found = history_mentions() + history_mentions(APPS)
    assert not found, "move figures and history to docs/ or benchmarks/results/:\n" + "\n".join(found)


def test_the_history_rule_catches_a_mention_put_back(tmp_path: Path):
    (tmp_path / "a.py").write_text('"""Fast (see benchmarks/bench_a.py)."""\n')
    (tmp_path / "b.py").write_text("# what Issue #12 asked for\n")
    (tmp_path / "c.py").write_text('"""An issue of scale, 12 benchmarks."""\n')
    assert [line.split(":")[0] for line in history_mentions(tmp_path)] == [
        f"{tmp_path.name}/a.py",
        f"{tmp_path.name}/b.py",
    ]


def test_test_module_names_are_unique_across_the_test_folders():
    """tests/ mirrors the packages in folders without ``__init__.py``: pytest imports a test module by its file name,
    and tests/conftest.py puts every folder on the path, so two files of one name would shadow each other."""
    names: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("*.py")):
        names.setdefault(path.name, []).append(path.relative_to(REPO).as_posix())
    twice = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not twice, f"test modules of one name in several folders: {twice}"
