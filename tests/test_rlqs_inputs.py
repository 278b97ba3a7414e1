"""RLQS inputs a careless or hostile Envoy can send (issue 26): a rule faster than Envoy's
uint32 token-bucket fields hold, and usage counts up to 2^64-1. The stream survives, and one
absurd report neither zeroes a client's quota nor costs other buckets their usage."""

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from fairlimit._proto.envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from fairlimit.core.admission import Code
from fairlimit.core.quota import UINT32_MAX, token_bucket
from fairlimit.grpc_api.servicer import GrpcServer
from fairlimit.limiter import Limiter
from fairlimit.quota import QuotaService, Usage
from fairlimit.quota.service import MAX_REPORTED
from fairlimit.store.base import Store
from fairlimit.telemetry import Telemetry
from helpers import FakeClock, LimiterFactory, desc, load_text, req

pytestmark = [pytest.mark.behaviour]

FAST = """
domain: edge
descriptors:
  - key: route
    value: fast
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 500000000}
"""
CAPPED = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: minute, requests_per_unit: 6000}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limit: {unit: minute, requests_per_unit: 3000}
"""
Reports = rlqs_pb2.RateLimitQuotaUsageReports


def _report(route: str, *usage: tuple[str, int, int]) -> Reports:
    lines = [
        Reports.BucketQuotaUsage(
            bucket_id={"bucket": {"route": route, "client_id": client}},
            num_requests_allowed=allowed,
            num_requests_denied=denied,
        )
        for client, allowed, denied in usage
    ]
    return Reports(domain="edge", bucket_quota_usages=lines)


@pytest.fixture
async def fast_server(tmp_path: Path) -> AsyncIterator[str]:
    from fairlimit.store.memory import MemoryStore

    clock = FakeClock()
    limiter = Limiter(load_text(tmp_path, FAST), MemoryStore(), clock)
    quota = QuotaService(lambda: limiter.loaded, limiter.store, clock.now)
    server = GrpcServer(limiter, Telemetry.off(), "127.0.0.1:0", quota=quota)
    await server.start()
    yield f"127.0.0.1:{server.port}"
    await server.server.stop(None)


class TestFastRules:
    def test_a_token_bucket_fits_envoys_fields(self) -> None:
        bucket = token_bucket(5e8, 10**10)
        assert bucket.tokens_per_fill == UINT32_MAX and bucket.max_tokens == UINT32_MAX

    async def test_a_rule_past_envoys_fields_keeps_the_stream(self, fast_server: str) -> None:
        """500M/s per client: assigned the fastest bucket Envoy can hold (about 429.5M/s);
        the stream answers and ends OK (it died with UNKNOWN)."""
        async with grpc.aio.insecure_channel(fast_server) as channel:
            call = rlqs_pb2_grpc.RateLimitQuotaServiceStub(channel).StreamRateLimitQuotas()
            await call.write(_report("fast", ("alice", 1, 0)))
            response = await asyncio.wait_for(call.read(), 10)
            bucket = response.bucket_action[0].quota_assignment_action.rate_limit_strategy
            assert bucket.token_bucket.tokens_per_fill.value == UINT32_MAX
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK


class TestHugeCounts:
    async def test_a_report_of_2_64_neither_zeroes_the_quota_nor_drops_others(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """A bucket under a 50/s assignment reports 2^64-1 allowed in 5 s; another bucket
        reports 500. The first counts as at most what its bucket could let through, the
        second in full (on Redis one overflowing payment failed the domain's whole charge),
        and RLS still admits the first client (its quota not zeroed)."""
        limiter = make_limiter(CAPPED)
        store: Store = limiter.store
        quota = QuotaService(lambda: limiter.loaded, store, clock.now)
        stream = quota.open(lambda actions: None)
        await stream.report("edge", [Usage({"route": "public", "client_id": c}, 1, 0)
                                     for c in ("liar", "honest")])  # fmt: skip
        clock.advance(5.0)
        huge = 2**64 - 1
        lines = [Usage({"route": "public", "client_id": "liar"}, huge, 0),
                 Usage({"route": "public", "client_id": "honest"}, 500, 0)]  # fmt: skip
        await stream.report("edge", lines)
        for _ in range(40):  # the drip pays the reports over the interval after them
            clock.advance(0.2)
            await quota.drip()
        assert quota.ledger.owed == pytest.approx(0, abs=1)
        liar = (stream.buckets[(("client_id", "liar"), ("route", "public"))]).allowed
        # its first report's 1, then twice what 50/s and a bucket of 50 let through in 5 s
        assert liar < MAX_REPORTED and liar <= 1 + 2 * (50 * 5 + 50)
        decision = await limiter.should_rate_limit(
            req("edge", desc("route=public", "client_id=honest"))
        )
        # 3000 a minute: 1 + 500 paid in, so 2499 remain after this request
        assert decision.code is Code.OK
        assert decision.statuses[0].limit_remaining == 3000 - 501 - 1
        decision = await limiter.should_rate_limit(
            req("edge", desc("route=public", "client_id=liar"))
        )
        assert decision.code is Code.OK


class TestBoundedCounts:
    def test_a_blanket_rule_in_the_span_leaves_allowed_unbounded(self) -> None:
        """A token bucket of 5/s, then ALLOW_ALL within the span: Envoy may have let any
        number through, so only the uint32 bound applies; under the bucket alone, twice its
        rate over the span and its depth."""
        from fairlimit.core.quota import Blanket, TokenBucket
        from fairlimit.quota.service import _Bucket, bounded

        held = _Bucket({"client_id": "a"}, 0.0)
        held.assign(TokenBucket(5, 50, 10))
        line = Usage({"client_id": "a"}, 10**6, 0)
        assert bounded(line, held, 5.0).allowed == 2 * (5 * 5 + 5)
        held.assign(Blanket.ALLOW_ALL)
        assert bounded(line, held, 5.0).allowed == 10**6
        held.start_span()  # the next report: ALLOW_ALL in force from its start
        assert bounded(line, held, 5.0).allowed == 10**6
