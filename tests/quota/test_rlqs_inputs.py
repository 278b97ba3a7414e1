"""RLQS inputs a careless or hostile Envoy can send (issue 26): a rule faster than Envoy's
uint32 token-bucket fields hold, usage counts up to 2^64-1, and more buckets than a stream
or a process may hold. The stream survives, one absurd report neither zeroes a client's
quota nor costs other buckets their usage, buckets past a cap are refused without losing
the others, and RLS calls are answered while thousands of buckets arrive."""

import asyncio
import contextlib
import json
import queue
import threading
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from fairlimit._proto.envoy.extensions.common.ratelimit.v3.ratelimit_pb2 import (
    RateLimitDescriptor,
)
from fairlimit._proto.envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from fairlimit.core.admission import Code
from fairlimit.core.quota import UINT32_MAX, token_bucket
from fairlimit.grpc_api.rlqs import RLQS_SERVICE
from fairlimit.grpc_api.servicer import GrpcServer
from fairlimit.limiter import Limiter
from fairlimit.quota import QuotaService, Usage
from fairlimit.quota.stream import MAX_REPORTED
from fairlimit.store.base import Store
from fairlimit.telemetry import Telemetry
from helpers import FakeClock, LimiterFactory, desc, load_text, req
from servers import fairlimit_server

pytestmark = [pytest.mark.behaviour]
DECIDED_OK = rls_pb2.RateLimitResponse.OK
DECIDED_OVER = rls_pb2.RateLimitResponse.OVER_LIMIT

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
Entry = RateLimitDescriptor.Entry


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        return str(response.read().decode())


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


@contextlib.asynccontextmanager
async def _serving(tmp_path: Path, config: str) -> AsyncIterator[str]:
    """A gRPC server with RLQS on ``config`` and a memory store; its target."""
    from fairlimit.store.memory import MemoryStore

    clock = FakeClock()
    limiter = Limiter(load_text(tmp_path, config), MemoryStore(), clock)
    quota = QuotaService(lambda: limiter.loaded, limiter.store, clock.now)
    server = GrpcServer(limiter, Telemetry.off(), "127.0.0.1:0", quota=quota)
    await server.start()
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        await server.server.stop(None)


@pytest.fixture
async def fast_server(tmp_path: Path) -> AsyncIterator[str]:
    async with _serving(tmp_path, FAST) as target:
        yield target


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


@pytest.fixture
async def capped_server(tmp_path: Path) -> AsyncIterator[str]:
    async with _serving(tmp_path, CAPPED) as target:
        yield target


def _raw_report(*clients: bytes) -> bytes:
    """A report of one request from each client on route=public, the client ids given as
    bytes (protobuf builds no message whose string is no UTF-8: they are put in after)."""
    marks = [str(i).rjust(len(client), "#").encode() for i, client in enumerate(clients)]
    payload = _report("public", *[(mark.decode(), 1, 0) for mark in marks]).SerializeToString()
    for mark, client in zip(marks, clients, strict=True):
        assert payload.count(mark) == 1
        payload = payload.replace(mark, client)
    return payload


class TestBucketIdsThatAreNoUtf8:
    async def test_a_bucket_id_that_is_no_utf8_keeps_the_stream(self, capped_server: str) -> None:
        """Envoy copies a header's bytes into a bucket id as the client sent them. Such a
        report ended the stream (INVALID_ARGUMENT), and with it every bucket's assignment;
        echoing the id back made Envoy reset the stream (it cannot read it). Now the bucket
        is divided under its value's stand-in, every response is one Envoy can read (all
        UTF-8), the others are assigned under their own ids, and the stream goes on."""
        async with grpc.aio.insecure_channel(capped_server) as channel:
            method = f"/{RLQS_SERVICE}/StreamRateLimitQuotas"
            call = channel.stream_stream(method)()
            hostile = b"hostile-\xff-client"
            for _ in range(2):
                await call.write(_raw_report(b"alice", hostile))
                raw = await asyncio.wait_for(call.read(), 10)
                assert isinstance(raw, bytes)
                response = rlqs_pb2.RateLimitQuotaResponse.FromString(raw)  # as Envoy reads it
                ids = [dict(a.bucket_id.bucket) for a in response.bucket_action]
                assert {"route": "public", "client_id": "alice"} in ids
                others = [i["client_id"] for i in ids if i["client_id"] != "alice"]
                assert others and all("sha256:" in other for other in others)
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
        await quota.report(stream, "edge", [Usage({"route": "public", "client_id": c}, 1, 0)
                                            for c in ("liar", "honest")])  # fmt: skip
        clock.advance(5.0)
        huge = 2**64 - 1
        lines = [Usage({"route": "public", "client_id": "liar"}, huge, 0),
                 Usage({"route": "public", "client_id": "honest"}, 500, 0)]  # fmt: skip
        await quota.report(stream, "edge", lines)
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


class TestReportLines:
    async def test_a_bucket_listed_twice_is_taken_line_by_line(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """A report's lines are taken in arrays; a bucket listed twice in one report adds
        up both lines, as line by line: both counted in its totals and owed, and the second
        line of a new bucket in the span of its first demand."""
        limiter = make_limiter(CAPPED)
        quota = QuotaService(lambda: limiter.loaded, limiter.store, clock.now)
        stream = quota.open(lambda actions: None)
        bucket = {"route": "public", "client_id": "twice"}
        await quota.report(stream, "edge", [Usage(bucket, 3, 10), Usage(bucket, 2, 5)])
        held = stream.buckets[(("client_id", "twice"), ("route", "public"))]
        assert (held.allowed, held.denied, held.demand) == (5, 15, None)
        assert quota.ledger.owed == pytest.approx(5)
        clock.advance(5.0)
        await quota.report(stream, "edge", [Usage(bucket, 0, 20)])
        assert held.demand == pytest.approx((2 + 5 + 20) / 5.0)

    async def test_a_report_in_the_last_ones_order_or_another_counts_each_bucket(
        self, make_limiter: LimiterFactory, clock: FakeClock
    ) -> None:
        """A report naming its buckets in the last report's order takes them by their place
        (no key made); in another order, or after an abandon moved slots, by their keys:
        either way each line counts for its own bucket."""
        limiter = make_limiter(CAPPED)
        quota = QuotaService(lambda: limiter.loaded, limiter.store, clock.now,
                             abandon_after=8.0)  # fmt: skip
        stream = quota.open(lambda actions: None)
        a, b, c = ({"route": "public", "client_id": n} for n in ("a", "b", "c"))
        await quota.report(stream, "edge", [Usage(c, 0, 3), Usage(a, 0, 1), Usage(b, 0, 2)])
        for lines in ([Usage(c, 0, 30), Usage(a, 0, 10), Usage(b, 0, 20)],  # the same order
                      [Usage(b, 0, 200), Usage(a, 0, 100), Usage(c, 0, 0)],  # another
                      # the same again: c idle for 10 s is abandoned, b moved into its slot
                      [Usage(b, 0, 200), Usage(a, 0, 100), Usage(c, 0, 0)],
                      [Usage(b, 0, 2000), Usage(a, 0, 1000), Usage(c, 0, 7)]):  # fmt: skip
            clock.advance(5.0)
            await quota.report(stream, "edge", lines)
        denied = {k[0][1]: held.denied for k, held in stream.buckets.items()}
        assert denied == {"a": 1 + 10 + 100 + 100 + 1000, "b": 2 + 20 + 200 + 200 + 2000,
                          "c": 7}  # fmt: skip

    async def test_a_count_past_uint32_is_logged_once_per_stream(
        self, make_limiter: LimiterFactory, clock: FakeClock, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A new bucket's count past MAX_REPORTED is cut to it, and the stream's first such
        report is logged with the counts as counted."""
        limiter = make_limiter(CAPPED)
        quota = QuotaService(lambda: limiter.loaded, limiter.store, clock.now)
        stream = quota.open(lambda actions: None)
        lines = [Usage({"route": "public", "client_id": "a"}, 1, 0),
                 Usage({"route": "public", "client_id": "huge"}, 2**40, 7)]  # fmt: skip
        with caplog.at_level("WARNING", logger="fairlimit.quota.reports"):
            await quota.report(stream, "edge", lines)
            clock.advance(5.0)
            await quota.report(stream, "edge", lines)
        warned = [r.getMessage() for r in caplog.records if "more requests" in r.getMessage()]
        assert warned == [
            f"RLQS: stream {stream.ident} reported more requests than it can have let through"
            f" (counted as at most {MAX_REPORTED} allowed, 7 denied)"
        ]


class TestBoundedCounts:
    def test_a_blanket_rule_in_the_span_leaves_allowed_unbounded(self) -> None:
        """A token bucket of 5/s, then ALLOW_ALL within the span: Envoy may have let any
        number through, so only the uint32 bound applies; under the bucket alone, twice its
        rate over the span and its depth."""
        from fairlimit.core.quota import Blanket, TokenBucket
        from fairlimit.quota.stream import Subscription, bounded

        held = Subscription({"client_id": "a"}, 0.0)
        held.assign(TokenBucket(5, 50, 10))
        line = Usage({"client_id": "a"}, 10**6, 0)
        assert bounded(line, held, 5.0).allowed == 2 * (5 * 5 + 5)
        held.assign(Blanket.ALLOW_ALL)
        assert bounded(line, held, 5.0).allowed == 10**6
        held.start_span()  # the next report: ALLOW_ALL in force from its start
        assert bounded(line, held, 5.0).allowed == 10**6


PER_CLIENT = """
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: second, requests_per_unit: 50}
"""


class _Stream:
    """A sync RLQS stream on a connection of its own: reports in (encoded already, so that
    one is on its way at once), responses out."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target, [("grpc.use_local_subchannel_pool", 1)])
        self.outbox: queue.Queue[bytes | None] = queue.Queue()
        method = self.channel.stream_stream(
            "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas",
            request_serializer=None,
            response_deserializer=rlqs_pb2.RateLimitQuotaResponse.FromString,
        )
        self.responses = method(iter(self.outbox.get, None), timeout=60)

    @staticmethod
    def encode(clients: list[str]) -> bytes:
        lines = [Reports.BucketQuotaUsage(bucket_id={"bucket": {"client_id": c}},
                                          num_requests_allowed=1) for c in clients]  # fmt: skip
        return Reports(domain="edge", bucket_quota_usages=lines).SerializeToString()

    def send(self, payload: bytes) -> None:
        self.outbox.put(payload)

    def receive(self) -> set[str]:
        """The clients the next response assigns."""
        response = next(self.responses)
        return {a.bucket_id.bucket["client_id"] for a in response.bucket_action
                if a.HasField("quota_assignment_action")}  # fmt: skip

    def report(self, clients: list[str]) -> set[str]:
        """Send one report of ``clients``; the clients the response assigns."""
        self.send(self.encode(clients))
        return self.receive()

    def close(self) -> None:
        self.outbox.put(None)
        self.responses.cancel()
        self.channel.close()


def _metric(text: str, name: str, label: str) -> float:
    found = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith(name + "{") and label in line]  # fmt: skip
    assert len(found) == 1, [line for line in text.splitlines() if name in line]
    return found[0]


@pytest.mark.process
class TestBucketCaps:
    def test_buckets_past_a_cap_are_refused_and_the_rest_keep_working(self, tmp_path: Path) -> None:
        """--rlqs-max-buckets-per-stream 50 and FAIRLIMIT_RLQS_MAX_BUCKETS=80: a stream
        reporting 70 new buckets has its first 50 tracked and the other 20 refused (not
        tracked, but each sent a new bucket's assignment, now and at its next reports); a
        second stream has 30 of its 40 tracked (the process's room), and the first stream's
        buckets are renewed as before. One log line per stream names the cap's flag;
        /metrics counts the refusals, /rlconfig the held."""
        config = tmp_path / "rlqs.yaml"
        config.write_text(PER_CLIENT)
        env = {"FAIRLIMIT_RLQS_MAX_BUCKETS": "80"}
        args = ["--config", str(config), "--rlqs-max-buckets-per-stream", "50"]
        with fairlimit_server(*args, env=env) as server:
            first, second = _Stream(server.target), _Stream(server.target)
            try:
                mine = [f"a{i}" for i in range(70)]
                assert first.report(mine) == set(mine)
                theirs = [f"b{i}" for i in range(40)]
                assert second.report(theirs) == set(theirs)
                for _ in range(2):
                    assert first.report(mine) == set(mine)
                admin = server.admin_port
                view = json.loads(_get(admin, "/rlconfig"))["rlqs"]
                metrics = _get(admin, "/metrics")
            finally:
                first.close()
                second.close()
        assert view["buckets"] == {"held": 80, "max_per_stream": 50, "max": 80}
        refused = [s["buckets_refused_in_last_report"] for s in view["streams"]]
        assert refused == [20, 10]
        name = "fairlimit_rlqs_refused_buckets_total"
        assert _metric(metrics, name, 'cap="stream"') == 3 * 20
        assert _metric(metrics, name, 'cap="process"') == 10
        told = [line for line in server.lines if "refused" in line]
        assert len(told) == 2, told
        assert "stream 1 " in told[0] and "--rlqs-max-buckets-per-stream" in told[0]
        assert "stream 2 " in told[1] and "(--rlqs-max-buckets)" in told[1]

    def test_rls_calls_are_answered_while_a_big_report_is_taken(self, tmp_path: Path) -> None:
        """Caps raised to 5,000: while the server takes a report of 4,000 new buckets (in
        chunks, its division in steps), RLS calls made one after another are answered. In
        one go (before), the report held the event loop for its whole length, and the first
        RLS call was answered only with its assignments."""
        config = tmp_path / "rlqs.yaml"
        config.write_text(PER_CLIENT)
        args = ["--config", str(config), "--rlqs-max-buckets-per-stream", "5000",
                "--rlqs-max-buckets", "5000"]  # fmt: skip
        call = rls_pb2.RateLimitRequest(
            domain="edge",
            descriptors=[RateLimitDescriptor(entries=[Entry(key="client_id", value="rls")])],
        )
        with (
            fairlimit_server(*args) as server,
            grpc.insecure_channel(server.target) as channel,
        ):
            rls = rls_pb2_grpc.RateLimitServiceStub(channel)
            rls.ShouldRateLimit(call, timeout=30)  # connected and warm
            stream = _Stream(server.target)
            try:
                assert stream.report(["warm"]) == {"warm"}
                clients = [f"c{i}" for i in range(4000)]
                assigned: list[set[str]] = []
                stream.send(stream.encode(clients))

                def receive() -> None:  # the assignments come in responses of 1000
                    got: set[str] = set()
                    while len(got) < len(clients):
                        got |= stream.receive()
                    assigned.append(got)

                reader = threading.Thread(target=receive)
                reader.start()
                answered = 0
                for _ in range(5000):  # bounded: ends when the assignments are in
                    if not reader.is_alive():
                        break
                    response = rls.ShouldRateLimit(call, timeout=30)
                    # answered with a decision: past its 50/s on a fast machine, OVER_LIMIT
                    assert response.overall_code in (DECIDED_OK, DECIDED_OVER)
                    answered += 1
                reader.join(60)
            finally:
                stream.close()
        assert assigned == [set(clients)]
        assert answered >= 5, answered
