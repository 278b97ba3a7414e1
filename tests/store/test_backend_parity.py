"""Backend parity, as a Hypothesis differential test: random fair-share configs and random
traffic get exactly the same answers from the memory store and from real Redis (standalone,
and a three-master Cluster), concurrency slots included.

The Redis stores run on the caller's clock (``clock=caller``), so all three see the same
``now``; every decision is compared whole (overall code; per descriptor its code, remaining,
current limit and reset), and a failure names the first step that differs.

One intended difference is kept out rather than tested: on a Cluster a nested cap and the
cap above it may live in different slots, so the nested cap cannot see its parent's share.
The Cluster parity therefore draws no nested cap; memory against one Redis does.
"""

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fairlimit.config.loader import parse_domain
from fairlimit.core.admission import Status
from fairlimit.core.request import Descriptor, Request
from fairlimit.core.rules import Config, Loaded
from fairlimit.limiter import Decision, Limiter
from fairlimit.settings import FailureMode
from fairlimit.store.base import Store
from fairlimit.store.memory import MemoryStore
from helpers import FakeClock, desc, req

pytestmark = [pytest.mark.behaviour, pytest.mark.asyncio]

DOMAIN = "parity"
FLAT = ("c0", "c1", "c2", "c3", "c4")  # clients under the flat cap (route=api)
TENANTS = ("t0", "t1")  # under the nested cap (route=org > tenant > user)
USERS = ("u0", "u1", "u2")
GRID = 0.005  # the clock moves in steps of this many seconds
START = 1_700_000_000.0  # a whole minute + 20 s; each example adds an offset of its own
# Examples per backend pair (the mutation profile's budget caps it: it never runs Redis).
EXAMPLES = min(25, settings.default.max_examples)


# --- configs -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A drawn config: the YAML and what the traffic may name in it."""

    yaml: str
    flat_slots: bool  # a flat descriptor takes a slot (cap or client declares concurrency)
    global_limit: bool  # a plain counter rule generic_key=global beside the caps
    global_slots: bool  # ... that declares concurrency too
    nested: bool  # route=org > tenant > user
    cap_window: int = 1  # seconds, of the flat cap (route=api)
    capacity: int = 0  # ... and its limit
    active: int = 1  # ... and its active_clients


def _limit(unit: str, n: int) -> str:
    return f"rate_limit: {{unit: {unit}, requests_per_unit: {n}}}"


def _slots(n: int | None, ttl: int | None) -> str:
    if n is None:
        return ""
    duration = "" if ttl is None else f", max_duration: {ttl}"
    return f"concurrency: {{max_in_flight: {n}{duration}}}"


def _fair(active: int, weights: dict[str, float]) -> str:
    shown = ", ".join(f"{c}: {w:g}" for c, w in weights.items())
    return f"fair_share: {{active_clients: {active}" + (
        f", weights: {{{shown}}}}}" if weights else "}"
    )


def _node(indent: int, *lines: str, child: str = "") -> str:
    """A descriptor node at ``indent``: its lines (the first as the list item, empty ones
    dropped), then ``child``, a node already indented, under ``descriptors``."""
    pad = " " * indent
    kept = [line for line in lines if line] + (["descriptors:"] if child else [])
    text = [f"{pad}- {kept[0]}", *(f"{pad}  {line}" for line in kept[1:])]
    return "\n".join([*text, child] if child else text)


capacities = st.one_of(st.integers(5, 20), st.integers(5, 200))
units = st.sampled_from(["second", "minute"])
slot_ttls = st.sampled_from([None, 2, 5, 30])  # None: the default 300 s


@st.composite
def configs(draw: st.DrawFn, nested: bool = True, contended: bool = False) -> Shape:
    """A fair-share cap over per-client limits, sometimes a nested tenant cap (``nested``),
    a plain counter and concurrency at the cap, the clients or the counter. ``contended``:
    a small cap declaring 1 to 3 clients, each allowed at least its part of the cap among
    them (so more clients asking enough are held at fractional shares), often exactly
    that: the cap is then sized for the clients it declares, never paced, and a client
    held at its share takes it whole."""
    unit = draw(units)
    capacity = draw(st.integers(5, 20) if contended else capacities)
    active = draw(st.integers(1, 3) if contended else st.integers(1, 6))
    weighted = draw(st.lists(st.sampled_from(FLAT), unique=True, max_size=3))
    weights = {c: draw(st.sampled_from([0.5, 2.0, 3.0])) for c in weighted}
    even = max(1, capacity // active)  # capacity / active: the client limit below or above
    # contended: from the most that keeps the cap sized for the clients it declares up
    below = st.integers(1, even) if not contended else st.nothing()
    client_limit = draw(st.just(even) | st.integers(even, 2 * capacity) | below)
    client_unit = draw(st.just(unit) if contended else st.one_of(st.just(unit), units))
    # No concurrency cap on the fair-share cap itself: its fair split of slots differs on
    # Redis after a release (SLOT_RELEASED below, a known difference kept as its own test).
    where = draw(st.sampled_from(["none", "none", "client", "global"]))
    global_limit = where == "global" or draw(st.booleans())
    ttl = draw(slot_ttls)
    cap_slots = draw(st.integers(1, 8)) if where in ("cap", "both") else None
    client_slots = draw(st.integers(1, 4)) if where in ("client", "both") else None
    global_slots = draw(st.integers(1, 6)) if where == "global" else None
    nodes = [
        _node(
            2,
            "key: route",
            "value: api",
            _limit(unit, capacity),
            _fair(active, weights),
            _slots(cap_slots, ttl),
            child=_node(
                6, "key: client_id", _limit(client_unit, client_limit), _slots(client_slots, ttl)
            ),
        )
    ]
    with_nested = nested and draw(st.booleans())
    if with_nested:
        org_unit = draw(units)
        org = draw(capacities)
        tenant = draw(st.integers(1, max(1, org)))
        user = draw(st.integers(1, max(1, tenant)) | st.integers(1, 2 * tenant))
        tenant_weights = draw(st.sampled_from([{}, {"t0": 2.0}]))
        user_weights = draw(st.sampled_from([{}, {"u1": 3.0}]))
        nodes.append(
            _node(
                2,
                "key: route",
                "value: org",
                _limit(org_unit, org),
                _fair(draw(st.integers(1, 4)), tenant_weights),
                child=_node(
                    6,
                    "key: tenant",
                    _limit(org_unit, tenant),
                    _fair(draw(st.integers(1, 4)), user_weights),
                    child=_node(10, "key: user", _limit(draw(units), user)),
                ),
            )
        )
    if global_limit:
        nodes.append(
            _node(
                2,
                "key: generic_key",
                "value: global",
                _limit(draw(units), draw(capacities)),
                _slots(global_slots, ttl),
            )
        )
    yaml = f"domain: {DOMAIN}\ndescriptors:\n" + "\n".join(nodes) + "\n"
    flat_slots = cap_slots is not None or client_slots is not None
    window = 1 if unit == "second" else 60
    return Shape(
        yaml, flat_slots, global_limit, global_slots is not None, with_nested, window, capacity,
        active,
    )  # fmt: skip


# --- traffic -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """One request: which descriptors, its hits, and the request id it takes slots with."""

    flat: str | None  # a flat client, or None
    nested: tuple[str, str] | None  # (tenant, user), or None
    global_: bool
    hits: int | None  # None: Envoy's default (1)
    per_descriptor: bool  # hits as each descriptor's hits_addend, else the request's
    reuse: int | None  # reuse the id of an earlier request (a duplicate), else a fresh one


@dataclass(frozen=True)
class Done:
    """A stream-done call: gives back the slots of the ``which``-th earlier request, or of an
    id never sent (``which`` None)."""

    which: int | None


@dataclass(frozen=True)
class Step:
    ticks: int  # the clock moves ticks x GRID seconds first
    action: Ask | Done


ticks = st.one_of(st.just(0), st.integers(0, 40), st.integers(0, 300))  # up to 1.5 s
hit_counts = st.one_of(st.none(), st.sampled_from([0, 1, 2, 3, 5]), st.integers(0, 20))


@st.composite
def asks(draw: st.DrawFn, shape: Shape) -> Ask:
    targets = ["flat", "flat", "flat"] + (["nested", "nested"] if shape.nested else [])
    if shape.global_limit:
        targets += ["global", "flat+global"] + (["nested+global"] if shape.nested else [])
    target = draw(st.sampled_from(targets))
    flat = draw(st.sampled_from(FLAT)) if "flat" in target else None
    nested = (
        (draw(st.sampled_from(TENANTS)), draw(st.sampled_from(USERS)))
        if "nested" in target
        else None
    )
    reuse = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, 299)))
    return Ask(flat, nested, "global" in target, draw(hit_counts), draw(st.booleans()), reuse)


@st.composite
def traffic(draw: st.DrawFn, shape: Shape) -> list[Step]:
    """Up to 300 steps; stream-done calls only where some descriptor takes slots."""
    slots = shape.flat_slots or shape.global_slots
    action = asks(shape)
    if slots:
        action = st.one_of(action, action, st.builds(Done, st.none() | st.integers(0, 299)))
    # A drawn floor: a list's own length averages a handful of steps, and with a floor of
    # n it averages about 2n, so most examples carry traffic enough to fill windows, contend
    # and hold slots; the shrinker lowers the floor and then drops steps one by one.
    floor = draw(st.one_of(st.integers(1, 10), st.sampled_from([40, 80, 120, 150])))
    return draw(st.lists(st.builds(Step, ticks, action), min_size=floor, max_size=300))


@st.composite
def rounds(draw: st.DrawFn, shape: Shape) -> list[Step]:
    """Steady contention at the flat cap over several of its windows in a row: 2 to 5
    clients, each asking its own number of times a window, evenly spread from a phase of
    its own, from a window of its own to a later one (so newcomers arrive and clients go
    quiet), now and then with the plain counter's descriptor too. The random steps above
    seldom fill a cap two windows in a row, and a minute cap's never: yet that is where
    fairness v3's history and prediction build up, and where a fraction of a client's
    share is carried to the next window as a credit (core/sharing.py, lua/admit/rows.lua)."""
    windows = draw(st.integers(3, 6))
    # more clients than the cap declares, mostly: its share is then under their limits
    many = draw(st.integers(min(shape.active + 1, len(FLAT)), len(FLAT)) | st.integers(2, 5))
    clients = draw(st.permutations(FLAT))[:many]
    hits = draw(st.sampled_from([None, None, 1, 2]))
    even = max(1, shape.capacity // len(clients))  # about each one's share
    per_window = round(shape.cap_window / GRID)
    events: list[tuple[int, str, bool]] = []
    for client in clients:
        times = draw(st.integers(even + 1, 3 * even + 2) | st.integers(1, even))
        # spread over the whole window, or over a part of it from a phase (0: a burst)
        span = draw(st.sampled_from([1.0, 1.0, 0.5, 0.1, 0.0]))
        phase = draw(st.integers(0, 99)) / 100 * (1 - span)
        first = draw(st.integers(0, windows - 3))
        last = draw(st.integers(first + 3, windows))
        both = shape.global_limit and draw(st.booleans())
        events += [
            (round((w + phase + span * j / times) * per_window), client, both)
            for w in range(first, last)
            for j in range(times)
        ]
    return _in_order(events, hits)


def _in_order(events: list[tuple[int, str, bool]], hits: int | None) -> list[Step]:
    """Steps from (tick, flat client, with the plain counter too) events, the first 300."""
    steps: list[Step] = []
    now = 0
    for at, client, both in sorted(events)[:300]:
        steps.append(Step(at - now, Ask(client, None, both, hits, False, None)))
        now = at
    return steps


@st.composite
def contention(draw: st.DrawFn) -> tuple[Shape, float, list[Step]]:
    """(config, the clock's start, traffic): rounds only."""
    shape = draw(configs(nested=True, contended=True))
    offset = draw(st.integers(0, int(60 / GRID) - 1)) * GRID
    return shape, START + offset, draw(rounds(shape))


@st.composite
def cases(draw: st.DrawFn, nested: bool = True) -> tuple[Shape, float, list[Step]]:
    """(config, the clock's start, traffic): random steps, or (as often) rounds at a cap
    small enough for its clients to fill it every window."""
    in_rounds = draw(st.booleans())
    shape = draw(configs(nested, contended=in_rounds))
    offset = draw(st.integers(0, int(60 / GRID) - 1)) * GRID  # anywhere in a minute
    return shape, START + offset, draw(rounds(shape) if in_rounds else traffic(shape))


# --- running -----------------------------------------------------------------------------


@dataclass
class Trace:
    """The requests sent so far: each one's descriptors that carried a request id."""

    sent: list[tuple[str, list[tuple[str, ...]]]] = field(default_factory=list)


def _request(shape: Shape, step: Step, index: int, trace: Trace) -> Request:
    """The Request for ``step`` (the index-th), noting its slot-taking descriptors."""
    action = step.action
    if isinstance(action, Done):
        if action.which is None or not trace.sent:
            own = ("route=api", "client_id=c0") if shape.flat_slots else ("generic_key=global",)
            rid, held = f"ghost{index}", [own]  # an id nobody took
        else:
            rid, held = trace.sent[action.which % len(trace.sent)]
        return req(DOMAIN, *[desc(*entries, f"request_done={rid}") for entries in held])
    rid = f"r{index}"
    if action.reuse is not None and trace.sent:
        rid = trace.sent[action.reuse % len(trace.sent)][0]  # an id in flight, or once was
    hits = action.hits if action.per_descriptor else None
    parts: list[tuple[tuple[str, ...], bool]] = []
    if action.flat is not None:
        parts.append((("route=api", f"client_id={action.flat}"), shape.flat_slots))
    if action.nested is not None:
        tenant, user = action.nested
        parts.append((("route=org", f"tenant={tenant}", f"user={user}"), False))
    if action.global_:
        parts.append((("generic_key=global",), shape.global_slots))
    descriptors: list[Descriptor] = []
    held: list[tuple[str, ...]] = []
    for entries, slots in parts:
        if slots:
            held.append(entries)
            descriptors.append(desc(*entries, f"request_id={rid}", hits=hits))
        else:
            descriptors.append(desc(*entries, hits=hits))
    if held:
        trace.sent.append((rid, held))
    request_hits = 0 if action.per_descriptor or action.hits is None else action.hits
    return req(DOMAIN, *descriptors, hits=request_hits)


def _status_view(s: Status) -> tuple[object, ...]:
    limit = s.current_limit
    shown = None if limit is None else (limit.requests_per_unit, limit.unit.name)
    return (s.code.name, s.limit_remaining, shown, s.duration_until_reset)


def view(decision: Decision) -> tuple[object, ...]:
    """What Envoy sees of a decision: the code, and each descriptor's status."""
    return (decision.code.name, tuple(_status_view(s) for s in decision.statuses))


def _loaded(yaml: str) -> Loaded:
    return Loaded(Config.of([parse_domain(yaml, "parity.yaml")]), (), ())


def _history(steps: Sequence[Step]) -> str:
    """The steps one a line, a run of equal steps on one line."""
    lines: list[str] = []
    i = 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[i]:
            j += 1
        shown = f"+{steps[i].ticks * GRID:.3f}s {steps[i].action}"
        lines.append(f"  {i}: {shown}" if i == j else f"  {i}-{j}: {j - i + 1} x {shown}")
        i = j + 1
    return "\n".join(lines)


async def _registry_writes(store: object) -> None:
    """Let a RedisStore's background cap-registry writes finish (none for the others)."""
    writes = getattr(getattr(store, "_registry", None), "tasks", ())
    await asyncio.gather(*writes, return_exceptions=True)


async def _compare(
    shape: Shape, start: float, steps: Sequence[Step], stores: Sequence[Store], names: list[str]
) -> None:
    clock = FakeClock(start)
    loaded = _loaded(shape.yaml)
    # closed: a store that fails raises, never answers with the failure mode's OK
    limiters = [Limiter(loaded, store, clock, failure_mode=FailureMode.CLOSED) for store in stores]
    trace = Trace()
    ticks = 0
    for index, step in enumerate(steps):
        ticks += step.ticks
        clock.t = start + ticks * GRID  # on the grid, without a sum's rounding drift
        request = _request(shape, step, index, trace)
        answers = [view(await limiter.should_rate_limit(request)) for limiter in limiters]
        if any(a != answers[0] for a in answers[1:]):
            lines = [f"  {n}: {a}" for n, a in zip(names, answers, strict=True)]
            history = _history(steps[: index + 1])
            pytest.fail(
                f"step {index} differs (t = {clock.now() - start:.3f}s after the start "
                f"{start!r}):\n  request: {request}\n"
                + "\n".join(lines)
                + f"\nconfig:\n{shape.yaml}steps:\n{history}",
                pytrace=False,
            )


StoreFactory = Callable[..., Awaitable[object]]


async def _parity(
    factory: StoreFactory, name: str, case: tuple[Shape, float, list[Step]], **options: object
) -> None:
    """One example: a fresh memory store and a fresh (flushed) Redis store, side by side."""
    shape, start, steps = case
    memory: Store = MemoryStore()
    other: Store = await factory(**options)  # type: ignore[assignment]
    try:
        await _compare(shape, start, steps, [memory, other], ["memory", name])
    finally:
        # RedisStore.close() cancels its background cap-registry writes without awaiting
        # them, and a write cancelled mid-call leaks its connection (an unclosed-connection
        # ResourceWarning, an error under filterwarnings=error, at some later test): they
        # are let finish first.
        await _registry_writes(other)
        await other.close()
        await memory.close()


# --- differences found: the minimal reproductions, replayed first ------------------------
# Each failed here when it was found (memory and Redis answering differently); kept as an
# explicit example so that the reproduction runs before any drawn case, on both pairs.


def _ask(client: str | None, hits: int | None = None, ticks: int = 0, glob: bool = False) -> Step:
    """A request by a flat client (or none), with the plain counter's descriptor when
    ``glob``; ``hits`` as the request's hits_addend; ``ticks`` grid steps later."""
    return Step(ticks, Ask(client, None, glob, hits, False, None))


def _nested(tenant: str, user: str, hits: int | None = None, ticks: int = 0) -> Step:
    """A request by ``user`` of ``tenant`` under the nested caps, ``ticks`` grid steps later."""
    return Step(ticks, Ask(None, (tenant, user), False, hits, False, None))


# A request under nested caps that finds both caps newly contended (t1 at the org cap, u0 at
# t1's): memory remakes both divisions with it counted. Redis handed back for the divisions
# due, then for the org cap's remake, and its third and last call could not lock: t1's cap
# decided on the division before and gave u0 a share of 0 where memory gave 7 (the last
# step's current_limit). Now a call may hand back once more per cap of its group.
NESTED_FORCED = (
    Shape(
        f"""domain: {DOMAIN}
descriptors:
  - key: route
    value: org
    rate_limit: {{unit: minute, requests_per_unit: 45}}
    fair_share: {{active_clients: 1}}
    descriptors:
      - key: tenant
        rate_limit: {{unit: minute, requests_per_unit: 34}}
        fair_share: {{active_clients: 1}}
        descriptors:
          - key: user
            rate_limit: {{unit: second, requests_per_unit: 34}}
""",
        flat_slots=False,
        global_limit=False,
        global_slots=False,
        nested=True,
    ),
    START + 7.56,
    [
        _nested("t0", "u0", 7),
        _nested("t0", "u0", 5, ticks=67),
        _nested("t1", "u2", 5, ticks=35),
        _nested("t1", "u0"),
        _nested("t1", "u2", 8, ticks=42),
        _nested("t1", "u0", 11, ticks=44),
    ],
)


# The over-limit cache of the Redis store answers a request whose client counter a
# rejection found over, without Redis, reporting the client's own limit (2/s) where memory
# reports its fair share at the cap (1/s, as c1 has arrived): step 4's current_limit.
CACHED_OVER_LIMIT = (
    Shape(
        f"""domain: {DOMAIN}
descriptors:
  - key: route
    value: api
    rate_limit: {{unit: second, requests_per_unit: 3}}
    fair_share: {{active_clients: 1}}
    descriptors:
      - key: client_id
        rate_limit: {{unit: second, requests_per_unit: 2}}
""",
        flat_slots=False,
        global_limit=False,
        global_slots=False,
        nested=False,
    ),
    START,
    [_ask("c0"), _ask("c0"), _ask("c1"), _ask("c0"), _ask("c0")],
)

# The same cache changes a later answer: a request it refuses (the plain counter over)
# never reaches the cap, so Redis does not count that demand there while memory does (a cap
# sees what the levels below it admit), and c2's last request is refused on memory,
# admitted on Redis.
CACHED_DEMAND = (
    Shape(
        f"""domain: {DOMAIN}
descriptors:
  - key: route
    value: api
    rate_limit: {{unit: second, requests_per_unit: 4}}
    fair_share: {{active_clients: 1}}
    descriptors:
      - key: client_id
        rate_limit: {{unit: second, requests_per_unit: 5}}
  - key: generic_key
    value: global
    rate_limit: {{unit: minute, requests_per_unit: 1}}
""",
        flat_slots=False,
        global_limit=True,
        global_slots=False,
        nested=False,
    ),
    START,
    [
        *[_ask("c1")] * 3,
        _ask(None, 2, glob=True),
        _ask("c2", 2, glob=True),
        _ask("c2", 2, ticks=50),
    ],
)

# A concurrency cap of one slot: c0 takes it and gives it back, then c1 asks for it at the
# same instant. Memory admits c1; Redis refuses it, as its fair bound at the cap comes from
# the cap's state the last acquire returned (c0 holding the slot), which the release does
# not update (store/redis/slots.py).
SLOT_RELEASED = (
    Shape(
        f"""domain: {DOMAIN}
descriptors:
  - key: route
    value: api
    fair_share: {{active_clients: 1}}
    concurrency: {{max_in_flight: 1}}
    descriptors:
      - key: client_id
""",
        flat_slots=True,
        global_limit=False,
        global_slots=False,
        nested=False,
    ),
    START,
    [_ask("c0"), Step(0, Done(0)), _ask("c1")],
)

# Three clients at a cap of 10 a second sized for the 2 it declares (5 a second each), each
# asking 6 times a second, evenly, for 8 seconds: each is held at 3.33 and admitted 3, and
# the third of a hit it is owed each second is carried as a credit until it makes a whole
# one (a 4 every third second). The random steps never drew it: a credit term dropped from
# the memory store (core/sharing.py) was seen by no parity test.
CREDITS = (
    Shape(
        f"""domain: {DOMAIN}
descriptors:
  - key: route
    value: api
    rate_limit: {{unit: second, requests_per_unit: 10}}
    fair_share: {{active_clients: 2}}
    descriptors:
      - key: client_id
        rate_limit: {{unit: second, requests_per_unit: 5}}
""",
        flat_slots=False,
        global_limit=False,
        global_slots=False,
        nested=False,
    ),
    START,
    _in_order(
        [
            (round((w + (j + k / 10) / 6) / GRID), FLAT[k], False)
            for w in range(8)
            for k in range(3)
            for j in range(6)
        ],
        None,
    ),
)

_settings = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# The drawn cases run without the Redis store's local over-limit cache: a request it
# answers (its client's own counter over) reports the fair share it saw at its last Redis
# call, where memory reports the current one (CACHED_OVER_LIMIT); the code agrees.
NO_CACHE = {"local_cache": 0}


class TestBackendParity:
    @_settings
    @given(case=cases(nested=True))
    @example(case=CREDITS)
    @example(case=NESTED_FORCED)
    async def test_memory_and_redis_agree(
        self, redis_store_factory: StoreFactory, case: tuple[Shape, float, list[Step]]
    ) -> None:
        """Memory and one standalone Redis: the same answer to every request, nested caps
        included."""
        await _parity(redis_store_factory, "redis", case, **NO_CACHE)

    @_settings
    @given(case=contention())
    @example(case=CREDITS)
    async def test_memory_and_redis_agree_under_steady_contention(
        self, redis_store_factory: StoreFactory, case: tuple[Shape, float, list[Step]]
    ) -> None:
        """Memory and one standalone Redis over rounds at a small cap only: a credit
        decides some answer in about one of these in five (one in ten of the mixed draws
        above; docs/mutation.md), so that 25 examples all but always reach one."""
        await _parity(redis_store_factory, "redis", case, **NO_CACHE)

    @_settings
    @given(case=cases(nested=False))
    @example(case=CREDITS)
    async def test_memory_and_redis_cluster_agree(
        self, redis_cluster_store_factory: StoreFactory, case: tuple[Shape, float, list[Step]]
    ) -> None:
        """Memory and a three-master Redis Cluster: the same answer to every request (no
        nested caps: see the module docstring); a request over the cap and the plain
        counter spans two slots."""
        await _parity(redis_cluster_store_factory, "redis-cluster", case, **NO_CACHE)


class TestKnownDifferences:
    """Differences this test found and that are not fixed yet: each must still differ (a
    fix makes its test fail, to be moved into the examples above)."""

    @pytest.mark.xfail(strict=True, reason="the over-limit cache reports a stale fair share")
    async def test_a_cached_refusal_reports_the_share_seen_last(
        self, redis_store_factory: StoreFactory
    ) -> None:
        """With its local cache, Redis answers c0's refusal with the share it last saw."""
        await _parity(redis_store_factory, "redis", CACHED_OVER_LIMIT)

    @pytest.mark.xfail(strict=True, reason="the over-limit cache hides demand from the cap")
    async def test_a_cached_refusal_is_demand_at_the_cap(
        self, redis_store_factory: StoreFactory
    ) -> None:
        """A refusal the Redis cache answers is not counted as demand at the cap."""
        await _parity(redis_store_factory, "redis", CACHED_DEMAND)

    @pytest.mark.xfail(strict=True, reason="store/redis/slots.py: a release leaves the bound")
    async def test_a_slot_given_back_is_found_by_the_next_client(
        self, redis_store_factory: StoreFactory
    ) -> None:
        """One slot at a fair-share cap, taken, given back, asked for at the same instant."""
        await _parity(redis_store_factory, "redis", SLOT_RELEASED, **NO_CACHE)


# --- several limits per rule, any window, sliding and GCRA --------------------------------

LIMITED = ("a", "b")  # the values of the limited key


@st.composite
def one_limit(draw: st.DrawFn) -> str:
    """A limit of any window and algorithm (flow-style YAML)."""
    n = draw(st.integers(0, 12))
    window = draw(
        st.sampled_from(
            ["unit: second", "unit: minute", "unit: second, multiplier: 3", "duration: 2s",
             "duration: 7s", "unit: day, calendar: UTC", "unit: day, calendar: Asia/Kolkata"]
        )
    )  # fmt: skip
    algorithm = (
        "fixed" if "calendar" in window else draw(st.sampled_from(["fixed", "sliding", "gcra"]))
    )
    if algorithm == "gcra":
        n = max(n, 1)
        burst = draw(st.integers(0, 6))
        return f"{{{window}, requests_per_unit: {n}, algorithm: gcra, burst: {burst}}}"
    return f"{{{window}, requests_per_unit: {n}, algorithm: {algorithm}}}"


@st.composite
def limit_configs(draw: st.DrawFn) -> str:
    """Two nodes of one to three limits each (no two counting the same window alike)."""
    nodes = []
    for key in ("user", "route"):
        limits = draw(st.lists(one_limit(), min_size=1, max_size=3, unique=True))
        kinds = {line.split(", requests_per_unit")[0] + line.split("algorithm:")[-1][:4]
                 for line in limits}  # fmt: skip
        if len(kinds) < len(limits):
            limits = limits[:1]
        shown = "\n".join(f"      - {line}" for line in limits)
        nodes.append(f"  - key: {key}\n    rate_limits:\n{shown}")
    return f"domain: {DOMAIN}\ndescriptors:\n" + "\n".join(nodes) + "\n"


@dataclass(frozen=True)
class Hit:
    ticks: int
    user: str | None
    route: str | None
    hits: int | None


hit_steps = st.builds(
    Hit,
    ticks,
    st.sampled_from([None, *LIMITED]),
    st.sampled_from([None, "a"]),
    st.one_of(st.none(), st.integers(0, 4)),
)


async def _compare_limits(yaml: str, start: float, steps: Sequence[Hit], stores: Sequence[Store],
                          names: list[str]) -> None:  # fmt: skip
    clock = FakeClock(start)
    limiters = [Limiter(_loaded(yaml), s, clock, failure_mode=FailureMode.CLOSED) for s in stores]
    t = 0
    for index, step in enumerate(steps):
        t += step.ticks
        clock.t = start + t * GRID
        parts = [desc(f"user={step.user}", hits=step.hits)] if step.user else []
        if step.route:
            parts.append(desc(f"route={step.route}", hits=step.hits))
        if not parts:
            continue
        request = req(DOMAIN, *parts)
        answers = [view(await limiter.should_rate_limit(request)) for limiter in limiters]
        if any(a != answers[0] for a in answers[1:]):
            lines = [f"  {n}: {a}" for n, a in zip(names, answers, strict=True)]
            pytest.fail(
                f"step {index} differs at t = {clock.t!r}:\n  request: {request}\n"
                + "\n".join(lines)
                + f"\nconfig:\n{yaml}steps: {list(steps[: index + 1])}",
                pytrace=False,
            )


async def _limit_parity(factory: StoreFactory, name: str, yaml: str, start: float,
                        steps: list[Hit]) -> None:  # fmt: skip
    memory: Store = MemoryStore()
    other: Store = await factory()  # type: ignore[assignment]
    try:
        await _compare_limits(yaml, start, steps, [memory, other], ["memory", name])
    finally:
        await _registry_writes(other)
        await other.close()
        await memory.close()


limit_starts = st.integers(0, int(60 / GRID) - 1).map(lambda k: START + k * GRID)


@st.composite
def limit_traffic(draw: st.DrawFn) -> list[Hit]:
    """Up to 200 steps, with a drawn floor as ``traffic`` has, so that windows fill."""
    floor = draw(st.one_of(st.integers(1, 10), st.sampled_from([40, 80, 120])))
    return draw(st.lists(hit_steps, min_size=floor, max_size=200))


class TestLimitsParity:
    """Several limits per rule, multiples, durations, calendar days, sliding and GCRA: the
    same answers from memory and Redis, standalone and Cluster (a request over both nodes
    spans two slots there)."""

    @_settings
    @given(yaml=limit_configs(), start=limit_starts, steps=limit_traffic())
    async def test_memory_and_redis_agree(
        self, redis_store_factory: StoreFactory, yaml: str, start: float, steps: list[Hit]
    ) -> None:
        await _limit_parity(redis_store_factory, "redis", yaml, start, steps)

    @_settings
    @given(yaml=limit_configs(), start=limit_starts, steps=limit_traffic())
    async def test_memory_and_redis_cluster_agree(
        self,
        redis_cluster_store_factory: StoreFactory,
        yaml: str,
        start: float,
        steps: list[Hit],
    ) -> None:
        await _limit_parity(redis_cluster_store_factory, "redis-cluster", yaml, start, steps)
