"""RLQS across processes (quota/peers.py): quota services sharing one store divide every cap
over every Envoy's demand, as one service holding all the streams would; a process that
stops reporting leaves the others' division after PEER_TTL. On memory (services sharing one
store object) and on a real Redis (one RedisStore per service)."""

import logging
from collections.abc import Sequence
from pathlib import Path

import pytest
from test_quota_service import CONFIG, TWO_CAPS, Envoy

from fairlimit.core.admission import Code
from fairlimit.core.bucket import bucket_key
from fairlimit.core.quota import SETTLE, TokenBucket
from fairlimit.limiter import Limiter
from fairlimit.quota import Assign, QuotaService, Usage, peers
from fairlimit.store.base import Store
from fairlimit.store.memory import MemoryStore
from helpers import FakeClock, desc, load_text, req
from redis_servers import RedisProcess, StoreFactory, suite_url

MODEST = [f"modest-{i}" for i in range(4)]
# Per Envoy and 5 s report: the greedy client 75/s, each modest one 7.4/s (two Envoys: 150/s
# and 14.8/s). Max-min at the cap of 100/s: modest 14.8/s each, greedy the other 40.8/s.
USAGE = [("greedy", 100, 275), *((m, 37, 0) for m in MODEST)]  # greedy: 20/s let through


@pytest.mark.unit
class TestReports:
    def test_a_report_reads_back_as_written(self) -> None:
        buckets = [
            peers.PeerBucket("edge", bucket_key({"client_id": "a", "route": "x,y"}), 7.5, 2, 5.0),
            peers.PeerBucket("edge", bucket_key({"client_id": "b"}), None, 1, 1.0),
        ]
        rls = [peers.PeerBucket("edge", bucket_key({"client_id": "c"}), 60.0, 1, 1.0)]
        report = peers.Report(buckets, rls)
        assert peers.decode(peers.encode(report)) == report

    @pytest.mark.parametrize(
        ("text", "reason"),
        [
            ("[]", "a demand report is a JSON object with lists buckets and rls"),
            ('{"buckets": []}', "a demand report is a JSON object with lists buckets and rls"),
            ('{"buckets": [[1, 2]], "rls": []}', "a demand report entry has 5 parts, not [1, 2]"),
            ('{"buckets": [["edge", [], -1, 1, 5]], "rls": []}',
             "a demand must be a finite rate >= 0, not -1"),
            ('{"buckets": [["edge", [], 1, 0, 5]], "rls": []}',
             "holders must be >= 1 and the interval > 0, not ['edge', [], 1, 0, 5]"),
            ('{"buckets": [["edge", [], 1, 1, 0]], "rls": []}',
             "holders must be >= 1 and the interval > 0, not ['edge', [], 1, 1, 0]"),
            ('{"buckets": [["edge", [], "NaN", 1, 5]], "rls": []}',
             "a demand must be a finite rate >= 0, not 'NaN'"),
            ('{"buckets": [["edge", ["k"], 1, 1, 5]], "rls": []}',
             "a bucket id is a list of [key, value] pairs, not ['k']"),
            ('{"buckets": [["edge", "k=v", 1, 1, 5]], "rls": []}',
             "a bucket id is a list of [key, value] pairs, not 'k=v'"),
            ('{"buckets": [["edge", "", 1, 1, 5]], "rls": []}',
             "a bucket id is a list of [key, value] pairs, not ''"),
            ('{"buckets": [], "rls": [["edge", [["k"]], 1, 1, 5]]}',
             "a bucket id is a list of [key, value] pairs, not [['k']]"),
        ],
    )  # fmt: skip
    def test_a_bad_report_is_refused_with_a_reason(self, text: str, reason: str) -> None:
        with pytest.raises(ValueError) as refused:
            peers.decode(text)
        assert str(refused.value) == reason

    @pytest.mark.parametrize("demand", [0, 0.5])
    def test_an_idle_or_slow_bucket_is_a_demand(self, demand: float) -> None:
        text = f'{{"buckets": [["edge", [["k", "v"]], {demand}, 1, 5]], "rls": []}}'
        (bucket,) = peers.decode(text).buckets
        assert (bucket.bucket, bucket.demand) == ((("k", "v"),), demand)

    def test_rls_hits_are_rates_over_the_span_one_holder_each(self) -> None:
        """Hits over the span since the last exchange (at least a millisecond), one holder
        a bucket, an interval of the span but at least EXCHANGE_SECONDS; none for no hits."""
        a, b, c = (bucket_key({"client_id": x}) for x in "abc")
        counts = {("edge", a): 30, ("edge", b): 0, ("edge", c): 1}
        assert peers.rls_demand(counts, 0.5) == [
            peers.PeerBucket("edge", a, 60.0, 1, peers.EXCHANGE_SECONDS),
            peers.PeerBucket("edge", c, 2.0, 1, peers.EXCHANGE_SECONDS),
        ]
        assert peers.rls_demand(counts, 4.0)[1] == peers.PeerBucket("edge", c, 0.25, 1, 4.0)
        assert peers.rls_demand({("edge", a): 3}, 0.0)[0].demand == pytest.approx(3000)

    def test_a_summary_sums_the_streams_of_a_bucket(self) -> None:
        key = bucket_key({"client_id": "a"})
        other = bucket_key({"client_id": "b"})
        held = [
            peers.Held("edge", key, 2.0, 5.0),
            peers.Held("edge", key, 3.0, 1.0),
            peers.Held("edge", other, None, 5.0),
            peers.Held("edge", other, 1.0, 5.0),
        ]
        got = {b.bucket: b for b in peers.summarise(held)}
        assert got[key] == peers.PeerBucket("edge", key, 5.0, 2, 5.0)
        assert got[other] == peers.PeerBucket("edge", other, None, 2, 5.0)


def _service(tmp_path: Path, store: Store, clock: FakeClock, name: str) -> QuotaService:
    loaded = load_text(tmp_path, CONFIG, f"{name}.yaml")
    return QuotaService(lambda: loaded, store, clock.now, consumer=name)


async def _run(services: Sequence[QuotaService], envoys: Sequence[Envoy], clock: FakeClock
               ) -> None:  # fmt: skip
    """Three reports from every Envoy 5 s apart, each followed by two seconds of drips (every
    service trades its report and divides)."""
    for _ in range(3):
        clock.advance(5.0 - 2 * peers.EXCHANGE_SECONDS)
        for envoy in envoys:
            await envoy.report(USAGE)
        for _ in range(2):
            clock.advance(peers.EXCHANGE_SECONDS)
            for service in services:
                await service.drip()


def _as_one(alone: dict[str, float]) -> object:
    """``alone``'s rates as a comparison: the same, within a 0.1/s step and the 3% an
    assignment in force is kept within (``settle``). Which rates are in force depends on the
    path to them: a process divides its own Envoy's report before it trades it, and then sees
    the cap's slack alone; the modest clients' 10.0/s kept on one path is 10.2/s on another."""
    return pytest.approx(alone, rel=SETTLE, abs=0.1)


def _rates(envoys: Sequence[Envoy]) -> dict[str, float]:
    """Each client's assigned rate summed over the Envoys."""
    return {c: sum(e.rate(c) for e in envoys) for c in ["greedy", *MODEST]}


async def _one_process(tmp_path: Path) -> dict[str, float]:
    clock = FakeClock()
    service = _service(tmp_path, MemoryStore(), clock, "alone")
    envoys = [Envoy(service), Envoy(service)]
    await _run([service], envoys, clock)
    return _rates(envoys)


async def _two_processes(tmp_path: Path, stores: Sequence[Store], clock: FakeClock
                         ) -> tuple[list[QuotaService], list[Envoy]]:  # fmt: skip
    services = [_service(tmp_path, s, clock, f"p{i}") for i, s in enumerate(stores)]
    envoys = [Envoy(services[0]), Envoy(services[1])]
    await _run(services, envoys, clock)
    return services, envoys


@pytest.mark.behaviour
class TestOnMemory:
    async def test_two_processes_divide_as_one(self, tmp_path: Path) -> None:
        """Each Envoy on its own service: the rates assigned are those one service holding
        both streams assigns (the greedy client 40.8/s in all, not per process)."""
        shared = MemoryStore()
        _, envoys = await _two_processes(tmp_path, [shared, shared], FakeClock())
        alone = await _one_process(tmp_path)
        assert _rates(envoys) == _as_one(alone)
        assert alone["greedy"] == pytest.approx(40.8, abs=0.2)

    async def test_without_the_store_shared_each_process_gives_the_whole_share(
        self, tmp_path: Path
    ) -> None:
        """The reason for the exchange: two stores, two divisions, each seeing half the
        modest demand: the greedy client gets its own limit, 50/s, from each (100 of 100)."""
        _, envoys = await _two_processes(tmp_path, [MemoryStore(), MemoryStore()], FakeClock())
        assert _rates(envoys)["greedy"] == pytest.approx(100, abs=0.2)

    async def test_a_process_gone_quiet_leaves_the_division(self, tmp_path: Path) -> None:
        """Process 1 stops reporting: after PEER_TTL process 0 divides the cap among its own
        Envoy alone (the greedy client gets its own limit, 50/s, there)."""
        shared = MemoryStore()
        clock = FakeClock()
        services, envoys = await _two_processes(tmp_path, [shared, shared], clock)
        assert envoys[0].rate("greedy") == pytest.approx(20.4, abs=0.2)
        for _ in range(int(peers.PEER_TTL / peers.EXCHANGE_SECONDS) + 2):
            clock.advance(peers.EXCHANGE_SECONDS)
            await services[0].drip()
        assert not services[0].remote.peers
        await _run(services[:1], envoys[:1], clock)  # its own reports measured again
        assert envoys[0].rate("greedy") == pytest.approx(50, abs=0.2)


@pytest.mark.behaviour
class TestOneBucketOnBothProcesses:
    async def test_its_envoys_are_split_as_one_process_splits_them(self, tmp_path: Path) -> None:
        """The greedy client's bucket on three Envoys, one on process 0 (100/s) and two on
        process 1 (150/s each, nearly all denied), at its own bound of 50/s: each Envoy
        gets the share of it one process holding all three streams gives (12.5, 18.75,
        18.75): process 1's report counts its two streams' summed demand once, split between
        them, and its holders stay apart from process 0's own stream."""
        usage = [[("greedy", 10, 490)], [("greedy", 10, 740)], [("greedy", 10, 740)]]

        async def rates(services: Sequence[QuotaService], on: Sequence[int]) -> list[float]:
            clock = clocks[len(services)]
            envoys = [Envoy(services[i]) for i in on]
            for _ in range(6):
                clock.advance(5.0 - 2 * peers.EXCHANGE_SECONDS)
                for envoy, used in zip(envoys, usage, strict=True):
                    await envoy.report(used)
                for _ in range(2):
                    clock.advance(peers.EXCHANGE_SECONDS)
                    for service in services:
                        await service.drip()
            return [e.rate("greedy") for e in envoys]

        clocks = {1: FakeClock(), 2: FakeClock()}
        alone = await rates([_service(tmp_path, MemoryStore(), clocks[1], "alone")], [0, 0, 0])
        shared = MemoryStore()
        pair = [_service(tmp_path, shared, clocks[2], f"p{i}") for i in range(2)]
        assert alone == pytest.approx([12.5, 18.7, 18.7], abs=0.1)
        assert await rates(pair, [0, 1, 1]) == pytest.approx(alone, abs=0.1)


@pytest.mark.behaviour
class TestPeersChanging:
    async def test_a_peers_new_demand_is_divided_at_the_next_drip(self, tmp_path: Path) -> None:
        """Process 0's Envoy holds the greedy client alone (50/s, its own limit); two more
        greedy clients appear on process 1: process 0's next drips read them and push its
        Envoy the smaller share, with no report of its own."""
        shared, clock = MemoryStore(), FakeClock()
        p0, p1 = (_service(tmp_path, shared, clock, f"p{i}") for i in range(2))
        mine, theirs = Envoy(p0), Envoy(p1)
        for _ in range(3):
            clock.advance(5.0)
            await mine.report([("greedy", 10, 490)])
            await p0.drip()
        assert mine.rate("greedy") == pytest.approx(50)
        for _ in range(3):
            clock.advance(5.0)
            # a bucket under a blanket rule first: it is no demand, and hides none
            await theirs.service.report(theirs.stream, "edge", [Usage({"health": "x"}, 5, 0)])
            await theirs.report([("b", 10, 490), ("c", 10, 490)])
            await p1.drip()
        pushed = len(mine.actions)
        for _ in range(2):
            clock.advance(peers.EXCHANGE_SECONDS)
            await p0.drip()
        assert len(mine.actions) > pushed
        assert mine.rate("greedy") == pytest.approx(100 / 3, abs=0.1)  # 100/s over three
        assert p0.allocation.levels["edge/route=public#1"] == pytest.approx(100 / 3)

    async def test_a_new_bucket_is_split_with_the_peers_holding_it(self, tmp_path: Path) -> None:
        """Within process 0's division gap its Envoy subscribes a bucket process 1's Envoy
        holds: the provisional assignment is the bound split between the two holders."""
        shared, clock = MemoryStore(), FakeClock()
        loaded = load_text(tmp_path, CONFIG, "p0.yaml")
        p0 = QuotaService(lambda: loaded, shared, clock.now, consumer="p0", divide_gap=0.2)
        p1 = _service(tmp_path, shared, clock, "p1")
        theirs, mine = Envoy(p1), Envoy(p0)
        await theirs.report([("alice", 1, 0)])
        await p1.drip()  # its report handed in
        await mine.report([("bob", 1, 0)])  # process 0 divides once, reading p1's report
        await p0.drip()
        assert p0.remote.peers
        await mine.report([("alice", 1, 0)])  # within the gap: provisional
        assert mine.rate("alice") == pytest.approx(25)

    async def test_a_report_divides_its_region_with_the_peers_buckets_in_it(
        self, tmp_path: Path
    ) -> None:
        """Two caps (two regions): process 1 holds a client under cap a and one under cap b
        (100/s), process 0 one under cap b (100/s). Process 0's reports divide region b
        alone, counting process 1's bucket there (listed after its cap-a bucket): cap b's
        80/s is split 40/40, not left whole to process 0's client."""
        shared, clock = MemoryStore(), FakeClock()
        loaded = load_text(tmp_path, TWO_CAPS, "two.yaml")
        p0, p1 = (QuotaService(lambda: loaded, shared, clock.now, consumer=f"p{i}")
                  for i in range(2))  # fmt: skip
        mine, theirs = Envoy(p0), Envoy(p1)

        def usage(*buckets: tuple[str, str]) -> list[Usage]:
            return [Usage({"route": r, "client_id": c}, 10, 490) for r, c in buckets]

        for _ in range(4):
            clock.advance(5.0 - 2 * peers.EXCHANGE_SECONDS)
            await theirs.service.report(theirs.stream, "edge", usage(("a", "a1"), ("b", "x")))
            await mine.service.report(mine.stream, "edge", usage(("b", "y")))
            for _ in range(2):
                clock.advance(peers.EXCHANGE_SECONDS)
                await p1.drip()
                await p0.drip()
        clock.advance(1.0)
        await mine.service.report(mine.stream, "edge", usage(("b", "y")))
        (assigned,) = [a for a in mine.actions[-1:] if isinstance(a, Assign)]
        assert isinstance(assigned.strategy, TokenBucket)
        assert assigned.strategy.rate == pytest.approx(40, abs=0.1)

    async def test_an_unreadable_peer_report_is_logged_and_skipped(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        shared, clock = MemoryStore(), FakeClock()
        await shared.exchange_demand("broken", "not json at all", clock.t, peers.PEER_TTL)
        service = _service(tmp_path, shared, clock, "p0")
        with caplog.at_level(logging.WARNING, logger="fairlimit"):
            await service.exchange()
        (line,) = [r.getMessage() for r in caplog.records]
        assert line.startswith("RLQS: the demand report of broken is unreadable: ")
        assert service.remote.peers == {}


@pytest.fixture
def shared_redis(redis_server: RedisProcess) -> StoreFactory:
    """RedisStores on the standalone server, flushed once: the services share it."""
    from fairlimit.store.redis import open_redis

    with redis_server.client() as client:
        client.flushall()

    async def make(**options: object) -> object:
        return open_redis(suite_url(redis_server.url, **options))

    return make


@pytest.mark.behaviour
class TestOnRedis:
    async def test_two_processes_on_one_redis_divide_as_one(
        self, tmp_path: Path, shared_redis: StoreFactory
    ) -> None:
        stores: list[Store] = [await shared_redis(), await shared_redis()]  # type: ignore[list-item]
        try:
            _, envoys = await _two_processes(tmp_path, stores, FakeClock())
        finally:
            for store in stores:
                await store.close()
        alone = await _one_process(tmp_path)
        assert _rates(envoys) == _as_one(alone)


WIDE = CONFIG.replace("requests_per_unit: 50}", "requests_per_unit: 80}")


@pytest.mark.behaviour
class TestRlsAtTheSameCap:
    async def test_rls_demand_arriving_is_divided_at_the_next_drips(self, tmp_path: Path) -> None:
        """The greedy client holds its own 80/s; RLS traffic of 30/s starts at the cap and
        the Envoy reports nothing more: the drips that take the tally divide, and push it
        the 70/s the RLS client leaves."""
        clock = FakeClock()
        loaded = load_text(tmp_path, WIDE, "arriving.yaml")
        limiter = Limiter(loaded, MemoryStore(), clock)
        service = QuotaService(lambda: loaded, limiter.store, clock.now, tally=limiter.tally)
        envoy = Envoy(service)
        for _ in range(3):
            await envoy.report([("greedy", 350, 25)])
            for _ in range(5):
                clock.advance(1.0)
                await service.drip()
        assert envoy.rate("greedy") == pytest.approx(80, abs=0.2)
        for _ in range(3):
            for _ in range(30):
                await limiter.should_rate_limit(
                    req("edge", desc("route=public", "client_id=rls-client"))
                )
                clock.advance(1.0 / 30)
            await service.drip()
        assert envoy.rate("greedy") == pytest.approx(70, abs=1.0)

    async def test_rls_demand_lowers_the_rlqs_share(self, tmp_path: Path) -> None:
        """A cap of 100/s over clients of 80/s; an RLS client asking 30/s, an RLQS Envoy
        whose greedy client asks 75/s: the division counts both, so the greedy client is
        assigned the 70/s the RLS client leaves (max-min); without RLS traffic, its own
        limit of 80/s."""
        got = {}
        for rls_rate in (30, 0):
            clock = FakeClock()
            loaded = load_text(tmp_path, WIDE, f"rls-{rls_rate}.yaml")
            limiter = Limiter(loaded, MemoryStore(), clock)
            service = QuotaService(lambda loaded=loaded: loaded, limiter.store, clock.now,
                                   tally=limiter.tally)  # fmt: skip
            envoy = Envoy(service)
            admitted = 0
            for second in range(16):
                for _ in range(rls_rate):
                    decision = await limiter.should_rate_limit(
                        req("edge", desc("route=public", "client_id=rls-client"))
                    )
                    admitted += decision.code is Code.OK
                    clock.advance(1.0 / rls_rate)
                if not rls_rate:
                    clock.advance(1.0)
                if second % 5 == 4:
                    await envoy.report([("greedy", 350, 25)])  # 70/s let through
                await service.drip()
            got[rls_rate] = envoy.rate("greedy")
            assert admitted >= 0.95 * 16 * rls_rate  # its share of the cap: what it asks
        assert got == {30: pytest.approx(70, abs=1.0), 0: pytest.approx(80, abs=0.2)}
