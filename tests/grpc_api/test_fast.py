"""A kept payload on this process's memory store is decided in one step (flows/fast.py):
a plan of plain counters by ``FastRates``, any other (caps, sliding, GCRA and calendar
limits, shadow levels, levels charged when refused) by ``FastMemory``; every other call by
the limiter's generic path. The two give the same answers, leave the same counters and caps
and count the same metrics.

Random configs the loader accepts (tests/support/config_fuzz.py), a few of plain limits and
a few of caps, each sent a small set of its requests again and again on a moving clock,
through the servicer (the one-step path wherever a request qualifies) and, beside it,
through a second limiter's ``decide`` and ``response_to_proto`` (the generic path): the
response bytes of every call, the counters' and the caps' state and the rule counters'
totals must be equal. Seeded: the same configs and requests on every run.
"""

import random
from collections import Counter
from pathlib import Path

import grpc
import pytest

from config_fuzz import draw_accepted, draw_request
from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit.core.rules import Loaded
from fairlimit.flows.fast import FastMemory, FastRates
from fairlimit.grpc_api.headers import ResponseOptions
from fairlimit.grpc_api.servicer import RateLimitServicer
from fairlimit.limiter import Limiter
from fairlimit.policy.breaker import BREAK_AFTER, BREAK_QUIET
from fairlimit.store.memory import MemoryStore
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

pytestmark = [pytest.mark.behaviour, pytest.mark.asyncio]

SEEDS = [7, 77, 777]
CONFIGS = 25  # accepted configs a seed draws
CALLS = 60  # calls a config is sent, from REQUESTS distinct requests
REQUESTS = 6
D = ratelimit_pb2.RateLimitDescriptor
STEPS = [0.0, 0.0, 0.001, 0.3, 0.999, 1.0, 61.0, 3600.0]

PLAIN = """
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: second, requests_per_unit: 3, name: per_client}
  - key: route
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 5}
    descriptors:
      - key: user
        rate_limit: {unit: hour, requests_per_unit: 4}
  - key: free
    rate_limit: {unlimited: true}
  - key: tier
    value: gold
    rate_limit: {unit: day, requests_per_unit: 4294967295}
"""


def _counters(limiter: Limiter) -> dict[str, tuple[int, int, int, int]]:
    store = limiter.store
    assert isinstance(store, MemoryStore)
    return {k: (c.start, c.end, c.count, c.reserved) for k, c in store.counters.table.items()}


def _fields(obj: object) -> tuple[object, ...]:
    return tuple(getattr(obj, name) for name in type(obj).__slots__)  # type: ignore[attr-defined]


def _caps(limiter: Limiter) -> dict[str, object]:
    """Every cap's rows, division and light demand, field by field."""
    store = limiter.store
    assert isinstance(store, MemoryStore)
    out: dict[str, object] = {}
    for key, cap in store.fair.table.items():
        division = None if cap.division is None else _fields(cap.division)
        rows = {client: _fields(row) for client, row in cap.rows.items()}
        light = cap.light
        out[key] = (rows, division, light.window, light.asked, light.expected, light.calendar)
    return out


async def _side_by_side(
    loaded: Loaded,
    payloads: list[bytes],
    r: random.Random,
    options: ResponseOptions,
) -> Counter[str]:
    """Send the payloads in a random order through both paths; the calls that took each
    one-step path, by its class's name."""
    clock = FakeClock(1_700_000_000.0 + r.random())
    (fast_telemetry, fast_reader), (slow_telemetry, slow_reader) = metered(), metered()
    fast = Limiter(loaded, MemoryStore(), clock, telemetry=fast_telemetry)
    slow = Limiter(loaded, MemoryStore(), clock, telemetry=slow_telemetry)
    servicer = RateLimitServicer(fast, fast_telemetry, options)
    fast.tally.on = slow.tally.on = r.random() < 0.5  # as an RLQS division turns it on
    quick: Counter[str] = Counter()
    for _ in range(CALLS):
        clock.advance(r.choice(STEPS))
        payload = r.choice(payloads)
        prepared = await answered_alike(servicer, slow, payload, options.rule_names)
        if prepared is not None and prepared.fast is not None:
            quick[type(prepared.fast).__name__] += 1
    assert _counters(fast) == _counters(slow)
    assert _caps(fast) == _caps(slow)
    assert fast.tally.counts == slow.tally.counts
    assert fast.policy.breaker.answered_at == slow.policy.breaker.answered_at
    assert exported(fast_reader) == exported(slow_reader)
    return quick


@pytest.mark.parametrize("seed", SEEDS)
async def test_random_configs_answer_alike_in_one_step(seed: int, tmp_path: Path) -> None:
    r = random.Random(seed)
    quick: Counter[str] = Counter()
    for _ in range(CONFIGS):
        config, loaded = draw_accepted(r, tmp_path / "d.yaml")
        payloads = [draw_request(r, config).SerializeToString() for _ in range(REQUESTS)]
        options = ResponseOptions(rule_names=r.random() < 0.5)
        quick += await _side_by_side(loaded, payloads, r, options)
    # both one-step paths were taken, each for many calls
    assert quick["FastRates"] >= CALLS and quick["FastMemory"] >= CALLS


@pytest.mark.parametrize("seed", SEEDS)
async def test_plain_limits_answer_alike_in_one_step(seed: int, tmp_path: Path) -> None:
    """Several descriptors a request, overrides, hits_addend 0 and large, detailed metrics,
    unlimited and unmatched descriptors, refusals: all in one step."""
    r = random.Random(seed)
    loaded = load_text(tmp_path, PLAIN)
    payloads = [_plain_request(r) for _ in range(REQUESTS)]
    options = ResponseOptions(rule_names=r.random() < 0.5)
    assert (await _side_by_side(loaded, payloads, r, options))["FastRates"] >= CALLS // 2


CAPPED = """
domain: edge
descriptors:
  - key: route
    value: shared
    rate_limit: {unit: second, requests_per_unit: 8}
    fair_share: {active_clients: 4}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 4}
  - key: route
    value: tenants
    rate_limit: {unit: minute, requests_per_unit: 30}
    fair_share: {active_clients: 2}
    descriptors:
      - key: tenant
        rate_limit: {unit: minute, requests_per_unit: 20}
        fair_share: {active_clients: 3}
        descriptors:
          - key: user
            rate_limit: {unit: minute, requests_per_unit: 9}
  - key: route
    value: upstream
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 3, charge_when_over_limit: true}
  - key: route
    value: sliding
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 5, algorithm: sliding}
  - key: route
    value: watched
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 2}
"""

CAPPED_ENTRIES = [
    *[[("route", "shared"), ("client_id", c)] for c in "abcdef"],
    *[[("route", "tenants"), ("tenant", t), ("user", u)] for t in "xy" for u in "123"],
    [("route", "upstream"), ("client_id", "a")],
    [("route", "sliding"), ("client_id", "a")],
    [("route", "watched")],
]


@pytest.mark.parametrize("seed", SEEDS)
async def test_caps_and_other_limits_answer_alike_in_one_step(seed: int, tmp_path: Path) -> None:
    """Clients contending for a cap and under nested caps, a level charged when refused, a
    sliding window and a shadow rule: decided by ``FastMemory``, as the generic path does."""
    r = random.Random(seed)
    loaded = load_text(tmp_path, CAPPED)
    payloads = []
    for _ in range(3 * REQUESTS):
        request = rls_pb2.RateLimitRequest(domain="edge")
        if r.random() < 0.2:
            request.hits_addend = r.choice([0, 2, 3])
        for _ in range(r.choice([1, 1, 1, 2])):
            entries = [D.Entry(key=k, value=v) for k, v in r.choice(CAPPED_ENTRIES)]
            request.descriptors.add(entries=entries)
        payloads.append(request.SerializeToString())
    options = ResponseOptions(rule_names=r.random() < 0.5)
    for _ in range(4):
        assert (await _side_by_side(loaded, payloads, r, options))["FastMemory"] >= CALLS // 2


QUOTAS = """
domain: edge
descriptors:
  - key: a
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: b
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: route
    rate_limit: {unit: minute, requests_per_unit: 50}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limit: {unit: minute, requests_per_unit: 20}
"""


async def test_a_plan_with_a_quota_rule_takes_the_generic_path(tmp_path: Path) -> None:
    """A quota descriptor over, in a group that passes, is charged again without it (a
    second admission): such a plan is never decided in one step."""
    r = random.Random(5)
    loaded = load_text(tmp_path, QUOTAS)
    entries = [[("a", "x")], [("b", "x")], [("route", "r"), ("client_id", "c")]]
    request = rls_pb2.RateLimitRequest(domain="edge")
    for pairs in entries:
        request.descriptors.add(entries=[D.Entry(key=k, value=v) for k, v in pairs])
    taken = await _side_by_side(loaded, [request.SerializeToString()], r, ResponseOptions())
    assert not taken


def _one_client(client: int) -> bytes:
    descriptor = D(entries=[D.Entry(key="client_id", value=str(client))])
    return rls_pb2.RateLimitRequest(domain="edge", descriptors=[descriptor]).SerializeToString()


def _shared_client(client: str) -> bytes:
    """A client of CAPPED's cap of 8 a second (4 each; 2 while nobody has history)."""
    entries = [D.Entry(key="route", value="shared"), D.Entry(key="client_id", value=client)]
    return rls_pb2.RateLimitRequest(domain="edge", descriptors=[D(entries=entries)]
                                    ).SerializeToString()  # fmt: skip


def _cases() -> list[tuple[str, bytes, type, int]]:
    """(config, payload, the one-step path it takes, what it has left after one call)."""
    return [(PLAIN, _one_client(1), FastRates, 2), (CAPPED, _shared_client("a"), FastMemory, 1)]


@pytest.mark.parametrize(("config", "payload", "kind", "left"), _cases())
async def test_a_tripped_breaker_is_the_failure_mode_s(
    config: str, payload: bytes, kind: type, left: int, tmp_path: Path
) -> None:
    """With the breaker open the call is the failure mode's (open: OK, nothing charged),
    as on the generic path: the one-step path does not answer it. (A payload's first call
    takes the generic path, its second the one step.)"""
    clock = FakeClock()
    limiter = Limiter(load_text(tmp_path, config), MemoryStore(), clock)
    servicer = RateLimitServicer(limiter, Telemetry.off())
    first = await asked(servicer, payload)
    assert first.statuses[0].limit_remaining == left
    assert servicer._prepared[payload][1].fast is None
    second = await asked(servicer, payload)
    assert second.statuses[0].limit_remaining == left - 1
    assert isinstance(servicer._prepared[payload][1].fast, kind)
    breaker = limiter.policy.breaker
    for _ in range(BREAK_AFTER):
        clock.advance(BREAK_QUIET)
        breaker.failed(clock.now())
    assert breaker.tripped
    opened = await asked(servicer, payload)
    assert (opened.overall_code, opened.statuses[0].HasField("current_limit")) == (
        opened.OK,
        False,
    )
    assert {count for _, _, count, _ in _counters(limiter).values()} == {2}  # the first two's


ENTRIES = [
    [("client_id", "a")],
    [("client_id", "b")],
    [("route", "r1")],
    [("route", "r1"), ("user", "u")],
    [("route", "r2"), ("user", "u")],
    [("free", "x")],
    [("tier", "gold")],
    [("tier", "silver")],
    [("nobody", "x")],
]


def _plain_request(r: random.Random) -> bytes:
    """One to three descriptors of PLAIN's paths (or none), a hits_addend now and then, a
    limit override now and then."""
    request = rls_pb2.RateLimitRequest(domain="edge")
    if r.random() < 0.3:
        request.hits_addend = r.choice([0, 2, 5])
    for _ in range(r.randint(1, 3)):
        entries = [D.Entry(key=k, value=v) for k, v in r.choice(ENTRIES)]
        descriptor = request.descriptors.add(entries=entries)
        if r.random() < 0.2:
            descriptor.hits_addend.value = r.choice([0, 1, 3, 10**6])
        if r.random() < 0.1:
            descriptor.limit.requests_per_unit = r.choice([0, 2, 7])
            descriptor.limit.unit = r.choice([1, 2, 3])
    return request.SerializeToString()


@pytest.mark.parametrize(("config", "payload", "kind", "left"), _cases())
async def test_a_failure_in_one_step_is_internal_and_logged(
    config: str,
    payload: bytes,
    kind: type,
    left: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Whatever goes wrong on the one-step path ends as on the generic path: INTERNAL and
    a logged traceback, never UNKNOWN (which Envoy lets through)."""

    def broken(self: object, now: float) -> None:
        raise RuntimeError("broken")

    limiter = Limiter(load_text(tmp_path, config), MemoryStore(), FakeClock())
    servicer = RateLimitServicer(limiter, Telemetry.off())
    first = await asked(servicer, payload)
    assert first.statuses[0].limit_remaining == left
    monkeypatch.setattr(kind, "decide", broken)
    with pytest.raises(Aborted) as refused:
        await servicer.ShouldRateLimit(None, CallContext(payload))
    assert refused.value.args[0] is grpc.StatusCode.INTERNAL
    assert "ShouldRateLimit failed" in caplog.text
