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
from fairlimit.core.concurrency import CapDemand, Pool, fair_bound, split
from fairlimit.core.matching import Matcher
from fairlimit.core.rules import Rule
from fairlimit.errors import ConfigWarningError
from helpers import desc, load_text, req

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "fixtures" / "concurrency"
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

    def test_weights_raise_the_bound(self) -> None:
        """Three saturated clients at 6: weight 2 against two of weight 1 may hold 3, not 2."""
        others = {"b": CapDemand(3, 2, 4, 1.0), "c": CapDemand(3, 2, 4, 1.0)}
        heavy = {**others, "a": CapDemand(3, 0, 4, 2.0)}
        light = {**others, "a": CapDemand(3, 0, 4, 1.0)}
        assert math.isclose(fair_bound(self._pool(weight=2.0), heavy), 3.0)
        assert math.isclose(fair_bound(self._pool(weight=1.0), light), 2.0)


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
        examples = Path(__file__).resolve().parents[1] / "examples" / "envoy"
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
