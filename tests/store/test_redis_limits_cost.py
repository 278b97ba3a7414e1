"""Redis-only: several limits on one rule cost one script call per request, as one limit does.

A rule's limits (``rate_limits``: fixed, sliding, GCRA) are counters of one descriptor, so
their keys share the descriptor's hash tag and sit in one slot group: the admit script checks and
charges them all in the one call (store/redis/store.py). Counted on the real server: the
script calls in ``INFO commandstats``, and every command clients sent (MONITOR, which tells
them apart from the commands a script runs inside Redis), so that a store making a call, or
sending any other command, per limit fails here. Memory has no calls to count; its cost per
limit is measured by ``python bench/limits.py``.
"""

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from fairlimit.core.admission import Code
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import plan as make_plan
from fairlimit.core.rules import Loaded
from fairlimit.core.sharing import SPLIT
from fairlimit.limiter import Limiter
from fairlimit.store.redis import RedisStore, division_rows
from helpers import FakeClock, desc, load_text, req
from redis_servers import RedisClusterProcesses, RedisProcess, StoreFactory

pytestmark = pytest.mark.behaviour

T0 = 1_700_000_040.25  # a quarter into a whole minute: every window of CONFIG is open
N = 40  # requests counted per case
SUB_PERIOD = 1 / SPLIT  # a 1-second cap's division is remade at most this often
SCRIPT_COMMANDS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")
# Sent by this test's own helpers, not by the store: left out of every count.
OURS = frozenset({"info", "echo", "monitor"})
# Limits large enough that N requests at one instant are all admitted (GCRA: burst + 1 at
# once); "three" and the clients' limits under the caps: fixed per-second, sliding
# per-minute, GCRA with a burst. "tight": the same with a GCRA that refuses after 5.
CONFIG = """
domain: cost
descriptors:
  - key: one
    rate_limit: {unit: second, requests_per_unit: 1000}
  - key: three
    rate_limits:
      - {unit: second, requests_per_unit: 1000}
      - {unit: minute, requests_per_unit: 10000, algorithm: sliding}
      - {unit: second, requests_per_unit: 100, algorithm: gcra, burst: 200}
  - key: tight
    rate_limits:
      - {unit: second, requests_per_unit: 1000}
      - {unit: minute, requests_per_unit: 10000, algorithm: sliding}
      - {unit: second, requests_per_unit: 10, algorithm: gcra, burst: 4}
  - key: tenant
    value: one
    rate_limit: {unit: second, requests_per_unit: 100000}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 1000}
  - key: tenant
    value: three
    rate_limit: {unit: second, requests_per_unit: 100000}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limits:
          - {unit: second, requests_per_unit: 1000}
          - {unit: minute, requests_per_unit: 10000, algorithm: sliding}
          - {unit: second, requests_per_unit: 100, algorithm: gcra, burst: 200}
  - key: tenant
    value: capped-twice
    rate_limits:
      - {unit: second, requests_per_unit: 100000}
      - {unit: minute, requests_per_unit: 1000000}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limits:
          - {unit: second, requests_per_unit: 1000}
          - {unit: minute, requests_per_unit: 10000, algorithm: sliding}
          - {unit: second, requests_per_unit: 100, algorithm: gcra, burst: 200}
"""


@dataclass(frozen=True)
class Case:
    """A rule to ask: its descriptor, the counters and caps its plan holds, and the admit
    script calls of the first request of a later sub-period (a cap's division in force is
    then stale, and that request hands it back to be remade: one call more, for every cap
    of the plan at once; each cap's rows are read by a call of read_rows.lua besides)."""

    entries: tuple[str, ...]
    counters: int
    caps: int
    next_calls: int


CASES = {
    "1 limit": Case(("one=a",), 1, 0, 1),
    "3 limits": Case(("three=a",), 3, 0, 1),
    "1 limit under a fair_share cap": Case(("tenant=one", "client_id=a"), 2, 1, 2),
    "3 limits under a fair_share cap": Case(("tenant=three", "client_id=a"), 4, 1, 2),
    "3 limits under a cap of 2 limits": Case(("tenant=capped-twice", "client_id=a"), 5, 2, 2),
}


@pytest.fixture
def loaded(tmp_path: Path) -> Loaded:
    return load_text(tmp_path, CONFIG)


@dataclass
class Seen:
    """What MONITOR showed: the commands clients sent and those scripts ran, by name."""

    sent: Counter[str]
    in_scripts: Counter[str]


class Watch:
    """INFO commandstats and MONITOR on every node, over connections opened before anything
    is counted (a new connection's HELLO would be counted with the requests otherwise)."""

    def __init__(self, nodes: Sequence[RedisProcess], stack: ExitStack) -> None:
        self._clients = [stack.enter_context(node.client()) for node in nodes]
        self._monitors = []
        for node in nodes:
            client = stack.enter_context(redis.Redis(port=node.port, socket_timeout=10))
            self._monitors.append(stack.enter_context(client.monitor()))

    def _stats(self) -> Iterator[tuple[str, dict[str, int]]]:
        for client in self._clients:
            stats = client.info("commandstats")
            for key, row in stats.items():
                yield key.removeprefix("cmdstat_"), row

    def script_calls(self) -> int:
        """Script calls that ran, over every node (a NOSCRIPT answer is a failed call, then
        the script is loaded and called again: not a round trip of ours)."""
        return sum(int(row["calls"]) - int(row["failed_calls"])
                   for name, row in self._stats() if name in SCRIPT_COMMANDS)  # fmt: skip

    def commands(self) -> int:
        """Every command run so far over every node, the ones scripts run inside Redis
        included (INFO commandstats counts both), this test's own left out."""
        return sum(int(row["calls"]) for name, row in self._stats() if name not in OURS)

    def read(self) -> Seen:
        """The commands since the last read, up to a marker sent now to each node."""
        marker = f"end-{uuid.uuid4().hex}"
        seen = Seen(Counter(), Counter())
        for client, monitor in zip(self._clients, self._monitors, strict=True):
            client.echo(marker)
            while True:
                command = monitor.next_command()
                name = command["command"].split(" ", 1)[0].lower()
                if command["client_type"] == "lua":
                    seen.in_scripts[name] += 1
                elif marker in command["command"]:
                    break
                elif name not in OURS:
                    seen.sent[name] += 1
        return seen


@contextmanager
def watching(nodes: Sequence[RedisProcess]) -> Iterator[Watch]:
    with ExitStack() as stack:
        yield Watch(nodes, stack)


@dataclass
class Cost:
    """What a rule's requests cost on the server."""

    calls: int  # script calls of N requests at one instant, after a first one
    seen: Seen  # what MONITOR saw of those N
    commands: int  # commandstats: every command of the N, the scripts' included
    next_calls: int  # script calls of the first request of the next sub-period (its rows'
    # reads for the division included)
    next_seen: Seen


async def _settled(store: RedisStore) -> None:
    """Let the background cap-registry write of a request that made a division finish (it
    would be counted with the requests after it otherwise)."""
    await asyncio.gather(*store._registry.tasks, return_exceptions=True)


async def measure(
    store: RedisStore, loaded: Loaded, nodes: Sequence[RedisProcess], entries: tuple[str, ...],
    concurrent: bool = False,
) -> Cost:  # fmt: skip
    """A first request (the script loaded, a cap's first division made; the script that
    reads a division's rows loaded too: nothing of its loading is counted below, whichever
    test ran on the server before), N more at the same instant, one after another or all at
    once, then one a sub-period later; every one must be admitted."""
    clock = FakeClock(T0)
    limiter = Limiter(loaded, store, clock)
    request = req("cost", desc(*entries))
    with watching(nodes) as watch:
        assert (await limiter.should_rate_limit(request)).code is Code.OK
        await _settled(store)
        await division_rows.read_clients(store._client, "{cost}warm", ["nobody"], 5.0)
        watch.read()
        calls, commands = watch.script_calls(), watch.commands()
        if concurrent:
            many = (limiter.should_rate_limit(request) for _ in range(N))
            decisions = await asyncio.gather(*many)
        else:
            decisions = [await limiter.should_rate_limit(request) for _ in range(N)]
        calls = watch.script_calls() - calls
        seen = watch.read()
        commands = watch.commands() - commands
        clock.advance(SUB_PERIOD)
        next_calls = watch.script_calls()
        decisions.append(await limiter.should_rate_limit(request))
        await _settled(store)
        next_calls = watch.script_calls() - next_calls
        next_seen = watch.read()
    assert [d.code for d in decisions] == [Code.OK] * (N + 1)
    return Cost(calls, seen, commands, next_calls, next_seen)


def _check_shape(loaded: Loaded, case: Case) -> None:
    """The plan holds the counters and caps the case says: the counts below are of what
    the case claims."""
    plan = make_plan(req("cost", desc(*case.entries)), Matcher(loaded.config))
    assert (len(plan.counters), len(plan.shares)) == (case.counters, case.caps)


def _assert_one_call_each(cost: Cost, case: Case) -> None:
    assert cost.calls == N  # one call per request, not one per limit (3 x N)
    assert cost.seen.sent == Counter({"evalsha": N})  # and no other command beside it
    # MONITOR saw every command commandstats counted: nothing went by unseen
    assert cost.commands == N + sum(cost.seen.in_scripts.values())
    # the division remade reads its rows outside the admit script (per cap: the clients
    # written lately, one ZRANGE step, and the one client's row, one read_rows.lua call)
    assert cost.next_calls == case.next_calls + case.caps
    sent = cost.next_seen.sent
    assert sent.pop("evalsha") == case.next_calls + case.caps
    if case.caps:  # and is added to the caps' registry (a pipeline)
        assert sent == Counter({"sadd": 1, "expire": 1, "zrange": case.caps})
    else:
        assert not sent


class TestOneScriptCallPerRequest:
    """One limit or three, fixed, sliding and GCRA, with or without a fair_share cap (of one
    limit or two) above them: one EVALSHA per request, and nothing else on the wire."""

    @pytest.mark.parametrize("name", list(CASES))
    async def test_standalone(
        self, redis_store_factory: StoreFactory, redis_server: RedisProcess, loaded: Loaded,
        name: str,
    ) -> None:  # fmt: skip
        case = CASES[name]
        _check_shape(loaded, case)
        store = await redis_store_factory()
        assert isinstance(store, RedisStore)
        try:
            cost = await measure(store, loaded, [redis_server], case.entries)
        finally:
            await store.close()
        _assert_one_call_each(cost, case)
        # the store's own count agrees: the first request, N, the next sub-period's
        assert store.round_trips == 1 + N + case.next_calls

    @pytest.mark.parametrize("name", list(CASES))
    async def test_cluster(
        self, redis_cluster_store_factory: StoreFactory, redis_cluster: RedisClusterProcesses,
        loaded: Loaded, name: str,
    ) -> None:  # fmt: skip
        """On a Cluster a descriptor's keys (and its caps') share one hash tag: one slot,
        so one call there too, not one per node or per limit."""
        case = CASES[name]
        store = await redis_cluster_store_factory()
        assert isinstance(store, RedisStore)
        try:
            cost = await measure(store, loaded, redis_cluster.nodes, case.entries)
        finally:
            await store.close()
        _assert_one_call_each(cost, case)

    async def test_concurrent_requests_are_one_call_each_in_shared_pipelines(
        self, redis_store_factory: StoreFactory, redis_server: RedisProcess, loaded: Loaded
    ) -> None:
        """N requests at once on the rule of 3 limits under a cap of 2: N calls, coalesced
        into fewer round trips (store/redis/batch.py), never split per limit."""
        case = CASES["3 limits under a cap of 2 limits"]
        store = await redis_store_factory()
        assert isinstance(store, RedisStore) and store._batch is not None
        try:
            cost = await measure(store, loaded, [redis_server], case.entries, concurrent=True)
        finally:
            await store.close()
        _assert_one_call_each(cost, case)
        assert store._batch.pipelines < N


class TestRefusals:
    async def test_a_refusal_by_one_of_three_limits_is_one_call(
        self, redis_store_factory: StoreFactory, redis_server: RedisProcess, loaded: Loaded
    ) -> None:
        """The GCRA limit of three refuses (a GCRA refusal is never answered from the local
        over-limit cache): each refused request is still one call, with no second one to
        take back what the other limits would have been charged."""
        store = await redis_store_factory()
        assert isinstance(store, RedisStore)
        limiter = Limiter(loaded, store, FakeClock(T0))
        request = req("cost", desc("tight=a"))
        try:
            with watching([redis_server]) as watch:
                admitted = [(await limiter.should_rate_limit(request)).code for _ in range(5)]
                watch.read()
                calls = watch.script_calls()
                refused = [(await limiter.should_rate_limit(request)).code for _ in range(N)]
                calls = watch.script_calls() - calls
                seen = watch.read()
        finally:
            await store.close()
        assert admitted == [Code.OK] * 5  # burst 4: 5 at once
        assert refused == [Code.OVER_LIMIT] * N
        assert calls == N
        assert seen.sent == Counter({"evalsha": N})
