"""Honest 429s: a status reports the level that denied it (its limit, remaining, reset and
rule), a response's headers and metadata the descriptor that refused the request, and a
client at a contended cap sees its share (docs/semantics.md, "What a response reports")."""

import math
from pathlib import Path

import pytest
from google.protobuf import json_format

from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit.core.admission import Code, Outcome, Status, reported, statuses
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import plan
from fairlimit.core.rules import RateLimit, Rule
from fairlimit.core.units import Unit
from fairlimit.grpc_api.convert import response_to_proto
from fairlimit.grpc_api.headers import ResponseOptions, add_extras
from fairlimit.limiter import Decision
from fairlimit.settings import Settings
from fairness_cases import flat_config
from helpers import desc, load_text, req

pytestmark = pytest.mark.unit

# A client's own 10/s under a per-minute cap of 6000 (its share there may be below 10/s).
PER_SECOND_CLIENTS = flat_config(6000, "minute", 10, client_unit="second")
CLIENT_RULE = "fair/route=api/client_id"


def _status(tmp_path: Path, own: int, at_cap: int, bound: float) -> Status:
    """c's status with ``own`` hits in its own second, ``at_cap`` admitted at the cap this
    minute, and ``bound`` its bound there (the request refused or admitted as they say)."""
    matcher = Matcher(load_text(tmp_path, PER_SECOND_CLIENTS).config)
    built = plan(req("fair", desc("route=api", "client_id=c")), matcher)
    over = own + 1 > 10 or at_cap + 1 > bound
    outcome = Outcome(not over, (own, at_cap), (at_cap,), (bound,))
    return statuses(built, outcome, 0.0)[0]


class TestTheLevelThatDenied:
    def test_an_own_limit_used_up_is_reported_though_the_share_is_tighter(
        self, tmp_path: Path
    ) -> None:
        """c's share is 300 a minute (5/s), 100 used; its own 10 this second are used: the
        429 says 10/s, 0 left, 1 s to wait, named by c's rule (it said 300/min, 0 left and
        1 s: a limit that did not refuse it, with the reset of one that did)."""
        status = _status(tmp_path, 10, 100, 300.0)
        assert status.code is Code.OVER_LIMIT
        assert status.current_limit == RateLimit(10, Unit.SECOND)
        assert (status.limit_remaining, status.duration_until_reset) == (0, 1)
        assert status.name == CLIENT_RULE

    def test_a_share_used_up_is_reported_as_the_share(self, tmp_path: Path) -> None:
        """c has its 300 of the minute at the cap, 2 this second: the share refused it, so
        the 429 says 300 a minute, 0 left, 60 s to wait."""
        status = _status(tmp_path, 2, 300, 300.0)
        assert status.code is Code.OVER_LIMIT
        assert status.current_limit == RateLimit(300, Unit.MINUTE)
        assert (status.limit_remaining, status.duration_until_reset) == (0, 60)
        assert status.name == CLIENT_RULE

    def test_an_admitted_request_reports_the_level_with_least_left(self, tmp_path: Path) -> None:
        """3 left at the share, 7 this second: the share, with its remaining and reset."""
        status = _status(tmp_path, 2, 296, 300.0)
        assert status.code is Code.OK
        assert (status.current_limit, status.limit_remaining) == (RateLimit(300, Unit.MINUTE), 3)
        assert status.duration_until_reset == 60

    def test_a_full_cap_is_named_by_the_cap(self, tmp_path: Path) -> None:
        """The cap's own 6000 are used while c's bound is open (infinite): the cap's limit
        and rule refuse it."""
        matcher = Matcher(load_text(tmp_path, PER_SECOND_CLIENTS).config)
        built = plan(req("fair", desc("route=api", "client_id=c")), matcher)
        outcome = Outcome(False, (0, 6000), (0,), (math.inf,))
        status = statuses(built, outcome, 0.0)[0]
        assert (status.code, status.current_limit) == (
            Code.OVER_LIMIT,
            RateLimit(6000, Unit.MINUTE),
        )
        assert status.name == "fair/route=api"

    def test_an_override_no_rule_matched_is_named_by_its_descriptor(self, tmp_path: Path) -> None:
        matcher = Matcher(load_text(tmp_path, PER_SECOND_CLIENTS).config)
        limit = RateLimit(5, Unit.HOUR)
        built = plan(req("fair", desc("tenant=t/x", limit=limit)), matcher)
        status = statuses(built, Outcome(True, (1,), (), ()), 0.0)[0]
        assert (status.current_limit, status.name) == (limit, "fair/tenant=t\\/x")


def _st(code: Code, remaining: int, name: str, quota: bool = False, group: str | None = None
        ) -> Status:  # fmt: skip
    rule = Rule(name, None, name, "t.yaml", RateLimit(10, Unit.MINUTE), quota_mode=quota,
                quota_group=group)  # fmt: skip
    return Status(code, RateLimit(10, Unit.MINUTE), remaining, 30.0, rule, name=name)


OK, OVER = Code.OK, Code.OVER_LIMIT


class TestReported:
    def test_a_refusal_reports_the_ordinary_descriptor_over(self) -> None:
        shown = reported([_st(OK, 1, "a"), _st(OVER, 4, "b")], False)
        assert shown is not None and shown.name == "b"

    def test_a_quota_group_all_over_is_reported_not_a_closer_ordinary_one(self) -> None:
        """Both quotas over (a request of 5 with 4 and 3 left) refuse it; the ordinary
        descriptor with 1 left did not: the 429 names the quota with least left (the
        least left overall named the ordinary one)."""
        parts = [_st(OK, 1, "a"), _st(OVER, 4, "q1", True), _st(OVER, 3, "q2", True)]
        shown = reported(parts, False)
        assert shown is not None and shown.name == "q2"

    def test_a_pass_does_not_report_a_quota_over_that_refused_nothing(self) -> None:
        """q1 is over, q2 passes (so the group passes): a 200 says what is left, q2's 5,
        not q1's 0."""
        shown = reported([_st(OVER, 0, "q1", True), _st(OK, 5, "q2", True)], False)
        assert shown is not None and shown.name == "q2"

    def test_nothing_limited_reports_nothing(self) -> None:
        assert reported([Status(OK, None, 0, 0.0)], False) is None


def _response(
    decision_statuses: list[Status], options: ResponseOptions
) -> rls_pb2.RateLimitResponse:
    request = rls_pb2.RateLimitRequest(domain="edge")
    for index in range(len(decision_statuses)):
        request.descriptors.add().entries.add(key="k", value=str(index))
    code = Code.OVER_LIMIT if any(s.code is OVER for s in decision_statuses) else Code.OK
    response = response_to_proto(Decision(code, tuple(decision_statuses)), options.rule_names)
    add_extras(response, request, decision_statuses, options)
    return response


class TestHeaders:
    def test_upstreams_headers_and_the_policy_of_the_descriptor_that_refused(self) -> None:
        options = ResponseOptions(headers=True, rule_names=True)
        response = _response([_st(OK, 1, "edge/a"), _st(OVER, 4, "edge/b")], options)
        headers = [(h.key, h.value) for h in response.response_headers_to_add]
        assert headers == [
            ("RateLimit-Limit", "10"),
            ("RateLimit-Remaining", "0"),
            ("RateLimit-Reset", "30"),
            ("RateLimit-Policy", '"edge/b";q=10;w=60'),
            ("RateLimit", '"edge/b";r=0;t=30'),
        ]
        assert [s.current_limit.name for s in response.statuses] == ["edge/a", "edge/b"]

    def test_without_rule_names_the_response_is_upstreams(self) -> None:
        """Off (xDS, upstream's layout): upstream's three headers, no names on the wire."""
        response = _response([_st(OK, 1, "edge/a"), _st(OVER, 4, "edge/b")],
                             ResponseOptions(headers=True, metadata=True))  # fmt: skip
        assert [h.key for h in response.response_headers_to_add] == [
            "RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset"
        ]  # fmt: skip
        assert [s.current_limit.name for s in response.statuses] == ["", ""]
        assert "fairlimit" not in response.dynamic_metadata.fields

    def test_a_configured_name_wins_on_the_wire(self) -> None:
        named = _st(OK, 1, "edge/a")
        named.current_limit = RateLimit(10, Unit.MINUTE, name="per-tenant")
        response = _response([named], ResponseOptions(rule_names=True))
        assert response.statuses[0].current_limit.name == "per-tenant"

    def test_a_name_is_a_structured_field_string(self) -> None:
        """A quote and a backslash escaped, non-ASCII percent-encoded (RFC 8941 strings)."""
        options = ResponseOptions(headers=True, rule_names=True)
        response = _response([_st(OVER, 0, 'edge/k="a\\b"/é')], options)
        policy = dict((h.key, h.value) for h in response.response_headers_to_add)
        assert policy["RateLimit-Policy"] == '"edge/k=\\"a\\\\b\\"/%C3%A9";q=10;w=60'


class TestMetadata:
    def test_the_reported_status_every_status_and_those_with_quota_left(self) -> None:
        """Two backends' quotas in one group: pt is used up, ondemand has 7 left. The
        metadata names pt's refusal in statuses and lists ondemand alone in withQuota."""
        options = ResponseOptions(metadata=True, rule_names=True)
        parts = [_st(OVER, 0, "ai/backend", True, "b"), _st(OK, 7, "ai/backend", True, "b")]
        fields = json_format.MessageToDict(_response(parts, options).dynamic_metadata)["fairlimit"]
        assert fields["withQuota"] == {"k=1": 7}
        assert [s["code"] for s in fields["statuses"]] == ["OVER_LIMIT", "OK"]
        assert fields["reported"] == {"code": "OK", "name": "ai/backend", "limit": 10,
                                            "window": 60, "remaining": 7, "reset": 30}  # fmt: skip


class TestRuleNamesSetting:
    def test_on_for_fairlimits_files_off_for_xds_and_upstreams_layout(self) -> None:
        """Off where upstream's exact response is expected (Envoy Gateway's conformance
        reads X-RateLimit-Limit whole); a flag or FAIRLIMIT_RULE_NAMES says otherwise."""
        assert Settings().names_rules
        assert not Settings(config_source="xds").names_rules
        assert not Settings.from_env({"RUNTIME_ROOT": "/srv/runtime_data/current"}).names_rules
        env = {"RUNTIME_ROOT": "/srv", "FAIRLIMIT_RULE_NAMES": "true"}
        assert Settings.from_env(env).names_rules
        assert not Settings().override({"rule_names": "false"}).names_rules
