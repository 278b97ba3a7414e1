"""How much a gRPC client may make the server hold: the receive limit, the call budgets
and the read deadline.

Each kind of call has a budget of its own: rate-limit calls, RLQS streams (long-lived, one
per Envoy) and the rest (health, reflection). A call beyond its kind's budget is refused at
once with RESOURCE_EXHAUSTED, before its message is read, so idle RLQS streams or stalled
health checks never take a rate-limit call's place. A call must deliver its (first) message
within the read deadline or it ends with DEADLINE_EXCEEDED: a client that sends headers and
nothing more holds a place for that long at most. HTTP/2's stream limit per connection keeps
one connection from taking a whole budget.
"""

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit._proto.envoy.type.v3 import ratelimit_unit_pb2
from fairlimit.core.request import MAX_DESCRIPTORS, MAX_ENTRIES, MAX_HITS, MAX_TEXT

D = ratelimit_pb2.RateLimitDescriptor


def largest_request() -> int:
    """The encoded size of the largest RateLimitRequest the request bounds admit (in ASCII
    text: 2,108,809 bytes). A larger message cannot be valid, so grpc may refuse it unread."""
    text = "x" * MAX_TEXT
    entry = D.Entry(key=text, value=text)
    override = D.RateLimitOverride(
        requests_per_unit=0xFFFFFFFF, unit=ratelimit_unit_pb2.RateLimitUnit.YEAR
    )
    descriptor = D(entries=[entry] * MAX_ENTRIES, limit=override)
    descriptor.hits_addend.value = MAX_HITS
    request = rls_pb2.RateLimitRequest(
        domain=text, descriptors=[descriptor] * MAX_DESCRIPTORS, hits_addend=MAX_HITS
    )
    return request.ByteSize()


# Envoy's requests are a few hundred bytes, and an RLQS report about 100 bytes a bucket:
# 256 KiB holds a report of a stream's most buckets with room to spare. 0 means the largest
# request the bounds admit (2.1 MB), for callers that send requests near every bound.
DEFAULT_MAX_RECEIVE = 256 * 1024
OTHER_CALLS = 8  # health checks and reflection at once: probes, grpcurl


@dataclass(frozen=True)
class Budgets:
    """What one process serves at once (--grpc-max-concurrent, --rlqs-max-streams, ...)."""

    rls: int = 32  # ShouldRateLimit calls in progress
    rlqs: int = 64  # RLQS streams open
    other: int = OTHER_CALLS
    per_connection: int = 16  # HTTP/2 streams one connection may have open
    read_timeout: float = 1.0  # seconds for a call's (first) message to arrive
    max_receive: int = DEFAULT_MAX_RECEIVE

    @property
    def receive_limit(self) -> int:
        return self.max_receive or largest_request()

    @property
    def calls(self) -> int:
        """Calls holding a message at once, at most: the memory bound's concurrency."""
        return self.rls + self.rlqs + self.other


def server_options(budgets: Budgets) -> list[tuple[str, int]]:
    """grpc options that bound what unread calls hold.

    Beyond the receive limit grpc answers RESOURCE_EXHAUSTED without reading the message
    (it used to be grpc's 4 MB, and a 3.9 MB request was parsed whole before the request
    bounds rejected it). Without BDP probing a stream's window stays at 64 KB, so a call
    waiting for its turn holds that much rather than its whole message: with the budgets,
    a flood of large requests costs about (sum of budgets) x receive limit.
    """
    return [
        ("grpc.max_receive_message_length", budgets.receive_limit),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.max_concurrent_streams", budgets.per_connection),
    ]


class Pool:
    """One kind of call's budget: how many are in progress, and the refusal beyond it."""

    def __init__(self, kind: str, most: int, what: str, refused: Callable[[str], None]) -> None:
        """``kind``: the metric's name for it (rls, rlqs, other); ``what``: the refusal's."""
        self.kind = kind
        self.most = most
        self.busy = 0
        detail = f"{most} {what} in progress, the most at once"

        async def refuse(requests: object, context: grpc.aio.ServicerContext) -> None:
            refused(kind)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, detail)

        # a stream-stream behaviour starts before any message is read, whatever the method
        self.refusal = grpc.stream_stream_rpc_method_handler(refuse)

    def take(self) -> bool:
        if self.busy >= self.most:
            return False
        self.busy += 1
        task = asyncio.current_task()  # the call's own task: done when the call is
        if task is not None:
            task.add_done_callback(self._give)
        return True

    def _give(self, _: object) -> None:
        self.busy -= 1


class TooSlow(Exception):
    """The call's message did not arrive within the read deadline."""


async def first_message(context: grpc.aio.ServicerContext, timeout: float) -> Any:
    """The call's first message, or grpc.aio.EOF; TooSlow past ``timeout`` seconds."""
    try:
        async with asyncio.timeout(timeout):
            return await context.read()
    except TimeoutError:
        raise TooSlow from None


def slow_detail(timeout: float) -> str:
    return f"no request message within {timeout:g} s (--grpc-read-timeout)"


class Gate(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc has no stubs
    """Counts every call against its kind's budget as it starts, refuses it beyond, and puts
    the read deadline on the methods that do not read their message themselves.

    ``native`` names the methods whose handlers apply the deadline themselves (the hot
    path: ShouldRateLimit reads its message as a stream of one); any other method's handler
    is rebuilt to read its first message under the deadline before the original runs.
    """

    def __init__(
        self,
        budgets: Budgets,
        kinds: dict[str, Pool],
        other: Pool,
        native: frozenset[str],
        timed_out: Callable[[str], None],
    ) -> None:
        self.budgets = budgets
        self.kinds = kinds
        self.other = other
        self.native = native
        self._timed_out = timed_out
        self._rebuilt: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        pool = self.kinds.get(method, self.other)
        if not pool.take():
            return pool.refusal
        handler = await continuation(handler_call_details)
        if handler is None or method in self.native:
            return handler
        rebuilt = self._rebuilt.get(method)
        if rebuilt is None:
            rebuilt = self._rebuilt[method] = self._with_deadline(handler, pool.kind)
        return rebuilt

    def _with_deadline(self, handler: grpc.RpcMethodHandler, kind: str) -> grpc.RpcMethodHandler:
        """``handler`` as a stream-request handler that waits for the first message at most
        the read deadline (a unary-request handler only starts once its message is in)."""
        timeout = self.budgets.read_timeout
        timed_out = self._timed_out
        original = (
            handler.unary_unary or handler.unary_stream or handler.stream_unary
            or handler.stream_stream
        )  # fmt: skip
        unary_request = not handler.request_streaming

        async def behaviour(_: object, context: grpc.aio.ServicerContext) -> Any:
            try:
                first = await first_message(context, timeout)
            except TooSlow:
                timed_out(kind)
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, slow_detail(timeout))
            if first is grpc.aio.EOF:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
            result = original(first if unary_request else _rest(first, context), context)
            if not handler.response_streaming:
                return await result if inspect.isawaitable(result) else result
            if inspect.isawaitable(result):  # writes with context.write itself
                await result
            else:
                async for response in result:
                    await context.write(response)
            return None

        make = (
            grpc.stream_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.stream_unary_rpc_method_handler
        )
        return make(
            behaviour,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


async def _rest(first: object, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
    """The call's messages: ``first``, then the rest as they arrive."""
    yield first
    while (message := await context.read()) is not grpc.aio.EOF:
        yield message
