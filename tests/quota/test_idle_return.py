"""RLQS after an idle spell (issue 41): a client whose measured demand fell to 0 is assigned
its bound at once where its cap has capacity nobody is granted (the *slack*, docs/rlqs.md
rule 3), so that it is served when it comes back, before its next report is divided; a
contended cap is divided as before.

The service on an injected clock (the simulated Envoy of test_quota_service), then the
division itself (``core.quota.allocate``, each result checked against the division in arrays,
quota/division.py): chosen cases, and properties against the exact max-min level of
tests/support/maxmin.py."""

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_quota_service import CONFIG, Envoy

from fairlimit.admin.rlqs import rlqs_report
from fairlimit.core.bucket import BucketKey, bucket_key
from fairlimit.core.quota import (
    HEADROOM,
    HEADROOM_FLOOR,
    Allocation,
    Blanket,
    CapClaim,
    Holder,
    Target,
    TokenBucket,
    allocate,
    strategy_of,
    token_bucket,
)
from fairlimit.quota import Assign, QuotaService
from fairlimit.quota.division import Table, divide
from fairlimit.store.memory import MemoryStore
from helpers import FakeClock, load_text
from maxmin import level as exact_level

CAP = "edge/route=public#1"  # CONFIG's: 100/s over per-client limits of 50/s
CAPACITY, LIMIT, INTERVAL = 100.0, 50.0, 5.0

# a per-client limit of 20/s and no cap above it
OWN_LIMIT = """
domain: edge
descriptors:
  - key: route
    value: public
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 20}
"""


def service_of(tmp_path: Path, text: str, clock: FakeClock) -> QuotaService:
    loaded = load_text(tmp_path, text)
    return QuotaService(lambda: loaded, MemoryStore(), clock.now)


async def reports(clock: FakeClock, envoy: Envoy, usage: list[tuple[str, int, int]],
                  rounds: int) -> None:  # fmt: skip
    """``rounds`` reports of ``usage``, INTERVAL apart (Envoy 1.40's)."""
    for _ in range(rounds):
        clock.advance(INTERVAL)
        await envoy.report(usage)


def strategy(envoy: Envoy, client: str) -> TokenBucket:
    action = envoy.latest(client)
    assert isinstance(action, Assign) and isinstance(action.strategy, TokenBucket), action
    return action.strategy


@pytest.mark.behaviour
class TestBackFromIdle:
    async def test_a_client_back_from_idle_is_assigned_its_bound_at_an_uncontended_cap(
        self, tmp_path: Path
    ) -> None:
        """alice runs at 40/s beside bob, greedy and held to his own 50/s; she goes idle for
        a report. The cap grants 50/s to bob and 0/s to her: its other 50/s are hers, up to
        her 50/s bound, a second deep; rule 3 alone gave her 1/s, two tokens."""
        clock = FakeClock()
        envoy = Envoy(service_of(tmp_path, CONFIG, clock))
        await reports(clock, envoy, [("alice", 200, 0), ("bob", 250, 2250)], 3)
        await reports(clock, envoy, [("alice", 0, 0), ("bob", 250, 2250)], 1)
        assert envoy.stream.buckets[bucket_key({"route": "public", "client_id": "alice"})
                                    ].demand == 0  # fmt: skip
        assert strategy(envoy, "alice") == TokenBucket(50, 500, 10)
        assert strategy(envoy, "bob").rate == LIMIT

    async def test_a_bucket_under_no_cap_is_assigned_its_own_limit_after_idle(
        self, tmp_path: Path
    ) -> None:
        """No cap over alice: her only bound is her own 20/s, which an idle report leaves
        her whole (rule 3 alone: 1/s)."""
        clock = FakeClock()
        envoy = Envoy(service_of(tmp_path, OWN_LIMIT, clock))
        await reports(clock, envoy, [("alice", 50, 0)], 3)
        await reports(clock, envoy, [("alice", 0, 0)], 1)
        assert strategy(envoy, "alice") == TokenBucket(20, 200, 10)

    async def test_many_idle_clients_share_the_slack_by_weight_within_the_cap(
        self, tmp_path: Path
    ) -> None:
        """40 clients, all idle: rule 3 gave each 1/s (40/s of headroom). The cap's 100/s
        are split among them, 2.5/s each: they sum to the cap, within C + that headroom, and
        /rlconfig reports the 100/s assigned above their demand as the cap's headroom."""
        clock = FakeClock()
        service = service_of(tmp_path, CONFIG, clock)
        envoy = Envoy(service)
        clients = [f"c{i}" for i in range(40)]
        await reports(clock, envoy, [(c, 25, 0) for c in clients], 2)
        await reports(clock, envoy, [(c, 0, 0) for c in clients], 1)
        rates = [strategy(envoy, c).rate for c in clients]
        old_headroom = len(clients) * HEADROOM_FLOOR
        assert rates == [2.5] * len(clients)
        assert sum(rates) <= CAPACITY + old_headroom
        assert service.allocation.headroom[CAP] == pytest.approx(CAPACITY)
        figures = rlqs_report(service)["caps"][CAP]
        assert figures == {"fair_share_level_per_second": None,
                           "headroom_per_second": pytest.approx(CAPACITY)}  # fmt: skip

    async def test_a_contended_cap_is_divided_as_before(self, tmp_path: Path) -> None:
        """Three greedy clients, a modest one at 10/s and an idle one: the cap is contended
        (λ = 30, the exact solver's), so nothing is left over: the greedy clients get 30/s,
        the modest 10·1.25 + 1 and the idle one 1/s, as rule 3 alone gives them, and the
        cap's headroom is rule 3's."""
        clock = FakeClock()
        service = service_of(tmp_path, CONFIG, clock)
        envoy = Envoy(service)
        greedy = [(g, 0, 2500) for g in ("g1", "g2", "g3")]
        await reports(clock, envoy, [*greedy, ("modest", 50, 0), ("idle", 0, 0)], 4)
        lam = exact_level([LIMIT, LIMIT, LIMIT, 10, 0], [1] * 5, CAPACITY)
        assert service.allocation.levels[CAP] == pytest.approx(lam) == 30
        assert [strategy(envoy, g).rate for g, _, _ in greedy] == [30.0] * 3
        assert strategy(envoy, "modest").rate == pytest.approx(10 * (1 + HEADROOM) + 1, abs=0.1)
        assert strategy(envoy, "idle").rate == HEADROOM_FLOOR
        assert service.allocation.headroom[CAP] == pytest.approx(10 * HEADROOM + 2 * HEADROOM_FLOOR)


def holder(stream: int, client: str, demand: float | None, caps: tuple[CapClaim, ...] = (),
           own: float = math.inf) -> Holder:  # fmt: skip
    return Holder(stream, bucket_key({"client_id": client}), Target(None, own, caps), demand,
                  INTERVAL)  # fmt: skip


def allocate_both(hs: list[Holder]) -> Allocation:
    """``allocate``'s result, once the division in arrays has given every holder the same
    strategy and part of the headroom (quota/division.py)."""
    out = allocate(hs)
    table = Table()
    rows = np.array([table.row(h.bucket, h.target) for h in hs], dtype=np.intp)
    got = divide(table, rows, np.array([np.nan if h.demand is None else h.demand for h in hs]),
                 np.array([h.interval for h in hs]))  # fmt: skip
    assert [strategy_of(c) for c in got.codes.tolist()] == [
        out.strategies[(h.stream, h.bucket)] for h in hs
    ]
    assert got.extra.tolist() == pytest.approx(
        [out.extra.get((h.stream, h.bucket), math.nan) for h in hs], nan_ok=True
    )
    return out


def rate(out: Allocation, stream: int, client: str) -> float:
    found = out.strategies[(stream, bucket_key({"client_id": client}))]
    assert isinstance(found, TokenBucket), found
    return found.rate


@pytest.mark.unit
class TestSlackSharing:
    def test_a_bucket_on_two_envoys_gets_the_extra_split_evenly(self) -> None:
        """Alone at the cap, a bucket at 20/s on one Envoy and idle on another: its total is
        its bound, 50/s; each Envoy keeps its rule 3 rate (26/s and 1/s) and the 23/s left
        are split evenly (+11.5/s each), whichever Envoy its requests come back on."""
        caps = (CapClaim(CAP, "a", CAPACITY, LIMIT, 1.0),)
        out = allocate_both([holder(1, "a", 20, caps), holder(2, "a", 0, caps)])
        assert (rate(out, 1, "a"), rate(out, 2, "a")) == (37.5, 12.5)
        assert out.headroom[CAP] == pytest.approx(50 - 20)

    def test_weights_split_the_slack(self) -> None:
        """Two idle clients of weights 3 and 1 under 100/s, limits 60/s: 75/s and 25/s of
        slack, the heavier held to its 60/s."""
        out = allocate_both([holder(1, c, 0, (CapClaim(CAP, c, CAPACITY, 60, w),)) for c, w in
                        (("heavy", 3.0), ("light", 1.0))])  # fmt: skip
        assert (rate(out, 1, "heavy"), rate(out, 1, "light")) == (60.0, 25.0)

    def test_a_clients_part_is_split_evenly_among_its_buckets(self) -> None:
        """One client, two idle buckets of their own limit 80/s under a 100/s cap: its part
        (all the slack) is halved, 50/s each, not 80/s each (160/s under a 100/s cap)."""
        caps = (CapClaim(CAP, "a", CAPACITY, math.inf, 1.0),)
        hs = [Holder(1, bucket_key({"client_id": "a", "path": p}), Target(None, 80.0, caps), 0.0,
                     INTERVAL) for p in ("x", "y")]  # fmt: skip
        out = allocate_both(hs)
        assert [out.strategies[(1, h.bucket)] for h in hs] == [TokenBucket(50, 500, 10)] * 2

    def test_a_bucket_under_two_caps_takes_the_least_of_its_parts(self) -> None:
        """x under caps a (100/s, alone there) and b (40/s, shared with idle y): its part at
        b, 20/s, is the lesser."""
        a, b = "edge/a#1", "edge/b#1"
        x = holder(1, "x", 0, (CapClaim(a, "x", 100, math.inf, 1), CapClaim(b, "x", 40, 50, 1)))
        y = holder(1, "y", 0, (CapClaim(b, "y", 40, 50, 1),))
        out = allocate_both([x, y])
        assert (rate(out, 1, "x"), rate(out, 1, "y")) == (20.0, 20.0)


# --- properties -----------------------------------------------------------------------------

CAPS = ("edge/a#1", "edge/b#1")


@st.composite
def divisions(draw: st.DrawFn) -> list[Holder]:
    """Buckets of a client each (so a client's bound is its bucket's) under cap a, cap b,
    both or none, each on one to three Envoys, demands idle, measured or (rarely) not yet."""
    capacity = {c: draw(st.sampled_from([5.0, 40.0, 100.0, 1000.0])) for c in CAPS}
    limit = {c: draw(st.sampled_from([math.inf, 10.0, 50.0])) for c in CAPS}
    out: list[Holder] = []
    for b in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["a", "b", "both", "own"]))
        caps = {"a": CAPS[:1], "b": CAPS[1:], "both": CAPS}.get(kind, ())
        weight = draw(st.sampled_from([0.5, 1.0, 2.0]))
        claims = tuple(CapClaim(c, f"u{b}", capacity[c], limit[c], weight) for c in caps)
        own = draw(st.sampled_from([20.0, 300.0] if kind == "own" else [math.inf, 20.0, 300.0]))
        for stream in range(1, draw(st.integers(1, 3)) + 1):
            demand = draw(st.one_of(st.just(0.0), st.floats(0.01, 400.0), st.none()))
            out.append(Holder(stream, bucket_key({"b": str(b)}), Target(None, own, claims),
                              demand, draw(st.sampled_from([0.5, 1.0, 5.0]))))  # fmt: skip
    return out


def bounds_of(hs: list[Holder]) -> dict[BucketKey, float]:
    """Each bucket's bound: its own limit and, at each cap, min(L, λ·w) at the exact level
    over the clients' wants (demand, or own limit while unmeasured)."""
    buckets: dict[BucketKey, list[Holder]] = {}
    for h in hs:
        buckets.setdefault(h.bucket, []).append(h)
    wants = {k: (v[0].target.limit if any(h.demand is None for h in v)
                 else min(sum(h.demand or 0.0 for h in v), v[0].target.limit))
             for k, v in buckets.items()}  # fmt: skip
    levels: dict[str, float] = {}
    for cap in CAPS:
        under = [(k, c) for k, v in buckets.items() for c in v[0].target.caps if c.cap == cap]
        if under:
            asked = [min(wants[k], c.client_limit, 1e18) for k, c in under]
            levels[cap] = exact_level(asked, [c.weight for _, c in under], under[0][1].capacity)
    return {k: min([v[0].target.limit, *(min(c.client_limit, levels[c.cap] * c.weight)
                                          for c in v[0].target.caps)])
            for k, v in buckets.items()}  # fmt: skip


@pytest.mark.unit
class TestSlackProperties:
    @given(divisions())
    def test_below_bound_buckets_keep_their_rule_3_rate_and_stay_within_their_bound(
        self, hs: list[Holder]
    ) -> None:
        """A measured bucket whose rule 3 rates fit its bound: each Envoy at least its rule 3
        rate (in 0.1/s steps), the bucket at most its bound."""
        out = allocate_both(hs)
        bounds = bounds_of(hs)
        for key, bound in bounds.items():
            mine = [h for h in hs if h.bucket == key]
            if not 0 < bound < math.inf or any(h.demand is None for h in mine):
                continue
            loose = [(h.demand or 0.0) * (1 + HEADROOM) + HEADROOM_FLOOR for h in mine]
            if sum(loose) > bound:
                continue
            got = [out.strategies[(h.stream, key)] for h in mine]
            for strategy, old in zip(got, loose, strict=True):
                assert isinstance(strategy, TokenBucket)
                assert strategy.rate >= token_bucket(old, 2).rate, (strategy, old)
            assert sum(s.rate for s in got) <= bound + 1e-9  # type: ignore[union-attr]

    @given(divisions())
    def test_a_caps_buckets_sum_to_at_most_c_plus_the_rule_3_headroom(
        self, hs: list[Holder]
    ) -> None:
        """At each cap, the assigned rates sum to at most C + H_old, H_old what rule 3 alone
        assigns above demand (a bucket held at its bound by its headroom included), and to at
        most C + the headroom the division reports (the 0.1/s floor of a token bucket
        aside); a contended cap gives no slack away: its headroom is rule 3's."""
        out = allocate_both(hs)
        bounds = bounds_of(hs)
        for cap in CAPS:
            under = [h for h in hs if any(c.cap == cap for c in h.target.caps)]
            if not under or Blanket.ALLOW_ALL in (out.strategies[(h.stream, h.bucket)]
                                                  for h in under):  # fmt: skip
                continue
            capacity = next(c.capacity for c in under[0].target.caps if c.cap == cap)
            given = [out.strategies[(h.stream, h.bucket)] for h in under]
            tokens = [s for s in given if isinstance(s, TokenBucket)]
            assigned = sum(s.rate for s in tokens)
            # a token bucket lets one token through a fill at least (0.1/s), whatever its rate
            floors = 0.1 * sum(s.tokens_per_fill == 1 for s in tokens)
            old = 0.0
            for key in {h.bucket for h in under}:
                mine = [h for h in under if h.bucket == key]
                if any(h.demand is None for h in mine) or not 0 < bounds[key] < math.inf:
                    continue
                loose = sum((h.demand or 0.0) * (1 + HEADROOM) + HEADROOM_FLOOR for h in mine)
                old += max(0.0, min(loose, bounds[key]) - sum(h.demand or 0.0 for h in mine))
            assert assigned <= capacity + old + floors + 1e-6, (assigned, capacity, old)
            assert assigned <= capacity + out.headroom[cap] + floors + 1e-6
            if not math.isinf(out.levels[cap]):
                assert out.headroom[cap] == pytest.approx(old, abs=1e-6)
