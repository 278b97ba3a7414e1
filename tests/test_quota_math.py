"""RLQS assignment math (core/quota.py) and the bucket -> descriptor mapping (core/bucket.py)."""

import math
from pathlib import Path

import pytest

from fairlimit.core.bucket import BucketKey, bucket_key, entries_for
from fairlimit.core.fairshare import grants
from fairlimit.core.quota import (
    HEADROOM,
    HEADROOM_FLOOR,
    Blanket,
    CapClaim,
    Holder,
    Target,
    TokenBucket,
    allocate,
    settle,
    token_bucket,
)
from fairlimit.core.rules import Domain
from helpers import load_text

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
        """The per-client rates equal the water-filling grants of the summed demand."""
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
        assert rate(out, 1, "c2") == pytest.approx(5 * (1 + HEADROOM) + HEADROOM_FLOOR, abs=0.1)

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

    def test_settle_keeps_a_rate_within_three_percent(self) -> None:
        """A jittering rate is not re-sent (Envoy would refill the bucket each time)."""
        old = TokenBucket(1, 400, 10)
        assert settle(old, TokenBucket(1, 410, 10)) is old
        assert settle(old, TokenBucket(1, 420, 10)) == TokenBucket(1, 420, 10)
        assert settle(None, Blanket.DENY_ALL) is Blanket.DENY_ALL


def key_of(client: str, path: str | None = None) -> BucketKey:
    return bucket_key({"client_id": client} | ({} if path is None else {"path": path}))


def strategies(holders: list[Holder]) -> dict[tuple[int, str], object]:
    """allocate's strategies by (stream, client[/path]), for comparing whole assignments."""
    out = allocate(holders).strategies
    return {(s, "/".join(v for _, v in k)): v for (s, k), v in out.items()}


class TestBucketStrategies:
    def test_a_bound_below_the_floor_is_split_by_demand(self) -> None:
        """Own limit 0.5/s, Envoys at 0.2/s and 0.6/s (their floors alone pass it): 0.125/s
        and 0.375/s, in 0.1/s steps 0.1/s and 0.3/s."""
        hs = [Holder(s, key_of("a"), Target(None, 0.5), d, 0.5) for s, d in ((1, 0.2), (2, 0.6))]
        assert strategies(hs) == {(1, "a"): TokenBucket(2, 1, 10), (2, "a"): TokenBucket(2, 3, 10)}

    def test_an_idle_bucket_below_one_request_a_second_is_split_evenly(self) -> None:
        """A 90/minute (1.5/s) bucket both of whose Envoys report nothing: no demand to split
        by, so 0.75/s each (0.7/s in 0.1/s steps), at the bound (no headroom counted, as for
        any bucket whose floors pass its bound); once a division crashed here."""
        out = allocate([Holder(s, key_of("a"), Target(None, 1.5), 0.0, 0.5) for s in (1, 2)])
        assert out.strategies == {
            (1, key_of("a")): TokenBucket(2, 7, 10),
            (2, key_of("a")): TokenBucket(2, 7, 10),
        }
        assert out.extra == {}


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

    def test_unused_or_unmatched_keys_map_to_nothing(self, domain: Domain) -> None:
        """Every key must be used; a value no rule matches maps to nothing."""
        assert entries_for(domain, {"route": "public", "client_id": "a", "extra": "x"}) is None
        assert entries_for(domain, {"route": "private", "client_id": "a"}) is None
        assert entries_for(domain, {}) is None
        assert entries_for(None, {"route": "public"}) is None
