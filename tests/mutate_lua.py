"""Mutation testing of the Redis store's Lua scripts (server/fairlimit/store/redis/lua/).

mutmut mutates Python only; this plants one small bug at a time in a .lua file and runs the
Redis tests that go through that script. A mutant is a modified copy of the file, loaded by
the normal path (store/redis/script.py reads the package's lua/ folder and prepends
clock.lua and the generated contract): the admit script is kept as parts (lua/admit/*.lua,
joined by script.py), and each part is a script here, named admit/<part>; "admit" on the
command line stands for all of them. The sources, tests and their data are copied to a
work folder, the mutant is written there, and the tests run against that copy. The
repository's own scripts are never written, so an interrupted run leaves nothing behind.

    python tests/mutate_lua.py run                     # every script, every mutant
    python tests/mutate_lua.py run acquire demand      # some scripts
    python tests/mutate_lua.py run admit --sample 120 --seed 29 --budget 40
    python tests/mutate_lua.py run clock --again       # the survivors, after a new test
    python tests/mutate_lua.py run admit --mutant admit/decide:24:0:line  # one again
    python tests/mutate_lua.py list admit              # the mutants, without running them
    python tests/mutate_lua.py results                 # the figures per script (markdown)
    python tests/mutate_lua.py results --survivors     # and each surviving mutant
    python tests/mutate_lua.py show admit/verdict:13:12:cmp   # one mutant, before and after
    python tests/mutate_lua.py run --changed-since main    # what changed since main
    python tests/mutate_lua.py list --changed-since main   # ... without running them
    python tests/mutate_lua.py results --changed-since main    # ... their figures
    python tests/mutate_lua.py run admit --per-function 3 --seed 43  # every function, 3 each

Operators, one at a time, in code (never in comments or string literals): a comparison
changed (``<`` and ``<=``, ``>`` and ``>=`` swapped, ``==`` and ``~=`` swapped), a binary
``+``/``-`` swapped, ``*``/``/`` swapped, a unit changed (a literal 1000, 60000 or 1000000
divided by 1000: milliseconds taken for seconds), ``and``/``or`` swapped, and a line of code
removed. A mutant Redis cannot compile (SCRIPT LOAD refuses it; a removed ``end``, say) is
counted as "does not load", the way mutmut counts a mutant mypy refuses: it could never pass
a test. Each mutant runs its script's test files (TESTS below) with ``-x``, ``-m "not
process"``, ``-k "redis and not mutation_config"`` and the derandomized ``mutation``
Hypothesis profile, under ``nice``, with a timeout of three times the unmutated run: exit 0
is a survivor, a failure a kill, the timeout a timeout (detected). Verdicts persist in
``.mutmut-lua/results.json`` (git-ignored), keyed by the mutant and the script's text, so a
second run resumes, a changed script is tried again, and ``--again`` tries the survivors
again (after a test was added). ``--sample N`` tries N mutants of each script drawn with
``--seed`` (the same draw every time); ``--budget MINUTES`` stops starting mutants after
that long (the rest stay "not checked"). ``--per-function N`` draws N of each function's
mutants instead (and N of the code outside functions), so a sample covers every function.
``--changed-since REF`` keeps the mutants of the scripts changed since the git ref REF
(``git diff REF``, the work tree included): those in a function with a changed line, and
those on a changed line outside functions. Needs ``redis-server``.
"""

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LUA = Path("server/fairlimit/store/redis/lua")
RESULTS = ROOT / ".mutmut-lua" / "results.json"
COPIED = ("server", "tests", "descriptors", "examples", "pyproject.toml")

# The tests each script's mutants run, fastest and closest to the script first (-x stops at
# the first failure, so a killed mutant costs little). clock.lua is prepended to every
# script: its mutants run every script's tests.
_RATES = (
    "tests/store/test_redis_script.py",
    "tests/limiter/test_limits.py",
    "tests/store/test_redis.py",
    "tests/store/test_redis_lease.py",
    "tests/core/test_admission.py",
    "tests/limiter/test_fair_share_invariants.py",
    "tests/limiter/test_charge_when_over_limit.py",
    "tests/limiter/test_all_or_nothing.py",
    "tests/quota/test_quota_service.py",
    "tests/telemetry/test_telemetry.py",
    "tests/limiter/test_upstream_keys.py",
    "tests/limiter/test_fairness_scenarios.py",
    "tests/simulate/test_fairness_cases.py",
    "tests/store/test_backend_parity.py",
)
_SLOTS = (
    "tests/store/test_redis_script.py",
    "tests/store/test_redis.py",
    "tests/limiter/test_concurrency_invariants.py",
    "tests/telemetry/test_telemetry.py",
    "tests/store/test_redis_slots_at_scale.py",
)
# settle.lua (token budgets): the reservation and settlement suites on every backend
_SETTLE = (
    "tests/limiter/test_tokens.py",
    "tests/limiter/test_tokens_fairness.py",
)
_DEMAND = (
    "tests/store/test_redis.py",
    "tests/quota/test_quota_peers.py",
    "tests/quota/test_quota_service.py",
    "tests/quota/test_rlqs_inputs.py",
)
# prune.lua (stale client rows dropped after a division): the division tests on Redis
_PRUNE = ("tests/store/test_redis_division.py",)
# read_rows.lua (a division's rows, 32 a call): the division tests, which compare its rows
# with an HMGET's and the division made with every row's, and the commands a division sends
_READ_ROWS = ("tests/store/test_redis_division.py", "tests/store/test_redis_limits_cost.py")
# The parts of the admit script (lua/admit/, joined by store/redis/script.py), each a script
# here: admit/<part>.
ADMIT_PARTS = tuple(sorted(f"admit/{p.stem}" for p in (ROOT / LUA / "admit").glob("*.lua")))
TESTS: dict[str, tuple[str, ...]] = {
    **{part: _RATES for part in ADMIT_PARTS},
    "release": _RATES,
    "acquire": _SLOTS,
    "release_slot": _SLOTS,
    "demand": _DEMAND,
    "settle": _SETTLE,
    "row_at": tuple(dict.fromkeys(_RATES + _SETTLE)),  # release.lua's and settle.lua's
    "prune": _PRUNE,
    "read_rows": _READ_ROWS,
    "clock": tuple(dict.fromkeys(_SLOTS + _DEMAND + _RATES + _SETTLE + _PRUNE)),
}
# The slowest test of the rate suites runs a three-master cluster through a long Hypothesis
# search (38 s unmutated); its standalone twin runs the same scripts.
DESELECT = (
    "tests/store/test_backend_parity.py::TestBackendParity::test_memory_and_redis_cluster_agree",
)
PYTEST_ARGS = (
    *("-x", "-q", "-p", "no:cacheprovider", "-m", "not process"),
    *("-k", "redis and not mutation_config", "--hypothesis-profile=mutation"),
)


@dataclass(frozen=True, slots=True)
class Mutant:
    script: str
    line: int  # 1-based
    col: int  # 0-based, into the line
    op: str  # cmp, arith, mul, unit, logic, line
    old: str
    new: str

    @property
    def name(self) -> str:
        return f"{self.script}:{self.line}:{self.col}:{self.op}"

    def apply(self, text: str) -> str:
        lines = text.split("\n")
        row = lines[self.line - 1]
        assert row[self.col : self.col + len(self.old)] == self.old, (self.name, row)
        lines[self.line - 1] = row[: self.col] + self.new + row[self.col + len(self.old) :]
        return "\n".join(lines)


# --- finding mutants ---------------------------------------------------------------------

_TOKEN = re.compile(
    r"""(?P<comment>--[^\n]*)
      | (?P<string>'(?:\\.|[^'\\\n])*'|"(?:\\.|[^"\\\n])*")
      | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
      | (?P<name>[A-Za-z_][A-Za-z_0-9]*)
      | (?P<op>\.\.\.|\.\.|==|~=|<=|>=|[-+*/%^#<>=(){}\[\];:,.])
      | (?P<space>\s+)
    """,
    re.VERBOSE,
)
_SWAP = {
    "<": ("cmp", "<="), "<=": ("cmp", "<"), ">": ("cmp", ">="), ">=": ("cmp", ">"),
    "==": ("cmp", "~="), "~=": ("cmp", "=="), "+": ("arith", "-"), "-": ("arith", "+"),
    "*": ("mul", "/"), "/": ("mul", "*"),
}  # fmt: skip
_UNITS = {"1000": "1", "60000": "60", "1000000": "1000"}
# A token after which + or - is binary: a value just ended.
_VALUE_END = ("number", "name", "string")
_NOT_VALUES = {"and", "or", "not", "return", "then", "do", "else", "elseif", "if", "while",
               "until", "local", "in", "for"}  # fmt: skip


def _tokens(line: str) -> Iterator[tuple[str, str, int]]:
    at = 0
    while at < len(line):
        m = _TOKEN.match(line, at)
        if m is None:
            raise ValueError(f"cannot read Lua at column {at}: {line!r}")
        kind = m.lastgroup
        assert kind is not None
        if kind != "space":
            yield kind, m.group(), at
        at = m.end()


def mutants(script: str, text: str) -> list[Mutant]:
    """Every mutant of ``script`` (its text ``text``), in file order."""
    found: list[Mutant] = []
    for number, line in enumerate(text.split("\n"), start=1):
        code = [t for t in _tokens(line) if t[0] != "comment"]
        if not code:
            continue
        previous: tuple[str, str] | None = None
        for kind, value, col in code:
            if kind == "op" and value in _SWAP:
                op, new = _SWAP[value]
                binary = previous is not None and (
                    (previous[0] in _VALUE_END and previous[1] not in _NOT_VALUES)
                    or previous[1] in (")", "]", "}")
                )
                if op != "arith" or binary:
                    found.append(Mutant(script, number, col, op, value, new))
            elif kind == "number" and value in _UNITS:
                found.append(Mutant(script, number, col, "unit", value, _UNITS[value]))
            elif kind == "name" and value in ("and", "or"):
                new = "or" if value == "and" else "and"
                found.append(Mutant(script, number, col, "logic", value, new))
            previous = (kind, value)
        found.append(Mutant(script, number, 0, "line", line, ""))
    return found


def functions(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, last line) of each function of a script: the scripts define them
    at the start of a line, and end them with the first ``end`` at the start of a line."""
    found: list[tuple[str, int, int]] = []
    lines = text.split("\n")
    for number, line in enumerate(lines, start=1):
        head = _FUNCTION.match(line)
        if head:
            last = next(n for n in range(number + 1, len(lines) + 1)
                        if lines[n - 1].rstrip() == "end")  # fmt: skip
            found.append((head[1], number, last))
    return found


_FUNCTION = re.compile(r"^(?:local\s+)?function\s+([A-Za-z_][\w.:]*)")


def part_of(m: Mutant, spans: list[tuple[str, int, int]]) -> str:
    """The function a mutant is in ("" outside functions)."""
    return next((name for name, first, last in spans if first <= m.line <= last), "")


def changed(script: str, text: str, lines: set[int]) -> list[Mutant]:
    """The mutants of the functions ``lines`` touch, and those on ``lines`` outside
    functions."""
    spans = functions(text)
    touched = {part_of(Mutant(script, n, 0, "", "", ""), spans) for n in lines}
    return [m for m in mutants(script, text)
            if (part_of(m, spans) or None) in touched or m.line in lines]  # fmt: skip


def named(folder: Path) -> dict[str, Path]:
    """The scripts in a lua/ folder by name: <stem> for lua/<stem>.lua, <dir>/<stem> for the
    parts lua/<dir>/<stem>.lua of a script kept as parts."""
    found = [*folder.glob("*.lua"), *folder.glob("*/*.lua")]
    return {p.relative_to(folder).with_suffix("").as_posix(): p for p in found}


def scripts() -> list[str]:
    return sorted(named(ROOT / LUA))


def expand(names: Sequence[str]) -> list[str]:
    """Script names as given on the command line: a script kept as parts ("admit") stands for
    each of its parts."""
    known = scripts()
    found: list[str] = []
    for name in names:
        found += [name] if name in known else [n for n in known if n.startswith(f"{name}/")]
    return found


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --- verdicts ----------------------------------------------------------------------------


def _load_results() -> dict[str, dict[str, str]]:
    if RESULTS.exists():
        found: dict[str, dict[str, str]] = json.loads(RESULTS.read_text())
        return found
    return {}


def _save_results(results: dict[str, dict[str, str]]) -> None:
    RESULTS.parent.mkdir(exist_ok=True)
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True))
    tmp.replace(RESULTS)


def _key(m: Mutant, digest: str) -> str:
    return f"{m.name}@{digest}"


Choose = Callable[[str, str], list[Mutant]]  # (script, its text) -> the mutants to try


def chooser(
    sample: int | None, seed: int, per_function: int | None = None, since: str | None = None
) -> Choose:
    """The mutants a run (list, results) is about: every one, a sample of them, or those
    changed since a git ref."""
    lines = None
    if since is not None:
        from mutation_changes import changed_lines

        found = changed_lines(since, [str(LUA)], ROOT).items()
        lines = {Path(p).relative_to(LUA).with_suffix("").as_posix(): n for p, n in found}

    def choose(script: str, text: str) -> list[Mutant]:
        if lines is not None:
            return changed(script, text, lines[script]) if script in lines else []
        return _chosen(script, text, sample, seed, per_function)

    return choose


def _chosen(
    script: str, text: str, sample: int | None, seed: int, per_function: int | None
) -> list[Mutant]:
    found = mutants(script, text)
    if per_function is not None:
        spans = functions(text)
        parts: dict[str, list[Mutant]] = {}
        for m in found:
            parts.setdefault(part_of(m, spans), []).append(m)
        kept = set()
        for name, each in parts.items():
            draw = random.Random(f"{seed}:{script}:{name}")
            kept.update(m.name for m in draw.sample(each, min(per_function, len(each))))
        return [m for m in found if m.name in kept]
    if sample is None or sample >= len(found):
        return found
    drawn = random.Random(f"{seed}:{script}").sample(range(len(found)), sample)
    return [found[i] for i in sorted(drawn)]


# --- running -----------------------------------------------------------------------------


def registered(texts: Mapping[str, str], script: str, text: str) -> str:
    """The source Redis is given for ``script`` with ``text`` as its file, the other files
    as ``texts`` holds them: clock.lua, the generated contract, then the script, as
    script.source builds it (clock.lua's mutants go before the admit script; a part's
    mutant is joined with the script's other parts)."""
    sys.path.insert(0, str(ROOT / "server"))
    from fairlimit.store.redis.script import PARTS, contract, join

    def body(name: str) -> str:
        return text if name == script else texts[name]

    target = "admit" if script == "clock" else script.split("/")[0]
    parts = PARTS.get(target)
    whole = join([body(f"{target}/{part}") for part in parts]) if parts else body(target)
    return body("clock") + contract() + whole


class Workspace:
    """A copy of the sources and tests in a temporary folder, and a redis-server to ask
    whether a mutant compiles; both go away on close (also when interrupted)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="mutate-lua-"))
        ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc")
        for name in COPIED:
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, self.root / name, ignore=ignore, symlinks=True)
            else:
                shutil.copy2(source, self.root / name)
        sys.path.insert(0, str(ROOT / "tests" / "support"))
        from redis_servers import RedisProcess

        self._redis = RedisProcess(self.root / "redis-check").start()
        # the scripts as copied: what every mutant starts from (the repository's files may
        # change while a run goes on; the run judges the copy it started with)
        self.texts = {name: p.read_text() for name, p in named(self.root / LUA).items()}

    def write(self, script: str, text: str) -> None:
        (self.root / LUA / f"{script}.lua").write_text(text)

    def loads(self, script: str, text: str) -> bool:
        """Whether Redis compiles the registered source of ``script`` with ``text`` as its
        file (``registered``)."""
        with self._redis.client() as client:
            try:
                client.script_load(registered(self.texts, script, text))
            except Exception:  # redis.ResponseError: the compile error
                return False
        return True

    def run(self, tests: Sequence[str], timeout: float | None) -> tuple[str, float]:
        """pytest over ``tests`` in the copy: (killed | survived | timeout | error, seconds)."""
        args = [sys.executable, "-m", "pytest", *PYTEST_ARGS, *tests]
        for test in DESELECT:
            if test.split("::")[0] in tests:
                args += ["--deselect", test]
        env = {**os.environ, "PYTHONPATH": str(self.root / "server")}
        started = time.monotonic()
        child = subprocess.Popen(
            ["nice", "-n", "15", *args], cwd=self.root, env=env, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            self._stop(child)
            return "timeout", time.monotonic() - started
        except BaseException:
            self._stop(child)
            raise
        seconds = time.monotonic() - started
        verdict = {0: "survived", 1: "killed"}.get(code, "error")
        return verdict, seconds

    @staticmethod
    def _stop(child: "subprocess.Popen[bytes]") -> None:
        """End the test run and the redis-servers it started (its own process group)."""
        try:
            os.killpg(child.pid, signal.SIGTERM)
            child.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        except ProcessLookupError:
            pass

    def close(self) -> None:
        self._redis.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def _interrupted(signum: int, frame: object) -> None:
    """SIGTERM (and SIGINT, which a shell's background job ignores) end a run as Ctrl-C
    does: through the ``finally`` that stops the tests' servers and removes the copy."""
    raise KeyboardInterrupt


def run(
    names: Sequence[str], choose: Choose, budget: float | None, again: bool,
    only: Sequence[str] = (),
) -> None:  # fmt: skip
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _interrupted)
    results = _load_results()
    deadline = None if budget is None else time.monotonic() + budget * 60
    space = Workspace()
    try:
        for script in names:
            text = space.texts[script]
            digest = _digest(text)
            todo = [m for m in choose(script, text)
                    if _key(m, digest) not in results
                    or (again and results[_key(m, digest)]["verdict"] == "survived")]  # fmt: skip
            if only:
                todo = [m for m in mutants(script, text) if m.name in only]
            if not todo:
                continue
            tests = TESTS[script]
            verdict, seconds = space.run(tests, None)
            if verdict != "survived":
                raise SystemExit(f"{script}: the unmutated tests do not pass ({verdict})")
            timeout = 3 * seconds + 30
            print(f"{script}: {len(todo)} mutants to run, unmutated {seconds:.0f} s", flush=True)
            for m in todo:
                if deadline is not None and time.monotonic() > deadline:
                    print("time budget spent", flush=True)
                    return
                mutated = m.apply(text)
                if not space.loads(script, mutated):
                    verdict, seconds = "does not load", 0.0
                else:
                    space.write(script, mutated)
                    try:
                        verdict, seconds = space.run(tests, timeout)
                    finally:
                        space.write(script, text)
                results[_key(m, digest)] = {"verdict": verdict, "seconds": f"{seconds:.1f}"}
                _save_results(results)
                print(f"{m.name} {verdict} {seconds:.0f} s", flush=True)
    finally:
        space.close()


# --- reporting ---------------------------------------------------------------------------

COLUMNS = ("does not load", "killed", "timeout", "survived", "error", "not checked")


def tally(survivors: bool, choose: Choose | None = None) -> None:
    """The figures per script of the scripts as they are now ("tried": mutants judged);
    of those ``choose`` picks, if given."""
    results = _load_results()
    rows = ["| script | mutants | tried | " + " | ".join(COLUMNS) + " |",
            "| --- |" + " ---: |" * (len(COLUMNS) + 2)]  # fmt: skip
    total: Counter[str] = Counter()
    lost: list[Mutant] = []
    for script in scripts():
        text = (ROOT / LUA / f"{script}.lua").read_text()
        digest = _digest(text)
        every = mutants(script, text) if choose is None else choose(script, text)
        if not every:
            continue
        counts: Counter[str] = Counter()
        for m in every:
            found = results.get(_key(m, digest))
            counts[found["verdict"] if found else "not checked"] += 1
            if found and found["verdict"] == "survived":
                lost.append(m)
        counts["mutants"] = len(every)
        counts["tried"] = len(every) - counts["not checked"]
        total.update(counts)
        cells = [str(counts[c]) for c in ("mutants", "tried", *COLUMNS)]
        rows.append(f"| {script}.lua | " + " | ".join(cells) + " |")
    cells = [str(total[c]) for c in ("mutants", "tried", *COLUMNS)]
    rows.append("| **total** | " + " | ".join(cells) + " |")
    print("\n".join(rows))
    ran = total["killed"] + total["timeout"] + total["survived"]
    if ran:
        print(f"\nsurvived {total['survived']} of {ran} run ({total['survived'] / ran:.1%})")
    if survivors:
        for m in lost:
            print(f"{m.name}: {m.old.strip()!r} -> {m.new.strip()!r}")


def show(name: str) -> None:
    script = name.split(":")[0]
    text = (ROOT / LUA / f"{script}.lua").read_text()
    for m in mutants(script, text):
        if m.name == name:
            before, after = text.split("\n"), m.apply(text).split("\n")
            print(f"- {before[m.line - 1]}\n+ {after[m.line - 1]}")
            return
    raise SystemExit(f"no mutant {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("run", "list", "results", "show"))
    parser.add_argument("names", nargs="*", help="scripts (run, list) or a mutant (show)")
    parser.add_argument("--sample", type=int, help="mutants per script, drawn by --seed")
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--budget", type=float, help="minutes after which no mutant starts")
    parser.add_argument("--survivors", action="store_true", help="results: list survivors")
    parser.add_argument("--again", action="store_true", help="run: try the survivors again")
    parser.add_argument("--mutant", action="append", default=[], help="run: only this one")
    parser.add_argument(
        "--per-function",
        type=int,
        metavar="N",
        help="N mutants of each function (and of the code outside them)",
    )
    parser.add_argument(
        "--changed-since", metavar="REF", help="the mutants of what changed since the git ref REF"
    )
    args = parser.parse_args()
    if args.command == "show":
        show(args.names[0])
        return
    choose = chooser(args.sample, args.seed, args.per_function, args.changed_since)
    if args.command == "results":
        tally(args.survivors, choose if args.changed_since or args.per_function else None)
        return
    names = expand(args.names) if args.names else scripts()
    unknown = {name for name in args.names if not expand([name])}
    if unknown:
        raise SystemExit(f"no such script: {sorted(unknown)}")
    if args.command == "list":
        for script in names:
            text = (ROOT / LUA / f"{script}.lua").read_text()
            for m in choose(script, text):
                print(f"{m.name}: {m.old.strip()!r} -> {m.new.strip()!r}")
        return
    run(names, choose, args.budget, args.again, args.mutant)


if __name__ == "__main__":
    main()
