"""Concurrency released by Envoy's negative hits (``released_by: negative_hits``): a slot
per request without a request id, given back by the client's stream-done descriptor with
``is_negative_hits``; never below 0; lost releases expire. On every backend."""

import pytest

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit.core.admission import Code
from fairlimit.core.request import Descriptor, Request
from fairlimit.grpc_api.servicer import RateLimitServicer
from fairlimit.limiter import Limiter
from fairlimit.telemetry import Telemetry
from helpers import FakeClock, LimiterFactory, asked

pytestmark = [pytest.mark.behaviour, pytest.mark.asyncio]

CONFIG = """
domain: edge
descriptors:
  - key: route
    value: llm
    concurrency: {max_in_flight: 3, max_duration: 30}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        concurrency: {max_in_flight: 2, max_duration: 30, released_by: negative_hits}
"""


def start(client: str) -> Request:
    return Request("edge", (Descriptor((("route", "llm"), ("client_id", client))),))


def end(client: str) -> Request:
    entries = (("route", "llm"), ("client_id", client))
    return Request("edge", (Descriptor(entries, None, 1, True),))


async def codes(limiter: Limiter, *requests: Request) -> list[Code]:
    return [(await limiter.should_rate_limit(r)).code for r in requests]


@pytest.fixture
def limiter(make_limiter: LimiterFactory) -> Limiter:
    return make_limiter(CONFIG)


def payload(client: str, negative: bool = False) -> bytes:
    """What Envoy sends for ``start`` (the same bytes for every request of the client) or
    ``end``."""
    D = ratelimit_pb2.RateLimitDescriptor
    entries = [D.Entry(key="route", value="llm"), D.Entry(key="client_id", value=client)]
    descriptor = D(entries=entries, is_negative_hits=negative)
    if negative:
        descriptor.hits_addend.value = 1
    return rls_pb2.RateLimitRequest(domain="edge", descriptors=[descriptor]).SerializeToString()


class TestReleasedByNegativeHits:
    async def test_the_same_bytes_take_a_slot_each_through_the_servicer(
        self, limiter: Limiter
    ) -> None:
        """The servicer keeps a payload's prepared request for its next call; a slot taken
        under an id made up for one request is not kept so: each call of the same bytes
        takes a slot of its own (the second in flight was refused as a duplicate id)."""
        servicer = RateLimitServicer(limiter, Telemetry.off())
        ok, over = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT

        async def overall(data: bytes, times: int) -> list[int]:
            return [(await asked(servicer, data)).overall_code for _ in range(times)]

        assert await overall(payload("a"), 3) == [ok, ok, over]
        assert await overall(payload("a", negative=True), 1) == [ok]
        assert await overall(payload("a"), 2) == [ok, over]
        assert await overall(payload("b"), 2) == [ok, over]  # the route's 3 in flight

    async def test_a_slot_per_request_and_one_back_per_refund(self, limiter: Limiter) -> None:
        """Two in flight, the third refused; a refund frees one, so the next passes."""
        assert await codes(limiter, start("a"), start("a"), start("a")) == [
            Code.OK, Code.OK, Code.OVER_LIMIT]  # fmt: skip
        assert await codes(limiter, end("a")) == [Code.OK]
        assert await codes(limiter, start("a"), start("a")) == [Code.OK, Code.OVER_LIMIT]

    async def test_never_below_zero(self, limiter: Limiter) -> None:
        """Refunds with nothing held (a 429's, a duplicate) change nothing: two still fit,
        not more."""
        await codes(limiter, start("a"))
        assert await codes(limiter, end("a"), end("a"), end("a")) == [Code.OK] * 3
        assert await codes(limiter, start("a"), start("a"), start("a")) == [
            Code.OK, Code.OK, Code.OVER_LIMIT]  # fmt: skip

    async def test_another_clients_refund_frees_nothing_of_ours(self, limiter: Limiter) -> None:
        """At the cap (3 slots) a's two and b's one fill it; b's refund frees b's slot only:
        a is still refused (at its own 2), c gets the freed cap slot."""
        assert await codes(limiter, start("a"), start("a"), start("b")) == [Code.OK] * 3
        assert await codes(limiter, start("c")) == [Code.OVER_LIMIT]
        await codes(limiter, end("b"), end("b"))
        assert await codes(limiter, start("a"), start("c")) == [Code.OVER_LIMIT, Code.OK]

    async def test_lost_refunds_expire(self, limiter: Limiter, clock: FakeClock) -> None:
        await codes(limiter, start("a"), start("a"))
        clock.advance(29)
        assert await codes(limiter, start("a")) == [Code.OVER_LIMIT]
        clock.advance(1.5)
        assert await codes(limiter, start("a")) == [Code.OK]

    async def test_the_first_to_expire_goes_back_first(
        self, limiter: Limiter, clock: FakeClock
    ) -> None:
        """Taken at 0 and 10 s; a refund at 20 s frees the one of 0 s: at 31 s the one of
        10 s still holds (expires at 40 s), so one more fits, not two."""
        await codes(limiter, start("a"))
        clock.advance(10)
        await codes(limiter, start("a"))
        clock.advance(10)
        await codes(limiter, end("a"))
        clock.advance(11)
        assert await codes(limiter, start("a"), start("a")) == [Code.OK, Code.OVER_LIMIT]
