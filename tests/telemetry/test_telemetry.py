"""Metrics and traces: per-rule counters, the seed trace's fairness gauges, a span per call."""

import logging
import math
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from fairlimit.admin import AdminServer, JsonCodec
from fairlimit.core.admission import Code
from fairlimit.core.fairshare import CapReport, FairnessFigures
from fairlimit.core.request import Descriptor, Request
from fairlimit.errors import StoreUnavailable
from fairlimit.grpc_api.proto_json import request_from_json, response_to_json
from fairlimit.grpc_api.servicer import GrpcServer
from fairlimit.limiter import BREAK_SECONDS, Limiter
from fairlimit.settings import FailureMode
from fairlimit.store.memory import MemoryStore
from fairlimit.telemetry import Telemetry
from fairlimit.telemetry.fairness import CapTable
from helpers import FakeClock, LimiterFactory, desc, load_text, req
from oracles import descriptor_key
from traffic import drive

JSON_CODEC = JsonCodec(request_from_json, response_to_json)  # as app.py passes it

pytestmark = pytest.mark.behaviour

Points = dict[tuple[str, frozenset[tuple[str, object]]], float]

RULES = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: route
    value: shadow
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: client_id
    detailed_metric: true
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: tenant
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 5}
"""

# The problem in numbers of docs/semantics.md at a tenth of the scale: a 100/s bucket, one
# batch client at 500/s retrying every 429 (once, to keep the test quick), nine interactive
# clients at 5/s each.
GLOBAL_BUCKET = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 100}
    descriptors:
      - key: client_id   # names the client; the bucket above is all there is
"""
FAIR_SHARE = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 100}
    fair_share: {active_clients: 10}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 10}
"""
SEED = {"batch": 500.0, **{f"web-{i}": 5.0 for i in range(1, 10)}}
PUBLIC = (("domain", "edge"), ("rule", "edge/route=public"))


class EnvoyActions:
    """What Envoy sends for a global bucket: ``(route)`` beside ``(route, client_id)``."""

    def __init__(self, limiter: Limiter) -> None:
        self.limiter = limiter

    async def should_rate_limit(self, request: Request) -> object:
        client = request.descriptors[0]
        bucket = Descriptor(client.entries[:1])
        return await self.limiter.should_rate_limit(Request(request.domain, (bucket, client)))


def points(reader: InMemoryMetricReader) -> Points:
    """Every data point as (name, attributes) -> value (a histogram's count)."""
    data = reader.get_metrics_data()
    out: Points = {}
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for p in metric.data.data_points:
                    value = getattr(p, "value", None)
                    out[(metric.name, frozenset(p.attributes.items()))] = (
                        float(p.count) if value is None else float(value)  # type: ignore[attr-defined]
                    )
    return out


def named(all_points: Points, name: str) -> dict[frozenset[tuple[str, object]], float]:
    return {attrs: v for (n, attrs), v in all_points.items() if n == name}


@pytest.fixture
def reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


@pytest.fixture
def telemetry(reader: InMemoryMetricReader) -> Iterator[Telemetry]:
    provider = MeterProvider(metric_readers=[reader])
    yield Telemetry(provider, TracerProvider())
    provider.shutdown()


class TestRuleCounters:
    async def test_counters_move_by_hits(
        self, make_limiter: LimiterFactory, telemetry: Telemetry, reader: InMemoryMetricReader
    ) -> None:
        """total, within, near (past 80%) and over count hits, with domain and rule only."""
        limiter = make_limiter(RULES, telemetry=telemetry)
        for hits in (6, 3, 1, 4):  # 6; 9 (1 past 8, near); 10 (near); 14 > 10 (over)
            await limiter.should_rate_limit(req("edge", desc("route=public", hits=hits)))
        got = points(reader)
        rule = frozenset(PUBLIC)
        assert named(got, "ratelimit.hits") == {rule: 14}
        assert named(got, "ratelimit.within_limit") == {rule: 10}
        assert named(got, "ratelimit.near_limit") == {rule: 2}
        assert named(got, "ratelimit.over_limit") == {rule: 4}

    async def test_shadow_overs_count_as_over_and_shadow(
        self, make_limiter: LimiterFactory, telemetry: Telemetry, reader: InMemoryMetricReader
    ) -> None:
        """A shadow-mode rule's overs are answered OK and counted in over_limit and shadow_mode."""
        limiter = make_limiter(RULES, telemetry=telemetry)
        for _ in range(3):
            await limiter.should_rate_limit(req("edge", desc("route=shadow")))
        rule = frozenset({("domain", "edge"), ("rule", "edge/route=shadow")})
        got = points(reader)
        assert named(got, "ratelimit.shadow_mode") == {rule: 1}
        assert named(got, "ratelimit.over_limit") == {rule: 1}
        assert named(got, "ratelimit.hits") == {rule: 3}

    async def test_client_values_only_with_detailed_metric(
        self, make_limiter: LimiterFactory, telemetry: Telemetry, reader: InMemoryMetricReader
    ) -> None:
        """A value becomes an attribute only where the rule sets detailed_metric."""
        limiter = make_limiter(RULES, telemetry=telemetry)
        await limiter.should_rate_limit(req("edge", desc("client_id=alice")))
        await limiter.should_rate_limit(req("edge", desc("tenant=acme", "user=bob")))
        totals = named(points(reader), "ratelimit.hits")
        assert set(totals) == {
            frozenset(
                {("domain", "edge"), ("rule", "edge/client_id"), ("value", "client_id=alice")}
            ),
            frozenset({("domain", "edge"), ("rule", "edge/tenant/user")}),
        }

    async def test_telemetry_never_fails_a_request(
        self, make_limiter: LimiterFactory, telemetry: Telemetry
    ) -> None:
        """A recording that raises is swallowed and counted; the request is answered."""

        class Broken:
            def add(self, *args: object) -> None:
                raise RuntimeError("exporter exploded")

        telemetry._rules.tallies["hits"] = Broken()  # type: ignore[assignment]
        limiter = make_limiter(RULES, telemetry=telemetry)
        for _ in range(2):
            decision = await limiter.should_rate_limit(req("edge", desc("route=public")))
            assert decision.statuses[0].limit_remaining < 10
        assert telemetry.errors == 2


class FlakyStore(MemoryStore):
    """A memory store whose backend can be switched off."""

    down = False

    async def admit(self, plan, now):  # type: ignore[no-untyped-def]
        if self.down:
            raise StoreUnavailable("connection refused")
        return await super().admit(plan, now)


class TestServiceMetrics:
    async def test_backend_errors_and_state_changes(
        self,
        tmp_path: Path,
        telemetry: Telemetry,
        reader: InMemoryMetricReader,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """Each failed store call is counted; each healthy <-> unavailable change logged once."""
        caplog.set_level(logging.INFO, logger="fairlimit")
        store = FlakyStore()
        clock = FakeClock()
        limiter = Limiter(load_text(tmp_path, RULES), store, clock, telemetry=telemetry)
        request = req("edge", desc("route=public"))
        await limiter.should_rate_limit(request)
        store.down = True
        for _ in range(3):
            assert (await limiter.should_rate_limit(request)).backend_failed
        store.down = False
        clock.advance(BREAK_SECONDS)  # three in a row opened the breaker: wait it out
        await limiter.should_rate_limit(request)
        assert named(points(reader), "fairlimit.backend.errors") == {frozenset(): 3}
        changes = [r.getMessage() for r in caplog.records if "backend" in r.getMessage()]
        assert changes == ["backend unavailable: connection refused", "backend healthy again"]

    async def test_fail_open_answers_are_counted_and_closed_ones_are_not(
        self, tmp_path: Path, telemetry: Telemetry, reader: InMemoryMetricReader
    ) -> None:
        """Each call answered OK unlimited because the store failed (open) counts once; a
        closed limiter's UNAVAILABLE answers are not fail-open answers."""
        store = FlakyStore()
        loaded = load_text(tmp_path, RULES)
        request = req("edge", desc("route=public"))
        limiter = Limiter(loaded, store, FakeClock(), telemetry=telemetry)
        await limiter.should_rate_limit(request)
        assert named(points(reader), "fairlimit.rpc.failed_open") == {frozenset(): 0}
        store.down = True
        for _ in range(2):
            await limiter.should_rate_limit(request)
        closed = Limiter(
            loaded, store, FakeClock(), telemetry=telemetry, failure_mode=FailureMode.CLOSED
        )
        with pytest.raises(StoreUnavailable):
            await closed.should_rate_limit(request)
        assert named(points(reader), "fairlimit.rpc.failed_open") == {frozenset(): 2}


async def _seed_trace(limiter: Limiter, clock: FakeClock, config: str) -> Limiter:
    """Two seconds of section 1; the gauges then read the first full period."""
    target = EnvoyActions(limiter) if config is GLOBAL_BUCKET else limiter
    await drive(target, clock, SEED, 2, retry=frozenset({"batch"}), retries=1)  # type: ignore[arg-type]
    await limiter.refresh_fairness()
    return limiter


class TestSeedTraceGauges:
    async def test_a_global_bucket_reads_unfair(
        self,
        make_limiter: LimiterFactory,
        clock: FakeClock,
        telemetry: Telemetry,
        reader: InMemoryMetricReader,
    ) -> None:
        """Section 1 against a global bucket: a low Jain index, the nine interactive starved."""
        await _seed_trace(make_limiter(GLOBAL_BUCKET, telemetry=telemetry), clock, GLOBAL_BUCKET)
        got = points(reader)
        public = frozenset(PUBLIC)
        assert named(got, "fairlimit.cap.jain_index_ratio")[public] < 0.5
        assert named(got, "fairlimit.cap.starved_clients")[public] == 9
        assert named(got, "fairlimit.cap.top_client_share_ratio")[public] > 0.6
        assert named(got, "fairlimit.cap.utilization_ratio")[public] == pytest.approx(1.0)
        assert named(got, "fairlimit.cap.active_clients")[public] == 10
        mode = frozenset({*PUBLIC, ("mode", "global-bucket-only")})
        assert named(got, "fairlimit.cap.mode") == {mode: 1}
        assert public not in named(got, "fairlimit.cap.over_declared")  # nothing declared

    async def test_fair_share_reads_fair(
        self,
        make_limiter: LimiterFactory,
        clock: FakeClock,
        telemetry: Telemetry,
        reader: InMemoryMetricReader,
    ) -> None:
        """Section 1 against fairlimit's cap: Jain's index ~1.0 and no client starved."""
        await _seed_trace(make_limiter(FAIR_SHARE, telemetry=telemetry), clock, FAIR_SHARE)
        got = points(reader)
        public = frozenset(PUBLIC)
        assert named(got, "fairlimit.cap.jain_index_ratio")[public] >= 0.99
        assert named(got, "fairlimit.cap.starved_clients")[public] == 0
        assert named(got, "fairlimit.cap.active_clients")[public] == 10
        assert named(got, "fairlimit.cap.declared_clients")[public] == 10
        assert named(got, "fairlimit.cap.over_declared")[public] == 0
        assert named(got, "fairlimit.cap.fair_share_level")[public] == -1  # uncontended
        mode = frozenset({*PUBLIC, ("mode", "per-client-buckets")})
        assert named(got, "fairlimit.cap.mode") == {mode: 1}

    @pytest.mark.parametrize(
        ("config", "jain", "starved"),
        [(GLOBAL_BUCKET, (0, 0.5), 9), (FAIR_SHARE, (0.99, 1), 0)],
        ids=["global-bucket", "fair-share"],
    )
    async def test_a_real_scrape_of_metrics_reads_the_same(
        self, tmp_path: Path, config: str, jain: tuple[float, float], starved: int
    ) -> None:
        """/metrics of a running admin server shows the same figures in Prometheus text.

        Memory only: the backends are compared above; this is about the scrape path.
        """
        registry = CollectorRegistry()
        provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry)])
        telemetry = Telemetry(provider, TracerProvider())
        clock = FakeClock()
        limiter = Limiter(load_text(tmp_path, config), MemoryStore(), clock, telemetry=telemetry)
        await _seed_trace(limiter, clock, config)
        admin = AdminServer(limiter, "127.0.0.1", 0, JSON_CODEC, registry)
        await admin.start()
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{admin.port}/metrics") as response,
            ):
                assert response.status == 200
                text = await response.text()
        finally:
            await admin.stop()
            provider.shutdown()
        samples = {
            (s.name, s.labels.get("rule")): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        jain_index = samples[("fairlimit_cap_jain_index_ratio", "edge/route=public")]
        assert jain[0] <= jain_index <= jain[1]
        assert samples[("fairlimit_cap_starved_clients", "edge/route=public")] == starved
        hits = sum(v for (name, _), v in samples.items() if name == "ratelimit_hits_total")
        assert hits > 1000  # 2 s of section 1 traffic
        assert "batch" not in text and "web-1" not in text  # no client value as a label


# GLOBAL_BUCKET, and a premium plan whose own limit replaces the bucket in its requests.
REPLACED_BUCKET = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {name: public-bucket, unit: second, requests_per_unit: 100}
    descriptors:
      - key: client_id
  - key: plan
    value: premium
    rate_limit: {unit: second, requests_per_unit: 1000, replaces: [{name: public-bucket}]}
"""


class TestBucketFigures:
    async def test_a_replaced_bucket_does_not_count_the_clients_it_did_not_serve(
        self,
        make_limiter: LimiterFactory,
        clock: FakeClock,
        telemetry: Telemetry,
        reader: InMemoryMetricReader,
    ) -> None:
        """Premium requests never reach the global bucket (their plan's limit replaces
        it): the bucket's figures count the one plain client, not the premium one."""
        limiter = make_limiter(REPLACED_BUCKET, telemetry=telemetry)
        for _ in range(2):
            for client, extra in (("plain", ()), ("premium", (desc("plan=premium"),))):
                entries = (desc("route=public"), desc("route=public", f"client_id={client}"))
                answer = await limiter.should_rate_limit(req("edge", *entries, *extra))
                assert answer.code is Code.OK
            clock.advance(1.0)
        await limiter.refresh_fairness()
        got = points(reader)
        assert named(got, "fairlimit.cap.active_clients")[frozenset(PUBLIC)] == 1


class TestCapTable:
    def test_instances_of_one_cap_rule_fold_into_one_row(self, tmp_path: Path) -> None:
        """Tenant caps fold into their rule: worst Jain, summed starved, no tenant value."""
        loaded = load_text(tmp_path, """
            domain: api
            descriptors:
              - key: tenant
                rate_limit: {unit: second, requests_per_unit: 50}
                fair_share: {active_clients: 2}
                descriptors:
                  - key: user
                    rate_limit: {unit: second, requests_per_unit: 20}
            """)  # fmt: skip

        def report(tenant: str, jain: float, starved: int, active: int) -> CapReport:
            figures = FairnessFigures(0.5, active, math.inf, jain, 0.5, starved)
            return CapReport(descriptor_key("api", [("tenant", tenant)], 1), None, 2, figures)

        reports = [report("acme", 0.9, 1, 2), report("globex", 0.6, 2, 3), report("x/y=z", 1, 0, 1)]
        (row,) = CapTable().rows(loaded, reports, {})
        assert (row.domain, row.rule, row.instances) == ("api", "api/tenant", 3)
        assert row.figures is not None
        assert (row.figures.jain_index, row.figures.starved_clients) == (0.6, 3)
        assert row.figures.active_clients == 3 and row.over_declared


@pytest.fixture
async def traced(
    tmp_path: Path,
) -> AsyncIterator[
    tuple[rls_pb2_grpc.RateLimitServiceStub, InMemorySpanExporter, InMemoryMetricReader]
]:
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    meter_provider = MeterProvider(metric_readers=[reader])
    telemetry = Telemetry(meter_provider, tracer_provider)
    limiter = Limiter(load_text(tmp_path, RULES), MemoryStore(), telemetry=telemetry)
    server = GrpcServer(limiter, telemetry, "127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield rls_pb2_grpc.RateLimitServiceStub(channel), exporter, reader
    await server.drain(0)
    meter_provider.shutdown()


def _rls(domain: str, *pairs: tuple[str, str]) -> rls_pb2.RateLimitRequest:
    D = ratelimit_pb2.RateLimitDescriptor
    entries = [D.Entry(key=k, value=v) for k, v in pairs]
    return rls_pb2.RateLimitRequest(domain=domain, descriptors=[D(entries=entries)])


class TestTraces:
    async def test_one_span_per_call_under_envoys_context(self, traced) -> None:  # type: ignore[no-untyped-def]
        """The span's parent is the traceparent sent in the metadata; it says what happened."""
        stub, exporter, reader = traced
        trace_id, parent_id = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
        metadata = (("traceparent", f"00-{trace_id:032x}-{parent_id:016x}-01"),)
        await stub.ShouldRateLimit(_rls("edge", ("route", "public")), metadata=metadata)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ShouldRateLimit(_rls(""), metadata=metadata)
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        first, second = exporter.get_finished_spans()
        for span in (first, second):
            assert span.name == "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
            assert span.context.trace_id == trace_id
            assert span.parent is not None and span.parent.span_id == parent_id
        assert first.attributes["ratelimit.domain"] == "edge"
        assert first.attributes["ratelimit.descriptor_count"] == 1
        assert first.attributes["ratelimit.result"] == "OK"
        assert first.attributes["ratelimit.backend_seconds"] >= 0
        assert second.attributes["ratelimit.result"] == "INVALID_ARGUMENT"
        durations = named(points(reader), "fairlimit.rpc.duration")
        assert durations == {
            frozenset({("result", "OK")}): 1,
            frozenset({("result", "INVALID_ARGUMENT")}): 1,
        }

    async def test_without_a_parent_each_call_starts_a_trace(self, traced) -> None:  # type: ignore[no-untyped-def]
        """No traceparent: a root span per call, still recorded."""
        stub, exporter, _ = traced
        for _ in range(2):
            await stub.ShouldRateLimit(_rls("edge", ("route", "public")))
        spans = exporter.get_finished_spans()
        assert len(spans) == 2 and all(s.parent is None for s in spans)
        assert spans[0].context.trace_id != spans[1].context.trace_id
