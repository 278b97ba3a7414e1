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

from fairlimit.core.fairshare import PeriodDemand, figures_of, level_of
from fairlimit.core.plan import Plan, Share
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


_CAP_FIELDS = ("period", "window", "capacity", "declared", "cap", "given_period", "given_level")
ADMIT = Layout(
    "admit",
    cap_keys=("meta", "cur", "prev", "adm", "lock"),
    head=("now", "may_lock", "lock_ms"),
    counter=("limit", "window", "hits", "shadow"),
    cap=(*_CAP_FIELDS, *FIGURES),
    share=("cap_index", "client", "limit", "weight", "hits", "shadow"),
)
RELEASE = Layout(
    "release",
    cap_keys=("cur", "adm"),
    head=("now",),
    counter=("window", "hits"),
    cap=("period", "window"),
    share=("cap_index", "client", "hits"),
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
    """λ computed here for one cap and period, with the figures of the period before."""

    period: str
    level: str
    figures: tuple[str, ...]


_NO_LEVEL = GivenLevel("", "", ("",) * len(FIGURES))


def admit_args(
    plan: Plan, g: SlotGroup, now: str, lock: tuple[bool, int], given: Mapping[str, GivenLevel]
) -> list[str | int]:
    """ARGV of admit.lua (ADMIT); ``now`` "" = Redis TIME, ``lock`` = (may lock, lock ms)."""
    args: list[str | int] = [now, int(lock[0]), lock[1], len(g.counters)]
    for i in g.counters:
        c = plan.counters[i]
        args += [c.limit, c.window, c.hits, int(c.shadow)]
    args.append(len(g.caps))
    for cap, i in zip(g.caps, g.cap_share, strict=True):
        s = plan.shares[i]
        lv = given.get(cap) or _NO_LEVEL
        args += [_num(s.period), s.window, s.capacity, s.declared, cap, lv.period, lv.level]
        args += lv.figures
    args.append(len(g.shares))
    for i in g.shares:
        s = plan.shares[i]
        args += [g.caps.index(s.cap) + 1, s.client, _num(s.client_limit), _num(s.weight)]
        args += [s.hits, int(s.shadow)]
    return args


def release_args(plan: Plan, g: SlotGroup, now: str) -> list[str | int]:
    """ARGV of release.lua (RELEASE): undo what admit.lua charged at ``now``."""
    args: list[str | int] = [now, len(g.counters)]
    for i in g.counters:
        c = plan.counters[i]
        args += [c.window, c.hits]
    args.append(len(g.caps))
    for i in g.cap_share:
        s = plan.shares[i]
        args += [_num(s.period), s.window]
    args.append(len(g.shares))
    for i in g.shares:
        s = plan.shares[i]
        args += [g.caps.index(s.cap) + 1, s.client, s.hits]
    return args


def _compute_level(share: Share, period: str, flat: Sequence[str]) -> GivenLevel:
    """λ for ``period`` from the last period's demand hash (``core.fairshare``, as memory)."""
    prev = dict(zip(flat[::2], flat[1::2], strict=True))
    clients = [f[2:] for f in prev if f.startswith("d:")]
    last = PeriodDemand(
        share.capacity,
        share.window / share.period,
        [float(prev["d:" + c]) for c in clients],
        [float(prev.get("a:" + c, 0)) for c in clients],
        [float(prev["l:" + c]) for c in clients],
        [float(prev["w:" + c]) for c in clients],
    )
    level, fig = level_of(last), figures_of(last)
    figures = (fig.utilization, fig.active_clients, fig.level, fig.jain_index,
               fig.top_client_share, fig.starved_clients)  # fmt: skip
    return GivenLevel(period, _num(level), tuple(_num(x) for x in figures))


# --- replies -------------------------------------------------------------------------------


def levels_wanted(plan: Plan, g: SlotGroup, reply: Sequence[Any]) -> dict[str, GivenLevel]:
    """λ for each cap an admit.lua hand-back (``reply[0] == NEED_LEVEL``) asked for."""
    given: dict[str, GivenLevel] = {}
    for index, period, flat in reply[2]:
        pos = int(index) - 1
        share = plan.shares[g.cap_share[pos]]
        given[g.caps[pos]] = _compute_level(share, str(period), flat)
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


def seen(reply: Sequence[Any]) -> Seen:
    return Seen(
        int(reply[0]) == 1,
        float(reply[1]),
        [int(x) for x in reply[2]],
        [int(x) for x in reply[3]],
        [float(x) for x in reply[4]],
        [int(x) == 1 for x in reply[5]],
        [int(x) - 1 for x in reply[6]],
    )
