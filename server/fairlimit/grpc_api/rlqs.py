"""The RateLimitQuotaService servicer: one bidirectional stream per Envoy, through quota.py.

Reports are read by a task of their own while the call writes whatever the quota service
sends, so assignments reach an Envoy when λ moves, not only in reply to its own reports.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

import grpc
from google.protobuf.message import DecodeError

from fairlimit._proto.envoy.service.rate_limit_quota.v3 import rlqs_pb2
from fairlimit._proto.envoy.type.v3 import ratelimit_strategy_pb2
from fairlimit.core.quota import Blanket, TokenBucket
from fairlimit.quota import Abandon, Action, QuotaService, QuotaStream, Usage

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
        assignment = out.quota_assignment_action
        assignment.assignment_time_to_live.seconds = action.ttl
        strategy = assignment.rate_limit_strategy
        if isinstance(action.strategy, TokenBucket):
            bucket = strategy.token_bucket
            bucket.max_tokens = action.strategy.max_tokens
            bucket.tokens_per_fill.value = action.strategy.tokens_per_fill
            bucket.fill_interval.seconds = action.strategy.fill_seconds
        else:
            strategy.blanket_rule = _BLANKETS[action.strategy]
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
            response_serializer=_Response.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(RLQS_SERVICE, {"StreamRateLimitQuotas": method})

    async def StreamRateLimitQuotas(  # the name is the RPC's
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rlqs_pb2.RateLimitQuotaResponse]:
        outbox: asyncio.Queue[Sequence[Action] | None] = asyncio.Queue()
        self._outboxes.add(outbox)
        stream = self.quota.open(outbox.put_nowait)
        failure: list[tuple[grpc.StatusCode, str]] = []
        reader = asyncio.create_task(self._read(requests, stream, outbox, failure))
        try:
            while (actions := await outbox.get()) is not None:
                yield response_to_proto(actions)
        finally:
            self._outboxes.discard(outbox)
            reader.cancel()
            self.quota.close(stream)
        if failure:
            await context.abort(*failure[0])

    async def _read(
        self,
        requests: AsyncIterator[bytes],
        stream: QuotaStream,
        outbox: "asyncio.Queue[Sequence[Action] | None]",
        failure: list[tuple[grpc.StatusCode, str]],
    ) -> None:
        """Feed every report to the stream; end the call when Envoy half-closes or errs."""
        try:
            async for payload in requests:
                message = rlqs_pb2.RateLimitQuotaUsageReports.FromString(payload)
                await self.quota.report(stream, message.domain, usages_from_proto(message))
        except DecodeError as exc:
            failure.append((grpc.StatusCode.INVALID_ARGUMENT, f"malformed usage report: {exc}"))
        except asyncio.CancelledError:
            raise
        except Exception:  # a report must never take the server down; the stream ends
            log.exception("RLQS stream failed")
            failure.append((grpc.StatusCode.INTERNAL, "RLQS stream failed"))
        outbox.put_nowait(None)
