"""The contract between store/redis/script.py and the Lua scripts, read from both sides: each
.lua file's opening comment and stride constants against the Python layouts, the argument
builders against the layouts' field names, the prelude generated from core/sharing.py
(constants, Row and Division fields), and the texts that cross the boundary (a given
division, a rows hash, the admit script's reply) parsed as the other side parses them, and the
admit script's parts (lua/admit/). No Redis needed."""

import itertools
import math
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fairlimit.core import sharing, smooth, units
from fairlimit.core.concurrency import split, taken
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import Plan
from fairlimit.core.plan import plan as make_plan
from fairlimit.core.sharing import (
    CALENDAR,
    DIVISION_FIELDS,
    LIGHT_FIELDS,
    ROW_FIELDS,
    WHOLE_FIELDS,
    Division,
    Row,
)
from fairlimit.store.redis import division, script, slots
from fairlimit.store.redis.keys import CAP_KINDS, SlotGroup, slot_groups
from fairlimit.store.redis.script import ADMIT, LAYOUTS, RELEASE, GivenDivision, Layout, Seen
from fairlimit.store.redis.slots import ACQUIRE, SLOT_LAYOUTS, SlotLayout
from fairness_cases import NESTED
from helpers import desc, load_text, req

pytestmark = pytest.mark.unit

CONFIG = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 20}
    fair_share: {active_clients: 4, weights: {heavy: 3}}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: route
    value: admin
    rate_limit: {unit: minute, requests_per_unit: 30}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limit: {unit: minute, requests_per_unit: 20}
  - key: user
    rate_limit: {unit: day, requests_per_unit: 3}
"""
_HEADER = re.compile(r"^-- (KEYS|ARGV) +(head|per counter|per cap|per share): (.+)$")
_STRIDES = re.compile(
    r"^local COUNTER_ARGS, CAP_ARGS, SHARE_ARGS, CAP_KEYS = (\d+), (\d+), (\d+), (\d+)$"
)


def header(layout: Layout) -> dict[tuple[str, str], tuple[str, ...]]:
    """The KEYS and ARGV lines of a script's opening comment, by (list, part)."""
    found: dict[tuple[str, str], tuple[str, ...]] = {}
    for line in script.text(layout.script).splitlines():
        if not line.startswith("--"):
            break
        if m := _HEADER.match(line):
            found[m[1], m[2]] = tuple(m[3].split())
    return found


def strides(layout: Layout) -> tuple[int, ...]:
    matches = [_STRIDES.match(line) for line in script.text(layout.script).splitlines()]
    (only,) = [m for m in matches if m]
    return tuple(int(x) for x in only.groups())


def rows(args: list[Any], layout: Layout) -> dict[str, list[dict[str, Any]]]:
    """ARGV cut back into named rows by ``layout``; every argument must be used."""
    out: dict[str, list[dict[str, Any]]] = {"head": [dict(zip(layout.head, args, strict=False))]}
    at = len(layout.head)
    for part, fields in (("counter", layout.counter), ("cap", layout.cap),
                         ("share", layout.share)):  # fmt: skip
        count, at = int(args[at]), at + 1
        out[part] = []
        for _ in range(count):
            out[part].append(dict(zip(fields, args[at : at + len(fields)], strict=True)))
            at += len(fields)
    assert at == len(args)
    return out


@pytest.fixture
def plan(tmp_path: Path) -> Plan:
    matcher = Matcher(load_text(tmp_path, CONFIG).config)
    request = req("edge", desc("route=public", "client_id=heavy"),
                  desc("route=admin", "client_id=a"), desc("user=u"))  # fmt: skip
    return make_plan(request, matcher)


@pytest.fixture
def groups(plan: Plan) -> list[SlotGroup]:
    found = slot_groups(plan, "fairlimit:", cluster=True)
    assert len(found) == 3  # the public cap, the admin cap, the user counter
    return found


class TestScriptHeaders:
    @pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.script)
    def test_each_script_opens_with_the_python_layout(self, layout: Layout) -> None:
        """Every KEYS and ARGV line of the .lua header names the fields script.py builds."""
        assert header(layout) == {
            ("KEYS", "per counter"): ("counter",),
            ("KEYS", "per cap"): layout.cap_keys,
            ("ARGV", "head"): layout.head,
            ("ARGV", "per counter"): layout.counter,
            ("ARGV", "per cap"): layout.cap,
            ("ARGV", "per share"): layout.share,
        }

    @pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.script)
    def test_each_script_walks_its_arguments_by_the_python_strides(self, layout: Layout) -> None:
        """The strides the Lua body steps by are the lengths of the Python rows."""
        expected = (len(layout.counter), len(layout.cap), len(layout.share), len(layout.cap_keys))
        assert strides(layout) == expected

    def test_cap_key_kinds_are_known_names(self) -> None:
        """Every cap key a script takes is one keys.py builds."""
        assert all(set(layout.cap_keys) <= set(CAP_KINDS) for layout in LAYOUTS)


class TestArgumentBuilders:
    def test_keys_are_counters_then_each_caps_kinds(self, groups: list[SlotGroup]) -> None:
        """KEYS: the counter keys, then the layout's kinds for each cap, in order."""
        for layout in LAYOUTS:
            for g in groups:
                caps = [c[kind] for c in g.cap_keys for kind in layout.cap_keys]
                assert script.keys(layout, g) == g.counter_keys + caps

    def test_admit_rows_carry_the_named_fields(self, plan: Plan, groups: list[SlotGroup]) -> None:
        """admit_args, cut by ADMIT, gives back each counter, cap and share by name, the
        division given for the cap as its epoch and its DIVISION_FIELDS text."""
        g = next(g for g in groups if g.shares)
        made = Division(sharing.FORCES * 50 + 1, 12.5, 2.5, 3)
        figures = ("0.5", "3", "2.5", "1.0", "0.4", "0")
        given = GivenDivision(str(made.epoch), script.division_text(made), figures)
        args = script.admit_args(plan, g, "12.5", (True, 250), {g.caps[0]: given})
        got = rows(args, ADMIT)
        head = {"now": "12.5", "may_lock": 1, "lock_ms": 250, "consumer": "", "want": 0}
        assert got["head"] == [head]
        c = plan.counters[g.counters[0]]
        assert got["counter"][0] == {"limit": c.limit, "window": c.window, "hits": c.hits,
                                     "shadow": int(c.shadow), "force": 0, "kind": "",
                                     "extra": ""}  # fmt: skip
        (cap,) = got["cap"]
        assert (cap["cap"], cap["given_epoch"], cap["given_division"]) == (
            g.caps[0],
            given.epoch,
            given.values,
        )
        assert (cap["period"], cap["window"], cap["capacity"], cap["declared"]) == ("1.0", 1, 20, 4)
        assert cap["total"] == 2  # the cap's own counter
        assert tuple(cap[f] for f in script.FIGURES) == given.figures
        (share,) = got["share"]
        s = plan.shares[g.shares[0]]
        assert (share["cap_index"], share["client"], share["hits"]) == (1, s.client, s.hits)
        assert (share["limit"], share["weight"], share["sized"]) == ("10.0", "3.0", 0)
        # below it: its own limit, the group's first counter; no cap above or below it
        assert (share["below_counters"], share["below_shares"]) == ("1", "")
        assert (share["parent"], share["nested"]) == (0, 0)

    def test_a_cap_given_no_division_passes_empty_fields(
        self, plan: Plan, groups: list[SlotGroup]
    ) -> None:
        """No division given: given_epoch and given_division "", each figure ""."""
        g = next(g for g in groups if g.shares)
        (cap,) = rows(script.admit_args(plan, g, "", (False, 250), {}), ADMIT)["cap"]
        assert (cap["given_epoch"], cap["given_division"]) == ("", "")
        assert all(cap[f] == "" for f in script.FIGURES)

    def test_nested_caps_name_their_parent_and_the_levels_below(self, tmp_path: Path) -> None:
        """route 1000/s > tenant 600/s > user 200/s in one group: tenant A at the route cap
        is a cap itself (nested), with the user's and its own counters (1, 3) and the
        tenant cap's share (2) below it; user u1 at the tenant cap has share 1 as parent,
        only its own counter below, and is sized (600 = 3 active clients x 200)."""
        matcher = Matcher(load_text(tmp_path, NESTED).config)
        nested = make_plan(req("fair", desc("route=api", "tenant=A", "user=u1")), matcher)
        (g,) = slot_groups(nested, "fairlimit:", cluster=False)
        shares = rows(script.admit_args(nested, g, "12.5", (True, 250), {}), ADMIT)["share"]
        picked = ("client", "cap_index", "below_counters", "below_shares", "parent", "nested")
        assert [tuple(r[f] for f in picked) for r in shares] == [
            ("A", 1, "1,3", "2", 0, 1),
            ("u1", 2, "1", "", 1, 0),
        ]
        assert [r["sized"] for r in shares] == [0, 1]

    def test_release_rows_carry_the_named_fields(self, plan: Plan, groups: list[SlotGroup]) -> None:
        """release_args, cut by RELEASE, gives back what the admit script charged, by name."""
        for g in groups:
            got = rows(script.release_args(plan, g, "12.5"), RELEASE)
            assert got["head"] == [{"now": "12.5", "demand": 0}]
            windows = [plan.counters[i].window for i in g.counters]
            assert [r["window"] for r in got["counter"]] == windows
            assert [r["hits"] for r in got["counter"]] == [
                plan.counters[i].hits for i in g.counters
            ]
            cap_windows = [plan.shares[i].window for i in g.cap_share]
            assert [(r["period"], r["window"]) for r in got["cap"]] == [
                ("1.0", w) for w in cap_windows
            ]
            assert [r["client"] for r in got["share"]] == [plan.shares[i].client for i in g.shares]
            assert [r["hits"] for r in got["share"]] == [plan.shares[i].hits for i in g.shares]
            assert all(r["cap_index"] == 1 for r in got["share"])


# The contract prelude: "local NAME = value", "local ROW = {'a', ...}", "local ROW_FIELD =
# {a = 'x', ...}" (and DIVISION, DIVISION_FIELD).
_CONSTANT = re.compile(r"^local ([A-Z_]+) = ([-+.e\d]+)$")
_NAMES = re.compile(r"^local ([A-Z_]+) = \{((?:'[a-z_]+'(?:, )?)*)\}$")
_FIELDS = re.compile(r"^local ([A-Z_]+) = \{((?:[a-z_]+ = '[a-z]+'(?:, )?)*)\}$")
_TEXT = re.compile(r"^local ([A-Z_]+) = '([a-z:]+)'$")
CONSTANTS = ("ALPHA", "STALE", "SPLIT", "FORCES", "AMORTISE", "LEAD", "BURST", "EPSILON")
CONSTANTS += ("RELEASE", "ROUNDING")


def prelude() -> tuple[dict[str, float], dict[str, list[str]], dict[str, dict[str, str]]]:
    """The generated contract, parsed: constants, name lists and field tables, the text
    constants as the table "TEXT" (every line must be one of these)."""
    constants: dict[str, float] = {}
    names: dict[str, list[str]] = {}
    fields: dict[str, dict[str, str]] = {}
    for line in script.contract().splitlines():
        if m := _CONSTANT.match(line):
            constants[m[1]] = float(m[2])
        elif m := _NAMES.match(line):
            names[m[1]] = re.findall(r"'([a-z_]+)'", m[2])
        elif m := _FIELDS.match(line):
            fields[m[1]] = dict(re.findall(r"([a-z_]+) = '([a-z]+)'", m[2]))
        elif m := _TEXT.match(line):
            fields.setdefault("TEXT", {})[m[1]] = m[2]
        else:
            raise AssertionError(f"not a contract line: {line!r}")
    return constants, names, fields


class TestContract:
    """The Lua prelude script.contract() generates from core/sharing.py."""

    def test_it_states_every_constant_with_its_python_value(self) -> None:
        """ALPHA, STALE, SPLIT, FORCES, AMORTISE, LEAD, BURST, EPSILON, RELEASE and ROUNDING,
        each as in core/sharing.py, SLIDING_PARTS and SMOOTH_EPSILON as in core/units.py and
        core/smooth.py, RESERVATION_OPEN as script.py's reply code, and no other."""
        constants, _, _ = prelude()
        expected = {name: float(getattr(sharing, name)) for name in CONSTANTS}
        expected["SLIDING_PARTS"] = float(units.SLIDING_PARTS)
        expected["SMOOTH_EPSILON"] = smooth.EPSILON
        expected["RESERVATION_OPEN"] = float(script.RESERVATION_OPEN)
        assert constants == expected

    def test_it_names_every_row_and_division_field_in_order(self) -> None:
        """ROW and DIVISION list the attributes in ROW_FIELDS / DIVISION_FIELDS order (the
        order the admit script reads and writes them in), ROW_NAMES and DIVISION_NAMES their
        hash fields in the same order, ROW_FIELD, DIVISION_FIELD and LIGHT_FIELD map each to
        its hash field."""
        _, names, fields = prelude()
        assert names == {
            "ROW": list(ROW_FIELDS),
            "ROW_NAMES": list(ROW_FIELDS.values()),
            "DIVISION": list(DIVISION_FIELDS),
            "DIVISION_NAMES": list(DIVISION_FIELDS.values()),
        }
        assert fields == {
            "ROW_FIELD": ROW_FIELDS,
            "DIVISION_FIELD": DIVISION_FIELDS,
            "LIGHT_FIELD": LIGHT_FIELDS,
            "TEXT": {"CALENDAR": CALENDAR},
        }

    def test_the_row_fields_are_the_rows_attributes(self) -> None:
        """Every attribute of core/sharing.Row has a hash field, each its own; the whole
        ones are among them."""
        assert set(ROW_FIELDS) == set(Row.__slots__)
        assert len(set(ROW_FIELDS.values())) == len(ROW_FIELDS)
        assert set(ROW_FIELDS) >= WHOLE_FIELDS
        assert len(set(DIVISION_FIELDS.values())) == len(DIVISION_FIELDS)

    def test_the_division_fields_are_the_divisions_attributes(self) -> None:
        """Every attribute of core/sharing.Division has a meta field; excluded, a client
        value, comes last (the Lua reads it as the rest of the given text)."""
        assert set(DIVISION_FIELDS) == set(Division.__slots__)
        assert list(DIVISION_FIELDS)[-1] == "excluded"

    @pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.script)
    def test_scripts_name_only_fields_the_contract_has(self, layout: Layout) -> None:
        """Every ROW_FIELD.x and DIVISION_FIELD.x a script names is in the tables (and each
        script names some: release.lua the row's window, period and admitted counts)."""
        text = script.text(layout.script)
        used = {
            table: set(re.findall(rf"\b{table}\.([a-z_]+)", text))
            for table in ("ROW_FIELD", "DIVISION_FIELD")
        }
        assert used["ROW_FIELD"] <= set(ROW_FIELDS)
        assert used["DIVISION_FIELD"] <= set(DIVISION_FIELDS)
        assert used["ROW_FIELD"] | used["DIVISION_FIELD"]

    def test_the_registered_source_is_the_clock_the_contract_and_the_script(self) -> None:
        """The clock, the contract, what the script shares with others (SHARED), then it."""
        for name in [layout.script for layout in LAYOUTS] + ["settle", "prune"]:
            shared = "".join(script.text(s) for s in script.SHARED.get(name, ()))
            assert script.source(name) == (
                script.text("clock") + script.contract() + shared + script.text(name)
            )
        assert script.SHARED[RELEASE.script] == script.SHARED["settle"] == ("row_at",)


LUA = Path(script.__file__).parent / "lua"
MAX_PART_LINES = 250
LUA_MAX_LOCALS = 200  # Lua 5.1's LUAI_MAXVARS: locals of one function, the main chunk too


def top_level_locals(source: str) -> int:
    """The locals a script declares outside its functions (at the start of a line): those
    count against the main chunk's limit, whichever part declares them."""
    found = 0
    for line in source.splitlines():
        if line.startswith("local function "):
            found += 1
        elif line.startswith("local "):
            found += len(line.removeprefix("local ").split("=")[0].split(","))
    return found


class TestAdmitParts:
    """The admit script kept as one file per concept in lua/admit/, joined by script.py into
    the one script registered (issue 42)."""

    def test_every_file_is_a_part_joined_once_in_the_stated_order(self) -> None:
        """PARTS names each file of lua/admit/ once; the admit script is their texts joined
        in that order, and each part's first line states its place in it."""
        parts = script.PARTS[ADMIT.script]
        assert sorted(parts) == sorted(p.stem for p in (LUA / "admit").glob("*.lua"))
        texts = [(LUA / "admit" / f"{part}.lua").read_text() for part in parts]
        assert script.text(ADMIT.script) == script.join(texts)
        for place, (part, text) in enumerate(zip(parts, texts, strict=True), start=1):
            assert text.startswith(f"-- admit/{part}.lua: part {place}"), part

    @pytest.mark.parametrize("part", script.PARTS[ADMIT.script])
    def test_each_part_is_short_and_opens_with_what_it_reads_and_defines(self, part: str) -> None:
        """At most 250 lines, opening with a comment that has a KEYS and an ARGV line (what
        it reads of them) and names what it defines for the parts after it."""
        lines = (LUA / "admit" / f"{part}.lua").read_text().splitlines()
        assert len(lines) <= MAX_PART_LINES
        opening = list(itertools.takewhile(lambda line: line.startswith("--"), lines))
        assert any(line.startswith("-- KEYS") for line in opening), part
        assert any(line.startswith("-- ARGV") for line in opening), part
        assert any("Defines" in line for line in opening), part

    @pytest.mark.parametrize("name", [ADMIT.script, RELEASE.script, "settle"])
    def test_every_line_registered_is_located_in_the_file_it_was_written_in(
        self, name: str
    ) -> None:
        """locate(script, n) names the file and line that line n of the registered source
        came from (clock.lua, the generated contract, the script's file or part), each
        part's first line as its line 1."""
        registered = script.source(name).split("\n")
        for number, line in enumerate(registered[:-1], start=1):
            where, _, at = script.locate(name, number).rpartition(":")
            written = script.contract() if where == "contract" else (LUA / where).read_text()
            assert written.split("\n")[int(at) - 1] == line, (number, where, at)
        starts = [script.locate(name, n) for n in range(1, len(registered))]
        files = [f"{name}/{part}.lua" for part in script.PARTS.get(name, ())] or [f"{name}.lua"]
        assert [f"{f}:1" in starts for f in ("clock.lua", "contract", *files)] == [True] * (
            2 + len(files)
        )

    def test_every_lua_file_is_shipped_in_the_package(self) -> None:
        """pyproject's package-data globs match every .lua file the store reads, the parts
        in lua/admit/ too (an installed server, the container's, has only what they match)."""
        pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
        globs = pyproject["tool"]["setuptools"]["package-data"]["fairlimit"]
        package = LUA.parents[3]  # server/fairlimit
        files = [p.relative_to(package) for p in LUA.rglob("*.lua")]
        assert len(files) > len(script.PARTS[ADMIT.script])
        assert [f for f in files if not any(f.match(g) for g in globs)] == []

    def test_the_joined_script_stays_under_luas_limit_of_locals(self) -> None:
        """The parts share one chunk, so their top-level locals (with clock.lua's and the
        contract's) count against one limit of 200: Redis refuses to load a script past it."""
        assert top_level_locals(script.source(ADMIT.script)) < LUA_MAX_LOCALS


def lua_given_division(text: str) -> dict[str, float | str]:
    """admit/division.lua's given_division: "," separated values in DIVISION order, each a number
    ("inf" the infinite one) but the last, excluded, which is the rest of the text."""
    out: dict[str, float | str] = {}
    at = 0
    names = list(DIVISION_FIELDS)
    for i, name in enumerate(names):
        if i == len(names) - 1:
            out[name] = text[at:]
        else:
            comma = text.index(",", at)
            value = text[at:comma]
            out[name] = math.inf if value == "inf" else float(value)
            at = comma + 1
    return out


def lua_fmt(x: float) -> str:
    """admit/args.lua's fmt: %.17g, "inf" for the infinite."""
    return "inf" if x == math.inf else f"{x:.17g}"


FINITE = st.floats(-1e12, 1e12, allow_nan=False) | st.integers(-(10**12), 10**12).map(float)


class TestDivisionText:
    @staticmethod
    def division(excluded: str) -> Division:
        """A division with a value of its own in every field (closing infinite)."""
        division = Division(64 * 542 + 3, 135.25, 14.666666666666666, 7)
        for k, name in enumerate(DIVISION_FIELDS):
            if name not in ("epoch", "at", "level", "rows"):
                setattr(division, name, 0.1 * k)
        division.closing, division.excluded = math.inf, excluded
        return division

    @pytest.mark.parametrize("excluded", ["", "web-1", "a,b", "x:y,z,", ",", "ü,\\"])
    def test_it_round_trips_through_the_lua_parse(self, excluded: str) -> None:
        """Each value comes back as the same double (the infinite closing as "inf"), and
        excluded as written, commas and all."""
        division = self.division(excluded)
        parsed = lua_given_division(script.division_text(division))
        assert parsed == {name: getattr(division, name) for name in DIVISION_FIELDS}

    def test_values_are_comma_separated_in_field_order(self) -> None:
        """Each value as repr of its double ("inf" for the infinite), in DIVISION_FIELDS
        order, joined by ","; excluded last, as it is."""
        division = self.division("a,b")
        expected = [
            "inf" if value == math.inf else repr(float(value))
            for value in (getattr(division, name) for name in list(DIVISION_FIELDS)[:-1])
        ]
        assert script.division_text(division) == ",".join([*expected, "a,b"])
        assert script.division_text(division).startswith("34691.0,135.25,14.666666666666666,7.0,")

    @given(st.lists(FINITE, min_size=len(DIVISION_FIELDS) - 1, max_size=len(DIVISION_FIELDS) - 1),
           st.text())  # fmt: skip
    def test_any_values_round_trip(self, values: list[float], excluded: str) -> None:
        """Any doubles and any client text: the Lua reads back what Python wrote."""
        division = Division(0, 0.0, 0.0, 0)
        for name, value in zip(list(DIVISION_FIELDS)[:-1], values, strict=True):
            setattr(division, name, value)
        division.excluded = excluded
        parsed = lua_given_division(script.division_text(division))
        assert parsed == {name: getattr(division, name) for name in DIVISION_FIELDS}


class TestRowsOf:
    @staticmethod
    def hgetall(rows: dict[str, Row]) -> list[str]:
        """A rows hash as HGETALL returns it, flat, as admit/rows.lua's save_row writes it
        (<field>:<client> = fmt(value)), the clients' fields interleaved."""
        pairs = [
            [f"{field}:{client}", lua_fmt(float(getattr(row, name)))]
            for name, field in ROW_FIELDS.items()
            for client, row in rows.items()
        ]
        return [x for pair in pairs for x in pair]

    def test_two_clients_come_back_field_by_field(self) -> None:
        """A plain client and one whose value holds ':' and ',' come back as the rows
        written, every attribute equal (the whole ones as ints, an infinite limit)."""
        plain = Row(30.0, 2.0)
        plain.window, plain.period, plain.epoch, plain.kind = 1_700_000_040, 1_700_000_071, -1, 2
        plain.asked, plain.admitted, plain.credit, plain.history = 12.0, 9.0, 1 / 3, 0.1
        odd = Row(math.inf, 0.5)
        odd.window, odd.period, odd.epoch, odd.kind = 1_700_000_040, 1_700_000_070, 64 * 7, 1
        odd.previous, odd.previous_last, odd.seen, odd.mass = -1.0, 1_700_000_039.9, 7.25, 0.75
        odd.fixed, odd.rate, odd.last_asked = 4.0, 2.5, 3.0
        written = {"web-1": plain, "ten:ant,b:c": odd}
        got = script.rows_of(self.hgetall(written))
        assert set(got) == set(written)
        for client, row in written.items():
            assert state(got[client]) == state(row)
            assert all(type(getattr(got[client], f)) is int for f in WHOLE_FIELDS)

    @given(st.lists(FINITE | st.just(math.inf), min_size=len(ROW_FIELDS), max_size=len(ROW_FIELDS)))
    def test_any_values_come_back_as_the_same_doubles(self, values: list[float]) -> None:
        """Any doubles written as the admit script writes them read back as the same (the whole
        fields as the ints they stand for)."""
        row = Row(1.0, 1.0)
        for name, value in zip(ROW_FIELDS, values, strict=True):
            finite = value if value != math.inf else 7.0
            setattr(row, name, int(finite) if name in WHOLE_FIELDS else value)
        assert state(script.rows_of(self.hgetall({"c": row}))["c"]) == state(row)

    def test_a_client_without_a_window_or_a_field_unknown_is_left_out(self) -> None:
        """Fields of other names are not a row's; a client without its window field has no
        row."""
        flat = self.hgetall({"a": Row(5.0, 1.0)})
        flat += ["zz:a", "1", ROW_FIELDS["limit"] + ":b", "3", ROW_FIELDS["weight"] + ":b", "1"]
        got = script.rows_of(flat)
        assert set(got) == {"a"} and state(got["a"]) == state(Row(5.0, 1.0))


def state(row: Row) -> dict[str, object]:
    return {name: getattr(row, name) for name in Row.__slots__}


class TestReplies:
    def test_a_hand_back_is_answered_with_the_division_it_asked_for(
        self, plan: Plan, groups: list[SlotGroup]
    ) -> None:
        """The admit script hands back the public cap (index 1) at 12.5 for the first remake
        forced in sub-period 50 (id FORCES x 50 + 1) by heavy asking 1, no rows yet (HLEN 0, a
        division in force, none indexed, none stale): the division given has that epoch, and
        its text reads back (the Lua's parse) as made at 12.5 with heavy counted (1 row) and
        excluded, forced once, cold, nothing contended."""
        g = next(g for g in groups if g.shares)
        epoch = sharing.FORCES * 50 + 1
        reply = [script.NEED_LEVEL, "12.5", [[1, str(epoch), 0, "heavy", "1", "", 1, 0, 0]]]
        now, (back,) = division.hand_backs(reply)
        assert (now, back.index, back.fields, back.in_force) == (12.5, 0, 0, True)
        assert (back.indexed, back.stale) == (0, False)
        made = division.divide(plan.shares[g.cap_share[back.index]], {}, now, back)
        assert made.epoch == str(epoch) and made.figures == ("",) * len(script.FIGURES)
        parsed = lua_given_division(made.values)
        picked = ("epoch", "at", "level", "rows", "forced", "excluded", "cold", "closing")
        assert {name: parsed[name] for name in picked} == {
            "epoch": epoch,
            "at": 12.5,
            "level": math.inf,
            "rows": 1,
            "forced": 1,
            "excluded": "heavy",
            "cold": 1,
            "closing": math.inf,
        }

    def test_seen_reads_the_flat_reply_of_an_admission(self) -> None:
        """{charged, now, lease block, counters, shares, rolled, wants, then the counts, the
        full-at times after and before as text, admitted per share, bounds as text, rolled
        caps 1-based, wants as text}: rolled indexes become 0-based."""
        head = [1, "12.5", 7, 2, 2, 1, 2]
        counters = [3, 0, "0", "14.25", "0", "13.5"]  # counts, full after, full before
        shares = [2, 5, "4.5", "inf"]  # admitted, bounds
        reply = [*head, *counters, *shares, 2, "3", "9.5"]
        got = script.seen(reply)
        assert got == Seen(
            True, 12.5, [3, 0], [2, 5], [4.5, math.inf], [1], 7, [3.0, 9.5], [0.0, 14.25],
            [0.0, 13.5],
        )  # fmt: skip
        refused = script.seen([0, "7", 0, 1, 0, 0, 0, 4, "0", "0"])
        assert (refused.admitted, refused.now, refused.counts, refused.rolled) == (
            False, 7.0, [4], [],
        )  # fmt: skip
        assert (refused.shared, refused.bounds, refused.wanted) == ([], [], [])

    def test_a_hand_back_is_not_an_admission(self) -> None:
        """NEED_LEVEL is the first element of a hand-back only: not 0 or 1."""
        assert script.NEED_LEVEL not in (0, 1)


_SLOT_HEADER = re.compile(r"^-- (KEYS|ARGV) +(head|per pool): (.+)$")
_SLOT_STRIDES = re.compile(r"^local POOL_ARGS, POOL_KEYS = (\d+), (\d+)$")
SLOT_CONFIG = """
domain: edge
descriptors:
  - key: route
    value: public
    concurrency: {max_in_flight: 20, max_duration: 60}
    fair_share: {active_clients: 4, weights: {heavy: 3}}
    descriptors:
      - key: client_id
        concurrency: {max_in_flight: 5}
"""


class TestSlotScripts:
    """acquire.lua and release_slot.lua against slots.py's layouts (issue 16)."""

    @pytest.mark.parametrize("layout", SLOT_LAYOUTS, ids=lambda lay: lay.script)
    def test_each_slot_script_opens_with_the_python_layout(self, layout: SlotLayout) -> None:
        """The KEYS and ARGV lines of the .lua header name the fields slots.py builds."""
        found: dict[tuple[str, str], tuple[str, ...]] = {}
        for line in script.text(layout.script).splitlines():
            if not line.startswith("--"):
                break
            if m := _SLOT_HEADER.match(line):
                found[m[1], m[2]] = tuple(m[3].split())
        assert found == {
            ("KEYS", "per pool"): layout.pool_keys,
            ("ARGV", "head"): layout.head,
            ("ARGV", "per pool"): layout.pool,
        }

    @pytest.mark.parametrize("layout", SLOT_LAYOUTS, ids=lambda lay: lay.script)
    def test_each_slot_script_walks_by_the_python_strides(self, layout: SlotLayout) -> None:
        """The strides the Lua body steps by are the lengths of the Python rows."""
        lines = [_SLOT_STRIDES.match(line) for line in script.text(layout.script).splitlines()]
        (only,) = [m for m in lines if m]
        assert (int(only[1]), int(only[2])) == (len(layout.pool), len(layout.pool_keys))

    def test_builders_give_back_each_pool_by_name(self, tmp_path: Path) -> None:
        """KEYS are each pool's kinds in order, one hash tag per call on a Cluster; ARGV cut
        by the layout gives back the request id, limits and client of every pool."""
        matcher = Matcher(load_text(tmp_path, SLOT_CONFIG).config)
        request = req("edge", desc("route=public", "client_id=heavy", "request_id=r1"))
        pairs = taken(split(request, matcher).acquire)
        cut = slots.keys(ACQUIRE, pairs, "fairlimit:", cluster=True)
        assert len(cut) == 2 * len(ACQUIRE.pool_keys)
        assert len({re.search(r"\{(.*?)\}", k)[1] for k in cut}) == 1  # type: ignore[index]
        args = slots.acquire_args(pairs, "12.5", [3.0, 0.0])
        assert args[:2] == ["12.5", 2]
        n = len(ACQUIRE.pool)
        rows = [dict(zip(ACQUIRE.pool, args[2 + i * n : 2 + (i + 1) * n], strict=True))
                for i in range(2)]  # fmt: skip
        assert [(r["request_id"], r["limit"], r["client"]) for r in rows] == [
            ("r1", 20, "heavy"),
            ("r1", 5, ""),
        ]
        assert (rows[0]["client_limit"], rows[0]["bound"], rows[0]["weight"]) == (
            "5.0",
            "3.0",
            "3.0",
        )
        released = slots.release_args(pairs, "12.5")
        assert released == ["12.5", 2, "r1", "heavy", "r1", ""]
