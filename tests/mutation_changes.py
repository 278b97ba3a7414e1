"""What changed since a git ref, as the mutation tools name it (docs/mutation.md).

    python tests/mutation_changes.py mutmut REF           # mutmut's names of the changed functions
    python tests/mutation_changes.py mutmut REF --redis   # ... in the Redis store's run
    python tests/mutation_changes.py lines REF            # changed lines per file

A change is what ``git diff REF`` shows against the work tree (uncommitted edits included),
and files git does not track yet, whole. mutmut mutates functions and the methods of
classes, and names each mutant after its module and function (``fairlimit.core.plan.
x__descriptor_plan__mutmut_3``, ``fairlimit.store.memory.xǁMemoryStoreǁadmit__mutmut_27``):
a function is changed when a changed line (its decorators included) is in it, and its
pattern (``...x__descriptor_plan__mutmut_*``) is what ``tests/mutate.sh --changed-since``
hands to ``mutmut run``. Only the files ``[tool.mutmut] only_mutate`` names are kept, less
those the Redis store's run mutates (``mutation_tally.redis_config``: their mutants reach no
test of the memory run); with ``--redis``, only those. tests/mutate_lua.py reads the Lua
scripts' changed lines from here too.
"""

import argparse
import ast
import fnmatch
import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEPARATOR = "ǁ"  # mutmut's between a class and its method (mutmut.mutation.trampoline_templates)
DIFF = ("diff", "-U0", "--no-color", "--no-ext-diff", "--src-prefix=a/", "--dst-prefix=b/")
_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@")


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def changed_lines(ref: str, paths: list[str], root: Path = ROOT) -> dict[str, set[int]]:
    """The lines (1-based, of the file as it is now) changed since ``ref`` in each file
    under ``paths``, by path from the repository's root; a deletion marks the lines on
    either side of it. New untracked files count whole."""
    changed: dict[str, set[int]] = {}
    current: set[int] | None = None
    for line in _git(root, *DIFF, ref, "--", *paths).splitlines():
        if line.startswith("+++ "):
            name = line[4:]
            current = None if name == "/dev/null" else changed.setdefault(name[2:], set())
            continue
        hunk = _HUNK.match(line)
        if hunk and current is not None:
            start, count = int(hunk[1]), 1 if hunk[2] is None else int(hunk[2])
            current.update(range(start, start + count) if count else (start, start + 1))
    untracked = _git(root, "ls-files", "--others", "--exclude-standard", "--", *paths)
    for name in untracked.splitlines():
        text = (root / name).read_text(errors="replace")
        changed[name] = set(range(1, text.count("\n") + 2))
    return {name: lines for name, lines in changed.items() if lines}


def functions(source: str) -> list[tuple[str, int, int]]:
    """(mutmut's name for it, first line, last line) of each function and method."""
    found: list[tuple[str, int, int]] = []

    def span(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[int, int]:
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        return first, node.end_lineno or node.lineno

    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.append((f"x_{node.name}", *span(node)))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    name = f"x{SEPARATOR}{node.name}{SEPARATOR}{item.name}"
                    found.append((name, *span(item)))
    return found


def only_mutate(redis: bool) -> list[str]:
    """The files mutmut mutates (pyproject's, or the Redis store's run's), as repository
    paths: mutmut sees server/ as src/ (tests/mutate.sh)."""
    text = (ROOT / "pyproject.toml").read_text()
    if redis:
        from mutation_tally import redis_config

        text = redis_config(text)
    patterns: list[str] = tomllib.loads(text)["tool"]["mutmut"]["only_mutate"]
    return ["server/" + p.removeprefix("src/") for p in patterns]


def mutmut_names(ref: str, redis: bool = False, root: Path = ROOT) -> list[str]:
    """mutmut's name patterns for the functions changed since ``ref`` in the files it
    mutates, in file order."""
    kept = only_mutate(redis)
    # the memory run leaves to the Redis store's run what only its tests reach
    left = () if redis else only_mutate(redis=True)
    names: list[str] = []
    for path, lines in changed_lines(ref, ["server/fairlimit"], root).items():
        if not path.endswith(".py") or not any(fnmatch.fnmatch(path, p) for p in kept):
            continue
        if any(fnmatch.fnmatch(path, p) for p in left):
            continue
        module = path.removeprefix("server/").removesuffix(".py").replace("/", ".")
        for name, first, last in functions((root / path).read_text()):
            if any(first <= n <= last for n in lines):
                names.append(f"{module}.{name}__mutmut_*")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("mutmut", "lines"))
    parser.add_argument("ref", help="a git ref: what changed since it (work tree included)")
    parser.add_argument("--redis", action="store_true", help="the Redis store's run")
    args = parser.parse_args()
    if args.what == "mutmut":
        print("\n".join(mutmut_names(args.ref, args.redis)))
        return
    for path, lines in sorted(changed_lines(args.ref, ["server/fairlimit"]).items()):
        print(f"{path}: {' '.join(map(str, sorted(lines)))}")


if __name__ == "__main__":
    main()
