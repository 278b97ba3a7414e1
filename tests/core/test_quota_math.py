"""RLQS assignment math (core/quota.py) and the bucket -> descriptor mapping (core/bucket.py)."""

import math
from pathlib import Path

import pytest

from fairlimit.core.bucket import BucketKey, bucket_key, entries_for
from fairlimit.core.quota import (
    HEADROOM,
    HEADROOM_FLOOR,
    Blanket,
    CapClaim,
    Holder,
    Target,
    TokenBucket,
    allocate,
    provisional,
    settle,
    token_bucket,
)
from fairlimit.core.rules import Domain
from fairlimit.core.values import MAX_TEXT, bounded_value
from helpers import load_text
from maxmin import maxmin
from oracles import grants

pytestmark = pytest.mark.unit

CAP = "edge/route=public#1"


def claim(client: str, capacity: float = 100, limit: float = 50, weight: float = 1) -> CapClaim:
    return CapClaim(CAP, client, capacity, limit, weight)


def holder(stream: int, client: str, demand: float | None, **kw: float) -> Holder:
    target = Target(None, kw.pop("own", 50), (claim(client, **kw),))
    return Holder(stream, bucket_key({"client_id": client}), target, demand, 0.5)


def rate(allocation: object, stream: int, client: str) -> float:
    strategy = allocation.strategies[(stream, bucket_key({"client_id": client}))]  # type: ignore[attr-defined]
    assert isinstance(strategy, TokenBucket)
    return strategy.rate


class TestMaxMinAcrossEnvoys:
    def test_a_greedy_client_gets_the_rest_split_by_its_envoys_demand(self) -> None:
        """Greedy 300/s over two Envoys (2:1), four modest at 15/s: greedy gets 100 - 60 = 40."""
        hs = [holder(1, "greedy", 200), holder(2, "greedy", 100)]
        hs += [holder(1 + i % 2, f"m{i}", 15) for i in range(4)]
        out = allocate(hs)
        assert out.levels[CAP] == pytest.approx(40)
        assert rate(out, 1, "greedy") == pytest.approx(40 * 2 / 3, abs=0.1)
        assert rate(out, 2, "greedy") == pytest.approx(40 / 3, abs=0.1)
        for i in range(4):
            assert rate(out, 1 + i % 2, f"m{i}") == pytest.approx(15 * (1 + HEADROOM) + 1, abs=0.1)

    def test_grants_at_the_bound_sum_to_at_most_the_cap(self) -> None:
        """Every client greedy: the assigned rates sum to the cap (rounded down), no headroom."""
        hs = [holder(s, f"c{i}", 500) for s in (1, 2) for i in range(7)]
        out = allocate(hs)
        total = sum(rate(out, s, f"c{i}") for s in (1, 2) for i in range(7))
        assert 100 - 14 * 0.1 <= total <= 100
        assert out.headroom[CAP] == 0
        assert all(s.max_tokens == 2 for s in out.strategies.values())  # type: ignore[union-attr]

    def test_weights_and_limits_as_water_filling(self) -> None:
        """The per-client rates equal the water-filling grants of the summed demand; the
        capacity they leave (100 - 50 - 30 - 5) goes to the one client below its bound."""
        demands, limits, weights = [80.0, 80.0, 5.0], [50.0, 30.0, 50.0], [3.0, 1.0, 1.0]
        hs = [
            Holder(1, bucket_key({"client_id": f"c{i}"}),
                   Target(None, limits[i], (claim(f"c{i}", limit=limits[i], weight=weights[i]),)),
                   demands[i], 1.0)
            for i in range(3)
        ]  # fmt: skip
        out = allocate(hs)
        expected = grants(demands, limits, weights, 100)
        assert rate(out, 1, "c0") == pytest.approx(expected[0], abs=0.1)
        assert rate(out, 1, "c1") == pytest.approx(expected[1], abs=0.1)
        assert rate(out, 1, "c2") == pytest.approx(100 - 50 - 30, abs=0.1)

    def test_headroom_is_bounded_and_reported(self) -> None:
        """Assigned rates exceed the cap by at most the headroom of the clients below it."""
        hs = [holder(1, "greedy", 1000), *(holder(2, f"m{i}", 10) for i in range(5))]
        out = allocate(hs)
        total = sum(s.rate for s in out.strategies.values())  # type: ignore[union-attr]
        grants_total = 50 + 5 * 10  # greedy held to its own 50/s, modest get their 10/s
        assert total <= grants_total + out.headroom[CAP] + 1e-6
        assert out.headroom[CAP] == pytest.approx(5 * (10 * HEADROOM + HEADROOM_FLOOR), abs=0.1)

    def test_headroom_never_passes_the_bound(self) -> None:
        """A client just under its bound is held at the bound, not above it."""
        out = allocate([holder(1, "a", 24), holder(2, "a", 24)])
        assert rate(out, 1, "a") + rate(out, 2, "a") <= 50

    def test_an_unmeasured_bucket_is_offered_its_bound(self) -> None:
        """First report: the newcomer wants its bound, so the greedy client makes room."""
        out = allocate([holder(1, "greedy", 500), holder(2, "new", None)])
        assert rate(out, 2, "new") == pytest.approx(50)
        assert rate(out, 1, "greedy") == pytest.approx(50)
        crowded = allocate([holder(1, "g1", 500), holder(1, "g2", 500), holder(2, "new", None)])
        assert rate(crowded, 2, "new") == pytest.approx(100 / 3, abs=0.1)


class TestStrategies:
    def test_blanket_targets_pass_through(self) -> None:
        """Unlimited or unmatched buckets are ALLOW_ALL, blocked ones DENY_ALL."""
        key = bucket_key({"k": "v"})
        out = allocate([Holder(1, key, Target(Blanket.ALLOW_ALL), 5, 1),
                        Holder(2, key, Target(Blanket.DENY_ALL), 5, 1)])  # fmt: skip
        assert out.strategies == {(1, key): Blanket.ALLOW_ALL, (2, key): Blanket.DENY_ALL}

    def test_a_zero_capacity_cap_denies(self) -> None:
        """A cap of 0 leaves every bucket under it DENY_ALL."""
        out = allocate([holder(1, "a", 5, capacity=0)])
        assert set(out.strategies.values()) == {Blanket.DENY_ALL}

    def test_token_bucket_rounds_down_in_tenths(self) -> None:
        """Envoy reads fill_interval in whole seconds: 10 s fills give 0.1/s steps, never 0."""
        assert token_bucket(12.37, 3) == TokenBucket(3, 123, 10)
        assert token_bucket(0.01, 1).rate == pytest.approx(0.1)

    def test_depth_is_a_quarter_second_at_the_bound_and_half_an_interval_below(self) -> None:
        """Greedy buckets hold 0.25 s of their rate; modest ones half an interval (>= 2)."""
        out = allocate([holder(1, "greedy", 500, capacity=1000, limit=400, own=400),
                        holder(1, "modest", 30)])  # fmt: skip
        greedy = out.strategies[(1, bucket_key({"client_id": "greedy"}))]
        modest = out.strategies[(1, bucket_key({"client_id": "modest"}))]
        assert isinstance(greedy, TokenBucket) and greedy.max_tokens == 100
        assert isinstance(modest, TokenBucket)
        assert modest.max_tokens == math.ceil(modest.rate * 0.5 / 2)

    def test_token_bucket_is_never_empty(self) -> None:
        """Envoy refuses ``max_tokens`` 0: a depth below one still holds one token, and a
        depth of one is kept as given."""
        assert token_bucket(5.0, 0) == TokenBucket(1, 50, 10)
        assert token_bucket(5.0, 1) == TokenBucket(1, 50, 10)

    def test_settle_keeps_a_rate_within_three_percent(self) -> None:
        """A jittering rate is not re-sent (Envoy would refill the bucket each time)."""
        old = TokenBucket(1, 400, 10)
        assert settle(old, TokenBucket(1, 410, 10)) is old
        assert settle(old, TokenBucket(1, 420, 10)) == TokenBucket(1, 420, 10)
        assert settle(None, Blanket.DENY_ALL) is Blanket.DENY_ALL

    def test_settle_keeps_a_rate_exactly_three_percent_off(self) -> None:
        """50/s -> 51.5/s is 3% to the last bit (1.5 == 0.03 * 50 in floats), and "within"
        includes it."""
        old = TokenBucket(2, 500, 10)
        assert settle(old, TokenBucket(2, 515, 10)) is old


def key_of(client: str, path: str | None = None) -> BucketKey:
    return bucket_key({"client_id": client} | ({} if path is None else {"path": path}))


def strategies(holders: list[Holder]) -> dict[tuple[int, str], object]:
    """allocate's strategies by (stream, client[/path]), for comparing whole assignments."""
    out = allocate(holders).strategies
    return {(s, "/".join(v for _, v in k)): v for (s, k), v in out.items()}


class TestCapBounds:
    def test_an_idle_bucket_claims_nothing_of_its_cap(self) -> None:
        """Demand 0 wants 0: the other client's 100/s fits the 100/s cap, which stays
        uncontended (λ = inf), so it keeps its whole bound (100/s, 0.25 s deep: 25 tokens)."""
        out = allocate([holder(1, "idle", 0, limit=100, own=100),
                        holder(1, "busy", 500, limit=100, own=100)])  # fmt: skip
        assert out.levels[CAP] == math.inf
        assert out.strategies[(1, key_of("busy"))] == TokenBucket(25, 1000, 10)

    def test_a_bucket_idle_on_two_envoys_claims_nothing_either(self) -> None:
        """The same over two Envoys, each reporting 0: the bucket wants 0, not one request
        a second per Envoy, and the cap stays uncontended."""
        hs = [holder(s, "idle", 0, limit=100, own=100) for s in (1, 2)]
        out = allocate([*hs, holder(1, "busy", 500, limit=100, own=100)])
        assert out.levels[CAP] == math.inf
        assert out.strategies[(1, key_of("busy"))] == TokenBucket(25, 1000, 10)

    def test_weights_scale_a_clients_share(self) -> None:
        """Two greedy clients of weights 3 and 1 under 100/s get 75/s and 25/s (the
        independent max-min solver agrees), each 0.25 s deep."""
        assert maxmin([500, 500], [math.inf, math.inf], [3, 1], 100) == [75, 25]
        hs = [Holder(1, key_of(c), Target(None, math.inf, (claim(c, limit=math.inf, weight=w),)),
                     500, 0.5)
              for c, w in (("heavy", 3), ("light", 1))]  # fmt: skip
        assert strategies(hs) == {
            (1, "heavy"): TokenBucket(19, 750, 10),
            (1, "light"): TokenBucket(7, 250, 10),
        }

    def test_a_clients_limit_is_split_among_its_buckets_by_demand(self) -> None:
        """A client limited to 1/s demands 0.2/s and 0.6/s on two buckets: they get 1/4 and
        3/4 of it, 0.25/s and 0.75/s, in 0.1/s steps 0.2/s and 0.7/s, two tokens deep."""
        hs = [Holder(1, key_of("a", p), Target(None, 50, (claim("a", limit=1),)), d, 0.5)
              for p, d in (("x", 0.2), ("y", 0.6))]  # fmt: skip
        assert strategies(hs) == {
            (1, "a/x"): TokenBucket(2, 2, 10),
            (1, "a/y"): TokenBucket(2, 7, 10),
        }

    @pytest.mark.parametrize("envoys", [1, 2])
    def test_a_buckets_demand_counts_at_most_its_own_limit(self, envoys: int) -> None:
        """At a 100/s cap, a (its own limit 10/s under an unlimited client level) wants 80/s
        and b 200/s: a can use 10 of the cap, so b gets the other 90 (λ = 90), whether each
        bucket is reported by one Envoy or split over two. Counting a's 80 at the cap would
        hold b to 50 and leave 40/s of the cap unused."""

        def bucket(client: str, own: float, demand: float) -> list[Holder]:
            target = Target(None, own, (claim(client, limit=math.inf),))
            return [Holder(s, key_of(client), target, demand / envoys, 0.5)
                    for s in range(1, envoys + 1)]  # fmt: skip

        out = allocate(bucket("a", 10, 80) + bucket("b", math.inf, 200))
        assert out.levels[CAP] == pytest.approx(90)
        streams = range(1, envoys + 1)
        assert sum(rate(out, s, "b") for s in streams) == pytest.approx(90, abs=0.1 * envoys)
        assert sum(rate(out, s, "a") for s in streams) == pytest.approx(10, abs=0.1 * envoys)

    @pytest.mark.parametrize("envoys", [1, 2])
    def test_a_clients_limit_is_split_by_demand_its_buckets_can_use(self, envoys: int) -> None:
        """A client limited to 60/s at the cap wants 80/s on bucket x (its own limit 10/s)
        and 20/s on y: x can use 10, so the 60 are split 10:20 (y bounded at 40/s, which the
        cap's slack gives it; x held to its own 10), not 80:20 (y held to 12/s)."""
        streams = range(1, envoys + 1)
        wants = (("x", 10, 80), ("y", math.inf, 20))
        hs = [Holder(s, key_of("a", path), Target(None, own, (claim("a", limit=60),)),
                     demand / envoys, 0.5)
              for path, own, demand in wants for s in streams]  # fmt: skip
        out = allocate(hs)

        def total(path: str) -> float:
            found = (out.strategies[(s, key_of("a", path))] for s in streams)
            return sum(t.rate for t in found if isinstance(t, TokenBucket))

        assert total("x") == pytest.approx(10, abs=0.1 * envoys)
        assert total("y") == pytest.approx(40, abs=0.1 * envoys)

    def test_a_clients_limit_is_split_evenly_among_its_unmeasured_buckets(self) -> None:
        """Two unmeasured buckets without limits of their own want unbounded rates: the
        client's 10/s is halved, 5/s each, a second (5 tokens) deep."""
        hs = [Holder(1, key_of("a", p), Target(None, math.inf, (claim("a", limit=10),)), None, 0.5)
              for p in ("x", "y")]  # fmt: skip
        assert strategies(hs) == {
            (1, "a/x"): TokenBucket(5, 50, 10),
            (1, "a/y"): TokenBucket(5, 50, 10),
        }


class TestBucketStrategies:
    def test_below_the_bound_demand_plus_headroom_half_an_interval_deep(self) -> None:
        """At a contended cap (40/s, a greedy client taking the rest: λ = 27), rate
        d*1.25 + 1: 12 -> 16/s, 1 -> 2.25/s, 0 -> 1/s; depth ceil(rate * 0.25 s) for a 0.5 s
        interval, at least 2: 4, 2, 2. The extra over demand is 4, 1.25 and 1."""
        out = allocate([holder(1, c, d, capacity=40) for c, d in
                        (("a", 12), ("b", 1), ("c", 0), ("greedy", 500))])  # fmt: skip
        assert out.levels[CAP] == pytest.approx(27)
        assert out.strategies == {
            (1, key_of("a")): TokenBucket(4, 160, 10),
            (1, key_of("b")): TokenBucket(2, 22, 10),
            (1, key_of("c")): TokenBucket(2, 10, 10),
            (1, key_of("greedy")): TokenBucket(7, 270, 10),
        }
        assert out.extra == {(1, key_of("a")): 4, (1, key_of("b")): 1.25, (1, key_of("c")): 1}
        assert out.headroom[CAP] == pytest.approx(6.25)

    def test_headroom_that_just_fits_the_bound_is_granted(self) -> None:
        """Demand 12 under an own limit of 16: 12*1.25 + 1 == 16 fits, so the bucket is below
        its bound, half its 1 s interval deep (8 tokens), with 4/s of headroom."""
        hs = [Holder(1, key_of("a"), Target(None, 16, (claim("a"),)), 12, 1.0)]
        out = allocate(hs)
        assert out.strategies == {(1, key_of("a")): TokenBucket(8, 160, 10)}
        assert out.headroom[CAP] == 4

    def test_an_unmeasured_bucket_is_split_equally_a_second_deep(self) -> None:
        """Two Envoys, no demand measured yet: each gets half the 50/s bound and holds one
        second of it (25 tokens), whatever their reporting interval."""
        assert strategies([holder(1, "a", None), holder(2, "a", None)]) == {
            (1, "a"): TokenBucket(25, 250, 10),
            (2, "a"): TokenBucket(25, 250, 10),
        }

    def test_at_the_bound_split_by_demand_an_idle_envoy_keeping_one_token_a_fill(self) -> None:
        """Own limit 50, Envoys at 100/s and 0/s: 50 * 100/100 = 50/s (13 tokens, 0.25 s) and
        0/s, which is one token a fill (0.1/s), two deep."""
        assert strategies([holder(1, "a", 100), holder(2, "a", 0)]) == {
            (1, "a"): TokenBucket(13, 500, 10),
            (2, "a"): TokenBucket(2, 1, 10),
        }

    def test_a_bound_below_the_floor_is_split_by_demand(self) -> None:
        """Own limit 0.5/s, Envoys at 0.2/s and 0.6/s (their floors alone pass it): 0.125/s
        and 0.375/s, in 0.1/s steps 0.1/s and 0.3/s."""
        hs = [Holder(s, key_of("a"), Target(None, 0.5), d, 0.5) for s, d in ((1, 0.2), (2, 0.6))]
        assert strategies(hs) == {(1, "a"): TokenBucket(2, 1, 10), (2, "a"): TokenBucket(2, 3, 10)}

    def test_an_idle_bucket_below_one_request_a_second_is_split_evenly(self) -> None:
        """A 90/minute (1.5/s) bucket both of whose Envoys report nothing: no demand to split
        by, so 0.75/s each (0.7/s in 0.1/s steps), at the bound; once a division crashed
        here. Held at its bound by its floors, not by its demand: the 0.75/s above the 0/s
        asked are counted as headroom (they are assigned above the grant)."""
        out = allocate([Holder(s, key_of("a"), Target(None, 1.5), 0.0, 0.5) for s in (1, 2)])
        assert out.strategies == {
            (1, key_of("a")): TokenBucket(2, 7, 10),
            (2, key_of("a")): TokenBucket(2, 7, 10),
        }
        assert out.extra == {(1, key_of("a")): 0.75, (2, key_of("a")): 0.75}


class TestAllocateEveryBucket:
    def test_blanket_bounds_leave_the_next_buckets_assigned(self) -> None:
        """An unbounded bucket (no limit anywhere, its cap uncontended) is ALLOW_ALL, one under a
        cap of 0 DENY_ALL, and the bucket after them still gets its bound, 50/s (alone at
        its cap: the slack is all its)."""
        hs = [
            Holder(1, key_of("free"), Target(None, math.inf, (claim("free", limit=math.inf),)),
                   5, 0.5),
            Holder(1, key_of("shut"), Target(None, 50, (CapClaim("closed#1", "shut", 0, 50, 1),)),
                   5, 0.5),
            holder(1, "a", 12),
        ]  # fmt: skip
        assert strategies(hs) == {
            (1, "free"): Blanket.ALLOW_ALL,
            (1, "shut"): Blanket.DENY_ALL,
            (1, "a"): TokenBucket(13, 500, 10),
        }


def target(own: float = 50, capacity: float = 100, limit: float = 50, weight: float = 1) -> Target:
    return Target(None, own, (CapClaim(CAP, "a", capacity, limit, weight),))


class TestProvisional:
    """A new bucket between divisions: the least of its own limit, its client's limit and its
    share at the level in force, split among its holders, one second deep."""

    def test_the_share_at_the_level_in_force(self) -> None:
        """Level 20 at weight 2: 40/s (40 tokens)."""
        assert provisional(target(weight=2), {CAP: 20}, 1) == TokenBucket(40, 400, 10)

    def test_a_cap_not_divided_yet_offers_its_capacity(self) -> None:
        """No level for the cap yet: its capacity of 30/s."""
        assert provisional(target(capacity=30), {}, 1) == TokenBucket(30, 300, 10)

    def test_its_own_limit(self) -> None:
        """Own limit 5 under a share of 20 and a client limit of 50: 5/s."""
        assert provisional(target(own=5), {CAP: 20}, 1) == TokenBucket(5, 50, 10)

    def test_its_clients_limit(self) -> None:
        """Client limit 8 under a share of 20 and an own limit of 50: 8/s."""
        assert provisional(target(limit=8), {CAP: 20}, 1) == TokenBucket(8, 80, 10)

    def test_split_among_its_holders(self) -> None:
        """50/s over two streams: 25/s each."""
        assert provisional(target(), {}, 2) == TokenBucket(25, 250, 10)

    def test_a_bound_of_zero_denies_and_one_below_a_request_a_second_does_not(self) -> None:
        """Own limit 0: DENY_ALL. Own limit 0.5/s: five tokens a 10 s fill, two deep."""
        assert provisional(target(own=0), {}, 1) is Blanket.DENY_ALL
        assert provisional(target(own=0.5), {}, 1) == TokenBucket(2, 5, 10)


DESCRIPTORS = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 100}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 50}
  - key: route
    value: "intern*"
    descriptors:
      - key: team
        value: ops
        rate_limit: {unit: minute, requests_per_unit: 10}
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 5}
"""


class TestBucketMapping:
    @pytest.fixture
    def domain(self, tmp_path: Path) -> Domain:
        return load_text(tmp_path, DESCRIPTORS).config.domains["edge"]

    def test_keys_are_ordered_by_the_rule_tree(self, domain: Domain) -> None:
        """{client_id, route} maps to (route, public), (client_id, alice) in any map order."""
        assert entries_for(domain, {"client_id": "alice", "route": "public"}) == (
            ("route", "public"),
            ("client_id", "alice"),
        )

    def test_wildcards_and_value_less_keys_match_as_for_rls(self, domain: Domain) -> None:
        """A wildcard level and a value-less top-level key map like RLS descriptors."""
        assert entries_for(domain, {"route": "internal", "team": "ops"}) == (
            ("route", "internal"),
            ("team", "ops"),
        )
        assert entries_for(domain, {"tenant": "t1"}) == (("tenant", "t1"),)

    def test_a_long_exact_value_maps_its_stand_in(self, tmp_path: Path) -> None:
        """A bucket's value past MAX_TEXT comes as its stand-in (grpc_api/rlqs.py): an exact
        value that long in the config maps it, as RLS matches it (core/matching.py)."""
        long = "v" * (MAX_TEXT + 1)
        text = f"""
domain: edge
descriptors:
  - key: client_id
    value: "{long}"
    rate_limit: {{unit: minute, requests_per_unit: 1}}
"""
        domain = load_text(tmp_path, text).config.domains["edge"]
        assert entries_for(domain, {"client_id": bounded_value(long)}) == (
            ("client_id", bounded_value(long)),
        )
        assert entries_for(domain, {"client_id": bounded_value(long + "v")}) is None

    def test_a_wildcard_maps_only_values_it_matches(self, domain: Domain) -> None:
        """The route "private" is not "intern*": its level has no rule for it, though the
        team below the wildcard would fit."""
        assert entries_for(domain, {"route": "private", "team": "ops"}) is None

    def test_a_wildcard_matches_across_a_newline_as_for_rls(self, domain: Domain) -> None:
        """RLS matching (core/matching.py) lets ``*`` span any character, newline included."""
        assert entries_for(domain, {"route": "intern\nal", "team": "ops"}) == (
            ("route", "intern\nal"),
            ("team", "ops"),
        )

    def test_unused_or_unmatched_keys_map_to_nothing(self, domain: Domain) -> None:
        """Every key must be used; a value no rule matches maps to nothing."""
        assert entries_for(domain, {"route": "public", "client_id": "a", "extra": "x"}) is None
        assert entries_for(domain, {"route": "private", "client_id": "a"}) is None
        assert entries_for(domain, {}) is None
        assert entries_for(None, {"route": "public"}) is None
