"""The contract with the Lua scripts (lua/, one file per operation): KEYS and ARGV layouts,
the argument builders, the reply parsers and the registration of the scripts.

Each script takes KEYS as the counter keys, then for each cap the keys its layout names;
ARGV as the layout's head, then for counters, caps and shares in turn: their number, then
that many rows of the layout's fields. Each .lua file states the same layout in its opening
comment; tests/test_redis_script.py checks the two against each other.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript

from fairlimit.core.admission import below
from fairlimit.core.fairshare import figures_of
from fairlimit.core.plan import Plan, Share
from fairlimit.core.sharing import Clock, Row, last_period, period_level
from fairlimit.store.redis.keys import SlotGroup

# The fairness figures of the last period, as named in a cap's meta hash.
FIGURES = ("f_u", "f_a", "f_l", "f_j", "f_t", "f_s")
NEED_LEVEL = 2  # admit.lua's first reply element when it hands λ back


@dataclass(frozen=True, slots=True)
class Layout:
    """The KEYS and ARGV of one script, by field name."""

    script: str
    cap_keys: tuple[str, ...]  # the kinds of keys.CAP_KINDS each cap passes, in order
    head: tuple[str, ...]
    counter: tuple[str, ...]
    cap: tuple[str, ...]
    share: tuple[str, ...]


_CAP_FIELDS = ("period", "window", "capacity", "declared", "cap", "total")
_GIVEN = ("given_period", "given_level", "given_reserved", "given_holders")
ADMIT = Layout(
    "admit",
    cap_keys=("meta", "rows", "lock"),
    head=("now", "may_lock", "lock_ms"),
    counter=("limit", "window", "hits", "shadow", "force"),
    cap=(*_CAP_FIELDS, *_GIVEN, *FIGURES),
    share=(
        *("cap_index", "client", "limit", "weight", "hits", "shadow", "sized"),
        *("below_counters", "below_shares", "force"),
    ),
)
RELEASE = Layout(
    "release",
    cap_keys=("meta", "rows"),
    head=("now",),
    counter=("window", "hits"),
    cap=("period", "window"),
    share=("cap_index", "client", "hits", "within"),
)
LAYOUTS = (ADMIT, RELEASE)


def source(layout: Layout) -> str:
    """The Lua text of a layout's script."""
    return resources.files(__package__).joinpath(f"lua/{layout.script}.lua").read_text()


@dataclass(frozen=True, slots=True)
class Scripts:
    """The scripts as registered with one client (EVALSHA, EVAL after NOSCRIPT)."""

    admit: AsyncScript
    release: AsyncScript


def register(client: "aioredis.Redis | RedisCluster") -> Scripts:
    return Scripts(client.register_script(source(ADMIT)), client.register_script(source(RELEASE)))


def keys(layout: Layout, g: SlotGroup) -> list[str]:
    """A slot group's KEYS for ``layout``'s script."""
    return g.counter_keys + [cap[kind] for cap in g.cap_keys for kind in layout.cap_keys]


# --- arguments -----------------------------------------------------------------------------


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else repr(float(x))


@dataclass(frozen=True, slots=True)
class GivenLevel:
    """λ and R computed here for one cap and period, with the figures of the period before."""

    period: str
    level: str
    reserved: str
    holders: str
    figures: tuple[str, ...]


_NO_LEVEL = GivenLevel("", "", "", "", ("",) * len(FIGURES))


def _indexes(positions: Sequence[int], of: Sequence[int]) -> str:
    """The 1-based positions in ``of`` of the plan indexes ``positions`` (those present)."""
    return ",".join(str(of.index(i) + 1) for i in positions if i in of)


def admit_args(
    plan: Plan, g: SlotGroup, now: str, lock: tuple[bool, int], given: Mapping[str, GivenLevel]
) -> list[str | int]:
    """ARGV of admit.lua (ADMIT); ``now`` "" = Redis TIME, ``lock`` = (may lock, lock ms)."""
    args: list[str | int] = [now, int(lock[0]), lock[1], len(g.counters)]
    for i in g.counters:
        c = plan.counters[i]
        args += [c.limit, c.window, c.hits, int(c.shadow), int(c.force)]
    args.append(len(g.caps))
    for cap, i in zip(g.caps, g.cap_share, strict=True):
        s = plan.shares[i]
        total = g.counters.index(s.total) + 1 if s.total in g.counters else 0
        lv = given.get(cap) or _NO_LEVEL
        args += [_num(s.period), s.window, s.capacity, s.declared, cap, total]
        args += [lv.period, lv.level, lv.reserved, lv.holders, *lv.figures]
    args.append(len(g.shares))
    deps = below(plan)
    for i in g.shares:
        s = plan.shares[i]
        counters, shares = deps[i]
        args += [g.caps.index(s.cap) + 1, s.client, _num(s.client_limit), _num(s.weight)]
        args += [s.hits, int(s.shadow), int(s.sized)]
        args += [_indexes(counters, g.counters), _indexes(shares, g.shares), int(s.force)]
    return args


def release_args(plan: Plan, g: SlotGroup, now: str, within: Sequence[bool]) -> list[str | int]:
    """ARGV of release.lua (RELEASE): undo what admit.lua charged at ``now`` (not the charges
    of charge_when_over_limit rules: a refused request keeps those)."""
    args: list[str | int] = [now, len(g.counters)]
    for i in g.counters:
        c = plan.counters[i]
        args += [c.window, 0 if c.force else c.hits]
    args.append(len(g.caps))
    for i in g.cap_share:
        s = plan.shares[i]
        args += [_num(s.period), s.window]
    args.append(len(g.shares))
    for pos, i in enumerate(g.shares):
        s = plan.shares[i]
        args += [g.caps.index(s.cap) + 1, s.client, 0 if s.force else s.hits, int(within[pos])]
    return args


_ROW_FIELDS = ("ws", "a", "d", "pk", "pd", "pa", "oo", "sp", "r", "q", "qa", "dk", "l", "w")
_WHOLE = frozenset({"ws", "pk", "sp"})


def rows_of(flat: Sequence[str]) -> list[Row]:
    """core.sharing rows from a cap's rows hash (HGETALL, flat)."""
    values: dict[str, dict[str, str]] = {}
    for field, value in zip(flat[::2], flat[1::2], strict=True):
        name, _, client = field.partition(":")
        values.setdefault(client, {})[name] = value
    out: list[Row] = []
    for fields in values.values():
        if "pk" not in fields:
            continue
        row = Row(float(fields["l"]), float(fields["w"]))
        for name in _ROW_FIELDS[:-2]:
            raw = fields.get(name, "0")
            setattr(row, name, int(float(raw)) if name in _WHOLE else float(raw))
        out.append(row)
    return out


def _compute_level(share: Share, period: str, flat: Sequence[str], now: float) -> GivenLevel:
    """λ and R for ``period`` from the cap's rows (``core.sharing``, as memory)."""
    clock = Clock(share.window, share.period, now)
    rows = rows_of(flat)
    level = period_level(rows, share.capacity, clock)
    last = last_period(rows, share.capacity, clock)
    figures: tuple[str, ...] = ("",) * len(FIGURES)
    if last is not None:
        fig = figures_of(last)
        figures = tuple(_num(x) for x in (fig.utilization, fig.active_clients, fig.level,
                        fig.jain_index, fig.top_client_share, fig.starved_clients))  # fmt: skip
    value = "none" if level.level is None else _num(level.level)
    return GivenLevel(period, value, _num(level.reserved), str(level.holders), figures)


# --- replies -------------------------------------------------------------------------------


def levels_wanted(plan: Plan, g: SlotGroup, reply: Sequence[Any]) -> dict[str, GivenLevel]:
    """λ for each cap an admit.lua hand-back (``reply[0] == NEED_LEVEL``) asked for."""
    given: dict[str, GivenLevel] = {}
    now = float(reply[1])
    for index, period, flat in reply[2]:
        pos = int(index) - 1
        share = plan.shares[g.cap_share[pos]]
        given[g.caps[pos]] = _compute_level(share, str(period), flat, now)
    return given


@dataclass(slots=True)
class Seen:
    """One group's admit.lua reply: the counters as they stood, and whether it charged."""

    admitted: bool
    now: float
    counts: list[int]
    shared: list[int]
    bounds: list[float]
    fresh: list[bool]
    rolled: list[int]  # indexes into SlotGroup.caps
    within: list[bool]  # per share: charged within its plan (release.lua needs it)


def seen(reply: Sequence[Any]) -> Seen:
    return Seen(
        int(reply[0]) == 1,
        float(reply[1]),
        [int(x) for x in reply[2]],
        [int(x) for x in reply[3]],
        [float(x) for x in reply[4]],
        [int(x) == 1 for x in reply[5]],
        [int(x) - 1 for x in reply[6]],
        [int(x) == 1 for x in reply[7]],
    )
