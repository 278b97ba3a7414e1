"""Who is the hog: each cap's top clients, recorded on the request path and shown on the admin
port (``GET /top``, ``/rlconfig``), never as metric attributes."""

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider

from fairlimit import topview
from fairlimit.admin import AdminServer, JsonCodec
from fairlimit.core.request import Request
from fairlimit.errors import SettingsError
from fairlimit.grpc_api.proto_json import request_from_json, response_to_json
from fairlimit.limiter import Limiter
from fairlimit.settings import Settings
from fairlimit.store.memory import MemoryStore
from fairlimit.telemetry import Telemetry
from fairlimit.telemetry.top import INTERVAL, TopClients
from helpers import FakeClock, desc, load_text, req
from limit_configs import CAP_OF_TWO, FOUR_LIMITS

pytestmark = pytest.mark.behaviour

CONFIG = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 1000}
    fair_share: {active_clients: 4}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 5}
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 1000}
    fair_share: {active_clients: 2}
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 100}
  - key: generic_key
    value: api
    rate_limit: {unit: minute, requests_per_unit: 1000}
    descriptors:
      - key: client_id
        rate_limit: {unit: minute, requests_per_unit: 1000}
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 50}
"""
CAP, TENANTS, BUCKET = "edge/route=public", "edge/tenant", "edge/generic_key=api"


def public(client: str) -> Request:
    return req("edge", desc("route=public", f"client_id={client}"))


def limiter_with(
    tmp_path: Path, capacity: int = 4, reader: InMemoryMetricReader | None = None
) -> Limiter:
    """A limiter over CONFIG with real (SDK) telemetry ranking ``capacity`` clients per cap."""
    meter = MeterProvider(metric_readers=[reader] if reader else [])
    telemetry = Telemetry(meter, TracerProvider(), top_clients=capacity)
    return Limiter(load_text(tmp_path, CONFIG), MemoryStore(), FakeClock(), telemetry=telemetry)


async def send(limiter: Limiter, request: Request, times: int = 1) -> None:
    for _ in range(times):
        await limiter.should_rate_limit(request)


class TestRecorder:
    async def test_a_cap_ranks_its_clients_by_demand_and_by_rejections(
        self, tmp_path: Path
    ) -> None:
        """The hog tops both lists: its demand counts every hit tried, its rejections the overs."""
        limiter = limiter_with(tmp_path)
        await send(limiter, public("hog"), 20)  # 5 admitted, 15 over its own limit
        await send(limiter, public("calm"), 3)
        row = {r.rule: r for r in limiter.top_clients(10)}[CAP]
        assert (row.hits, row.rejected, row.mode.value) == (23, 15, "per-client-buckets")
        assert [(c.client, c.cap, c.hits, c.rejected) for c in row.by_demand] == [
            ("hog", CAP, 20, 15),
            ("calm", CAP, 3, 0),
        ]
        assert [c.client for c in row.by_rejections] == ["hog"]
        assert all(c.error == 0 for c in row.by_demand)  # fewer clients than counters

    async def test_memory_is_bounded_and_the_hog_survives_many_clients(
        self, tmp_path: Path
    ) -> None:
        """Hundreds of one-off clients keep at most 2k counters, and the hog stays on top."""
        limiter = limiter_with(tmp_path, capacity=2)
        for i in range(300):
            await send(limiter, public(f"once-{i}"))
            if i % 2 == 0:
                await send(limiter, public("hog"))
        row = {r.rule: r for r in limiter.top_clients(10)}[CAP]
        assert len(row.by_demand) == 2  # n is capped at the capacity
        top = row.by_demand[0]
        assert top.client == "hog" and 150 <= top.hits <= 150 + top.error
        assert top.error * 3 <= row.hits  # error <= total / (k + 1)

    async def test_a_value_less_cap_names_the_instance_of_each_client(self, tmp_path: Path) -> None:
        """Under a per-tenant cap, alice of acme and alice of zeta are two clients."""
        limiter = limiter_with(tmp_path)
        await send(limiter, req("edge", desc("tenant=acme", "user=alice")), 3)
        await send(limiter, req("edge", desc("tenant=zeta", "user=alice")), 1)
        row = {r.rule: r for r in limiter.top_clients(10)}[TENANTS]
        assert [(c.client, c.cap, c.hits) for c in row.by_demand] == [
            ("alice", "edge/tenant=acme", 3),
            ("alice", "edge/tenant=zeta", 1),
        ]

    async def test_a_global_bucket_names_the_client_of_the_deeper_descriptor(
        self, tmp_path: Path
    ) -> None:
        """As Envoy sends (generic_key) beside (generic_key, client_id); unnamed hits are not
        in the ranking but are in the bucket's total."""
        limiter = limiter_with(tmp_path)
        both = req("edge", desc("generic_key=api"), desc("generic_key=api", "client_id=etl"))
        await send(limiter, both, 4)
        await send(limiter, req("edge", desc("generic_key=api")), 2)
        row = {r.rule: r for r in limiter.top_clients(10)}[BUCKET]
        assert row.mode.value == "global-bucket-only"
        assert [(c.client, c.hits) for c in row.by_demand] == [("etl", 4)]

    async def test_a_report_covers_the_last_complete_interval_and_the_current_one(
        self, tmp_path: Path
    ) -> None:
        """Two intervals later, old demand is gone; a gap in traffic forgets the past."""
        limiter = limiter_with(tmp_path)
        clock: FakeClock = limiter.clock  # type: ignore[assignment]
        clock.t = 1000 * INTERVAL
        await send(limiter, public("early"))
        clock.advance(INTERVAL)
        await send(limiter, public("late"))
        row = {r.rule: r for r in limiter.top_clients(10)}[CAP]
        assert [c.client for c in row.by_demand] == ["early", "late"]
        assert row.seconds == INTERVAL
        clock.advance(INTERVAL)
        row = {r.rule: r for r in limiter.top_clients(10)}[CAP]
        assert [c.client for c in row.by_demand] == ["late"]
        clock.advance(3 * INTERVAL)
        row = {r.rule: r for r in limiter.top_clients(10)}[CAP]
        assert (row.hits, row.by_demand) == (0, ())

    async def test_client_values_never_become_metric_attributes(self, tmp_path: Path) -> None:
        """After traffic, no exported data point carries a client's value."""
        reader = InMemoryMetricReader()
        limiter = limiter_with(tmp_path, reader=reader)
        await send(limiter, public("hog-client"), 10)
        await limiter.refresh_fairness()
        data = reader.get_metrics_data()
        assert data is not None
        text = data.to_json()
        assert "route=public" in text and "hog-client" not in text

    async def test_a_reload_keeps_the_tallies_of_rules_still_there(self, tmp_path: Path) -> None:
        """Swapping in a config keeps the ranking of a cap it still has, and drops the rest."""
        limiter = limiter_with(tmp_path)
        await send(limiter, public("hog"), 2)
        await send(limiter, req("edge", desc("tenant=acme", "user=alice")))
        limiter.swap(load_text(tmp_path, CONFIG.split("  - key: tenant")[0], "cap-only.yaml"))
        rows = {r.rule: r for r in limiter.top_clients(10)}
        assert set(rows) == {CAP}
        assert [(c.client, c.hits) for c in rows[CAP].by_demand] == [("hog", 2)]

    async def test_telemetry_off_ranks_nothing(self, tmp_path: Path) -> None:
        """The limiter's default telemetry records nothing, so there is nothing to rank."""
        limiter = Limiter(load_text(tmp_path, CONFIG), MemoryStore(), FakeClock())
        await send(limiter, public("hog"))
        assert limiter.top_clients(10) == () and limiter.top_capacity == 0

    def test_nothing_is_watched_without_caps_or_with_capacity_zero(self, tmp_path: Path) -> None:
        """The request path pays one flag check when there is nothing to rank."""
        limit = "    rate_limit: {unit: second, requests_per_unit: 1}\n"  # a limit, no cap
        plain = f"domain: d\ndescriptors:\n  - key: k\n{limit}"
        no_caps = load_text(tmp_path, plain, "plain.yaml")
        recorder = TopClients(4)
        recorder.use(no_caps)
        assert not recorder.watching
        off = TopClients(0)
        off.use(load_text(tmp_path, CONFIG))
        assert not off.watching


@pytest.fixture
async def admin(tmp_path: Path) -> AsyncIterator[tuple[str, Limiter]]:
    limiter = limiter_with(tmp_path)
    server = AdminServer(limiter, "127.0.0.1", 0, JsonCodec(request_from_json, response_to_json))
    await server.start()
    yield f"http://127.0.0.1:{server.port}", limiter
    await server.stop()


class TestEndpoint:
    async def test_top_after_traffic(self, admin: tuple[str, Limiter]) -> None:
        """GET /top lists every classified rule, each with its clients ranked, as JSON."""
        base, limiter = admin
        await send(limiter, public("hog"), 8)
        await send(limiter, public("calm"), 2)
        async with aiohttp.ClientSession() as http, http.get(base + "/top?n=1") as response:
            assert response.status == 200
            body = await response.json()
        assert (body["scope"], body["capacity"], body["n"]) == ("process", 4, 1)
        caps = {c["rule"]: c for c in body["caps"]}
        assert set(caps) == {CAP, TENANTS, BUCKET}  # remote_address: per client, no cap
        cap = caps[CAP]
        assert (cap["hits"], cap["rejected"], cap["mode"]) == (10, 3, "per-client-buckets")
        assert cap["by_demand"] == [
            {"client": "hog", "cap": CAP, "hits": 8, "rejected": 3, "error": 0, "share": 0.8}
        ]
        assert [c["client"] for c in cap["by_rejections"]] == ["hog"]
        assert caps[TENANTS]["by_demand"] == [] and caps[TENANTS]["hits"] == 0

    async def test_top_of_one_rule_and_bad_n(self, admin: tuple[str, Limiter]) -> None:
        """?rule= keeps one rule, one that is none is a 404; n above the capacity is the
        capacity; a bad n is a 400."""
        base, limiter = admin
        await send(limiter, public("hog"))
        async with aiohttp.ClientSession() as http:
            async with http.get(base + "/top", params={"rule": CAP, "n": "99"}) as response:
                body = await response.json()
            assert body["n"] == 4 and [c["rule"] for c in body["caps"]] == [CAP]
            async with http.get(base + "/top", params={"rule": "nosuch"}) as response:
                assert response.status == 404  # not an empty list (issue 37)
                error = (await response.json())["error"]
            assert error.startswith("rule: no cap or global bucket 'nosuch' (there are: ")
            for bad in ("0", "-1", "ten"):
                async with http.get(base + "/top", params={"n": bad}) as response:
                    assert response.status == 400
                    assert "n: expected a whole number" in (await response.json())["error"]

    async def test_rlconfig_shows_each_caps_top_clients(self, admin: tuple[str, Limiter]) -> None:
        """/rlconfig carries the same ranking on each classified rule, and on no other."""
        base, limiter = admin
        await send(limiter, public("hog"), 6)
        async with aiohttp.ClientSession() as http, http.get(base + "/rlconfig") as response:
            rules = (await response.json())["domains"][0]["descriptors"]
        cap = rules[0]
        assert cap["path"] == CAP
        assert [(c["client"], c["hits"], c["rejected"]) for c in cap["top"]["by_demand"]] == [
            ("hog", 6, 1)
        ]
        assert "top" not in cap["descriptors"][0]  # the per-client rule is not a cap


# A cap whose second limit (10/s over 5 minutes for 5 x 15/s) is contended, and a bucket with
# a burst per second, a sliding 5 minutes, a gcra with a burst and a calendar month in a zone.
SEVERAL = (
    """
domain: api
descriptors:
"""
    + CAP_OF_TWO
    + """  - key: generic_key
    value: search
"""
    + FOUR_LIMITS
    + """    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 20}
"""
)
SEARCH_LIMITS = [
    {"unit": "second", "requests_per_unit": 20, "window_seconds": 1, "algorithm": "fixed"},
    {"unit": "minute", "requests_per_unit": 3000, "window_seconds": 300, "algorithm": "sliding"},
    {"unit": "minute", "requests_per_unit": 600, "window_seconds": 60, "algorithm": "gcra",
     "burst": 30},
    {"unit": "month", "requests_per_unit": 1000000, "window_seconds": 2592000,
     "algorithm": "fixed", "calendar": "Europe/Berlin"},
]  # fmt: skip


@pytest.fixture
async def several(tmp_path: Path) -> AsyncIterator[tuple[str, Limiter]]:
    """An admin server over SEVERAL, after traffic at the cap and at the bucket."""
    telemetry = Telemetry(MeterProvider(), TracerProvider(), top_clients=4)
    loaded = load_text(tmp_path, SEVERAL)
    limiter = Limiter(loaded, MemoryStore(), FakeClock(), telemetry=telemetry)
    await send(limiter, req("api", desc("tenant=acme", "user=alice")), 3)
    search = req("api", desc("generic_key=search"), desc("generic_key=search", "client_id=etl"))
    await send(limiter, search, 2)
    server = AdminServer(limiter, "127.0.0.1", 0, JsonCodec(request_from_json, response_to_json))
    await server.start()
    yield f"http://127.0.0.1:{server.port}", limiter
    await server.stop()


class TestSeveralLimits:
    """/top and ``fairlimit top`` show every limit of a rule, and a cap classified once per
    limit is one row."""

    async def test_one_row_per_rule_with_every_limit(self, several: tuple[str, Limiter]) -> None:
        base, limiter = several
        rows = limiter.top_clients(10)
        assert [r.rule for r in rows] == ["api/tenant", "api/generic_key=search"]
        cap, bucket = rows
        assert (cap.hits, cap.mode.value) == (3, "weighted-fair-queue")  # the most severe
        assert (bucket.hits, [c.client for c in bucket.by_demand]) == (2, ["etl"])
        async with aiohttp.ClientSession() as http, http.get(base + "/top") as response:
            shown = {c["rule"]: c for c in (await response.json())["caps"]}
        assert shown["api/tenant"]["limits"] == [
            {"unit": "second", "requests_per_unit": 100, "window_seconds": 1,
             "algorithm": "fixed", "mode": "per-client-buckets"},
            {"unit": "minute", "requests_per_unit": 3000, "window_seconds": 300,
             "algorithm": "fixed", "mode": "weighted-fair-queue"},
        ]  # fmt: skip
        assert shown["api/generic_key=search"]["limits"] == SEARCH_LIMITS
        assert shown["api/generic_key=search"]["mode"] == "global-bucket-only"

    async def test_the_terminal_view_writes_each_limit(self, several: tuple[str, Limiter]) -> None:
        """What ``fairlimit top --once`` prints from this server's ``GET /top``."""
        base, _ = several
        port = int(base.rpartition(":")[2])
        snapshot = await asyncio.to_thread(
            topview.fetch, topview.url_of(f"127.0.0.1:{port}", 5, None)
        )
        lines = topview.render(snapshot, "here", "demand", 0.0).splitlines()
        at = lines.index(next(x for x in lines if x.startswith("api/tenant  weighted-fair-queue")))
        assert lines[at + 1] == (
            "  limits: 100 per second (per-client-buckets); 3000 per 5m (weighted-fair-queue)"
        )
        at = lines.index(next(x for x in lines if x.startswith("api/generic_key=search  ")))
        assert lines[at + 1] == (
            "  limits: 20 per second; 3000 per 5m, sliding; 600 per minute, gcra, burst 30; "
            "1000000 per calendar month in Europe/Berlin"
        )
        assert lines[at + 2].split()[:2] == ["#", "CLIENT"] and "etl" in lines[at + 3]


class TestSetting:
    def test_top_clients_is_a_bounded_whole_number(self) -> None:
        """--top-clients / FAIRLIMIT_TOP_CLIENTS: 0 (off) to 1000 counters per cap."""
        assert Settings().top_clients == 16
        assert Settings.from_env({"FAIRLIMIT_TOP_CLIENTS": "0"}).top_clients == 0
        with pytest.raises(SettingsError, match="--top-clients: expected 0 to 1000, got 1001"):
            Settings().override({"top_clients": "1001"})
        with pytest.raises(SettingsError, match="FAIRLIMIT_TOP_CLIENTS: expected a whole number"):
            Settings.from_env({"FAIRLIMIT_TOP_CLIENTS": "many"})
