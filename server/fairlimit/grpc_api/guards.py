"""How much a gRPC client may make the server hold: the receive limit, the call budgets
and the read deadline.

Each kind of call has a budget of its own: rate-limit calls, RLQS streams (long-lived, one
per Envoy) and the rest (health, reflection). A call beyond its kind's budget is refused at
once with RESOURCE_EXHAUSTED, before its message is read, so idle RLQS streams or stalled
health checks never take a rate-limit call's place. A call must deliver its (first) message
within the read deadline or it ends with DEADLINE_EXCEEDED: a client that sends headers and
nothing more holds a place for that long at most. The budgets, not HTTP/2's stream limit,
bound what connections hold, and refuse with a status: no SETTINGS_MAX_CONCURRENT_STREAMS is
sent unless asked for, since a fresh connection opens streams before it reads the setting and
grpc resets each one past it (REFUSED_STREAM), which Envoy does not retry.
"""

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit._proto.envoy.type.v3 import ratelimit_unit_pb2
from fairlimit.core.request import MAX_DESCRIPTORS, MAX_ENTRIES, MAX_HITS, MAX_TEXT
from fairlimit.settings import Settings


def largest_request() -> int:
    """The encoded size of the largest RateLimitRequest the request bounds admit (in ASCII
    text: 2,108,809 bytes). A larger message cannot be valid, so grpc may refuse it unread."""
    text = "x" * MAX_TEXT
    entry = ratelimit_pb2.RateLimitDescriptor.Entry(key=text, value=text)
    override = ratelimit_pb2.RateLimitDescriptor.RateLimitOverride(
        requests_per_unit=0xFFFFFFFF, unit=ratelimit_unit_pb2.RateLimitUnit.YEAR
    )
    descriptor = ratelimit_pb2.RateLimitDescriptor(entries=[entry] * MAX_ENTRIES, limit=override)
    descriptor.hits_addend.value = MAX_HITS
    request = rls_pb2.RateLimitRequest(
        domain=text, descriptors=[descriptor] * MAX_DESCRIPTORS, hits_addend=MAX_HITS
    )
    return request.ByteSize()


OTHER_CALLS = 8  # health checks and reflection at once: probes, grpcurl (not a flag)


@dataclass(frozen=True)
class Budgets:
    """What one process serves at once (--grpc-max-concurrent, --rlqs-max-streams, ...).

    The values come from the settings (``Budgets.of``), whose defaults are the server's:
    nothing here has a default of its own that could drift from the flags'.
    """

    rls: int  # ShouldRateLimit calls in progress
    rlqs: int  # RLQS streams open
    per_connection: int  # HTTP/2 streams one connection may have open; 0: no limit sent
    read_timeout: float  # seconds for a call's (first) message to arrive
    max_receive: int  # 0: the largest request the bounds admit
    other: int = OTHER_CALLS

    @classmethod
    def of(cls, settings: Settings) -> "Budgets":
        """The budgets ``settings`` set (``Budgets.of(Settings())``: the defaults)."""
        return cls(
            rls=settings.grpc_max_concurrent,
            rlqs=settings.rlqs_max_streams,
            per_connection=settings.grpc_max_streams_per_connection,
            read_timeout=settings.grpc_read_timeout,
            max_receive=settings.grpc_max_receive_bytes,
        )

    @property
    def receive_limit(self) -> int:
        return self.max_receive or largest_request()


def server_options(budgets: Budgets) -> list[tuple[str, int]]:
    """grpc options that bound what unread calls hold.

    Beyond the receive limit grpc answers RESOURCE_EXHAUSTED without reading the message
    (it used to be grpc's 4 MB, and a 3.9 MB request was parsed whole before the request
    bounds rejected it). Without BDP probing a stream's window stays at 64 KB, so a call
    waiting for its turn holds that much rather than its whole message: with the budgets,
    a flood of large requests costs about (sum of budgets) x receive limit. A stream limit
    per connection is set only when asked for (0 sends none: grpc's 0 would refuse every
    stream).
    """
    options = [
        ("grpc.max_receive_message_length", budgets.receive_limit),
        ("grpc.http2.bdp_probe", 0),
    ]
    if budgets.per_connection:
        options.append(("grpc.max_concurrent_streams", budgets.per_connection))
    return options


class Pool:
    """One kind of call's budget: how many are in progress, and which of them are still
    waiting for their message (those give their place to a new call when it is full).

    When it is full, a call waiting on the store gives its place first (``relieve``: the
    rate-limit calls'), answered by the failure mode at once: a slow store fills no budget
    (issue 38).
    """

    def __init__(self, kind: str, most: int, what: str) -> None:
        """``kind``: the metric's name for it (rls, rlqs, other); ``what``: the refusal's."""
        self.kind = kind
        self.most = most
        self.busy = 0
        self.started = 0  # calls admitted so far (a drain waits until none come)
        self.detail = f"{most} {what} in progress, the most at once"
        self.evicted_detail = f"no request message yet, and {most} {what} in progress"
        # calls waiting for their first message, oldest first, with their deadline
        self.waiting: dict[asyncio.Task[Any], float] = {}
        self.interrupted: dict[asyncio.Task[Any], str] = {}  # why: read_timeout, evicted
        # a call in progress that can give up its place: True when one did (its wait on the
        # store given up, so the failure mode answers it at once)
        self.relieve: Callable[[], bool] | None = None

    def admit(self) -> bool:
        """Take a place for a new call; when the budget is full, a call that ``relieve``
        answers at once gives up its place (its wait on the store given up: answered by the
        failure mode), else the call that has waited longest for its message (a real client
        sends the message with the headers: the waiting ones are stalled, or their message
        is still to be read on a busy loop, and end RESOURCE_EXHAUSTED). False: every place
        serves a call that is neither."""
        if self.busy >= self.most:
            if self.relieve is not None and self.relieve():
                pass
            elif self.waiting:
                self.interrupt(next(iter(self.waiting)), "evicted")
            else:
                return False
        self.busy += 1
        self.started += 1
        return True

    def interrupt(self, task: "asyncio.Task[Any]", why: str) -> None:
        del self.waiting[task]
        self.interrupted[task] = why
        task.cancel()


class TooSlow(Exception):
    """The call's message did not come in time: its deadline passed (``read_timeout``), or
    a new call took its place in a full budget (``evicted``)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Reader:
    """Reads a call's first message under the read deadline.

    A timer per call would cost the hot path a few microseconds; instead each call waiting
    for its message is noted with its deadline, and a sweep every quarter of the deadline
    interrupts those past it (a call's message normally arrives with its headers).
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.detail = f"no request message within {timeout:g} s (--grpc-read-timeout)"
        self.pools: list[Pool] = []

    async def first(
        self, context: grpc.aio.ServicerContext, pool: Pool, task: "asyncio.Task[Any] | None"
    ) -> Any:
        """The call's first message, or grpc.aio.EOF; TooSlow when interrupted. ``task``:
        the call's (``asyncio.current_task()``, which the caller has read already)."""
        if task is None:  # not on a task: cannot be interrupted, wait as long as it takes
            return await context.read()
        pool.waiting[task] = task.get_loop().time() + self.timeout  # the running loop's
        try:
            return await context.read()
        except asyncio.CancelledError:
            why = pool.interrupted.pop(task, None)
            if why is None:
                raise
            task.uncancel()  # interrupted here, not cancelled: the call goes on to end
            raise TooSlow(why) from None
        finally:
            pool.waiting.pop(task, None)

    def details(self, pool: Pool, slow: TooSlow) -> tuple[grpc.StatusCode, str]:
        """The status a call interrupted while waiting for its message ends with."""
        if slow.why == "evicted":
            return grpc.StatusCode.RESOURCE_EXHAUSTED, pool.evicted_detail
        return grpc.StatusCode.DEADLINE_EXCEEDED, self.detail

    async def sweep(self) -> None:
        """Interrupt the calls past their deadline, for as long as the server runs."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.timeout / 4)
            now = loop.time()
            for pool in self.pools:
                for task in [t for t, deadline in pool.waiting.items() if deadline <= now]:
                    pool.interrupt(task, "read_timeout")


Refused = Callable[[str, str], None]  # kind, reason (busy, read_timeout, evicted)


class Guarded(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc has no stubs
    """Another service's handlers under a budget and the read deadline.

    Each method's handler is rebuilt as one whose request is a stream: it starts as the call
    does (a unary-request handler starts only once its message is in), so a call beyond the
    budget is refused before anything is read, and the first message is read under the
    deadline before the original handler runs.
    """

    def __init__(
        self, inner: grpc.GenericRpcHandler, pool: Pool, reader: Reader, refused: Refused
    ) -> None:
        self.inner = inner
        self.pool = pool
        self.reader = reader
        self.refused = refused
        self._rebuilt: dict[str, grpc.RpcMethodHandler | None] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method: str = details.method
        if method not in self._rebuilt:
            found = self.inner.service(details)
            self._rebuilt[method] = None if found is None else self._guard(found)
        return self._rebuilt[method]

    def _guard(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        pool, reader, refused = self.pool, self.reader, self.refused
        original = (
            handler.unary_unary or handler.unary_stream or handler.stream_unary
            or handler.stream_stream
        )  # fmt: skip
        unary_request = not handler.request_streaming

        async def behaviour(_: object, context: grpc.aio.ServicerContext) -> Any:
            if not pool.admit():
                refused(pool.kind, "busy")
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, pool.detail)
            try:
                return await _serve(handler, original, unary_request, reader, pool, context)
            except TooSlow as slow:
                refused(pool.kind, slow.why)
                await context.abort(*reader.details(pool, slow))
            finally:
                pool.busy -= 1

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


async def _serve(
    handler: grpc.RpcMethodHandler,
    original: Callable[..., Any],
    unary_request: bool,
    reader: Reader,
    pool: Pool,
    context: grpc.aio.ServicerContext,
) -> Any:
    """Run ``original`` on the call's messages once the first is in (TooSlow before)."""
    first = await reader.first(context, pool, asyncio.current_task())
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


async def _rest(first: object, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
    """The call's messages: ``first``, then the rest as they arrive."""
    yield first
    while (message := await context.read()) is not grpc.aio.EOF:
        yield message
