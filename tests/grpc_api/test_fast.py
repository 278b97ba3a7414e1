"""A kept payload of plain counters is decided in one step (flows/fast.py); every other call
by the limiter's generic path. The two give the same answers, leave the same counters and
count the same metrics.

Random configs the loader accepts (tests/support/config_fuzz.py) and a few of plain limits,
each sent a small set of its random requests again and again on a moving clock, through the
servicer (the one-step path wherever a request qualifies) and, beside it, through a second
limiter's ``decide`` and ``response_to_proto`` (the generic path): the response bytes of every
call, the counters' state and the rule counters' totals must be equal. Seeded: the same
configs and requests on every run.
"""

import random
from pathlib import Path

import grpc
import pytest

from config_fuzz import draw_accepted, draw_request
from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit.core.rules import Loaded
from fairlimit.flows.fast import FastRates
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


async def _side_by_side(
    loaded: Loaded, payloads: list[bytes], r: random.Random, options: ResponseOptions
) -> int:
    """Send the payloads in a random order through both paths; the calls that took the
    one-step path."""
    clock = FakeClock(1_700_000_000.0 + r.random())
    (fast_telemetry, fast_reader), (slow_telemetry, slow_reader) = metered(), metered()
    fast = Limiter(loaded, MemoryStore(), clock, telemetry=fast_telemetry)
    slow = Limiter(loaded, MemoryStore(), clock, telemetry=slow_telemetry)
    servicer = RateLimitServicer(fast, fast_telemetry, options)
    quick = 0
    for _ in range(CALLS):
        clock.advance(r.choice(STEPS))
        payload = r.choice(payloads)
        prepared = await answered_alike(servicer, slow, payload, options.rule_names)
        quick += prepared is not None and prepared.fast is not None
    assert _counters(fast) == _counters(slow)
    assert exported(fast_reader) == exported(slow_reader)
    return quick


@pytest.mark.parametrize("seed", SEEDS)
async def test_random_configs_answer_alike_in_one_step(seed: int, tmp_path: Path) -> None:
    r = random.Random(seed)
    quick = 0
    for _ in range(CONFIGS):
        config, loaded = draw_accepted(r, tmp_path / "d.yaml")
        payloads = [draw_request(r, config).SerializeToString() for _ in range(REQUESTS)]
        options = ResponseOptions(rule_names=r.random() < 0.5)
        quick += await _side_by_side(loaded, payloads, r, options)
    assert quick >= CALLS  # the one-step path was taken (about a fifth of the calls)


@pytest.mark.parametrize("seed", SEEDS)
async def test_plain_limits_answer_alike_in_one_step(seed: int, tmp_path: Path) -> None:
    """Several descriptors a request, overrides, hits_addend 0 and large, detailed metrics,
    unlimited and unmatched descriptors, refusals: all in one step."""
    r = random.Random(seed)
    loaded = load_text(tmp_path, PLAIN)
    payloads = [_plain_request(r) for _ in range(REQUESTS)]
    options = ResponseOptions(rule_names=r.random() < 0.5)
    assert await _side_by_side(loaded, payloads, r, options) >= CALLS // 2


async def test_a_tripped_breaker_is_the_failure_mode_s(tmp_path: Path) -> None:
    """With the breaker open the call is the failure mode's (open: OK, nothing charged),
    as on the generic path: the one-step path does not answer it."""
    clock = FakeClock()
    limiter = Limiter(load_text(tmp_path, PLAIN), MemoryStore(), clock)
    servicer = RateLimitServicer(limiter, Telemetry.off())
    payload = _one_client(1)
    first = await asked(servicer, payload)
    assert first.statuses[0].limit_remaining == 2
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
    assert [count for _, _, count, _ in _counters(limiter).values()] == [1]  # the first call


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


def _one_client(client: int) -> bytes:
    descriptor = D(entries=[D.Entry(key="client_id", value=str(client))])
    return rls_pb2.RateLimitRequest(domain="edge", descriptors=[descriptor]).SerializeToString()


async def test_a_failure_in_one_step_is_internal_and_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever goes wrong on the one-step path ends as on the generic path: INTERNAL and
    a logged traceback, never UNKNOWN (which Envoy lets through)."""

    def broken(self: FastRates, now: float) -> None:
        raise RuntimeError("broken")

    limiter = Limiter(load_text(tmp_path, PLAIN), MemoryStore(), FakeClock())
    servicer = RateLimitServicer(limiter, Telemetry.off())
    first = await asked(servicer, _one_client(1))
    assert first.statuses[0].limit_remaining == 2
    monkeypatch.setattr(FastRates, "decide", broken)
    with pytest.raises(Aborted) as refused:
        await servicer.ShouldRateLimit(None, CallContext(_one_client(1)))
    assert refused.value.args[0] is grpc.StatusCode.INTERNAL
    assert "ShouldRateLimit failed" in caplog.text
