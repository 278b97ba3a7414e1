"""A request that reaches one counter or one client's claim twice (core/plan): one entry,
the hits summed, charged when over the limit if either reach says so."""

import math
from pathlib import Path

import pytest

from fairlimit.core.matching import Matcher
from fairlimit.core.plan import Plan, plan
from helpers import desc, load_text, req

pytestmark = pytest.mark.unit

# tenant t reaches the route cap from its own descriptor and from its user's; only the
# user's limit is charged when over the limit
CONFIG = """
domain: d
descriptors:
  - key: route
    value: api
    rate_limit: {unit: second, requests_per_unit: 100}
    fair_share: {active_clients: 2}
    descriptors:
      - key: tenant
        rate_limit: {unit: second, requests_per_unit: 50}
        descriptors:
          - key: user
            rate_limit: {unit: second, requests_per_unit: 10, charge_when_over_limit: true}
"""
TENANT = ("route=api", "tenant=t")
USER = ("route=api", "tenant=t", "user=u")


def _plan(tmp_path: Path, *descriptors: tuple[tuple[str, ...], int]) -> Plan:
    matcher = Matcher(load_text(tmp_path, CONFIG).config)
    return plan(req("d", *(desc(*pairs, hits=hits) for pairs, hits in descriptors)), matcher)


class TestRepeats:
    def test_the_cap_and_the_claim_are_one_entry_with_the_hits_summed(self, tmp_path: Path) -> None:
        """2 hits as the tenant, then 3 as its user: the route cap counts 5 and t claims 5,
        charged when over the limit as the user's limit says (False, then True)."""
        built = _plan(tmp_path, (TENANT, 2), (USER, 3))
        counters = {c.key: (c.hits, c.force, c.shadow) for c in built.counters}
        assert counters == {
            "d/route=api#1": (5, True, False),
            "d/route=api/tenant=t#1": (2, False, False),
            "d/route=api/tenant=t/user=u#1": (3, True, False),
        }
        assert [(s.cap, s.client, s.hits, s.force) for s in built.shares] == [
            ("d/route=api#1", "t", 5, True)
        ]

    def test_a_forced_reach_first_stays_forced(self, tmp_path: Path) -> None:
        """The user's 3 first, then the tenant's 2: still one claim of 5, charged."""
        built = _plan(tmp_path, (USER, 3), (TENANT, 2))
        assert [(s.client, s.hits, s.force) for s in built.shares] == [("t", 5, True)]
        assert [(c.hits, c.force) for c in built.counters if c.key == "d/route=api#1"] == [
            (5, True)
        ]


LOWER_CAP = """
domain: d
descriptors:
  - key: route
    value: api
    rate_limit: {unit: second, requests_per_unit: 1000}
    descriptors:
      - key: tenant
        rate_limit: {unit: second, requests_per_unit: 100}
        fair_share: {active_clients: 2}
        descriptors:
          - key: user
            rate_limit: {unit: second, requests_per_unit: 10}
"""


class TestCapsBelowPlainLevels:
    def test_a_cap_under_a_plain_limit_is_claimed(self, tmp_path: Path) -> None:
        """route (a plain limit) > tenant (a cap) > user: user u claims at t's cap."""
        matcher = Matcher(load_text(tmp_path, LOWER_CAP).config)
        built = plan(req("d", desc(*USER)), matcher)
        assert [(s.cap, s.client) for s in built.shares] == [("d/route=api/tenant=t#1", "u")]

    def test_a_client_without_its_own_limit_is_claimed(self, tmp_path: Path) -> None:
        """A cap over value-less clients with no limit of their own (two levels, nothing of
        the client's to charge): client u still claims at the cap, at an unbounded limit."""
        text = """
domain: d
descriptors:
  - key: route
    value: api
    rate_limit: {unit: second, requests_per_unit: 100}
    fair_share: {active_clients: 2}
    descriptors:
      - key: user
"""
        built = plan(
            req("d", desc("route=api", "user=u")), Matcher(load_text(tmp_path, text).config)
        )
        assert [(s.cap, s.client, s.client_limit) for s in built.shares] == [
            ("d/route=api#1", "u", math.inf)
        ]
