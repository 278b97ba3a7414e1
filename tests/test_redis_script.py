"""The KEYS/ARGV contract between store/redis/script.py and the Lua scripts, read from both
sides: each .lua file's opening comment and stride constants against the Python layouts,
and the argument builders against the layouts' field names. No Redis needed."""

import re
from pathlib import Path
from typing import Any

import pytest

from conftest import load_text
from fairlimit.core.concurrency import split, taken
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import Plan
from fairlimit.core.plan import plan as make_plan
from fairlimit.store.redis import script, slots
from fairlimit.store.redis.keys import CAP_KINDS, SlotGroup, slot_groups
from fairlimit.store.redis.script import ADMIT, LAYOUTS, RELEASE, GivenLevel, Layout
from fairlimit.store.redis.slots import ACQUIRE, SLOT_LAYOUTS, SlotLayout
from helpers import desc, req

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
    for line in script.source(layout).splitlines():
        if not line.startswith("--"):
            break
        if m := _HEADER.match(line):
            found[m[1], m[2]] = tuple(m[3].split())
    return found


def strides(layout: Layout) -> tuple[int, ...]:
    matches = [_STRIDES.match(line) for line in script.source(layout).splitlines()]
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
        """admit_args, cut by ADMIT, gives back each counter, cap and share by name."""
        g = next(g for g in groups if g.shares)
        lv = GivenLevel("7", "2.5", "12", "3", ("0.5", "3", "2.5", "1.0", "0.4", "0"))
        args = script.admit_args(plan, g, "12.5", (True, 250), {g.caps[0]: lv})
        got = rows(args, ADMIT)
        assert got["head"] == [{"now": "12.5", "may_lock": 1, "lock_ms": 250}]
        c = plan.counters[g.counters[0]]
        assert got["counter"][0] == {"limit": c.limit, "window": c.window, "hits": c.hits,
                                     "shadow": int(c.shadow), "force": 0}  # fmt: skip
        (cap,) = got["cap"]
        assert (cap["cap"], cap["given_period"], cap["given_level"]) == (g.caps[0], "7", "2.5")
        assert (cap["given_reserved"], cap["given_holders"]) == ("12", "3")
        assert cap["total"] == 2  # the cap's own counter
        assert tuple(cap[f] for f in script.FIGURES) == lv.figures
        (share,) = got["share"]
        s = plan.shares[g.shares[0]]
        assert (share["cap_index"], share["client"], share["hits"]) == (1, s.client, s.hits)

    def test_release_rows_carry_the_named_fields(self, plan: Plan, groups: list[SlotGroup]) -> None:
        """release_args, cut by RELEASE, gives back what admit.lua charged, by name."""
        for g in groups:
            within = [True] * len(g.shares)
            got = rows(script.release_args(plan, g, "12.5", within), RELEASE)
            assert got["head"] == [{"now": "12.5"}]
            windows = [plan.counters[i].window for i in g.counters]
            assert [r["window"] for r in got["counter"]] == windows
            assert [r["hits"] for r in got["counter"]] == [
                plan.counters[i].hits for i in g.counters
            ]
            assert [r["client"] for r in got["share"]] == [plan.shares[i].client for i in g.shares]
            assert all(r["cap_index"] == 1 for r in got["share"])
            assert all(r["within"] == 1 for r in got["share"])


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
        for line in slots.source(layout).splitlines():
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
        lines = [_SLOT_STRIDES.match(line) for line in slots.source(layout).splitlines()]
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
        rows = [dict(zip(ACQUIRE.pool, args[2 + i * 7 : 9 + i * 7], strict=True)) for i in range(2)]
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
