"""RLQS over real gRPC streams: a server on loopback, clients through grpc.aio channels."""

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from fairlimit._proto.envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from fairlimit._proto.envoy.type.v3 import ratelimit_strategy_pb2
from fairlimit.grpc_api.servicer import GrpcServer
from fairlimit.limiter import Limiter
from fairlimit.quota import QuotaService
from fairlimit.store.memory import MemoryStore
from fairlimit.telemetry import Telemetry
from helpers import FakeClock, load_text

pytestmark = [pytest.mark.behaviour, pytest.mark.asyncio]

CONFIG = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 100}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 50}
"""
Reports = rlqs_pb2.RateLimitQuotaUsageReports
Stream = grpc.aio.StreamStreamCall  # type: ignore[type-arg]


def report(*usage: tuple[str, int, int], domain: str = "edge") -> Reports:
    lines = [
        Reports.BucketQuotaUsage(
            bucket_id={"bucket": {"route": "public", "client_id": client}},
            num_requests_allowed=allowed,
            num_requests_denied=denied,
        )
        for client, allowed, denied in usage
    ]
    return Reports(domain=domain, bucket_quota_usages=lines)


def assigned(response: rlqs_pb2.RateLimitQuotaResponse) -> dict[str, float]:
    """Token-bucket rate per client_id in one response."""
    out = {}
    for action in response.bucket_action:
        bucket = action.quota_assignment_action.rate_limit_strategy.token_bucket
        rate = bucket.tokens_per_fill.value / bucket.fill_interval.seconds
        out[action.bucket_id.bucket["client_id"]] = rate
    return out


@dataclass
class Served:
    server: GrpcServer
    clock: FakeClock
    quota: QuotaService

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    clock = FakeClock()
    limiter = Limiter(load_text(tmp_path, CONFIG), MemoryStore(), clock)
    quota = QuotaService(lambda: limiter.loaded, limiter.store, clock.now)
    server = GrpcServer(limiter, Telemetry.off(), "127.0.0.1:0", quota=quota)
    await server.start()
    yield Served(server, clock, quota)
    await server.server.stop(None)


@pytest.fixture
async def stub(served: Served) -> AsyncIterator[rlqs_pb2_grpc.RateLimitQuotaServiceStub]:
    async with grpc.aio.insecure_channel(served.target) as channel:
        yield rlqs_pb2_grpc.RateLimitQuotaServiceStub(channel)


# Far above any real answer (a stream's end reaches the servicer in milliseconds), so a
# wait fails only when the condition never comes, however loaded the machine.
DEADLINE = 10.0


async def wait_for(predicate: Callable[[], bool], what: str) -> None:
    """Poll until ``predicate()`` holds, failing after DEADLINE seconds: the server's threads
    hand a stream's end to the loop when they get to it, not within a count of loop turns."""
    loop = asyncio.get_running_loop()
    until = loop.time() + DEADLINE
    while not predicate():
        if loop.time() >= until:
            pytest.fail(f"never happened within {DEADLINE} s: {what}")
        await asyncio.sleep(0.005)


class TestStream:
    async def test_subscription_is_answered_with_a_token_bucket(
        self, stub: rlqs_pb2_grpc.RateLimitQuotaServiceStub
    ) -> None:
        """The first report of a bucket gets its assignment back on the same stream."""
        call = stub.StreamRateLimitQuotas()
        await call.write(report(("alice", 1, 0)))
        response = await asyncio.wait_for(call.read(), 10)
        action = response.bucket_action[0]
        assert dict(action.bucket_id.bucket) == {"route": "public", "client_id": "alice"}
        assert action.quota_assignment_action.assignment_time_to_live.seconds >= 2
        bucket = action.quota_assignment_action.rate_limit_strategy.token_bucket
        assert (bucket.tokens_per_fill.value, bucket.fill_interval.seconds) == (500, 10)
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK

    async def test_another_envoy_is_pushed_a_smaller_share(
        self,
        stub: rlqs_pb2_grpc.RateLimitQuotaServiceStub,
        served: Served,
    ) -> None:
        """A greedy client on one stream; two more on another: the first stream is pushed
        its new share without reporting anything."""
        clock, quota = served.clock, served.quota
        one, two = stub.StreamRateLimitQuotas(), stub.StreamRateLimitQuotas()
        await one.write(report(("a", 1, 0)))
        await one.read()
        for _ in range(2):
            clock.advance(5.0)  # Envoy 1.40 reports every 5 s
            await one.write(report(("a", 300, 400)))
            assert assigned(await one.read()) == {"a": 50}
        await two.write(report(("b", 1, 0), ("c", 1, 0)))
        pushed = assigned(await asyncio.wait_for(one.read(), 10))
        assert pushed["a"] == pytest.approx(100 / 3, abs=0.1)
        assert sum(assigned(await two.read()).values()) == pytest.approx(200 / 3, abs=0.2)
        await two.done_writing()
        assert await two.code() == grpc.StatusCode.OK
        back = assigned(await asyncio.wait_for(one.read(), 10))
        assert back == {"a": 50}
        await wait_for(lambda: len(quota.streams) == 1, "the closed stream dropped")
        one.cancel()
        await wait_for(lambda: not quota.streams, "the cancelled stream dropped")

    async def test_blanket_rule_for_an_unknown_domain(
        self, stub: rlqs_pb2_grpc.RateLimitQuotaServiceStub
    ) -> None:
        """A domain no config names: ALLOW_ALL."""
        call = stub.StreamRateLimitQuotas()
        await call.write(report(("x", 1, 0), domain="elsewhere"))
        strategy = (await call.read()).bucket_action[0].quota_assignment_action.rate_limit_strategy
        assert strategy.WhichOneof("strategy") == "blanket_rule"
        assert strategy.blanket_rule == ratelimit_strategy_pb2.RateLimitStrategy.ALLOW_ALL
        call.cancel()

    async def test_draining_ends_open_streams_with_ok(
        self, stub: rlqs_pb2_grpc.RateLimitQuotaServiceStub, served: Served
    ) -> None:
        """SIGTERM's drain ends every RLQS stream with OK at once, rather than holding the
        grace period and then cutting it (Envoy reopens it elsewhere)."""
        call = stub.StreamRateLimitQuotas()
        await call.write(report(("alice", 1, 0)))
        await call.read()
        drain = asyncio.create_task(served.server.drain(grace=60))
        assert await asyncio.wait_for(call.code(), 30) == grpc.StatusCode.OK
        await drain

    async def test_a_corrupt_report_is_invalid_argument(self, served: Served) -> None:
        """Bytes that are no usage report end the stream with INVALID_ARGUMENT, not UNKNOWN."""
        async with grpc.aio.insecure_channel(served.target) as channel:
            method = channel.stream_stream(
                "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas"
            )
            call = method()
            await call.write(b"\xff\xff\xff")
            assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed usage report" in await call.details()
