"""Concurrency caps in the pure core and the loader: which descriptors take or give back
slots, the fair bound at a cap, and the sum rule's classification (FILE: PATH: message)."""

import math
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from fairlimit.admin import config_report
from fairlimit.config.loader import load
from fairlimit.core.concurrency import CapDemand, Pool, declared, fair_bound, may_take, split
from fairlimit.core.matching import Matcher
from fairlimit.core.request import Descriptor
from fairlimit.core.rules import RateLimit, Rule
from fairlimit.core.units import Unit
from fairlimit.errors import ConfigError, ConfigWarningError
from helpers import desc, load_text, req

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parents[1] / "fixtures" / "concurrency"
CONFIG = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 100}
    concurrency: {max_in_flight: 20, max_duration: 60}
    fair_share: {active_clients: 4, weights: {gold: 3}}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 10}
        concurrency: {max_in_flight: 5}
  - key: user
    rate_limit: {unit: second, requests_per_unit: 10}
"""
# A cap one level down (under a plain tenant node), and a pool under no cap at all.
NESTED = """
domain: edge
descriptors:
  - key: tenant
    value: acme
    descriptors:
      - key: route
        value: public
        concurrency: {max_in_flight: 20, max_duration: 60}
        fair_share: {active_clients: 4, weights: {gold: 3}}
        descriptors:
          - key: client_id
            concurrency: {max_in_flight: 5}
  - key: generic_key
    value: api
    descriptors:
      - key: client_id
        concurrency: {max_in_flight: 2}
"""


def _expected(path: Path) -> list[str]:
    lines = re.findall(r"^# expect: (.*)$", path.read_text(), re.MULTILINE)
    return [line.replace("{file}", str(path)) for line in lines]


@pytest.fixture
def matcher(tmp_path: Path) -> Matcher:
    return Matcher(load_text(tmp_path, CONFIG).config)


class TestSplit:
    def test_an_acquire_claims_the_client_and_the_cap_and_keeps_its_rates(
        self, matcher: Matcher
    ) -> None:
        """(route, client_id, request_id): slots in the client's pool and the cap's, and the
        rates see the descriptor without the id entry."""
        slots = split(req("edge", desc("route=public", "client_id=gold", "request_id=r1")), matcher)
        (claim,) = slots.acquire
        assert claim.request_id == "r1" and not slots.release
        cap, own = claim.pools
        assert (
            cap.key == "edge/route=public#inflight"
            and own.key == "edge/route=public/client_id=gold#inflight"
        )
        assert (cap.limit, cap.ttl, cap.client, cap.client_limit, cap.weight) == (
            20,
            60.0,
            "gold",
            5,
            3.0,
        )
        assert (own.limit, own.ttl, own.client) == (5, 300.0, None)
        assert slots.rates.descriptors[0].entries == (("route", "public"), ("client_id", "gold"))

    def test_a_release_claims_the_same_pools_and_charges_no_rate(self, matcher: Matcher) -> None:
        """(…, request_done): the same pools to give back; the rates see nothing of it."""
        slots = split(
            req("edge", desc("user=u"), desc("route=public", "client_id=a", "request_done=r1")),
            matcher,
        )
        (claim,) = slots.release
        assert [p.key for p in claim.pools][-1] == "edge/route=public/client_id=a#inflight"
        assert claim.descriptor == 1 and slots.positions == (0,)
        assert [d.entries for d in slots.rates.descriptors] == [(("user", "u"),)]

    def test_an_id_entry_under_a_rule_without_concurrency_is_an_ordinary_entry(
        self, matcher: Matcher
    ) -> None:
        """user has no concurrency: (user, request_id) is matched whole (and matches nothing)."""
        request = req("edge", desc("user=u", "request_id=r1"))
        slots = split(request, matcher)
        assert not slots.acquire and slots.rates is request

    def test_a_descriptor_stopping_at_the_cap_takes_no_slot(self, matcher: Matcher) -> None:
        """(route=public, request_id): no client below the cap, so no slot to hold."""
        slots = split(req("edge", desc("route=public", "request_id=r1")), matcher)
        assert not slots.acquire and not slots.release

    def test_an_acquire_keeps_its_limit_override_and_hits_for_the_rates(
        self, matcher: Matcher
    ) -> None:
        """The id entry is all the rates lose: the descriptor's limit and hits_addend, and
        the request's, reach the rate limits as sent."""
        override = RateLimit(7, Unit.MINUTE)
        sent = desc("route=public", "client_id=a", "request_id=r1", hits=3, limit=override)
        slots = split(req("edge", sent, hits=2), matcher)
        assert slots.acquire and slots.rates.hits == 2
        assert slots.rates.descriptors == (
            Descriptor((("route", "public"), ("client_id", "a")), override, 3),
        )

    def test_a_cap_below_a_plain_node_pools_its_client_under_the_cap(self, tmp_path: Path) -> None:
        """(tenant, route cap, client_id): the tenant node declares nothing and is passed
        over; the cap's pool names the entry below the cap (gold, weight 3, own max 5), and
        both pools are anchored at the cap's path, the outermost cap (from NESTED)."""
        matcher = Matcher(load_text(tmp_path, NESTED).config)
        entries = ("tenant=acme", "route=public", "client_id=gold", "request_id=r1")
        (claim,) = split(req("edge", desc(*entries)), matcher).acquire
        cap = "edge/tenant=acme/route=public"
        assert [(p.key, p.limit, p.client, p.client_limit, p.weight, p.anchor)
                for p in claim.pools] == [
            (cap + "#inflight", 20, "gold", 5, 3.0, cap),
            (cap + "/client_id=gold#inflight", 5, None, math.inf, 1.0, cap),
        ]  # fmt: skip

    def test_a_pool_under_no_cap_is_anchored_at_its_own_path(self, tmp_path: Path) -> None:
        """(generic_key=api, client_id): no fair_share above, so the anchor is the pool's
        own path, not its parent's (Pool.anchor)."""
        matcher = Matcher(load_text(tmp_path, NESTED).config)
        entries = ("generic_key=api", "client_id=c", "request_id=r1")
        (claim,) = split(req("edge", desc(*entries)), matcher).acquire
        (pool,) = claim.pools
        assert (pool.key, pool.anchor) == (
            "edge/generic_key=api/client_id=c#inflight",
            "edge/generic_key=api/client_id=c",
        )


class TestDeclared:
    def test_a_config_whose_every_rule_declares_concurrency_declares_it(self) -> None:
        """sized.yaml: the cap and its clients all declare concurrency."""
        assert declared(load([FIXTURES / "sized.yaml"]).config)

    def test_a_config_of_rates_only_declares_none(self, tmp_path: Path) -> None:
        """No rule declares concurrency: no request needs its slots split off."""
        rates_only = """
domain: edge
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 10}
"""
        assert not declared(load_text(tmp_path, rates_only).config)


def _one_pool(block: str) -> str:
    return f"domain: edge\ndescriptors:\n  - key: client_id\n    concurrency: {block}\n"


class TestBounds:
    @pytest.mark.parametrize(
        ("block", "most", "duration"),
        [
            ("{max_in_flight: 1000000000}", 1_000_000_000, 300.0),
            ("{max_in_flight: 1, max_duration: 0.5}", 1, 0.5),
            ("{max_in_flight: 1, max_duration: 604800}", 1, 604800.0),
        ],
        ids=["most_slots", "half_a_second", "a_week"],
    )
    def test_the_ends_of_each_range_load(
        self, tmp_path: Path, block: str, most: int, duration: float
    ) -> None:
        """max_in_flight up to 10^9 and max_duration up to a week (604800 s), and any
        duration above 0, under a second too."""
        (rule,) = load_text(tmp_path, _one_pool(block)).config.domains["edge"].rules
        assert rule.concurrency is not None
        assert (rule.concurrency.max_in_flight, rule.concurrency.max_duration) == (most, duration)

    @pytest.mark.parametrize(
        ("block", "message"),
        [
            ("{max_in_flight: 1000000001}",
             "concurrency.max_in_flight must be an integer from 1 to 1000000000, not 1000000001"),
            ("{max_in_flight: 1, max_duration: 0}",
             "concurrency.max_duration must be seconds in (0, 604800], not 0"),
            ("{max_in_flight: 1, max_duration: 604801}",
             "concurrency.max_duration must be seconds in (0, 604800], not 604801"),
        ],
        ids=["one_slot_too_many", "no_time", "a_week_and_a_second"],
    )  # fmt: skip
    def test_just_past_either_end_is_refused(
        self, tmp_path: Path, block: str, message: str
    ) -> None:
        """One past 10^9 slots, a zero duration, a second past a week: FILE: PATH: message."""
        with pytest.raises(ConfigError) as caught:
            load_text(tmp_path, _one_pool(block))
        assert caught.value.problems == [f"{tmp_path / 'test.yaml'}: edge/client_id: {message}"]


class TestFairBound:
    def _pool(self, weight: float = 1.0, client: str = "a") -> Pool:
        return Pool("cap#inflight", Rule("route", "x", "d/route=x", "f"), 6, 30.0, "cap",
                    client, 4, weight)  # fmt: skip

    def test_alone_a_client_may_reach_its_own_max(self) -> None:
        """No one else wants a slot: the bound is the client's own max_in_flight."""
        assert fair_bound(self._pool(), {}) == 4

    def test_a_refused_client_lowers_the_holders_bound(self) -> None:
        """a holds 3, b holds 2, c was refused once: a's next slot is not fair (bound 3)."""
        clients = {"a": CapDemand(3, 0, 4, 1.0), "b": CapDemand(2, 0, 4, 1.0),
                   "c": CapDemand(0, 1, 4, 1.0)}  # fmt: skip
        assert fair_bound(self._pool(), clients) == 3

    def test_a_newcomers_demand_is_its_one_asking_slot(self) -> None:
        """a holds nothing and was refused nothing: it wants 1, b wants 3 + 2 = 5, cap 4.
        By hand, λ solves min(1, λ) + min(5, λ) = 4: λ = 3, so a may hold 3."""
        pool = Pool("cap#inflight", Rule("route", "x", "d/route=x", "f"), 4, 30.0, "cap",
                    "a", 4, 1.0)  # fmt: skip
        assert fair_bound(pool, {"b": CapDemand(3, 2, math.inf, 1.0)}) == 3

    def test_the_clients_own_refusals_add_to_its_demand(self) -> None:
        """a holds 1, was refused 2 and asks 1: it wants 4; b wants 4 + 3 = 7; cap 6.
        By hand, min(4, λ) + min(7, λ) = 6 gives λ = 3, so a may hold 3 (not its max, 4)."""
        clients = {"a": CapDemand(1, 2, 4, 1.0), "b": CapDemand(4, 3, math.inf, 1.0)}
        assert fair_bound(self._pool(), clients) == 3

    def test_weights_raise_the_bound(self) -> None:
        """Three saturated clients at 6: weight 2 against two of weight 1 may hold 3, not 2."""
        others = {"b": CapDemand(3, 2, 4, 1.0), "c": CapDemand(3, 2, 4, 1.0)}
        heavy = {**others, "a": CapDemand(3, 0, 4, 2.0)}
        light = {**others, "a": CapDemand(3, 0, 4, 1.0)}
        assert math.isclose(fair_bound(self._pool(weight=2.0), heavy), 3.0)
        assert math.isclose(fair_bound(self._pool(weight=1.0), light), 2.0)


class TestMayTake:
    POOL = Pool("cap#inflight", Rule("route", "x", "d/route=x", "f"), 6, 30.0, "cap", "a", 4)

    def test_a_client_may_reach_its_fair_bound_exactly(self) -> None:
        """Holding 2 with a bound of 3, the third slot is fair; holding 3, a fourth is not."""
        assert may_take(self.POOL, 3, 2, 3.0)
        assert not may_take(self.POOL, 4, 3, 3.0)

    def test_a_bound_a_rounding_error_under_a_whole_slot_still_reaches_it(self) -> None:
        """The water level is float arithmetic: a bound up to 1e-9 (the tolerance, inclusive)
        under 3 admits the third slot; one 1e-6 under does not."""
        assert may_take(self.POOL, 3, 2, 3 - 1e-9)
        assert not may_take(self.POOL, 3, 2, 3 - 1e-6)

    def test_a_full_pool_refuses_whatever_the_bound(self) -> None:
        """6 of 6 held: no slot, even for a client far below its bound."""
        assert not may_take(self.POOL, 6, 0, 4.0)


CLIENT_STATES = st.builds(
    CapDemand,
    st.integers(0, 6),
    st.integers(0, 4),
    st.sampled_from([1.0, 2.0, 4.0, math.inf]),
    st.sampled_from([0.5, 1.0, 3.0]),
)


class TestFairBoundProperties:
    @settings(max_examples=150, deadline=None)
    @given(
        st.dictionaries(st.sampled_from("abcdef"), CLIENT_STATES, max_size=6),
        st.integers(1, 30),
        st.sampled_from([1.0, 3.0, math.inf]),
    )
    def test_never_above_the_own_max_and_no_refusal_while_everyone_fits(
        self, clients: dict[str, CapDemand], capacity: int, own_limit: float
    ) -> None:
        """The bound never passes the client's own max_in_flight; when every client's
        capped demand (the asking request included) fits the cap, the next slot is fair."""
        pool = Pool("cap#inflight", Rule("route", "x", "d/route=x", "f"), capacity, 30.0,
                    "cap", "a", own_limit, 1.0)  # fmt: skip
        clients = {n: c for n, c in clients.items() if n != "a"}
        bound = fair_bound(pool, clients)
        assert bound <= own_limit
        wants = 1 + sum(min(c.held + c.refused, c.limit) for c in clients.values())
        if wants <= capacity and own_limit >= 1:
            assert bound >= 1


class TestClassification:
    @pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.yaml")), ids=lambda p: p.stem)
    def test_each_concurrency_cap_is_classified_with_its_exact_message(self, path: Path) -> None:
        """Every concurrency cap and global pool gets the mode and message the fixture says."""
        got = [f"{c.mode.value} {c.line}" for c in load([path]).concurrency]
        assert got == _expected(path)

    def test_strict_turns_a_contended_concurrency_cap_into_an_error(self) -> None:
        """--strict rejects the file, naming the concurrency cap's line."""
        path = FIXTURES / "unlimited_children.yaml"
        with pytest.raises(ConfigWarningError) as caught:
            load([path], strict=True)
        assert caught.value.problems == [line.split(" ", 1)[1] for line in _expected(path)]

    def test_a_caps_figures_are_its_max_the_sum_and_the_active_clients(self) -> None:
        """contended.yaml: max 10; batch 4 + 5 for each of the 3 other active clients = 19."""
        (cap,) = load([FIXTURES / "contended.yaml"]).concurrency
        assert (cap.cap_per_second, cap.required_per_second, cap.active_clients) == (10, 19, 4)
        assert cap.per_client_per_second is None

    @pytest.mark.parametrize(
        ("active", "required", "how"),
        [
            (2, 8, "largest 2 of 3 named clients"),  # 5 + 3: the two largest, not 1 + 3
            (3, 9, "largest 3 of 3 named clients"),  # 5 + 3 + 1
            (4, 9, "3 named clients"),  # no value-less child: no others to add
        ],
        ids=["two_of_three", "three_of_three", "more_active_than_named"],
    )
    def test_named_clients_only_sum_the_largest_active_ones(
        self, tmp_path: Path, active: int, required: int, how: str
    ) -> None:
        """A cap over three named clients (max 1, 5, 3) and none value-less: the sum is of
        the largest ``active`` of them, at most all three."""
        children = "".join(
            f"""
      - key: client_id
        value: c{most}
        concurrency: {{max_in_flight: {most}}}"""
            for most in (1, 5, 3)
        )
        text = f"""
domain: edge
descriptors:
  - key: route
    value: r
    concurrency: {{max_in_flight: 20}}
    fair_share: {{active_clients: {active}}}
    descriptors:{children}
"""
        (cap,) = load_text(tmp_path, text).concurrency
        assert cap.required_per_second == required
        assert cap.message.endswith(f"max_in_flight {required} ({how})")

    def test_request_id_keys_can_be_renamed(self, tmp_path: Path) -> None:
        """request_id_keys: {acquire: rid, release: rid_done} changes which entries count."""
        text = CONFIG.replace(
            "domain: edge\n", "domain: edge\nrequest_id_keys: {acquire: rid, release: rid_done}\n"
        )
        matcher = Matcher(load_text(tmp_path, text).config)
        assert split(req("edge", desc("route=public", "client_id=a", "rid=1")), matcher).acquire
        assert split(
            req("edge", desc("route=public", "client_id=a", "rid_done=1")), matcher
        ).release
        assert not split(
            req("edge", desc("route=public", "client_id=a", "request_id=1")), matcher
        ).acquire

    @pytest.mark.parametrize(
        ("keys", "acquire", "release"),
        [
            ("{acquire: rid}", "rid", "request_done"),
            ("{release: rid_done}", "request_id", "rid_done"),
        ],
        ids=["acquire_only", "release_only"],
    )
    def test_renaming_one_request_id_key_keeps_the_other_documented_default(
        self, tmp_path: Path, keys: str, acquire: str, release: str
    ) -> None:
        """The key not renamed keeps its default (request_id, request_done) and still counts."""
        text = CONFIG.replace("domain: edge\n", f"domain: edge\nrequest_id_keys: {keys}\n")
        matcher = Matcher(load_text(tmp_path, text).config)
        entries = ("route=public", "client_id=a")
        assert split(req("edge", desc(*entries, f"{acquire}=1")), matcher).acquire
        assert split(req("edge", desc(*entries, f"{release}=1")), matcher).release


class TestReports:
    def test_rlconfig_shows_each_rules_concurrency_and_the_caps_verdict(self) -> None:
        """/rlconfig's report: max_in_flight and max_duration, and the cap's classification."""
        loaded = load([FIXTURES / "sized.yaml"])
        (cap,) = config_report(loaded, ())["domains"][0]["descriptors"]
        verdict = cap["concurrency"].pop("classification")
        assert cap["concurrency"] == {"max_in_flight": 20, "max_duration": 300.0}
        assert verdict["mode"] == "per-client-buckets" and verdict["warning"] is False
        assert cap["descriptors"][0]["concurrency"]["max_in_flight"] == 5


class TestEnvoyExample:
    def test_the_example_actions_acquire_and_release_the_example_pools(self) -> None:
        """examples/envoy/concurrency.yaml's two rate_limits entries, filled with header values,
        acquire and release the client's and the cap's pools of concurrency-descriptors.yaml."""
        examples = Path(__file__).resolve().parents[2] / "examples" / "envoy"
        bootstrap = yaml.safe_load((examples / "concurrency.yaml").read_text())
        hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        (host,) = hcm["typed_config"]["route_config"]["virtual_hosts"]
        headers = {"x-client-id": "alice", "x-request-id": "f3a9"}
        built = []
        for entry in host["rate_limits"]:
            entries = []
            for action in entry["actions"]:
                if "generic_key" in action:
                    g = action["generic_key"]
                    entries.append(f"{g['descriptor_key']}={g['descriptor_value']}")
                else:
                    h = action["request_headers"]
                    entries.append(f"{h['descriptor_key']}={headers[h['header_name']]}")
            built.append((entry.get("apply_on_stream_done", False), desc(*entries)))
        matcher = Matcher(load([examples / "concurrency-descriptors.yaml"]).config)
        (on_request, acquire), (on_done, release) = built
        assert (on_request, on_done) == (False, True)
        (taking,) = split(req("edge", acquire), matcher).acquire
        (giving,) = split(req("edge", release), matcher).release
        assert taking.request_id == giving.request_id == "f3a9"
        assert (
            [p.key for p in taking.pools]
            == [p.key for p in giving.pools]
            == [
                "edge/route=public#inflight",
                "edge/route=public/client_id=alice#inflight",
            ]
        )
        assert [p.limit for p in taking.pools] == [20, 5]
