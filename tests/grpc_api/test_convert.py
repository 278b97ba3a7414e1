"""grpc_api/convert.py: the response Envoy reads, from the core's decision."""

import random

import pytest

from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit.core.admission import Code, Status
from fairlimit.core.rules import RateLimit
from fairlimit.core.units import Unit
from fairlimit.grpc_api.convert import MAX_RESET_SECONDS, Reply, response_to_proto
from fairlimit.grpc_api.headers import ResponseOptions, add_extras
from fairlimit.limiter import Decision

pytestmark = pytest.mark.unit

RLS = rls_pb2.RateLimitResponse


class TestResponse:
    @pytest.mark.parametrize("unit", list(Unit), ids=lambda u: u.name)
    def test_a_status_says_its_limits_unit_by_the_same_name(self, unit: Unit) -> None:
        """Each unit reaches Envoy as RateLimitResponse.RateLimit's unit of the same name."""
        status = Status(Code.OK, RateLimit(7, unit), 6, 0.0)
        response = response_to_proto(Decision(Code.OK, (status,)))
        limit = response.statuses[0].current_limit
        assert (limit.requests_per_unit, RLS.RateLimit.Unit.Name(limit.unit)) == (7, unit.name)

    @pytest.mark.parametrize("reset", [1e19, 1e23, float(MAX_RESET_SECONDS) + 0.5])
    def test_a_reset_past_durations_range_is_sent_as_its_longest(self, reset: float) -> None:
        """A GCRA bucket charged far ahead resets after more seconds than int64 holds
        (protobuf raised ValueError: the call ended UNKNOWN, found by fuzzing accepted
        configs, issue 41); sent as google.protobuf.Duration's longest, 10,000 years."""
        status = Status(Code.OVER_LIMIT, RateLimit(1, Unit.YEAR), 0, reset)
        response = response_to_proto(Decision(Code.OVER_LIMIT, (status,)))
        duration = response.statuses[0].duration_until_reset
        assert (duration.seconds, duration.nanos) == (MAX_RESET_SECONDS, 0)

    def test_the_headers_and_metadata_say_the_reset_the_status_says(self) -> None:
        """The same far reset in RateLimit-Reset, the RateLimit header and the fairlimit
        metadata as in the status (they said the raw 10^23 s, found by fuzzing, issue 41)."""
        status = Status(Code.OVER_LIMIT, RateLimit(1, Unit.YEAR), 0, 1e23, name="edge/k")
        request = rls_pb2.RateLimitRequest(domain="edge")
        request.descriptors.add().entries.add(key="k", value="v")
        response = response_to_proto(Decision(Code.OVER_LIMIT, (status,)))
        options = ResponseOptions(headers=True, metadata=True, rule_names=True)
        add_extras(response, request, (status,), options)
        headers = {h.key: h.value for h in response.response_headers_to_add}
        said = str(response.statuses[0].duration_until_reset.seconds)
        assert headers["RateLimit-Reset"] == said == str(MAX_RESET_SECONDS)
        assert headers["RateLimit"].endswith(f";t={said}")
        fairlimit = response.dynamic_metadata.fields["fairlimit"].struct_value
        assert fairlimit.fields["reported"].struct_value.fields["reset"].number_value == float(
            MAX_RESET_SECONDS
        )

    @pytest.mark.parametrize("code", list(Code), ids=lambda c: c.name)
    def test_codes_overall_and_per_status_by_the_same_name(self, code: Code) -> None:
        """The overall code and each status's code are Envoy's of the same name; an
        OVER_LIMIT status says 0 left, an OK one what is left."""
        other = Code.OK if code is Code.OVER_LIMIT else Code.OVER_LIMIT
        statuses = (Status(code, RateLimit(5, Unit.SECOND), 3, 0.5),
                    Status(other, RateLimit(5, Unit.MINUTE), 2, 30.0))  # fmt: skip
        response = response_to_proto(Decision(code, statuses))
        assert RLS.Code.Name(response.overall_code) == code.name
        assert [RLS.Code.Name(s.code) for s in response.statuses] == [code.name, other.name]
        assert [s.limit_remaining for s in response.statuses] == [
            0 if s.code is Code.OVER_LIMIT else s.limit_remaining for s in statuses
        ]


class TestReply:
    """convert.Reply: a kept payload's answers written into one message, the bytes of a new
    message (``response_to_proto``) every time, whatever the answer before held."""

    @pytest.mark.parametrize("seed", range(6))
    def test_each_answer_is_a_new_messages_bytes(self, seed: int) -> None:
        rng = random.Random(seed)
        names = bool(seed % 2)
        limits = [RateLimit(5, Unit.SECOND), RateLimit(9, Unit.HOUR, name="own"),
                  RateLimit(0, Unit.MINUTE)]  # fmt: skip
        resets = [0.0, -1.0, 0.25, 59.5, 1e23]
        reply = Reply(names)
        count = rng.randint(1, 3)  # a payload's descriptors
        for call in range(300):
            if call == 150:
                count = rng.randint(1, 3)  # a config swap may change how many statuses
            statuses = []
            for _ in range(count):
                pick = rng.random()
                # the same limit object, an equal new one, or none (unlimited, failure mode)
                limit = (None if pick < 0.2 else RateLimit(5, Unit.SECOND) if pick < 0.3
                         else rng.choice(limits))  # fmt: skip
                code = rng.choice([Code.OK, Code.OVER_LIMIT])
                name = rng.choice([None, "edge/a", "edge/b"])
                status = Status(code, limit, rng.choice([0, 3, 2**40]), rng.choice(resets),
                                name=name)  # fmt: skip
                statuses.append(status)
            overall = Code.OVER_LIMIT if rng.random() < 0.3 else Code.OK
            decision = Decision(overall, tuple(statuses))
            expected = response_to_proto(decision, names).SerializeToString()
            assert reply.decision(decision) == expected, (call, decision)
