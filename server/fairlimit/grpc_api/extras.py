"""envoyproxy/ratelimit's optional parts of a response: rate-limit headers, dynamic metadata.

Headers (``LIMIT_RESPONSE_HEADERS_ENABLED``): the limit, remaining and reset of one status,
the one closest to its limit, or the ordinary (non-quota) descriptor that is over; Envoy adds
them to the client's response. Dynamic metadata (``RESPONSE_DYNAMIC_METADATA``): the
request's domain, descriptors and hits, and the ``metadata`` of every matched rule that was
not over, merged (the first value written for a key wins, mappings merge).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import struct_pb2, text_format

from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit.core.admission import Code, Status, is_quota


@dataclass(frozen=True, slots=True)
class ResponseOptions:
    """Which optional parts to add, and the header names."""

    headers: bool = False
    limit_header: str = "RateLimit-Limit"
    remaining_header: str = "RateLimit-Remaining"
    reset_header: str = "RateLimit-Reset"
    metadata: bool = False
    quota_all: bool = False  # upstream's QUOTA_MODE: every rule a quota

    @property
    def any(self) -> bool:
        return self.headers or self.metadata


def _closest(statuses: Sequence[Status], quota_all: bool) -> Status | None:
    """The status the headers describe: an ordinary descriptor over wins, else the least left."""
    best: Status | None = None
    for status in statuses:
        if status.current_limit is None:
            continue
        if status.code is Code.OVER_LIMIT and not is_quota(status, quota_all):
            return status
        if best is None or status.limit_remaining < best.limit_remaining:
            best = status
    return best


def add_headers(
    response: rls_pb2.RateLimitResponse, statuses: Sequence[Status], options: ResponseOptions
) -> None:
    status = _closest(statuses, options.quota_all)
    if status is None or status.current_limit is None:
        return
    remaining = 0 if status.code is Code.OVER_LIMIT else status.limit_remaining
    for name, value in (
        (options.limit_header, status.current_limit.requests_per_unit),
        (options.remaining_header, min(remaining, 0xFFFFFFFF)),
        (options.reset_header, int(status.duration_until_reset)),
    ):
        response.response_headers_to_add.add(key=name, value=str(value))


def _merge(into: dict[str, Any], source: Mapping[str, object]) -> None:
    for key, value in source.items():
        known = into.get(key)
        if known is None:
            into[key] = _plain(value)
        elif isinstance(known, dict) and isinstance(value, Mapping):
            _merge(known, value)


def _plain(value: object) -> object:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _descriptor(message: Any) -> dict[str, object]:
    out: dict[str, object] = {"entries": [f"{e.key}={e.value}" for e in message.entries]}
    if message.HasField("limit"):
        out["limit"] = text_format.MessageToString(message.limit, as_one_line=True)
    if message.HasField("hits_addend"):
        out["hitsAddend"] = message.hits_addend.value
    return out


def add_metadata(
    response: rls_pb2.RateLimitResponse,
    request: rls_pb2.RateLimitRequest,
    statuses: Sequence[Status],
) -> None:
    fields: dict[str, Any] = {
        "domain": request.domain,
        "descriptors": [_descriptor(d) for d in request.descriptors],
    }
    if request.hits_addend:
        fields["hitsAddend"] = request.hits_addend
    merged: dict[str, Any] = {}
    for status in statuses:
        rule = status.rule
        passed = status.code is Code.OK and status.current_limit is not None
        if passed and rule is not None and rule.metadata:
            _merge(merged, rule.metadata)
    if merged:
        fields["metadata"] = merged
    struct = struct_pb2.Struct()
    struct.update(fields)
    response.dynamic_metadata.CopyFrom(struct)


def add_extras(
    response: rls_pb2.RateLimitResponse,
    request: rls_pb2.RateLimitRequest,
    statuses: Sequence[Status],
    options: ResponseOptions,
) -> None:
    """Add the optional parts ``options`` asks for to ``response``."""
    if options.headers:
        add_headers(response, statuses, options)
    if options.metadata:
        add_metadata(response, request, statuses)
