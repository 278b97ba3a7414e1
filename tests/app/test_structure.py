"""The layering of docs/architecture.md ("The layer order"), read from the imports.

Every ``fairlimit`` import (absolute or relative, at module level, inside a function or under
``TYPE_CHECKING``) must point into the importer's own layer-package or a layer to its left:

    errors, _proto <- core <- config, store, telemetry, settings <- policy <- flows
        <- limiter <- grpc_api, admin, simulate <- app, workers, topview <- cli
    (quota is limiter's sibling)

Packages of one layer do not import each other. core/ imports only the standard library, and
grpc, redis and the generated code stay with their owning packages.
"""

import ast
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "server" / "fairlimit"
STDLIB_ONLY = "core"
OWNERS = {
    "grpc": ("grpc_api",),
    "grpc_health": ("grpc_api",),
    "grpc_reflection": ("grpc_api",),
    "redis": ("store",),
    "fairlimit._proto": ("grpc_api",),
}

# Left to right; a module may import from its own layer-package and the layers to the left.
# "fairlimit" is the package's __init__ (``__version__`` only); __main__ sits above cli.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("fairlimit", "errors", "_proto"),
    ("core",),
    ("config", "store", "telemetry", "settings"),
    ("policy",),  # the failure policy around the store (breaker, shedding, local mode)
    ("flows",),  # the limiter's three flows: rates, slots, tokens
    ("limiter", "quota"),
    ("grpc_api", "admin", "simulate"),
    ("app", "workers", "topview"),  # topview: the admin port's terminal client, for cli
    ("cli",),
    ("__main__",),
)
LAYER_OF = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}


@dataclass(frozen=True)
class Violation:
    """One import that breaks the layer order."""

    file: str
    line: int
    target: str
    rule: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.target}: {self.rule}"


def _module_name(path: Path, root: Path) -> str:
    parts = ("fairlimit", *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _fairlimit_imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every fairlimit import in ``path``, relative ones resolved."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            # `from pkg import name` may name a submodule: judge each name as pkg.name.
            found += [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return [(line, target) for line, target in found if target.split(".")[0] == "fairlimit"]


def _layer_package(dotted: str) -> str:
    """The layer-package a fairlimit module belongs to ("fairlimit" for the package root)."""
    parts = dotted.split(".")
    head = parts[1] if len(parts) > 1 else "fairlimit"
    return head if head in LAYER_OF else "fairlimit"


def _target_module(target: str) -> str:
    """``target`` trimmed to a module or package that exists (drops an imported name)."""
    parts = target.split(".")
    while len(parts) > 1:
        candidate = PACKAGE.parent.joinpath(*parts)
        if candidate.with_suffix(".py").exists() or (candidate / "__init__.py").exists():
            return ".".join(parts)
        parts.pop()
    return "fairlimit"


def violations(path: Path, root: Path = PACKAGE) -> list[Violation]:
    """Every import in ``path`` (a module under ``root``, the fairlimit package) that points up
    the layer order or sideways to a sibling; imported names are resolved in the real package."""
    own = _layer_package(_module_name(path, root))
    file = str(path.relative_to(root))
    found = []
    resolved = {(line, _target_module(raw)) for line, raw in _fairlimit_imports(path, root)}
    for line, target in sorted(resolved):
        other = _layer_package(target)
        if other == own or LAYER_OF[other] < LAYER_OF[own]:
            continue
        if LAYER_OF[other] == LAYER_OF[own]:
            rule = f"{own} and {other} are siblings in one layer and must not import each other"
        else:
            rule = f"{own} (layer {LAYER_OF[own]}) may not import {other} (layer {LAYER_OF[other]})"
        found.append(Violation(file, line, target, rule))
    return found


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_proto" not in p.relative_to(PACKAGE).parts)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


class TestLayerOrder:
    @pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
    def test_imports_point_left_in_the_layer_order(self, path: Path) -> None:
        """No module imports a layer to its right or a sibling package of its own layer."""
        found = [str(v) for v in violations(path)]
        assert not found, "imports against the layer order (docs/architecture.md):\n" + "\n".join(
            found
        )

    def test_every_package_has_a_layer(self) -> None:
        """Each top-level module or package of fairlimit is placed in LAYERS."""
        tops = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in _modules()}
        unplaced = {t for t in tops if t not in LAYER_OF}
        assert unplaced == {"__init__"}


class TestLayerRule:
    """The checker itself catches what it must (on probe files in a scratch package)."""

    def _check(self, tmp: Path, relative: str, source: str) -> list[str]:
        path = tmp / "fairlimit" / relative
        path.parent.mkdir(parents=True)
        path.write_text(source)
        return [str(v) for v in violations(path, tmp / "fairlimit")]

    def test_upward_import_inside_a_function_names_file_line_and_rule(self, tmp_path: Path) -> None:
        """An upward import in a function body is found, with file, line and rule."""
        source = "def f():\n    from fairlimit.limiter import Limiter\n"
        assert self._check(tmp_path, "core/zz_probe.py", source) == [
            "core/zz_probe.py:2 imports fairlimit.limiter: core (layer 1) may not import"
            " limiter (layer 5)"
        ]

    def test_relative_and_type_checking_imports_are_resolved(self, tmp_path: Path) -> None:
        """A relative import under TYPE_CHECKING is judged like an absolute one."""
        source = (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..store import base\n"
        )
        assert self._check(tmp_path, "config/zz_probe.py", source) == [
            "config/zz_probe.py:3 imports fairlimit.store.base: config and store are siblings"
            " in one layer and must not import each other"
        ]

    def test_own_package_and_left_layers_pass(self, tmp_path: Path) -> None:
        """Imports of the own package (relative too) and of left layers are allowed."""
        source = "from . import base\nfrom fairlimit.core import units\nimport fairlimit.errors\n"
        assert self._check(tmp_path, "store/zz_probe.py", source) == []


class TestLayering:
    @pytest.mark.parametrize(
        "path", sorted((PACKAGE / STDLIB_ONLY).glob("*.py")), ids=lambda p: p.name
    )
    def test_core_imports_only_stdlib_and_itself(self, path: Path) -> None:
        """core/ imports nothing outside the standard library, errors and core."""
        for name in _imports(path):
            top = name.split(".")[0]
            allowed = name.startswith(("fairlimit.core", "fairlimit.errors"))
            assert allowed or top in sys.stdlib_module_names, f"{path.name} imports {name}"

    def test_a_quota_stream_does_not_know_the_service(self) -> None:
        """quota/stream.py is a stream's state: the service reads and updates it, and it
        never calls the service back (it imports nothing else of quota/)."""
        names = _imports(PACKAGE / "quota" / "stream.py")
        assert not [n for n in names if n.startswith("fairlimit.quota")]

    def test_the_config_source_interface_knows_no_source(self) -> None:
        """config/source.py, the one interface the app holds, imports neither the files'
        watcher, the loader nor xDS: the sources import it."""
        names = _imports(PACKAGE / "config" / "source.py")
        assert not [n for n in names if n.startswith(("fairlimit.config", "fairlimit.grpc"))]

    @pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
    def test_wire_and_backend_libraries_stay_with_their_owners(self, path: Path) -> None:
        """grpc, the generated code and redis are imported only by their owning package."""
        where = path.relative_to(PACKAGE).parts[0]
        for name in _imports(path):
            for lib, owners in OWNERS.items():
                if name == lib or name.startswith(lib + "."):
                    assert where in owners, f"{path.relative_to(PACKAGE)} imports {name}"


def _modules_under(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root`` by its dotted name (generated code left out)."""
    return {
        _module_name(p, root): p
        for p in sorted(root.rglob("*.py"))
        if "_proto" not in p.relative_to(root).parts
    }


def _existing(target: str, modules: Mapping[str, Path]) -> str | None:
    """``target`` trimmed to a module of ``modules`` (drops an imported name)."""
    parts = target.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def import_graph(root: Path = PACKAGE) -> dict[str, dict[str, str]]:
    """Each module -> the modules of the package it imports (at module level, inside a
    function or under ``TYPE_CHECKING``), each with where: ``file:line`` of the first import."""
    modules = _modules_under(root)
    graph: dict[str, dict[str, str]] = {}
    for name, path in modules.items():
        edges = graph[name] = {}
        for line, raw in _fairlimit_imports(path, root):
            target = _existing(raw, modules)
            if target is not None and target != name:
                edges.setdefault(target, f"{path.relative_to(root)}:{line}")
    return graph


def circles(root: Path = PACKAGE) -> list[list[str]]:
    """The import circles of the package at ``root``: each strongly connected group of two
    or more modules (Tarjan), as the imports that close it (``file:line imports module``)."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = {stack.pop()}
            while module not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for module in graph:
        if module not in index:
            visit(module)
    return [sorted(_closing(graph, group)) for group in groups]


def _closing(graph: Mapping[str, Mapping[str, str]], group: set[str]) -> list[str]:
    """The imports between the modules of ``group``."""
    return [
        f"{where} imports {target}"
        for module in group
        for target, where in graph[module].items()
        if target in group
    ]


class TestNoCircles:
    """No two modules import each other, directly or through others: each module is a room
    (docs/architecture.md), and a circle between two of them means neither can be read, or
    loaded, without the other. A type-only or a function-level import counts as well: it
    hides the circle from the interpreter, not from the reader."""

    def test_no_module_imports_itself_back(self) -> None:
        """The package has no import circle."""
        found = circles()
        assert not found, "import circles:\n" + "\n\n".join("\n".join(c) for c in found)

    def test_a_circle_through_a_function_and_type_checking_is_found(self, tmp_path: Path) -> None:
        """A circle closed by an import inside a function and one under TYPE_CHECKING, across
        three modules of one package, is found and named by its imports."""
        root = tmp_path / "fairlimit"
        (root / "core").mkdir(parents=True)
        (root / "__init__.py").write_text("")
        (root / "core" / "__init__.py").write_text("")
        (root / "core" / "a.py").write_text("from fairlimit.core.b import B\n")
        (root / "core" / "b.py").write_text("def f():\n    from . import c\n")
        (root / "core" / "c.py").write_text(
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"
        )
        (root / "core" / "d.py").write_text("from fairlimit.core import a, b\n")
        assert circles(root) == [[
            "core/a.py:1 imports fairlimit.core.b",
            "core/b.py:2 imports fairlimit.core.c",
            "core/c.py:3 imports fairlimit.core.a",
        ]]  # fmt: skip


LONGEST_CLASS = 250  # lines: a class past it holds several ideas (docs/architecture.md)
# Classes allowed past it for now, each with why; an entry goes once its class is split.
LONG_CLASSES: dict[str, str] = {}


def _class_lengths() -> dict[str, int]:
    """Each class of the package (nested ones too) -> its length in lines."""
    lengths = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                lengths[f"{path.relative_to(PACKAGE)}:{node.name}"] = length
    return lengths


class TestClassSizes:
    def test_no_class_is_longer_than_the_limit(self) -> None:
        """No class is over LONGEST_CLASS lines, but those LONG_CLASSES says why."""
        long = {c: n for c, n in _class_lengths().items() if n > LONGEST_CLASS}
        unexplained = [f"{c}: {n} lines" for c, n in sorted(long.items()) if c not in LONG_CLASSES]
        assert not unexplained, "\n".join(unexplained)

    def test_every_long_class_listed_still_is(self) -> None:
        """An entry of LONG_CLASSES goes once its class is split (or gone)."""
        lengths = _class_lengths()
        stale = [c for c in LONG_CLASSES if lengths.get(c, 0) <= LONGEST_CLASS]
        assert not stale, f"no longer over {LONGEST_CLASS} lines: {stale}"


REPOSITORY = PACKAGE.parents[1]
OUTSIDE = ("DESIGN.md", "STYLE.md", "../shared")  # the team's notes beside the repository
SKIPPED = {".git", ".venv", ".tools", "node_modules", "site", "__pycache__", ".pytest_cache"}


def _text_files(root: Path) -> list[Path]:
    found = []
    for path in root.iterdir():
        if path.name in SKIPPED or path.name.startswith(".mypy"):
            continue
        if path.is_dir():
            found += _text_files(path)
        elif path.suffix in {".py", ".md", ".yaml", ".yml", ".lua", ".sh", ".toml", ".json"}:
            found.append(path)
    return found


class TestSelfContained:
    def test_nothing_cites_a_file_outside_the_repository(self) -> None:
        """The design the code and tests cite is in docs/: a reader of the repository has
        nothing else (docs/semantics.md, docs/architecture.md, docs/fairness.md)."""
        cited = [
            f"{path.relative_to(REPOSITORY)}:{number}: {line.strip()}"
            for path in _text_files(REPOSITORY)
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
            if any(name in line for name in OUTSIDE) and path.name != "test_structure.py"
        ]
        assert not cited, "\n".join(cited)
