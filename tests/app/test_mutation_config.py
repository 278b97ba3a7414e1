"""The mutation-testing setup (pyproject [tool.mutmut], tests/mutate.sh) names what exists.

mutmut itself is not a test dependency (a run takes an hour); these checks keep its
configuration from drifting silently away from the layout it mutates and the tests it runs.
"""

import fnmatch
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

import mutation_tally
from helpers import ROOT

pytestmark = pytest.mark.unit

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MUTMUT: dict[str, Any] = PYPROJECT["tool"]["mutmut"]
SCRIPT = (ROOT / "tests" / "mutate.sh").read_text()


LUA = Path("server/fairlimit/store/redis/lua")


def mutate_lua_scripts() -> list[str]:
    import mutate_lua

    return list(mutate_lua.scripts())


def _server_path(path: str) -> str:
    """A path as mutmut sees it (tests/mutate.sh links src/ to server/) in the repository."""
    assert path.startswith("src/"), path
    return "server/" + path.removeprefix("src/")


def _cli_value(flag: str) -> str:
    args: list[str] = MUTMUT["pytest_add_cli_args"]
    return args[args.index(flag) + 1]


class TestWhatIsMutated:
    def test_the_sources_are_the_fairlimit_package(self) -> None:
        """source_paths is server/fairlimit seen through the src/ link the script makes."""
        assert [_server_path(p) for p in MUTMUT["source_paths"]] == ["server/fairlimit"]
        assert 'ln -sfn "$root/server" "$work/src"' in SCRIPT

    def test_core_config_store_policy_and_quota_each_have_modules_to_mutate(self) -> None:
        """Every only_mutate pattern matches Python files in the repository (policy/: the
        local limits of --failure-mode local, mutated since they lived in store/)."""
        files = [str(p.relative_to(ROOT)) for p in (ROOT / "server").rglob("*.py")]
        for pattern in MUTMUT["only_mutate"]:
            assert fnmatch.filter(files, _server_path(pattern)), pattern
        packages = {_server_path(p).split("/")[2] for p in MUTMUT["only_mutate"]}
        assert packages == {"core", "config", "store", "policy", "quota"}


class TestHowMutantsRun:
    def test_copied_files_exist_and_are_linked(self) -> None:
        """Each also_copy entry exists, and the script links it into .mutmut/."""
        for name in MUTMUT["also_copy"]:
            assert (ROOT / name).exists(), name
            assert name in SCRIPT.split("for name in ", 1)[1].split(";", 1)[0], name

    def test_markers_named_are_declared(self) -> None:
        """The -m expression names only markers pyproject declares (--strict-markers)."""
        declared = {m.split(":")[0] for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
        words = set(_cli_value("-m").replace("(", " ").replace(")", " ").split())
        assert words - {"not", "and", "or"} <= declared

    def test_the_hypothesis_profile_is_registered(self) -> None:
        """--hypothesis-profile names a profile conftest registers, derandomized."""
        flag = next(a for a in MUTMUT["pytest_add_cli_args"] if a.startswith("--hypothesis"))
        profile = settings.get_profile(flag.partition("=")[2])
        assert profile.derandomize
        assert profile.database is None

    def test_no_process_or_redis_tests_in_a_mutant(self) -> None:
        """Mutants run in one process (no xdist), on the memory backend, without child processes."""
        assert _cli_value("-m") == "not process"
        assert _cli_value("-k") == "not redis"
        assert "-n" not in MUTMUT["pytest_add_cli_args"]


class TestTheRedisStoresRun:
    def test_it_changes_only_what_is_mutated_and_which_tests_run(self) -> None:
        """mutate.sh --redis reads pyproject with two settings changed: store/redis/ and
        core/lease.py are mutated, and each mutant runs the tests with "redis" in their id."""
        text = (ROOT / "pyproject.toml").read_text()
        changed = tomllib.loads(mutation_tally.redis_config(text))
        redis: dict[str, Any] = changed["tool"]["mutmut"]
        assert redis["only_mutate"] == [
            "src/fairlimit/store/redis/*",
            "src/fairlimit/core/lease.py",
        ]
        args: list[str] = redis["pytest_add_cli_args"]
        assert args[args.index("-k") + 1] == "redis and not mutation_config"
        args[args.index("-k") + 1] = "not redis"
        changed["tool"]["mutmut"] = {**redis, "only_mutate": MUTMUT["only_mutate"]}
        assert changed == PYPROJECT
        assert "--redis" in SCRIPT and "--redis-config" in SCRIPT


class TestTheLuaRunner:
    """tests/mutate_lua.py: every script has its tests, and a mutant changes code only."""

    def test_every_script_names_test_files_that_exist(self) -> None:
        import mutate_lua

        assert set(mutate_lua.TESTS) == set(mutate_lua.scripts())
        for script, files in mutate_lua.TESTS.items():
            assert files, script
            for name in files:
                assert (ROOT / name).is_file(), (script, name)
        for test in mutate_lua.DESELECT:
            assert (ROOT / test.split("::")[0]).is_file(), test

    @pytest.mark.process
    def test_its_work_folder_starts_and_goes_away(self) -> None:
        """Run as `python tests/mutate_lua.py`, the runner finds the suite's Redis helpers
        in tests/support (their move once stopped every run before its first mutant),
        copies what the tests read, and leaves nothing behind."""
        from redis_servers import require_redis

        require_redis()
        program = (
            "import runpy, sys; sys.argv = ['tests/mutate_lua.py'];"
            "lua = runpy.run_path('tests/mutate_lua.py', run_name='mutate_lua');"
            "w = lua['Workspace'](); print(w.root, sorted(w.texts)); w.close()"
        )
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        root, scripts = done.stdout.split(" ", 1)
        assert scripts.strip() == str(sorted(mutate_lua_scripts()))
        assert not Path(root).exists()

    def test_a_part_is_judged_in_the_script_it_is_joined_into(self) -> None:
        """Each part of the admit script (lua/admit/) is a script of the runner, and its
        mutant is compiled as the whole admit script with it in its place: unmutated, what
        Redis is given is script.source("admit") itself; a mutant of a part changes that
        text at that part only, and a mutant of clock.lua goes before the admit script."""
        import mutate_lua
        from fairlimit.store.redis import script

        texts = {name: path.read_text() for name, path in mutate_lua.named(ROOT / LUA).items()}
        parts = [f"admit/{part}" for part in script.PARTS["admit"]]
        assert [name for name in mutate_lua.scripts() if name.startswith("admit")] == sorted(parts)
        assert mutate_lua.expand(["admit", "clock"]) == [*sorted(parts), "clock"]
        for name in (*parts, "clock"):
            assert mutate_lua.registered(texts, name, texts[name]) == script.source("admit")
        line = next(m for m in mutate_lua.mutants("admit/lease", texts["admit/lease"])
                    if m.op == "cmp")  # fmt: skip
        mutated = mutate_lua.registered(texts, "admit/lease", line.apply(texts["admit/lease"]))
        before, after = script.source("admit").split("\n"), mutated.split("\n")
        changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
        assert len(changed) == 1 and after[changed[0]].strip() == (
            line.apply(texts["admit/lease"]).split("\n")[line.line - 1].strip()
        )

    def test_mutants_leave_comments_strings_and_unary_minus_alone(self) -> None:
        import mutate_lua

        text = "local x = -a + b * 1000 -- a < b\nif s == 'a-b<c' and y then x = t[1] end"
        found = {(m.line, m.old, m.new) for m in mutate_lua.mutants("t", text)}
        assert found == {
            (1, "+", "-"), (1, "*", "/"), (1, "1000", "1"),
            (1, "local x = -a + b * 1000 -- a < b", ""),
            (2, "==", "~="), (2, "and", "or"),
            (2, "if s == 'a-b<c' and y then x = t[1] end", ""),
        }  # fmt: skip
        for m in mutate_lua.mutants("t", text):
            assert m.apply(text) != text


def _touch(path: Path, after: str) -> int:
    """Append a comment to the line after the first that starts with ``after`` (stripped):
    a one-line change. Returns that line's number."""
    lines = path.read_text().split("\n")
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(after)) + 1
    lines[at] += " -- touched" if path.suffix == ".lua" else "  # touched"
    path.write_text("\n".join(lines))
    return at + 1


@pytest.mark.process
class TestChangedSince:
    """--changed-since REF: the mutation tools run on a tiny change in a repository of their
    own (the tools, pyproject and a few sources, committed), as programs."""

    TOOLS = ("tests/mutate_lua.py", "tests/mutation_changes.py", "tests/mutation_tally.py")
    SOURCES = (
        "server/fairlimit/policy/local.py",
        "server/fairlimit/store/replicas.py",
        "server/fairlimit/core/lease.py",
    )

    @pytest.fixture
    def repo(self, tmp_path: Path) -> Path:
        lua = "server/fairlimit/store/redis/lua"
        for name in (*self.TOOLS, *self.SOURCES, "pyproject.toml"):
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text((ROOT / name).read_text())
        (tmp_path / lua).mkdir(parents=True)
        for script in (ROOT / lua).glob("*.lua"):
            (tmp_path / lua / script.name).write_text(script.read_text())
        git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
        for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "base"]):
            subprocess.run([*git, *args], cwd=tmp_path, check=True, capture_output=True)
        return tmp_path

    @staticmethod
    def _run(repo: Path, *args: str) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run([sys.executable, *args], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    def test_lua_mutants_of_the_changed_function_only(self, repo: Path) -> None:
        """One line of release.lua's add() changed: `list --changed-since HEAD` lists the
        mutants of add() and of no other function or script; `results` counts them."""
        import mutate_lua

        script = repo / "server/fairlimit/store/redis/lua/release.lua"
        line = _touch(script, "local function add(")
        text = script.read_text()
        (span,) = [s for s in mutate_lua.functions(text) if s[0] == "add"]
        listed = self._run(repo, "tests/mutate_lua.py", "list", "--changed-since", "HEAD")
        expected = [m for m in mutate_lua.mutants("release", text) if span[1] <= m.line <= span[2]]
        assert [row.split(": ")[0] for row in listed] == [m.name for m in expected]
        assert f"release:{line}:0:line" in [m.name for m in expected]
        shown = self._run(repo, "tests/mutate_lua.py", "results", "--changed-since", "HEAD")
        assert [row.split(" |")[0] for row in shown[2:4]] == ["| release.lua", "| **total**"]
        assert shown[2].split(" | ")[1:3] == [str(len(expected)), "0"]  # mutants, tried

    def test_mutmut_names_of_the_changed_functions_in_each_run(self, repo: Path) -> None:
        """A line changed in policy/local.py's _add(), in Replicas.place() and in lease.py's
        eligible(): the memory run's names are the first two (as mutmut spells them), the
        Redis store's run's the third (only its tests reach core/lease.py)."""
        _touch(repo / "server/fairlimit/policy/local.py", "def _add(")
        _touch(repo / "server/fairlimit/store/replicas.py", "n = max(self.configured")
        _touch(repo / "server/fairlimit/core/lease.py", "def eligible(")
        memory = self._run(repo, "tests/mutation_changes.py", "mutmut", "HEAD")
        redis = self._run(repo, "tests/mutation_changes.py", "mutmut", "HEAD", "--redis")
        assert memory == [
            "fairlimit.policy.local.x__add__mutmut_*",
            "fairlimit.store.replicas.xǁReplicasǁplace__mutmut_*",
        ]
        assert redis == ["fairlimit.core.lease.x_eligible__mutmut_*"]
        assert "mutmut run $names" in SCRIPT and "--changed-since" in SCRIPT

    def test_the_names_are_mutmuts(self) -> None:
        """mutation_changes names a function and a method as mutmut does (when installed)."""
        format_utils = pytest.importorskip("mutmut.utils.format_utils")
        import mutation_changes

        source = "def f():\n    pass\nclass C:\n    @property\n    def m(self):\n        pass\n"
        assert [name for name, _, _ in mutation_changes.functions(source)] == [
            format_utils.make_mutant_key("f"), format_utils.make_mutant_key("m", "C")
        ]  # fmt: skip
        assert mutation_changes.functions(source)[1][1:] == (4, 6)  # the decorator's line on
