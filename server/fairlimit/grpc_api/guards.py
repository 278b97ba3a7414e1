"""How much a gRPC client may make the server hold: the receive limit, the call budgets
and the read deadline.

Each kind of call has a budget of its own: rate-limit calls, RLQS streams (long-lived, one
per Envoy) and the rest (health, reflection), so idle RLQS streams or stalled health checks
never take a rate-limit call's place. A call beyond its kind's budget waits for a place,
its message unread (``Pool``): a burst is served in turn rather than refused, since Envoy
lets through every request whose call is refused. Only when the queue is full too, or a
call has waited the read deadline in it, is it refused with RESOURCE_EXHAUSTED. A call must
deliver its (first) message within the read deadline or it ends with DEADLINE_EXCEEDED: a
client that sends headers and nothing more holds a place for that long at most, and for a
quarter of a second when calls wait for one. The budgets, not HTTP/2's stream limit, bound
what connections hold, and refuse with a status: no SETTINGS_MAX_CONCURRENT_STREAMS is sent
unless asked for, since a fresh connection opens streams before it reads the setting and
grpc resets each one past it (REFUSED_STREAM), which Envoy does not retry.
"""

import asyncio
import contextlib
import inspect
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit._proto.envoy.type.v3 import ratelimit_unit_pb2
from fairlimit.core.request import MAX_DESCRIPTORS, MAX_ENTRIES, MAX_HITS
from fairlimit.core.values import MAX_TEXT
from fairlimit.settings import Settings


def largest_request() -> int:
    """The encoded size of the largest RateLimitRequest the request bounds admit with every
    text within MAX_TEXT (in ASCII: 2,108,809 bytes), the receive limit ``0`` asks for. A
    longer value is taken as its stand-in (core/values.py), but past this size grpc
    refuses the message unread."""
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
# Calls that may wait for a place, per place in the budget (rate-limit and other calls; an
# RLQS stream holds its place for as long as Envoy runs, so none waits for one). Each holds
# its message unread: 64 KB at most (HTTP/2's window without BDP probing).
QUEUED_PER_PLACE = 32
# A call in a place that has waited this long for its message (or on the store) gives its
# place to a call waiting for one. A real client sends its message with its headers, and
# Envoy's rate-limit timeouts (20 ms by default, 0.25 s in examples/envoy) have passed by
# then; a starved event loop took up to 40 ms to read a message that had come (bench/
# grpc_burst.py --starve 6).
STALLED_SECONDS = 0.25
STALLED_CHECK = STALLED_SECONDS / 5  # how often a queue looks for a stalled call
# Calls grpc holds before the server has taken them up (its loop takes one call at a time).
# grpc's own default drops new calls at random from 1,000 such calls (CANCELLED, counted
# nowhere of ours) and all from 3,000: one soft limit at its hard one drops none below it.
PENDING_CALLS = 3000


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
        ("grpc.server.max_pending_requests", PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS),
    ]
    if budgets.per_connection:
        options.append(("grpc.max_concurrent_streams", budgets.per_connection))
    return options


class Pool:
    """One kind of call's budget: the calls in progress, which of them still wait for their
    message, and the calls waiting for a place (``queue``).

    A new call takes a free place (``admit``); when there is none it waits for one
    (``wait_for_place``) with its message unread. A call leaving hands its place to a
    waiting call (``leave``): the first to come, or the last while the first has waited
    ``stalled`` seconds (a queue that old is a flood of stalled calls, or calls whose
    callers' deadlines are passing: the newest are the ones still worth serving). A call in
    a place gives it up to a waiting call, ending at once, only when it is stalled:

    - waiting for its message for ``stalled`` seconds: it ends RESOURCE_EXHAUSTED
      (``evicted``);
    - waiting on a store that has not answered anything since the wait began, for a moment
      (``relieve``, the rate-limit calls': grpc_api/servicer.py): the failure mode answers
      it, so a stalled store fills no budget (issue 38), while a slow one that answers is
      waited for.

    A burst on a busy loop (calls started faster than their messages are read) is thus
    served in turn. Before, each call beyond the budget took at once the place of the call
    that had waited longest for its message, which had often sent it: that call ended
    RESOURCE_EXHAUSTED and Envoy let its request through.
    """

    def __init__(
        self, kind: str, most: int, what: str, *, queued: int | None = None,
        stalled: float = STALLED_SECONDS,
    ) -> None:  # fmt: skip
        """``kind``: the metric's name for it (rls, rlqs, other); ``what``: the refusal's;
        ``queued``: how many calls may wait for a place (QUEUED_PER_PLACE a place if None)."""
        self.kind = kind
        self.most = most
        self.queued = QUEUED_PER_PLACE * most if queued is None else queued
        self.stalled = stalled
        self.busy = 0
        self.started = 0  # calls admitted so far (a drain waits until none come)
        self.detail = f"{most} {what} in progress, the most at once"
        self.evicted_detail = f"no request message yet, and {most} {what} in progress"
        # calls waiting for their first message, oldest first, since when (the loop's clock)
        self.waiting: dict[asyncio.Task[Any], float] = {}
        self.interrupted: dict[asyncio.Task[Any], str] = {}  # why: read_timeout, evicted
        # calls waiting for a place, in order of arrival: their future (True: a place was
        # handed over) and since when
        self.queue: deque[tuple[asyncio.Future[bool], float]] = deque()
        self._checking: asyncio.TimerHandle | None = None
        # a call in progress waiting on a stalled store gives up its place: True when one
        # did (its wait given up, so the failure mode answers it)
        self.relieve: Callable[[], bool] | None = None

    def admit(self) -> bool:
        """Take a place at once: a free one, when no call waits for one, or a stalled
        call's. False: the call must wait for a place (``wait_for_place``)."""
        if self.queue or (self.busy >= self.most and not self._give_up_one()):
            return False
        self.busy += 1
        self.started += 1
        return True

    async def wait_for_place(self) -> bool:
        """Wait for a place; False when none came: the queue is full, or the call waited
        the read deadline (the sweep ends it)."""
        if len(self.queue) >= self.queued:
            return False
        loop = asyncio.get_running_loop()
        handed: asyncio.Future[bool] = loop.create_future()
        entry = (handed, loop.time())
        self.queue.append(entry)
        if self.busy < self.most:  # a place came free as the queue emptied
            self._serve_queue()
        if self._checking is None and self.queue:
            self._checking = loop.call_later(STALLED_CHECK, self._check)
        try:
            placed = await handed
        except asyncio.CancelledError:  # the call ended (its deadline, the client)
            if handed.done() and not handed.cancelled() and handed.result():
                self.leave()  # handed a place as it was cancelled: give it on
            else:
                self._drop(entry)
            raise
        if placed:
            self.started += 1
        return placed

    def leave(self) -> None:
        """A call in a place has ended: a call waiting for one takes it."""
        self.busy -= 1
        if self.queue and self.busy < self.most:
            self._hand_over()

    def expire(self, now: float, timeout: float) -> None:
        """End the waits for a place that began ``timeout`` seconds or more before ``now``."""
        while self.queue and self.queue[0][1] <= now - timeout:
            future, _ = self.queue.popleft()
            if not future.done():
                future.set_result(False)

    def interrupt(self, task: "asyncio.Task[Any]", why: str) -> None:
        del self.waiting[task]
        self.interrupted[task] = why
        task.cancel()

    def _hand_over(self) -> None:
        """Give a place to a waiting call: the first, or the last once the first has waited
        ``stalled`` seconds."""
        queue = self.queue
        newest = queue[0][1] <= queue[0][0].get_loop().time() - self.stalled
        while queue:
            future, _ = queue.pop() if newest else queue.popleft()
            if not future.done():
                self.busy += 1
                future.set_result(True)
                return

    def _give_up_one(self) -> bool:
        """End a stalled call in a place (see the class); False when none is."""
        if self.relieve is not None and self.relieve():
            return True
        for task, since in self.waiting.items():  # the oldest only
            if task.get_loop().time() - since < self.stalled:
                return False
            self.interrupt(task, "evicted")
            return True
        return False

    def _serve_queue(self) -> None:
        while self.queue and (self.busy < self.most or self._give_up_one()):
            self._hand_over()

    def _check(self) -> None:
        self._checking = None
        self._serve_queue()
        if self.queue:
            self._checking = asyncio.get_running_loop().call_later(STALLED_CHECK, self._check)

    def _drop(self, entry: tuple["asyncio.Future[bool]", float]) -> None:
        with contextlib.suppress(ValueError):  # already taken off by the sweep
            self.queue.remove(entry)


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
        pool.waiting[task] = task.get_loop().time()  # the running loop's clock
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
        """Interrupt the calls past their deadline, and end the waits for a place as long,
        for as long as the server runs."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.timeout / 4)
            now = loop.time()
            for pool in self.pools:
                late = [t for t, since in pool.waiting.items() if since <= now - self.timeout]
                for task in late:
                    pool.interrupt(task, "read_timeout")
                pool.expire(now, self.timeout)


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
            if not pool.admit() and not await pool.wait_for_place():
                refused(pool.kind, "busy")
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, pool.detail)
            try:
                return await _serve(handler, original, unary_request, reader, pool, context)
            except TooSlow as slow:
                refused(pool.kind, slow.why)
                await context.abort(*reader.details(pool, slow))
            finally:
                pool.leave()

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
