"""The RateLimitQuotaService servicer: one bidirectional stream per Envoy, through quota.py.

Reports are read by a task of their own while the call writes whatever the quota service
sends, so assignments reach an Envoy when λ moves, not only in reply to its own reports.

A periodic report lists every bucket of the Envoy, and its division renews each one's
assignment: 50,000 buckets cost 0.11 s parsing (a bucket map made a dict per line) and
0.14 s building the responses (a message per assignment) before ``Wire`` (issue 41). Each
stream's ``Wire`` keeps, per bucket, its map as parsed (by the bucket id's bytes: a report
is parsed by ``_raw_reports``' message, the same wire format with the bucket id left as
bytes) and its encoded ``bucket_id`` field, and writes a response's assignments as bytes
from those and each strategy's encoded action.
"""

import asyncio
import logging
import operator
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from itertools import chain, repeat
from typing import Any, cast

import grpc
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, duration_pb2, message_factory
from google.protobuf.message import DecodeError

from fairlimit._proto.envoy.service.rate_limit_quota.v3 import rlqs_pb2
from fairlimit._proto.envoy.type.v3 import ratelimit_strategy_pb2
from fairlimit.core.quota import STEP, Blanket, Strategy, TokenBucket
from fairlimit.core.values import MAX_TEXT, bounded_value
from fairlimit.grpc_api import lenient
from fairlimit.quota import Abandon, Action, Assigns, Lines, QuotaService, QuotaStream, Usage

log = logging.getLogger(__name__)

RLQS_SERVICE = "envoy.service.rate_limit_quota.v3.RateLimitQuotaService"
_Response = rlqs_pb2.RateLimitQuotaResponse
_BLANKETS = {
    Blanket.ALLOW_ALL: ratelimit_strategy_pb2.RateLimitStrategy.ALLOW_ALL,
    Blanket.DENY_ALL: ratelimit_strategy_pb2.RateLimitStrategy.DENY_ALL,
}


def usages_from_proto(message: rlqs_pb2.RateLimitQuotaUsageReports) -> list[Usage]:
    """The report's lines as the use case sees them (bucket maps, allowed, denied)."""
    return [
        Usage(dict(u.bucket_id.bucket), u.num_requests_allowed, u.num_requests_denied)
        for u in message.bucket_quota_usages
    ]


def response_to_proto(actions: Sequence[Action]) -> rlqs_pb2.RateLimitQuotaResponse:
    """The RateLimitQuotaResponse carrying ``actions`` in order."""
    response = _Response()
    for action in actions:
        out = response.bucket_action.add()
        out.bucket_id.bucket.update(action.bucket)
        if isinstance(action, Abandon):
            out.abandon_action.SetInParent()
            continue
        _assign(out.quota_assignment_action, action.strategy, action.ttl)
    return response


def _assign(assignment: Any, strategy: Strategy, ttl: int) -> None:
    """Fill a QuotaAssignmentAction: ``strategy`` for ``ttl`` seconds."""
    assignment.assignment_time_to_live.seconds = ttl
    out = assignment.rate_limit_strategy
    if isinstance(strategy, TokenBucket):
        bucket = out.token_bucket
        bucket.max_tokens = strategy.max_tokens
        bucket.tokens_per_fill.value = strategy.tokens_per_fill
        bucket.fill_interval.seconds = strategy.fill_seconds
    else:
        out.blanket_rule = _BLANKETS[strategy]


def _raw_reports() -> Callable[[bytes], Any]:
    """``RateLimitQuotaUsageReports.FromString`` with each line's ``bucket_id`` left as bytes
    (the same wire format, field numbers read from the real descriptors; ``time_elapsed``
    parsed as a Duration's fields, so that what the real message refuses is refused)."""
    real = rlqs_pb2.RateLimitQuotaUsageReports.DESCRIPTOR
    usage = rlqs_pb2.RateLimitQuotaUsageReports.BucketQuotaUsage.DESCRIPTOR
    elapsed = duration_pb2.Duration.DESCRIPTOR
    f = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(
        name="fairlimit/rlqs_raw.proto", package="fairlimit.rlqs_raw", syntax="proto3"
    )

    def message(name: str, fields: list[tuple[Any, int, str]]) -> None:
        out = file.message_type.add(name=name)
        for field, kind, type_name in fields:
            label = f.LABEL_REPEATED if field.name == "bucket_quota_usages" else f.LABEL_OPTIONAL
            added = out.field.add(name=field.name, number=field.number, type=kind, label=label)
            if type_name:
                added.type_name = type_name

    by = usage.fields_by_name
    message("Elapsed", [(elapsed.fields_by_name["seconds"], f.TYPE_INT64, ""),
                        (elapsed.fields_by_name["nanos"], f.TYPE_INT32, "")])  # fmt: skip
    message("Line", [(by["bucket_id"], f.TYPE_BYTES, ""),
                     (by["time_elapsed"], f.TYPE_MESSAGE, ".fairlimit.rlqs_raw.Elapsed"),
                     (by["num_requests_allowed"], f.TYPE_UINT64, ""),
                     (by["num_requests_denied"], f.TYPE_UINT64, "")])  # fmt: skip
    message("Reports", [(real.fields_by_name["domain"], f.TYPE_STRING, ""),
                        (real.fields_by_name["bucket_quota_usages"], f.TYPE_MESSAGE,
                         ".fairlimit.rlqs_raw.Line")])  # fmt: skip
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    made = message_factory.GetMessageClass(pool.FindMessageTypeByName("fairlimit.rlqs_raw.Reports"))
    return cast(Callable[[bytes], Any], made.FromString)


_parse_raw = _raw_reports()
_BUCKET_ID = operator.attrgetter("bucket_id")
_ALLOWED = operator.attrgetter("num_requests_allowed")
_DENIED = operator.attrgetter("num_requests_denied")
_BucketAction = rlqs_pb2.RateLimitQuotaResponse.BucketAction
_ACTION_TAG = _Response.DESCRIPTOR.fields_by_name["bucket_action"].number << 3 | 2  # a message
_BUCKET_ID_TAG = _BucketAction.DESCRIPTOR.fields_by_name["bucket_id"].number << 3 | 2
_ASSIGNMENT_TAG = _BucketAction.DESCRIPTOR.fields_by_name["quota_assignment_action"].number << 3 | 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SHORT = [_varint(n) for n in range(0x80)]  # a length under 128, as most actions' are
_TAG = _varint(_ACTION_TAG)
_SECOND = operator.itemgetter(1)
_KEPT_STRATEGIES = 4096


def _field(tag: int, payload: bytes) -> bytes:
    return _varint(tag) + _varint(len(payload)) + payload


class Wire:
    """One stream's reports parsed and responses encoded, with what stays the same from one
    to the next kept: each bucket's map by its bucket id's bytes (as Envoy sent it), each
    bucket map's encoded ``bucket_id`` field (by the map, a subscription's own: kept alive
    here, so that its id names it), and each strategy's encoded action (by the strategy, for
    one TTL). The maps and ids are kept at most twice the stream's buckets and STEP more,
    the actions at most _KEPT_STRATEGIES (then emptied)."""

    def __init__(self, stream: QuotaStream) -> None:
        self.stream = stream
        self._maps: dict[bytes, dict[str, str]] = {}
        self._ids: dict[int, tuple[Mapping[str, str], bytes]] = {}
        # the ids Envoy sent of buckets whose map took a value's stand-in (a value past
        # MAX_TEXT): the map does not encode them again; kept as long as the maps
        self._sent: dict[int, tuple[Mapping[str, str], bytes]] = {}
        self._actions: dict[int, tuple[Strategy, bytes]] = {}
        self._ttl = 0

    def usages(self, payload: bytes) -> tuple[str, Lines]:
        """A report's domain and lines; DecodeError for bytes that are no usage report."""
        message = _parse_raw(payload)
        lines = message.bucket_quota_usages
        ids = list(map(_BUCKET_ID, lines))
        maps = self._maps
        if len(maps) > 2 * len(self.stream.buckets) + STEP:
            maps.clear()
            self._ids.clear()
            self._sent.clear()
        buckets = list(map(maps.get, ids))
        if None in buckets:
            for i, raw in enumerate(ids):
                if buckets[i] is None:
                    bucket = maps.get(raw)
                    if bucket is None:
                        bucket, readable, exact = _bucket_map(raw)
                        maps[raw] = bucket
                        # its id as Envoy sent it, for the responses; Envoy cannot read
                        # back one that is no UTF-8 (it resets the stream): its stand-in's,
                        # which Envoy ignores (that bucket keeps no_assignment_behavior)
                        sent = raw if readable else _bucket_id(bucket)
                        self._ids[id(bucket)] = known = (bucket, _id_field(sent))
                        if readable and not exact:
                            self._sent[id(bucket)] = known
                    buckets[i] = bucket
        n = len(ids)
        allowed = np.fromiter(map(_ALLOWED, lines), np.uint64, n)
        denied = np.fromiter(map(_DENIED, lines), np.uint64, n)
        return message.domain, Lines(cast(list[dict[str, str]], buckets), allowed, denied)

    def response(self, actions: Sequence[Action]) -> bytes:
        """The encoded RateLimitQuotaResponse carrying ``actions`` in order."""
        if not isinstance(actions, Assigns):
            return response_to_proto(actions).SerializeToString()
        ids = self._ids
        if len(ids) > 2 * len(self.stream.buckets) + STEP:
            ids.clear()
        fields = list(map(ids.get, map(id, actions.buckets)))
        if None in fields:
            for i, bucket in enumerate(actions.buckets):
                if fields[i] is None:
                    known = ids.get(id(bucket)) or self._sent.get(id(bucket))
                    if known is None:
                        known = (bucket, _id_field(_bucket_id(bucket)))
                    ids[id(bucket)] = known
                    fields[i] = known
        # each strategy's encoded action, by the strategy's id (kept alive here; a division
        # makes each strategy once, core.quota.strategy_of)
        kept = self._actions
        if self._ttl != actions.ttl or len(kept) > _KEPT_STRATEGIES:
            kept.clear()
            self._ttl = actions.ttl
        if not kept.keys() >= set(map(id, actions.strategies)):
            for strategy in actions.strategies:
                if id(strategy) not in kept:
                    kept[id(strategy)] = (strategy, _assignment(strategy, actions.ttl))
        assigned = map(_SECOND, map(kept.__getitem__, map(id, actions.strategies)))
        bodies = list(map(bytes.__add__, map(_SECOND, cast(list[tuple[object, bytes]], fields)),
                          assigned))  # fmt: skip
        sizes = list(map(len, bodies))
        heads = (list(map(_SHORT.__getitem__, sizes)) if max(sizes, default=0) < 0x80
                 else list(map(_varint, sizes)))  # fmt: skip
        out = [response_to_proto(actions.head).SerializeToString()] if actions.head else []
        out += chain.from_iterable(zip(repeat(_TAG), heads, bodies))
        return b"".join(out)


def _bucket_map(raw: bytes) -> tuple[dict[str, str], bool, bool]:
    """The bucket map of an encoded BucketId, each value that is no UTF-8 (lenient.py) or
    longer than MAX_TEXT taken as its stand-in, as a rate-limit call's (core/values.py):
    Envoy copies a header into it as the client sent it; whether it was all UTF-8, and
    whether the map is the id's own (no stand-in taken)."""
    message, readable = lenient.bucket_id(raw)
    bucket = {key: bounded_value(value) for key, value in message.bucket.items()}
    exact = readable and all(len(value) <= MAX_TEXT for value in message.bucket.values())
    return bucket, readable, exact


def _id_field(encoded: bytes) -> bytes:
    """The ``bucket_id`` field of an encoded BucketId (none for an empty one, as
    response_to_proto leaves it)."""
    return _field(_BUCKET_ID_TAG, encoded) if encoded else b""


def _bucket_id(bucket: Mapping[str, str]) -> bytes:
    message = rlqs_pb2.BucketId()
    message.bucket.update(bucket)
    return message.SerializeToString(deterministic=True)


def _assignment(strategy: Strategy, ttl: int) -> bytes:
    """The encoded ``quota_assignment_action`` field of an Assign."""
    assignment = _BucketAction.QuotaAssignmentAction()
    _assign(assignment, strategy, ttl)
    return _field(_ASSIGNMENT_TAG, assignment.SerializeToString())


def _serialized(response: bytes) -> bytes:
    return response


class QuotaServicer:
    """StreamRateLimitQuotas over the quota service; a corrupt report is INVALID_ARGUMENT."""

    def __init__(self, quota: QuotaService) -> None:
        self.quota = quota
        self._outboxes: set[asyncio.Queue[Sequence[Action] | None]] = set()

    def end_streams(self) -> None:
        """End every open stream with OK (draining): Envoy reopens it, on another server
        if this one is going, and keeps its assignments until their TTL meanwhile. Left
        open, a stream would hold the drain for its whole grace period."""
        for outbox in self._outboxes:
            outbox.put_nowait(None)

    def handler(self) -> grpc.GenericRpcHandler:
        method = grpc.stream_stream_rpc_method_handler(
            self.StreamRateLimitQuotas,
            request_deserializer=None,  # parsed here: a bad payload is ours to answer
            response_serializer=_serialized,  # encoded by the stream's Wire
        )
        return grpc.method_handlers_generic_handler(RLQS_SERVICE, {"StreamRateLimitQuotas": method})

    async def StreamRateLimitQuotas(  # the name is the RPC's
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        outbox: asyncio.Queue[Sequence[Action] | None] = asyncio.Queue()
        self._outboxes.add(outbox)
        stream = self.quota.open(outbox.put_nowait)
        wire = Wire(stream)
        failure: list[tuple[grpc.StatusCode, str]] = []
        reader = asyncio.create_task(self._read(requests, wire, outbox, failure))
        try:
            while (actions := await outbox.get()) is not None:
                yield wire.response(actions)
        finally:
            self._outboxes.discard(outbox)
            reader.cancel()
            self.quota.close(stream)
        if failure:
            await context.abort(*failure[0])

    async def _read(
        self,
        requests: AsyncIterator[bytes],
        wire: Wire,
        outbox: "asyncio.Queue[Sequence[Action] | None]",
        failure: list[tuple[grpc.StatusCode, str]],
    ) -> None:
        """Feed every report to the stream; end the call when Envoy half-closes or errs."""
        try:
            async for payload in requests:
                domain, lines = wire.usages(payload)
                await self.quota.report(wire.stream, domain, lines)
        except DecodeError as exc:
            failure.append((grpc.StatusCode.INVALID_ARGUMENT, f"malformed usage report: {exc}"))
        except asyncio.CancelledError:
            raise
        except Exception:  # a report must never take the server down; the stream ends
            log.exception("RLQS stream failed")
            failure.append((grpc.StatusCode.INTERNAL, "RLQS stream failed"))
        outbox.put_nowait(None)
