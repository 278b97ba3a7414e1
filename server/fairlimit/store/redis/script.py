"""The contract with the Lua scripts (lua/, one file per operation): KEYS and ARGV layouts,
the argument builders, the reply parsers and the registration of the scripts.

Each script takes KEYS as the counter keys, then for each cap the keys its layout names;
ARGV as the layout's head, then for counters, caps and shares in turn: their number, then
that many rows of the layout's fields. Each .lua file states the same layout in its opening
comment; tests/store/test_redis_script.py checks the two against each other. The admit
script is long: it is kept as one file per concept in lua/admit/ (PARTS names them), joined
here in that fixed order into the one script registered, so a request still costs one
EVALSHA per slot group; its layout comment opens the first part, lua/admit/args.lua.
"""

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript

from fairlimit.core import sharing, smooth, units
from fairlimit.core.admission import above, below
from fairlimit.core.plan import Counter, Plan
from fairlimit.core.sharing import (
    CALENDAR,
    DIVISION_FIELDS,
    LIGHT_FIELDS,
    ROW_FIELDS,
    WHOLE_FIELDS,
    Division,
    Row,
)
from fairlimit.store.redis.keys import SlotGroup

# The fairness figures of the last period, as named in a cap's meta hash.
FIGURES = ("f_u", "f_a", "f_l", "f_j", "f_t", "f_s")
NEED_LEVEL = 2  # the admit script's first reply element when it hands λ back
RESERVATION_OPEN = 3  # its first reply element when a reservation's id is still open


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
ADMIT = Layout(
    "admit",
    cap_keys=("meta", "rows", "lock", "seen"),
    head=("now", "may_lock", "lock_ms", "consumer", "want"),
    counter=("limit", "window", "hits", "shadow", "force", "kind", "extra"),
    cap=(*_CAP_FIELDS, "given_epoch", "given_division", *FIGURES),
    share=(
        *("cap_index", "client", "limit", "weight", "hits", "shadow", "sized"),
        *("below_counters", "below_shares", "force", "parent", "nested"),
    ),
)
RELEASE = Layout(
    "release",
    cap_keys=("rows",),
    head=("now", "demand"),
    counter=("window", "hits", "kind", "extra"),
    cap=("period", "window"),
    share=("cap_index", "client", "hits"),
)
LAYOUTS = (ADMIT, RELEASE)


# The scripts kept as parts, lua/<script>/<part>.lua, and the order they are joined in: each
# part uses what the parts before it define (one Lua chunk), and the body runs through them
# top to bottom. Each part's opening comment states what it reads and defines.
PARTS: dict[str, tuple[str, ...]] = {
    ADMIT.script: ("args", "rows", "division", "verdict", "meters", "decide", "lease", "charge"),
}


def _file(path: str) -> str:
    return resources.files(__package__).joinpath(path).read_text()


def join(texts: Sequence[str]) -> str:
    """A script's parts as one text: in the order given, a blank line between two."""
    return "\n".join(texts)


def text(script: str) -> str:
    """``lua/<script>.lua`` as written, or the parts of ``script`` (PARTS) joined: its opening
    comment states its KEYS/ARGV contract."""
    parts = PARTS.get(script)
    if parts is None:
        return _file(f"lua/{script}.lua")
    return join([_file(f"lua/{script}/{part}.lua") for part in parts])


def _lua(value: object) -> str:
    if isinstance(value, str):
        return "'" + value + "'"
    return repr(value)


def _table(names: Mapping[str, str]) -> str:
    return "{" + ", ".join(f"{k} = {_lua(v)}" for k, v in names.items()) + "}"


def contract() -> str:
    """The Lua prelude generated from core/sharing.py: its constants, the Row and Division
    attributes in order with their Redis hash fields, and the light demand's fields
    (the admit script reads only these, so the two sides cannot drift apart)."""
    constants: tuple[str, ...] = ("ALPHA", "STALE", "SPLIT", "FORCES", "AMORTISE", "LEAD")
    constants += ("BURST", "EPSILON", "RELEASE", "ROUNDING")
    lines = [f"local {name} = {_lua(getattr(sharing, name))}" for name in constants]
    lines.append(f"local SLIDING_PARTS = {units.SLIDING_PARTS}")
    lines.append(f"local SMOOTH_EPSILON = {smooth.EPSILON!r}")
    lines.append(f"local RESERVATION_OPEN = {RESERVATION_OPEN}")
    lines.append("local ROW = {" + ", ".join(_lua(f) for f in ROW_FIELDS) + "}")
    lines.append(f"local ROW_FIELD = {_table(ROW_FIELDS)}")
    # each attribute's hash field, in order: HMGET and HSET arguments without a loop a call
    lines.append("local ROW_NAMES = {" + ", ".join(_lua(f) for f in ROW_FIELDS.values()) + "}")
    lines.append("local DIVISION = {" + ", ".join(_lua(f) for f in DIVISION_FIELDS) + "}")
    lines.append(f"local DIVISION_FIELD = {_table(DIVISION_FIELDS)}")
    lines.append(
        "local DIVISION_NAMES = {" + ", ".join(_lua(f) for f in DIVISION_FIELDS.values()) + "}"
    )
    lines.append(f"local LIGHT_FIELD = {_table(LIGHT_FIELDS)}")
    lines.append(f"local CALENDAR = {_lua(CALENDAR)}")
    return "\n".join(lines) + "\n"


# What some scripts share, lua/<name>.lua, put after the contract and before the script.
SHARED: dict[str, tuple[str, ...]] = {RELEASE.script: ("row_at",), "settle": ("row_at",)}


def source(script: str) -> str:
    """What is registered for ``script``: the clock every script reads (clock.lua), the
    contract generated from core/sharing.py, what it shares with others (SHARED), then it."""
    shared = "".join(text(name) for name in SHARED.get(script, ()))
    return text("clock") + contract() + shared + text(script)


def locate(script: str, line: int) -> str:
    """Where line ``line`` of what is registered for ``script`` was written, as "<file>:<line>"
    (a Redis error names the line as ``user_script:<line>``): clock.lua, the contract
    (generated: "contract:<line>"), a file it shares (SHARED), or the script's file, for a
    script kept as parts the part's (a blank line between two parts counts as the earlier
    part's last)."""
    pieces = [("clock.lua", text("clock")), ("contract", contract())]
    pieces += [(f"{name}.lua", text(name)) for name in SHARED.get(script, ())]
    parts = PARTS.get(script)
    if parts is None:
        pieces.append((f"{script}.lua", text(script)))
    else:
        texts = [_file(f"lua/{script}/{part}.lua") for part in parts]
        joined = [t + "\n" for t in texts[:-1]] + texts[-1:]  # as join() puts them
        pieces += [(f"{script}/{part}.lua", t) for part, t in zip(parts, joined, strict=True)]
    at = line
    for name, body in pieces:
        if 1 <= at <= body.count("\n"):
            return f"{name}:{at}"
        at -= body.count("\n")
    raise ValueError(f"{script} has no line {line}")


@dataclass(frozen=True, slots=True)
class Scripts:
    """The scripts as registered with one client (EVALSHA, EVAL after NOSCRIPT)."""

    admit: AsyncScript
    release: AsyncScript
    settle: AsyncScript  # token budgets (store/redis/reservations.py)
    prune: AsyncScript  # stale client rows (store/redis/division.py)


def register(client: "aioredis.Redis | RedisCluster") -> Scripts:
    return Scripts(
        client.register_script(source(ADMIT.script)),
        client.register_script(source(RELEASE.script)),
        client.register_script(source("settle")),
        client.register_script(source("prune")),
    )


def keys(layout: Layout, g: SlotGroup) -> list[str]:
    """A slot group's KEYS for ``layout``'s script."""
    return g.counter_keys + [cap[kind] for cap in g.cap_keys for kind in layout.cap_keys]


# --- arguments -----------------------------------------------------------------------------


def num(x: float) -> str:
    return "inf" if math.isinf(x) else repr(float(x))


@dataclass(frozen=True, slots=True)
class GivenDivision:
    """A division made here for one cap, with the figures of the period before."""

    epoch: str
    values: str  # the division's values in DIVISION_FIELDS order, "," separated
    figures: tuple[str, ...]


_NO_DIVISION = GivenDivision("", "", ("",) * len(FIGURES))


def _kind(c: Counter, around: float) -> tuple[str, str]:
    """(kind, extra) of a counter for the admit script and release.lua: "" a fixed window; "c" a
    calendar one with the boundaries of the window before, this one and the one after
    ``around`` (the script picks by its own clock); "s" sliding; "g" GCRA with its burst
    (admit) and interval (release)."""
    shape = c.shape
    if shape is None:
        return "", ""
    if shape.calendar is not None:
        start, end = shape.calendar.bounds(around)
        before, after = shape.calendar.bounds(start - 1)[0], shape.calendar.bounds(end)[1]
        return "c", f"{before},{start},{end},{after}"
    if shape.algorithm is units.Algorithm.SLIDING:
        return "s", ""
    return "g", str(shape.burst)


def _around(now: str) -> float:
    """The caller's clock, or this host's while Redis TIME decides (calendar boundaries
    are passed around it)."""
    return float(now) if now else time.time()


def _indexes(positions: Sequence[int], of: Sequence[int]) -> str:
    """The 1-based positions in ``of`` of the plan indexes ``positions`` (those present)."""
    return ",".join(str(of.index(i) + 1) for i in positions if i in of)


def admit_args(
    plan: Plan,
    g: SlotGroup,
    now: str,
    lock: tuple[bool, int],
    given: Mapping[str, GivenDivision],
    lease: tuple[str, int] = ("", 0),
) -> list[str | int]:
    """ARGV of the admit script (ADMIT); ``now`` "" = Redis TIME, ``lock`` = (may lock,
    lock ms), ``lease`` = (consumer, hits of the block it asks for; 0 = none)."""
    args: list[str | int] = [now, int(lock[0]), lock[1], lease[0], lease[1], len(g.counters)]
    around = _around(now) if any(plan.counters[i].shape for i in g.counters) else 0.0
    for i in g.counters:
        c = plan.counters[i]
        args += [c.limit, c.window, c.hits, int(c.shadow), int(c.force), *_kind(c, around)]
    args.append(len(g.caps))
    for cap, i in zip(g.caps, g.cap_share, strict=True):
        s = plan.shares[i]
        total = g.counters.index(s.total) + 1 if s.total in g.counters else 0
        lv = given.get(cap) or _NO_DIVISION
        args += [num(s.period), s.window, s.capacity, s.declared, cap, total]
        args += [lv.epoch, lv.values, *lv.figures]
    args.append(len(g.shares))
    deps, parents = below(plan), above(plan)
    for i in g.shares:
        s = plan.shares[i]
        counters, shares = deps[i]
        parent = g.shares.index(parents[i]) + 1 if parents[i] in g.shares else 0
        args += [g.caps.index(s.cap) + 1, s.client, num(s.client_limit), num(s.weight)]
        args += [s.hits, int(s.shadow), int(s.sized)]
        args += [_indexes(counters, g.counters), _indexes(shares, g.shares), int(s.force)]
        args += [parent, int(i in parents)]
    return args


def release_args(plan: Plan, g: SlotGroup, now: str, block: int | None = None) -> list[str | int]:
    """ARGV of release.lua (RELEASE): undo what the admit script charged at ``now`` (not the
    charges of charge_when_over_limit rules: a refused request keeps those), or, with
    ``block``, give back that many unused hits of a lease block granted at ``now``, demand
    included."""
    args: list[str | int] = [now, int(block is not None), len(g.counters)]
    for i in g.counters:
        c = plan.counters[i]
        kind, extra = _kind(c, float(now))
        if kind == "g":
            extra = "0" if c.limit == 0 else repr(smooth.interval(c))
        args += [c.window, block if block is not None else 0 if c.force else c.hits, kind, extra]
    args.append(len(g.caps))
    for i in g.cap_share:
        s = plan.shares[i]
        args += [num(s.period), s.window]
    args.append(len(g.shares))
    for i in g.shares:
        s = plan.shares[i]
        hits = block if block is not None else 0 if s.force else s.hits
        args += [g.caps.index(s.cap) + 1, s.client, hits]
    return args


def rows_of(flat: Sequence[str]) -> dict[str, Row]:
    """core.sharing rows by client from a cap's rows hash (HSCAN's pairs, flat). A loop
    per field: at 100k clients (2.2M fields) this is most of a division's time."""
    values: dict[str, dict[str, str]] = {}
    get = values.get
    pairs = iter(flat)
    for field, value in zip(pairs, pairs, strict=True):
        name, _, client = field.partition(":")
        fields = get(client)
        if fields is None:
            fields = values[client] = {}
        fields[name] = value
    out: dict[str, Row] = {}
    every = _WHOLE_ROW.fields
    for client, fields in values.items():
        # a row partly read (HSCAN) is none: the next division counts it
        row = _WHOLE_ROW.row([fields.get(field) for field in every])
        if row is not None:
            out[client] = row
    return out


class RowReader:
    """Rows from HMGET of some of their fields: those of ``names`` (Row attributes, each
    row's window, limit and weight among them), in that order."""

    def __init__(self, names: Sequence[str]) -> None:
        self.fields = tuple(ROW_FIELDS[name] for name in names)
        self._parse = tuple((name, name in WHOLE_FIELDS) for name in names)
        self._at = tuple(list(names).index(name) for name in ("window", "limit", "weight"))

    def row(self, values: Sequence[str | None]) -> Row | None:
        """The core.sharing row of ``values`` (None: no row), as rows_of makes it, its
        other attributes as a new row has them."""
        window, limit, weight = (values[i] for i in self._at)
        if window is None or limit is None or weight is None:
            return None
        row = Row(float(limit), float(weight))
        for (name, whole), raw in zip(self._parse, values, strict=True):
            if raw is not None:
                setattr(row, name, int(float(raw)) if whole else float(raw))
        return row


_WHOLE_ROW = RowReader(tuple(ROW_FIELDS))


def row_of(values: Sequence[str | None]) -> Row | None:
    """A core.sharing row from HMGET of its fields in ROW_FIELDS order (None: no row), as
    rows_of makes it."""
    return _WHOLE_ROW.row(values)


def division_text(division: Division) -> str:
    """The division's values in DIVISION_FIELDS order, as the admit script reads them."""
    values = (getattr(division, name) for name in DIVISION_FIELDS)
    return ",".join(v if isinstance(v, str) else num(v) for v in values)


# --- replies -------------------------------------------------------------------------------


@dataclass(slots=True)
class Seen:
    """One group's admit script reply: the counters as they stood, and whether it charged."""

    admitted: bool
    now: float
    counts: list[int]
    shared: list[int]
    bounds: list[float]
    rolled: list[int]  # indexes into SlotGroup.caps
    block: int = 0  # hits reserved as a lease block (core/lease.py)
    # per share: the client's want, when a lease block was asked for (else empty)
    wanted: list[float] = dataclasses.field(default_factory=list)
    # per counter: when a sliding or GCRA one is full again (0 for the others), after the
    # call and, for a charge another slot group's refusal takes back, before it
    full_at: list[float] = dataclasses.field(default_factory=list)
    full_before: list[float] = dataclasses.field(default_factory=list)


def seen(reply: Sequence[Any]) -> Seen:
    """The admit script's flat reply: {charged, now, block, counters, shares, rolled, wants},
    then per counter its count, then its full-at times after and before the call, per share
    its admitted count, then its bound, the rolled caps (1-based), the wants."""
    n, k, r, w = (int(x) for x in reply[3:7])
    at = 7
    parts = []
    for size in (n, n, n, k, k, r, w):
        parts.append(reply[at : at + size])
        at += size
    counts, full, was, shared, bounds, rolled, wanted = parts
    return Seen(
        int(reply[0]) == 1,
        float(reply[1]),
        [int(x) for x in counts],
        [int(x) for x in shared],
        [float(x) for x in bounds],
        [int(x) - 1 for x in rolled],
        int(reply[2]),
        [float(x) for x in wanted],
        [float(x) for x in full],
        [float(x) for x in was],
    )
