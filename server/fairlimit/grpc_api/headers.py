"""envoyproxy/ratelimit's optional parts of a response: rate-limit headers, dynamic metadata.

Headers (``LIMIT_RESPONSE_HEADERS_ENABLED``): the limit, remaining and reset of one status,
``admission.reported``'s: the descriptor that refused the request, else the one closest to
its limit; Envoy adds them to the client's response. With rule names on, ``RateLimit-Policy``
and ``RateLimit`` (draft-ietf-httpapi-ratelimit-headers) follow, naming that status's rule.
Dynamic metadata (``RESPONSE_DYNAMIC_METADATA``): the request's domain, descriptors and
hits, and the ``metadata`` of every matched rule that was not over, merged (the first value
written for a key wins, mappings merge); with rule names on, a ``fairlimit`` struct too:
the reported status, and each descriptor's rule with what it has left.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import struct_pb2, text_format

from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit.core.admission import Code, Status, reported
from fairlimit.grpc_api.convert import MAX_RESET_SECONDS


@dataclass(frozen=True, slots=True)
class ResponseOptions:
    """Which optional parts to add, and the header names."""

    headers: bool = False
    limit_header: str = "RateLimit-Limit"
    remaining_header: str = "RateLimit-Remaining"
    reset_header: str = "RateLimit-Reset"
    metadata: bool = False
    quota_all: bool = False  # upstream's QUOTA_MODE: every rule a quota
    # fairlimit's own parts: statuses named by their rule, RateLimit-Policy and RateLimit
    # headers, the ``fairlimit`` metadata (off: exactly upstream's response)
    rule_names: bool = False

    @property
    def any(self) -> bool:
        return self.headers or self.metadata


def _sf_string(text: str) -> str:
    """``text`` as a structured-field string (RFC 8941): quoted, ``\\`` and ``"`` escaped,
    anything outside printable ASCII percent-encoded (an sf-string cannot hold it)."""
    out = []
    for char in text:
        if char in '\\"':
            out.append("\\" + char)
        elif " " <= char <= "~":
            out.append(char)
        else:
            out.append("".join(f"%{b:02X}" for b in char.encode()))
    return '"' + "".join(out) + '"'


def add_headers(
    response: rls_pb2.RateLimitResponse, statuses: Sequence[Status], options: ResponseOptions
) -> None:
    status = reported(statuses, options.quota_all)
    if status is None or status.current_limit is None:
        return
    limit = status.current_limit
    remaining = 0 if status.code is Code.OVER_LIMIT else min(status.limit_remaining, 0xFFFFFFFF)
    reset = _reset(status)
    headers = [
        (options.limit_header, str(limit.requests_per_unit)),
        (options.remaining_header, str(remaining)),
        (options.reset_header, str(reset)),
    ]
    if options.rule_names and status.name is not None:
        name = _sf_string(status.name)
        headers.append(("RateLimit-Policy", f"{name};q={limit.requests_per_unit};w={limit.window}"))
        headers.append(("RateLimit", f"{name};r={remaining};t={reset}"))
    for key, value in headers:
        response.response_headers_to_add.add(key=key, value=value)


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


def _reset(status: Status) -> int:
    """Whole seconds until the status's window resets, at most what its status in the
    response says (convert.MAX_RESET_SECONDS: a GCRA bucket charged far ahead)."""
    return int(min(status.duration_until_reset, MAX_RESET_SECONDS))


def _status_fields(status: Status) -> dict[str, object]:
    out: dict[str, object] = {"code": status.code.name}
    limit = status.current_limit
    if limit is None:
        return out
    if status.name is not None:
        out["name"] = status.name
    out.update(limit=limit.requests_per_unit, window=limit.window,
               remaining=min(status.limit_remaining, 0xFFFFFFFF),
               reset=_reset(status))  # fmt: skip
    return out


def _fairlimit(
    request: rls_pb2.RateLimitRequest, statuses: Sequence[Status], quota_all: bool
) -> dict[str, object]:
    """fairlimit's part of the metadata: the status the headers describe, every descriptor's
    status, and ``withQuota``: the descriptors (``key=value/...``) not over with hits left,
    what they have left, for a route to pick a backend with budget."""
    out: dict[str, object] = {"statuses": [_status_fields(s) for s in statuses]}
    shown = reported(statuses, quota_all)
    if shown is not None:
        out["reported"] = _status_fields(shown)
    left: dict[str, object] = {}
    for descriptor, status in zip(request.descriptors, statuses, strict=True):
        if status.code is Code.OK and status.current_limit is not None and status.limit_remaining:
            entries = "/".join(f"{e.key}={e.value}" for e in descriptor.entries)
            left.setdefault(entries, min(status.limit_remaining, 0xFFFFFFFF))
    out["withQuota"] = left
    return out


def add_metadata(
    response: rls_pb2.RateLimitResponse,
    request: rls_pb2.RateLimitRequest,
    statuses: Sequence[Status],
    options: ResponseOptions | None = None,
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
    if options is not None and options.rule_names:
        fields["fairlimit"] = _fairlimit(request, statuses, options.quota_all)
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
        add_metadata(response, request, statuses, options)
