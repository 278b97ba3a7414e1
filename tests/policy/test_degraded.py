"""--failure-mode local (degraded mode): while the store is away each process limits alone,
to its part of every limit (core/parts.py), and writes what it admitted back into the store
once it answers again (policy/local.py). The behaviour tests run over every backend: the
store is real, only a switch in front of it makes it fail as a lost backend does."""

import asyncio
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from fairlimit.core.admission import Code, Outcome
from fairlimit.core.concurrency import Claim, SlotOutcome, split
from fairlimit.core.fairshare import CapReport
from fairlimit.core.matching import Matcher
from fairlimit.core.parts import part, scaled, scaled_claims
from fairlimit.core.plan import Plan, plan
from fairlimit.errors import SettingsError, StoreUnavailable
from fairlimit.limiter import BREAK_SECONDS, RETURN_GRACE, Limiter
from fairlimit.quota import QuotaService
from fairlimit.settings import FailureMode, Settings
from fairlimit.store.base import Store
from fairlimit.store.memory import MemoryStore
from fairlimit.store.replicas import Replicas
from fairlimit.telemetry import Telemetry
from helpers import FakeClock, desc, load_text, req

CONFIG = """
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: tenant
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: admin
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: route
    value: public
    rate_limit: {unit: hour, requests_per_unit: 9}
    fair_share: {active_clients: 2}
    descriptors:
      - key: user
        rate_limit: {unit: hour, requests_per_unit: 6}
  - key: job
    concurrency: {max_in_flight: 5, max_duration: 30}
"""

PER_MINUTE = """
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: minute, requests_per_unit: 10}
"""


class Switch:
    """A real store behind a switch: ``down``, every call fails at once as a lost backend's
    does; ``pings_only``, the readiness ping answers and the rest still fail."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.down = False
        self.pings_only = False

    def _check(self) -> None:
        if self.down or self.pings_only:
            raise StoreUnavailable("redis: connection refused")

    async def admit(self, plan: Plan, now: float) -> Outcome:
        self._check()
        return await self.inner.admit(plan, now)

    async def acquire(self, claims: Sequence[Claim], now: float) -> SlotOutcome:
        self._check()
        return await self.inner.acquire(claims, now)

    async def release(self, claims: Sequence[Claim], now: float) -> tuple[bool, ...]:
        self._check()
        return await self.inner.release(claims, now)

    async def exchange_demand(
        self, consumer: str, report: str, now: float, ttl: float
    ) -> Mapping[str, str]:
        self._check()
        return await self.inner.exchange_demand(consumer, report, now, ttl)

    async def caps(self) -> Mapping[str, CapReport]:
        self._check()
        return await self.inner.caps()

    async def ping(self) -> None:
        if self.down:
            raise StoreUnavailable("redis: connection refused")
        await self.inner.ping()

    async def close(self) -> None:
        await self.inner.close()


class Stall(Switch):
    """A switch whose calls, while ``stalled``, wait for ``resume`` and then fail: a stopped
    Redis that answers nothing until the client gives up."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.stalled = False
        self.waiting = 0
        self.resume = asyncio.Event()

    async def admit(self, plan: Plan, now: float) -> Outcome:
        if self.stalled:
            self.waiting += 1
            await self.resume.wait()
            raise StoreUnavailable("redis: timeout")
        return await super().admit(plan, now)


SECOND = """
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: second, requests_per_unit: 20}
"""


def placed(me: str, *others: str, configured: int = 0) -> Replicas:
    """The processes as an exchange that saw ``me`` and ``others`` leaves them."""
    replicas = Replicas(configured)
    replicas.saw(me, others)
    return replicas


async def codes(limiter: Limiter, pairs: tuple[str, ...], times: int) -> list[Code]:
    request = req("edge", desc(*pairs))
    return [(await limiter.should_rate_limit(request)).code for _ in range(times)]


OK, OVER = Code.OK, Code.OVER_LIMIT


@pytest.mark.unit
class TestParts:
    def test_the_parts_add_up_to_the_limit(self) -> None:
        """Every place gets limit // n, the first limit % n one more: the sum is the limit."""
        for limit in range(40):
            for n in range(1, 8):
                parts = [part(limit, n, k) for k in range(n)]
                assert sum(parts) == limit
                assert set(parts) <= {limit // n, limit // n + 1}
                assert parts == sorted(parts, reverse=True)

    def test_a_limit_under_the_processes_goes_to_the_first_places(self) -> None:
        """1 among 3: one process may admit one, the others none (never 1 each)."""
        assert [part(1, 3, k) for k in range(3)] == [1, 0, 0]
        assert [part(2, 3, k) for k in range(3)] == [1, 1, 0]
        assert part(5, 2, 7) == 2  # a place past them (unknown): no remainder

    def test_a_scaled_plan_weighs_each_hit_n_times(self, tmp_path: Path) -> None:
        """Counters and caps keep the deployment's units: hits x n against n x part."""
        matcher = Matcher(load_text(tmp_path, CONFIG).config)
        request = req("edge", desc("tenant=t"), desc("route=public", "user=u", hits=2))
        whole = plan(request, matcher)
        local = scaled(whole, 3, 1)
        assert [(c.limit, c.hits) for c in whole.counters] == [(5, 1), (6, 2), (9, 2)]
        assert [(c.limit, c.hits) for c in local.counters] == [(6, 3), (6, 6), (9, 6)]
        assert [(s.capacity, s.hits) for s in local.shares] == [(9, 6)]
        assert local.descriptors is whole.descriptors
        assert scaled(whole, 1, 0) is whole

    def test_scaled_pools_hold_the_part_of_their_slots(self, tmp_path: Path) -> None:
        matcher = Matcher(load_text(tmp_path, CONFIG).config)
        slots = split(req("edge", desc("job=j", "request_id=r1")), matcher)
        (claim,) = scaled_claims(slots.acquire, 2, 1)
        assert [p.limit for p in claim.pools] == [2]
        assert [p.limit for p in scaled_claims(slots.acquire, 2, 0)[0].pools] == [3]


@pytest.mark.unit
class TestReplicas:
    def test_the_place_among_the_processes_last_seen(self) -> None:
        assert Replicas().place() == (1, 0)  # alone and told nothing: the whole limit
        assert Replicas(3).place() == (3, 2)  # none seen: the last place, no remainder
        assert placed("b", "c", "a").place() == (3, 1)  # by sorted id
        assert placed("b", "a", configured=4).place() == (4, 3)  # 2 of 4 seen: the last
        assert placed("c", "a", "b", configured=2).place() == (3, 2)  # more than told
        assert placed("a", configured=2).place() == (2, 1)  # only itself of 2: the last

    @given(st.data())
    @hypothesis_settings(max_examples=300, deadline=None)
    def test_the_places_taken_never_pass_a_limit(self, data: st.DataObject) -> None:
        """n processes (--replicas x --workers n), each having seen itself and any of the
        others at its last exchange: the parts they take add up to the limit at most.
        Before, a process took its index among those it saw, and two that saw only
        themselves both took the first place (seen in a live run: 11 and 12 of 10)."""
        n = data.draw(st.integers(1, 6), "processes")
        limit = data.draw(st.integers(0, 40), "limit")
        ids = [f"p{k}" for k in range(n)]
        total = 0
        for me in ids:
            rest = [i for i in ids if i != me]
            others = data.draw(st.sets(st.sampled_from(rest)), me) if rest else set()
            processes, index = placed(me, *others, configured=n).place()
            assert processes == n
            total += part(limit, processes, index)
        assert total <= limit

    async def test_every_exchange_tells_the_processes_apart(self, tmp_path: Path) -> None:
        """Two quota services (one per process, RLQS used or not) on one store each see
        both after an exchange, and take different places."""
        store, clock = MemoryStore(), FakeClock()
        loaded = load_text(tmp_path, CONFIG)
        seen = [Replicas(), Replicas()]
        services = [
            QuotaService(lambda: loaded, store, clock.now, consumer=name, replicas=r)
            for name, r in zip(("p1", "p2"), seen, strict=True)
        ]
        for service in services:
            await service.exchange()
        clock.advance(1.0)
        await services[0].exchange()
        assert [r.place() for r in seen] == [(2, 0), (2, 1)]


@pytest.mark.behaviour
class TestAlone:
    async def test_a_replica_admits_its_part_while_the_store_is_away(
        self, store: Store, clock: FakeClock, tmp_path: Path
    ) -> None:
        """10 an hour over 2 processes: 5 here, then OVER_LIMIT; open would say OK to all,
        closed UNAVAILABLE."""
        switch = Switch(store)
        loaded = load_text(tmp_path, CONFIG)
        local = Limiter(loaded, switch, clock, failure_mode=FailureMode.LOCAL,
                        replicas=placed("a", "b"))  # fmt: skip
        opened = Limiter(loaded, switch, clock, failure_mode=FailureMode.OPEN)
        closed = Limiter(loaded, switch, clock, failure_mode=FailureMode.CLOSED)
        switch.down = True
        assert await codes(local, ("client_id=x",), 7) == [OK] * 5 + [OVER] * 2
        assert await codes(opened, ("client_id=x",), 7) == [OK] * 7
        with pytest.raises(StoreUnavailable):
            await codes(closed, ("client_id=x",), 1)
        decision = await local.should_rate_limit(req("edge", desc("client_id=y")))
        assert not decision.backend_failed  # a decision, not a failure-mode answer
        (status,) = decision.statuses
        assert status.current_limit is not None and status.current_limit.requests_per_unit == 10
        assert status.limit_remaining == 8  # as if each of the 2 had admitted one

    async def test_a_window_cut_in_two_starts_where_the_store_was(
        self, store: Store, clock: FakeClock, tmp_path: Path
    ) -> None:
        """4 admitted by the store, then it goes: (10 - 4) / 2 = 3 more here."""
        switch = Switch(store)
        limiter = Limiter(load_text(tmp_path, CONFIG), switch, clock,
                          failure_mode=FailureMode.LOCAL, replicas=placed("a", "b"))  # fmt: skip
        assert await codes(limiter, ("client_id=x",), 4) == [OK] * 4
        switch.down = True
        assert await codes(limiter, ("client_id=x",), 4) == [OK] * 3 + [OVER]

    async def test_replicas_alone_together_never_pass_a_limit(
        self, store: Store, clock: FakeClock, tmp_path: Path
    ) -> None:
        """5 an hour over 2 processes: 3 and 2; 1 an hour over 3: 1, 0 and 0; a cap of 9
        over two clients of 6: at most 9 in all, each client at most its 6."""
        switch = Switch(store)
        loaded = load_text(tmp_path, CONFIG)
        names = ("p0", "p1", "p2")
        three = [
            Limiter(loaded, switch, clock, failure_mode=FailureMode.LOCAL,
                    replicas=placed(me, *(n for n in names if n != me)))
            for me in names
        ]  # fmt: skip
        two = [
            Limiter(loaded, switch, clock, failure_mode=FailureMode.LOCAL,
                    replicas=placed(me, *(n for n in names[:2] if n != me)))
            for me in names[:2]
        ]  # fmt: skip
        switch.down = True
        got = [(await codes(r, ("tenant=t",), 4)).count(OK) for r in two]
        assert got == [3, 2]
        assert [(await codes(r, ("admin=root",), 2)).count(OK) for r in three] == [1, 0, 0]
        users: dict[str, int] = {"u1": 0, "u2": 0}
        per_replica = []
        for replica in two:
            admitted = 0
            for user in users:
                n = (await codes(replica, ("route=public", f"user={user}"), 6)).count(OK)
                users[user] += n
                admitted += n
            per_replica.append(admitted)
        assert per_replica[0] <= 5 and per_replica[1] <= 4 and sum(per_replica) >= 4
        assert all(n <= 6 for n in users.values())

    async def test_calls_that_waited_into_the_next_second_count_in_it(
        self, store: Store, clock: FakeClock, tmp_path: Path
    ) -> None:
        """20 a second over 2 processes: 6 calls from the end of one second wait for the
        stopped store into the next, where 8 are decided meanwhile; decided when their
        wait ends, they and 4 more make this process's 10 in that second, not 18."""
        stall = Stall(store)
        limiter = Limiter(load_text(tmp_path, SECOND), stall, clock,
                          failure_mode=FailureMode.LOCAL, replicas=placed("a", "b"))  # fmt: skip
        clock.t = 1_700_000_000.9
        stall.stalled = True
        request = req("edge", desc("client_id=x"))
        late = [asyncio.ensure_future(limiter.should_rate_limit(request)) for _ in range(6)]
        while stall.waiting < 6:
            await asyncio.sleep(0)
        stall.stalled, stall.down = False, True
        clock.advance(0.2)  # the next second
        meanwhile = await codes(limiter, ("client_id=x",), 8)
        stall.resume.set()
        ended = [(await call).code for call in late]
        after = await codes(limiter, ("client_id=x",), 4)
        assert meanwhile == [OK] * 8
        assert (meanwhile + ended + after).count(OK) == part(20, 2, 0) == 10

    async def test_slots_taken_alone_are_the_part_of_a_pool(
        self, store: Store, clock: FakeClock, tmp_path: Path
    ) -> None:
        """5 in flight over 2 processes: 3 here (place 0); a release frees one."""
        switch = Switch(store)
        limiter = Limiter(load_text(tmp_path, CONFIG), switch, clock,
                          failure_mode=FailureMode.LOCAL, replicas=placed("a", "b"))  # fmt: skip
        switch.down = True
        taken = [await codes(limiter, ("job=j", f"request_id=r{i}"), 1) for i in range(4)]
        assert taken == [[OK]] * 3 + [[OVER]]
        await codes(limiter, ("job=j", "request_done=r0"), 1)
        assert await codes(limiter, ("job=j", "request_id=r9"), 1) == [OK]


@pytest.mark.behaviour
class TestBack:
    async def test_what_was_admitted_alone_is_written_back(
        self, store: Store, clock: FakeClock, tmp_path: Path
    ) -> None:
        """5 admitted here for x while away: back, the store holds them, so x has 5 left
        (the store decides again: 5 more, not a fresh 10); the same at a cap."""
        switch = Switch(store)
        loaded = load_text(tmp_path, CONFIG)
        limiter = Limiter(loaded, switch, clock, failure_mode=FailureMode.LOCAL,
                          replicas=placed("a", "b"))  # fmt: skip
        switch.down = True
        assert await codes(limiter, ("client_id=x",), 6) == [OK] * 5 + [OVER]
        alone = (await codes(limiter, ("route=public", "user=u1"), 6)).count(OK)
        assert alone >= 2
        switch.down = False
        clock.advance(BREAK_SECONDS)  # the breaker opened: the store is asked again after
        assert await codes(limiter, ("client_id=y",), 1) == [OK]  # answered: pays back
        await limiter.close()  # waits for the write-back
        assert limiter.local is not None and limiter.local.active  # for RETURN_GRACE
        clock.advance(RETURN_GRACE)
        await limiter.watch_backend()
        assert not limiter.local.active
        direct = Limiter(loaded, store, clock)  # no switch, no local state
        assert await codes(direct, ("client_id=x",), 6) == [OK] * 5 + [OVER]
        at_cap = (await codes(direct, ("route=public", "user=u3"), 9)).count(OK)
        assert at_cap <= 9 - alone

    async def test_a_store_back_in_the_next_window_starts_it_from_zero(
        self, store: Store, clock: FakeClock, tmp_path: Path
    ) -> None:
        """10 a minute over 2 processes: 5 admitted here while away. The store answers
        again in the next minute, with no traffic in between: what was admitted in the
        minute that ended is owed to nothing, so the new minute admits 10, not 5 (written
        back into it, the last minute's admissions would count twice)."""
        switch = Switch(store)
        loaded = load_text(tmp_path, PER_MINUTE)
        limiter = Limiter(loaded, switch, clock, failure_mode=FailureMode.LOCAL,
                          replicas=placed("a", "b"))  # fmt: skip
        clock.t = 1_700_000_041.0  # a second into a minute (1_700_000_040 starts one)
        switch.down = True
        assert await codes(limiter, ("client_id=x",), 6) == [OK] * 5 + [OVER]
        clock.t = 1_700_000_101.0  # a second into the next minute
        switch.down = False
        await limiter.watch_backend()  # the serve loop's ping: the store answers
        await limiter.close()  # waits for the write-back
        assert limiter.local is not None and limiter.local.returned_at is not None
        clock.advance(RETURN_GRACE)
        await limiter.watch_backend()
        assert not limiter.local.active and not limiter.local.owes
        direct = Limiter(loaded, store, clock)  # no switch, no local state
        assert await codes(direct, ("client_id=x",), 11) == [OK] * 10 + [OVER]

    async def test_for_a_while_back_the_part_still_bounds_each_replica(
        self, store: Store, clock: FakeClock, tmp_path: Path
    ) -> None:
        """Both admitted their 5 of x's 10 alone. The first to be back is refused by its
        part (its answer, charged by the store, even before its write-back is in), and so
        is the second; once RETURN_GRACE has passed the store alone decides: x has had its
        10 in this window, from the two together."""
        switch = Switch(store)
        loaded = load_text(tmp_path, CONFIG)
        a, b = [Limiter(loaded, switch, clock, failure_mode=FailureMode.LOCAL,
                        replicas=placed(me, other))
                for me, other in (("a", "b"), ("b", "a"))]  # fmt: skip
        switch.down = True
        assert [await codes(r, ("client_id=x",), 5) for r in (a, b)] == [[OK] * 5] * 2
        switch.down = False
        clock.advance(BREAK_SECONDS)
        assert await codes(a, ("client_id=x",), 1) == [OVER]  # b's 5 not in the store yet
        await a.close()
        assert await codes(a, ("client_id=x",), 2) == [OVER] * 2
        assert await codes(a, ("client_id=y",), 6) == [OK] * 5 + [OVER]  # a's part of y
        assert await codes(b, ("client_id=x",), 1) == [OVER]
        await b.close()
        clock.advance(RETURN_GRACE)
        for replica in (a, b):
            await replica.watch_backend()
            assert replica.local is not None and not replica.local.active
        assert [await codes(r, ("client_id=x",), 1) for r in (a, b)] == [[OVER]] * 2
        assert await codes(a, ("client_id=y",), 6) == [OK] * 5 + [OVER]  # the store's rest

    async def test_a_write_back_that_fails_is_kept_for_the_next_answer(
        self, store: Store, clock: FakeClock, tmp_path: Path
    ) -> None:
        """The readiness ping answers but the write-back's calls fail: still alone, still
        owed; once the store answers them, they are written."""
        switch = Switch(store)
        loaded = load_text(tmp_path, CONFIG)
        limiter = Limiter(loaded, switch, clock, failure_mode=FailureMode.LOCAL,
                          replicas=placed("a", "b"))  # fmt: skip
        switch.down = True
        assert await codes(limiter, ("client_id=x",), 3) == [OK] * 3
        switch.down, switch.pings_only = False, True
        assert await limiter.ping()
        await limiter.close()
        assert limiter.local is not None and limiter.local.active and limiter.local.owes
        assert not limiter.backend_healthy  # the failed write-back says so
        switch.pings_only = False
        await limiter.watch_backend()  # pings, as the serve loop does every BREAK_SECONDS
        await limiter.close()
        assert not limiter.local.owes and limiter.local.returned_at is not None
        clock.advance(RETURN_GRACE)
        await limiter.watch_backend()
        assert not limiter.local.active
        direct = Limiter(loaded, store, clock)
        assert await codes(direct, ("client_id=x",), 8) == [OK] * 7 + [OVER]

    async def test_one_log_line_each_way_and_the_metrics(
        self, store: Store, clock: FakeClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A warning on going alone (the processes and a part), an info line when back; the
        calls decided alone are counted and fairlimit.backend.degraded is 1 meanwhile."""
        caplog.set_level(logging.INFO, logger="fairlimit")
        reader = InMemoryMetricReader()
        provider = MeterProvider(metric_readers=[reader])
        switch = Switch(store)
        limiter = Limiter(load_text(tmp_path, CONFIG), switch, clock,
                          failure_mode=FailureMode.LOCAL, replicas=placed("a", "b", "c"),
                          telemetry=Telemetry(provider))  # fmt: skip
        try:
            assert _values(reader) == {"fairlimit.backend.degraded": 0,
                                       "fairlimit.rpc.decided_locally": 0}  # fmt: skip
            switch.down = True
            assert await codes(limiter, ("client_id=x",), 5) == [OK] * 4 + [OVER]  # 10 / 3
            assert _values(reader) == {"fairlimit.backend.degraded": 1,
                                       "fairlimit.rpc.decided_locally": 5}  # fmt: skip
            switch.down = False
            clock.advance(BREAK_SECONDS)
            await codes(limiter, ("client_id=x",), 1)
            await limiter.close()
            clock.advance(RETURN_GRACE)
            await codes(limiter, ("client_id=z",), 1)  # a request ends it too
            assert _values(reader)["fairlimit.backend.degraded"] == 0
        finally:
            provider.shutdown()
        alone = [r for r in caplog.records if "limiting locally" in r.getMessage()]
        assert [r.levelno for r in alone] == [logging.WARNING, logging.INFO]
        assert "about 1/3 (place 1 of 3; 3 processes last seen" in alone[0].getMessage()
        assert "100 a window -> 34" in alone[0].getMessage()
        assert "6 decisions made here, 4 admitted" in alone[1].getMessage()


def _values(reader: InMemoryMetricReader) -> dict[str, float]:
    wanted = {"fairlimit.backend.degraded", "fairlimit.rpc.decided_locally"}
    out: dict[str, float] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name in wanted:
                    for p in metric.data.data_points:
                        out[metric.name] = float(p.value)  # type: ignore[union-attr]
    return out


@pytest.mark.unit
class TestSettings:
    def test_local_and_replicas_from_flags_and_the_environment(self) -> None:
        given = Settings().override({"failure_mode": "local", "replicas": "3"})
        assert (given.failure_mode, given.replicas) == (FailureMode.LOCAL, 3)
        env = Settings.from_env({"FAIRLIMIT_FAILURE_MODE": "LOCAL", "FAIRLIMIT_REPLICAS": "2"})
        assert (env.failure_mode, env.replicas) == (FailureMode.LOCAL, 2)
        assert Settings().replicas == 0

    def test_a_bad_replica_count_is_refused(self) -> None:
        with pytest.raises(SettingsError, match="--replicas: expected a whole number"):
            Settings().override({"replicas": "two"})
