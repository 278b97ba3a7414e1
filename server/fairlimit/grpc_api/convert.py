"""Pure translation between Envoy's RLS v3 messages and the core's request and decision."""

import math
from collections.abc import Sequence

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit.core.admission import Code
from fairlimit.core.request import (
    MAX_DESCRIPTORS,
    MAX_HITS,
    Descriptor,
    Request,
    too_many_descriptors,
)
from fairlimit.core.rules import RateLimit
from fairlimit.core.units import Unit
from fairlimit.core.values import bounded_value
from fairlimit.errors import RequestError
from fairlimit.flows.fast import Answer, Reported
from fairlimit.limiter import Decision

# envoy.type.v3.RateLimitUnit and RateLimitResponse.RateLimit.Unit share their numbers.
_UNIT_BY_NUMBER = {1: Unit.SECOND, 2: Unit.MINUTE, 3: Unit.HOUR, 4: Unit.DAY, 5: Unit.MONTH,
                   6: Unit.YEAR, 7: Unit.WEEK}  # fmt: skip
_RL = rls_pb2.RateLimitResponse.RateLimit
# Keyed by the unit's value (its window in seconds), read as ``_value_``: an Enum member's
# hash and its ``value`` are Python-level calls (~0.3 µs each), and a response looks up a
# unit per status and a code per status and overall (the enum docs name ``_value_``).
_PROTO_UNITS = {Unit.SECOND.value: _RL.SECOND, Unit.MINUTE.value: _RL.MINUTE,
                Unit.HOUR.value: _RL.HOUR, Unit.DAY.value: _RL.DAY, Unit.WEEK.value: _RL.WEEK,
                Unit.MONTH.value: _RL.MONTH, Unit.YEAR.value: _RL.YEAR}  # fmt: skip
_OK, _OVER_LIMIT = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT
# google.protobuf.Duration's range (10,000 years): a longer reset is sent as this. A GCRA
# bucket charged far ahead (charge_when_over_limit and huge hits_addends) has a reset past
# int64 seconds, which protobuf refused with ValueError: the call ended UNKNOWN.
MAX_RESET_SECONDS = 315_576_000_000


def _code(code: Code) -> "rls_pb2.RateLimitResponse.Code":
    """The RateLimitResponse.Code of ``code`` (compared by identity, not hashed)."""
    return _OVER_LIMIT if code is Code.OVER_LIMIT else _OK


def _override(descriptor: ratelimit_pb2.RateLimitDescriptor, index: int) -> RateLimit | None:
    if not descriptor.HasField("limit"):
        return None
    unit = _UNIT_BY_NUMBER.get(int(descriptor.limit.unit))
    if unit is None:
        raise RequestError(f"descriptor {index}: limit override has unit UNKNOWN")
    return RateLimit(int(descriptor.limit.requests_per_unit), unit)


def request_from_proto(message: rls_pb2.RateLimitRequest) -> Request:
    """A RateLimitRequest as the core sees it; RequestError for what cannot be honoured.

    The descriptor count is checked before any descriptor is converted: a request of 10,000
    descriptors (200 kB, under the receive limit) took 30-40 ms of the event loop to convert
    before validate() refused it, and 32 of them held every other call for up to 1 s.

    What a client may have chosen is bounded, not refused: Envoy lets the request of a
    refused call through. A value longer than MAX_TEXT is taken as its stand-in
    (core/values.py); a descriptor's hits_addend (a uint64, which Envoy may format from a
    request header) above MAX_HITS as MAX_HITS, more than any limit but the largest holds,
    as RLQS takes a count past it.
    """
    if len(message.descriptors) > MAX_DESCRIPTORS:
        raise too_many_descriptors()
    descriptors = []
    for index, descriptor in enumerate(message.descriptors):
        hits = int(descriptor.hits_addend.value) if descriptor.HasField("hits_addend") else None
        if hits is not None and hits > MAX_HITS:  # more than any limit holds (see above)
            hits = MAX_HITS
        entries = tuple([(e.key, bounded_value(e.value)) for e in descriptor.entries])
        negative = descriptor.is_negative_hits
        descriptors.append(Descriptor(entries, _override(descriptor, index), hits, negative))
    return Request(message.domain, tuple(descriptors), message.hits_addend)


# what a status holds as written: its limit and name, and whether it has a reset
_Written = tuple[RateLimit | None, str | None, bool]
_NEW: _Written = (None, None, False)  # a new status: no current_limit, no reset


def _write(
    out: rls_pb2.RateLimitResponse.DescriptorStatus,
    over: bool,
    remaining: int,
    limit: RateLimit | None,
    reset: float,
    rule_name: str | None,
    names: bool,
    written: _Written,
) -> _Written:
    """One descriptor's status written into ``out``: its code, what is left of ``limit``
    and the seconds until it is reset (``names``: a limit without a name of its own is
    named ``rule_name``, what its status names it by). ``out`` is new (``_NEW``) or holds
    ``written`` from an answer before: each field is set, or cleared where a new status
    would not have it (its current_limit left as it is when the limit and name are the
    same). Returns what it now holds."""
    # An OVER_LIMIT status says 0 left, as upstream's: Envoy writes X-RateLimit-* from the
    # status with the least left, which must be the one that refused (a request of 5 hits
    # refused with 2 left would lose to another descriptor's 1). The 2 stay in the metadata.
    out.code = _OVER_LIMIT if over else _OK
    out.limit_remaining = 0 if over else min(remaining, 0xFFFFFFFF)
    # Envoy writes the name into X-RateLimit-Limit's quota policy (;name="..."): the
    # limit's own name when it has one (as upstream), else the rule's when ``names``
    name = None if limit is None else limit.name or (rule_name if names else None)
    same = limit is written[0] and name == written[1]
    if not same:
        if limit is None:
            out.ClearField("current_limit")
        else:
            current = out.current_limit
            current.requests_per_unit = limit.requests_per_unit
            current.unit = _PROTO_UNITS[limit.unit._value_]
            current.name = name or ""
    timed = reset > 0
    if timed:
        if reset > MAX_RESET_SECONDS:
            reset = MAX_RESET_SECONDS
        seconds = math.floor(reset)
        duration = out.duration_until_reset
        duration.seconds = seconds
        duration.nanos = int((reset - seconds) * 1e9)
    elif written[2]:
        out.ClearField("duration_until_reset")
    return written if same and timed is written[2] else (limit, name, timed)


def response_to_proto(decision: Decision, names: bool = False) -> rls_pb2.RateLimitResponse:
    """The RateLimitResponse Envoy reads its verdict and X-RateLimit headers from;
    ``names``: a limit without a name of its own is named by its rule."""
    response = rls_pb2.RateLimitResponse(overall_code=_code(decision.code))
    for status in decision.statuses:
        over = status.code is Code.OVER_LIMIT
        _write(response.statuses.add(), over, status.limit_remaining, status.current_limit,
               status.duration_until_reset, status.name, names, _NEW)  # fmt: skip
    return response


class Reply:
    """The responses to one kept payload (grpc_api/servicer.py), serialized: one message
    made once, each answer written into it in place (``_write``) and its bytes taken at
    once, so the message is never handed out: the bytes ``response_to_proto`` gives. A
    new message a call cost the server more than the fields of the last one written again
    (docs/benchmarks.md, "Ninth pass")."""

    __slots__ = ("_message", "_names", "_written")

    def __init__(self, names: bool = False) -> None:
        self._message = rls_pb2.RateLimitResponse()
        self._names = names
        self._written: list[_Written] = []  # what each status holds as written (_Written)

    def _fit(self, count: int) -> None:
        """A status for each of ``count`` descriptors (its first answer: always after)."""
        if len(self._written) != count:
            statuses = self._message.statuses
            del statuses[:]
            for _ in range(count):
                statuses.add()
            self._written = [_NEW] * count

    def decision(self, decision: Decision) -> bytes:
        """``response_to_proto(decision, names)``'s bytes."""
        message = self._message
        message.overall_code = _code(decision.code)
        self._fit(len(decision.statuses))
        statuses, written, names = message.statuses, self._written, self._names
        for i, status in enumerate(decision.statuses):
            over, limit = status.code is Code.OVER_LIMIT, status.current_limit
            reset = status.duration_until_reset
            written[i] = _write(statuses[i], over, status.limit_remaining, limit, reset,
                                status.name, names, written[i])  # fmt: skip
        return message.SerializeToString()

    def answer(self, reported: Sequence[Reported], answer: Answer) -> bytes:
        """The bytes of an answer made in one step (flows/fast.py), each descriptor's status
        from what it reports (``reported``): ``response_to_proto``'s of the same decision."""
        refused, parts = answer
        message = self._message
        message.overall_code = _OVER_LIMIT if refused else _OK
        self._fit(len(parts))
        statuses, written, names = message.statuses, self._written, self._names
        for i, (r, (over, remaining, reset)) in enumerate(zip(reported, parts, strict=True)):
            written[i] = _write(statuses[i], over, remaining, r.limit, reset, r.name, names,
                                written[i])  # fmt: skip
        return message.SerializeToString()
