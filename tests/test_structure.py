"""The layering of STYLE.md, read from the imports."""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "server" / "fairlimit"
STDLIB_ONLY = "core"
OWNERS = {
    "grpc": ("grpc_api",),
    "grpc_health": ("grpc_api",),
    "grpc_reflection": ("grpc_api",),
    "redis": ("store",),
    "fairlimit._proto": ("grpc_api",),
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _modules() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if "_proto" not in p.parts]


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

    @pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
    def test_wire_and_backend_libraries_stay_with_their_owners(self, path: Path) -> None:
        """grpc, the generated code and redis are imported only by their owning package."""
        where = path.relative_to(PACKAGE).parts[0]
        for name in _imports(path):
            for lib, owners in OWNERS.items():
                if name == lib or name.startswith(lib + "."):
                    assert where in owners, f"{path.relative_to(PACKAGE)} imports {name}"
