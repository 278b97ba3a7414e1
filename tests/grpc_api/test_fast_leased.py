"""On Redis with leases (the default), a kept payload that a lease block held here covers is
admitted from it and decided in one step (flows/fast.py ``FastLeased``); every other call
by the limiter's generic path, which answers from the same blocks. The two give the same
answers, make the same script calls and count the same metrics.

A config of fair-share caps and plain and upstream-style limits (charge_when_over_limit),
and random configs the loader accepts (tests/support/config_fuzz.py), each sent a small set
of requests again and again on a moving clock (mostly within a block's 0.25 s, so blocks are
taken and used), through the servicer of one store and, beside it, through a second
limiter's ``decide`` and ``response_to_proto`` on another store (its own key prefix on the
same real redis-server, the caller's clock): every response's bytes, the script calls made,
the rule counters and, once both stores have given their blocks back, every counter and
row in Redis must be equal. Seeded: the same configs and requests on every run.
"""

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from config_fuzz import draw_accepted, draw_request
from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit.core.rules import Loaded
from fairlimit.flows.decision import Decision
from fairlimit.flows.fast import Answer, FastLeased
from fairlimit.grpc_api.headers import ResponseOptions
from fairlimit.grpc_api.servicer import RateLimitServicer
from fairlimit.limiter import Limiter
from fairlimit.policy.breaker import BREAK_AFTER, BREAK_QUIET
from fairlimit.store.redis import RedisStore, open_redis
from fairlimit.telemetry import Telemetry
from helpers import (
    Aborted,
    CallContext,
    FakeClock,
    answered_alike,
    asked,
    exported,
    load_text,
    metered,
)
from redis_servers import RedisProcess, suite_url

pytestmark = [pytest.mark.behaviour, pytest.mark.asyncio]

SEEDS = [1, 2, 3]
CONFIGS = 8  # accepted configs a seed draws
CALLS = 80  # calls a config is sent, from REQUESTS distinct requests
REQUESTS = 4
D = ratelimit_pb2.RateLimitDescriptor
# mostly within a block's life (core/lease.py LEASE_TTL), now and then past it or a window
STEPS = [0.0, 0.0, 0.001, 0.001, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.3, 1.0, 61.0]

CAPPED = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 60}
    fair_share: {active_clients: 4}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 20, name: per_client}
  - key: route
    value: roomy
    rate_limit: {unit: minute, requests_per_unit: 100000}
    fair_share: {active_clients: 10}
    descriptors:
      - key: client_id
        rate_limit: {unit: minute, requests_per_unit: 5000}
  - key: route
    value: plain
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 25, charge_when_over_limit: true}
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 40}
  - key: free
    rate_limit: {unlimited: true}
"""

ENTRIES = [
    [("route", "public"), ("client_id", "a")],
    [("route", "public"), ("client_id", "b")],
    [("route", "roomy"), ("client_id", "a")],
    [("route", "plain"), ("client_id", "a")],
    [("user", "u")],
    [("free", "x")],
    [("nobody", "x")],
]

Stores = Callable[[], RedisStore]


@pytest.fixture
def stores(redis_server: RedisProcess) -> Stores:
    """RedisStores with leases on, each on its own key prefix of the flushed server."""
    with redis_server.client() as client:
        client.flushall()
    made = iter(range(1_000_000))

    def make() -> RedisStore:
        return open_redis(suite_url(redis_server.url, leases="on", key_prefix=f"s{next(made)}:"))

    return make


def _state(client: "redis.Redis[bytes]", prefix: str) -> dict[bytes, Any]:
    """Every key under ``prefix``, named without it, with its value: the counters and the
    caps' rows and divisions (the lease holders' keys name a process: left out)."""
    out: dict[bytes, Any] = {}
    for key in client.scan_iter(match=f"{prefix}*".encode()):
        kind = client.type(key)
        name = key[len(prefix) :]
        if kind == b"string":
            out[name] = client.get(key)
        elif kind == b"hash":
            out[name] = client.hgetall(key)
        elif kind == b"zset":
            out[name] = client.zrange(key, 0, -1, withscores=True)
        else:
            out[name] = kind
    return out


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``FastLeased.decide`` counting the calls it answers, in the list's one item."""
    answered = [0]
    decide = FastLeased.decide

    def counted(self: FastLeased, now: float) -> Answer | Decision | None:
        decision = decide(self, now)
        answered[0] += decision is not None
        return decision

    monkeypatch.setattr(FastLeased, "decide", counted)
    return answered


async def _side_by_side(
    stores: Stores,
    redis_server: RedisProcess,
    loaded: Loaded,
    payloads: list[bytes],
    r: random.Random,
    options: ResponseOptions,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[int, int]:
    """Send the payloads in a random order through both paths; the calls prepared for the
    one-step path, and those it answered."""
    clock = FakeClock(1_700_000_000.0 + r.random())
    (fast_telemetry, fast_reader), (slow_telemetry, slow_reader) = metered(), metered()
    fast_store, slow_store = stores(), stores()
    fast = Limiter(loaded, fast_store, clock, telemetry=fast_telemetry)
    slow = Limiter(loaded, slow_store, clock, telemetry=slow_telemetry)
    servicer = RateLimitServicer(fast, fast_telemetry, options)
    prepared_fast = 0
    answered = _counting(monkeypatch)
    try:
        payload = payloads[0]
        for _ in range(CALLS):
            clock.advance(r.choice(STEPS))
            if r.random() < 0.4:  # else the same client again: a hot client's burst
                payload = r.choice(payloads)
            prepared = await answered_alike(servicer, slow, payload, options.rule_names)
            prepared_fast += prepared is not None and isinstance(prepared.fast, FastLeased)
        assert fast_store.round_trips == slow_store.round_trips
        assert exported(fast_reader) == exported(slow_reader)
    finally:
        monkeypatch.undo()
        await fast_store.close()  # every unused block given back
        await slow_store.close()
    with redis_server.client() as client:
        prefixes = [s._options.key_prefix for s in (fast_store, slow_store)]
        assert _state(client, prefixes[0]) == _state(client, prefixes[1])
    return prepared_fast, answered[0]


def _request(r: random.Random) -> bytes:
    """One or two descriptors of CAPPED's paths, a hits_addend now and then."""
    request = rls_pb2.RateLimitRequest(domain="edge")
    if r.random() < 0.2:
        request.hits_addend = r.choice([0, 2, 5])
    for _ in range(r.choice([1, 1, 1, 1, 2])):
        entries = [D.Entry(key=k, value=v) for k, v in r.choice(ENTRIES)]
        request.descriptors.add(entries=entries)
    return request.SerializeToString()


@pytest.mark.parametrize("seed", SEEDS)
async def test_caps_and_upstream_limits_answer_alike_from_a_block(
    seed: int,
    tmp_path: Path,
    stores: Stores,
    redis_server: RedisProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    r = random.Random(seed)
    loaded = load_text(tmp_path, CAPPED)
    answered = 0
    for _ in range(3):
        payloads = [_request(r) for _ in range(REQUESTS)]
        options = ResponseOptions(rule_names=r.random() < 0.5)
        answered += (
            await _side_by_side(stores, redis_server, loaded, payloads, r, options, monkeypatch)
        )[1]
    assert answered >= CALLS // 4  # of 3 x CALLS: the one-step path answered from blocks


@pytest.mark.parametrize("seed", SEEDS)
async def test_random_configs_answer_alike_from_a_block(
    seed: int,
    tmp_path: Path,
    stores: Stores,
    redis_server: RedisProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    r = random.Random(seed)
    prepared = 0
    for _ in range(CONFIGS):
        config, loaded = draw_accepted(r, tmp_path / "d.yaml")
        payloads = [draw_request(r, config).SerializeToString() for _ in range(REQUESTS)]
        options = ResponseOptions(rule_names=r.random() < 0.5)
        prepared += (
            await _side_by_side(stores, redis_server, loaded, payloads, r, options, monkeypatch)
        )[0]
    # plans a block may serve (their limits are mostly too small for one: what matters here
    # is that none answers otherwise than the generic path)
    assert prepared >= CALLS // 2


def _roomy(client: str) -> bytes:
    entries = [D.Entry(key="route", value="roomy"), D.Entry(key="client_id", value=client)]
    return rls_pb2.RateLimitRequest(
        domain="edge", descriptors=[D(entries=entries)]
    ).SerializeToString()


async def test_a_hot_client_is_answered_from_its_block(
    tmp_path: Path, stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One client a millisecond apart under a cap sized for its clients: after its first
    requests (the first takes no block, core/lease.py), its calls are answered in one step,
    each charged once in Redis when its block was reserved."""
    clock = FakeClock()
    store = stores()
    limiter = Limiter(load_text(tmp_path, CAPPED), store, clock)
    servicer = RateLimitServicer(limiter, Telemetry.off())
    calls = 0
    answered = _counting(monkeypatch)
    try:
        for _ in range(200):
            clock.advance(0.001)
            response = await asked(servicer, _roomy("hot"))
            calls += 1
            assert response.overall_code == response.OK
    finally:
        await store.close()
    assert answered[0] >= 0.9 * calls
    assert store.round_trips <= 0.1 * calls


async def test_a_tripped_breaker_is_the_failure_mode_s(tmp_path: Path, stores: Stores) -> None:
    """With the breaker open a call is the failure mode's (open: OK, no limit), though a
    block would cover it, as on the generic path: the one-step path does not answer it."""
    clock = FakeClock()
    store = stores()
    limiter = Limiter(load_text(tmp_path, CAPPED), store, clock)
    servicer = RateLimitServicer(limiter, Telemetry.off())
    try:
        for _ in range(20):  # a block is taken
            clock.advance(0.001)
            answered = await asked(servicer, _roomy("hot"))
            assert answered.statuses[0].HasField("current_limit")
        breaker = limiter.policy.breaker
        for _ in range(BREAK_AFTER):
            clock.advance(BREAK_QUIET)
            breaker.failed(clock.now())
        assert breaker.tripped
        opened = await asked(servicer, _roomy("hot"))
        assert (opened.overall_code, opened.statuses[0].HasField("current_limit")) == (
            opened.OK,
            False,
        )
    finally:
        await store.close()


async def test_a_failure_in_one_step_is_internal_and_logged(
    tmp_path: Path,
    stores: Stores,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Whatever goes wrong on the one-step path ends as on the generic path: INTERNAL and a
    logged traceback, never UNKNOWN (which Envoy lets through)."""

    def broken(self: FastLeased, now: float) -> None:
        raise RuntimeError("broken")

    store = stores()
    limiter = Limiter(load_text(tmp_path, CAPPED), store, FakeClock())
    servicer = RateLimitServicer(limiter, Telemetry.off())
    try:
        first = await asked(servicer, _roomy("hot"))
        assert first.overall_code == first.OK
        monkeypatch.setattr(FastLeased, "decide", broken)
        with pytest.raises(Aborted) as refused:
            await servicer.ShouldRateLimit(None, CallContext(_roomy("hot")))
        assert refused.value.args[0] is grpc.StatusCode.INTERNAL
        assert "ShouldRateLimit failed" in caplog.text
    finally:
        await store.close()
