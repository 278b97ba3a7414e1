"""The RateLimitService servicer and the grpc.aio server around it."""

import asyncio
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from opentelemetry.trace import INVALID_SPAN, Span, StatusCode

from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit.core.admission import Code
from fairlimit.errors import RequestError, StoreUnavailable
from fairlimit.flows.decision import Decision
from fairlimit.grpc_api import guards, lenient
from fairlimit.grpc_api.convert import Reply, request_from_proto, response_to_proto
from fairlimit.grpc_api.headers import ResponseOptions, add_extras
from fairlimit.grpc_api.rlqs import RLQS_SERVICE, QuotaServicer
from fairlimit.grpc_api.tls import TlsFiles
from fairlimit.limiter import Limiter, Prepared
from fairlimit.quota import QuotaService
from fairlimit.settings import Settings
from fairlimit.telemetry import Telemetry

log = logging.getLogger(__name__)

RLS_SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
# gRPC health names: the server, the RLS service, and "ratelimit", envoyproxy/ratelimit's
# name, which its users' probes ask for.
HEALTH_NAMES = ("", RLS_SERVICE, "ratelimit")

# Our errors -> gRPC codes, in one place. A backend failure is UNAVAILABLE, never UNKNOWN:
# Envoy's ratelimit filter lets a call through on UNKNOWN whatever failure_mode_deny says,
# while UNAVAILABLE leaves the verdict to failure_mode_deny as the operator configured it.
_STATUS_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (RequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (StoreUnavailable, grpc.StatusCode.UNAVAILABLE),
)
RLS_KIND = "rls"  # the budgets' names in the refused metric
RLS_WHAT = "rate-limit calls (--grpc-max-concurrent)"  # ... in refusals
RLQS_WHAT = "RLQS streams (--rlqs-max-streams)"
OTHER_WHAT = "health or reflection calls"
_SPAN = f"{RLS_SERVICE}/ShouldRateLimit"  # the RPC span name of OpenTelemetry's conventions
_SPAN_ATTRIBUTES = {
    "rpc.system": "grpc",
    "rpc.service": RLS_SERVICE,
    "rpc.method": "ShouldRateLimit",
}
_FAILED = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)  # the server's fault
# Envoy sends the same bytes for a client on a route again and again: parsing, validating and
# planning them is a third of our work per call, and pure of time, so it is kept by payload.
# Emptied when full (a dict lookup is all a miss adds); 4096 entries of ~2.5 kB at most
# (with the payload's reply: convert.Reply).
PREPARED_CACHE_SIZE = 4096
# Only payloads this small are kept: Envoy's requests are a few hundred bytes, and distinct
# requests near the bounds (2 MB each) would otherwise be kept 4096 at a time (+6 MB each).
PREPARED_MAX_BYTES = 1024
# A drain stops the grpc server only once no call has started for SETTLE_QUIET seconds and
# no rate-limit call is in progress: grpc's stop cancels the calls that have reached the
# server but that its loop has not taken up yet (40 calls sent 10 ms before a SIGTERM: 30
# ended CANCELLED), and a busy loop takes them up one at a time. The quiet counts only
# while the process runs: a step that woke SETTLE_LAG late means it did not (a loaded
# machine), and calls that came meanwhile may not be taken up yet, so the quiet starts
# again (at 0.1 s and without it, a drain on a machine at a load of 26 on 2 cores stopped
# the server with 15 calls sent to it and not taken up: they ended CANCELLED).
SETTLE_QUIET = 0.25
SETTLE_STEP = 0.01
SETTLE_LAG = 0.02
STOP_GRACE = 1.0  # of the drain's grace, what is kept for grpc's stop, at the least
_Failure = tuple[grpc.StatusCode, str]
_Answered = tuple[bytes, str]  # the response's bytes and its overall code's name
# the parsed request (read-only), its plan, the message its responses are written in, and
# whether it was seen again (its decision in one step then added: Limiter.quicken)
_Kept = tuple[rls_pb2.RateLimitRequest, Prepared, Reply, bool]


_CODE_NAMES = {
    value.number: value.name for value in rls_pb2.RateLimitResponse.Code.DESCRIPTOR.values
}  # what RateLimitResponse.Code.Name gives, without its lookups per call


_OK_NAME = _CODE_NAMES[rls_pb2.RateLimitResponse.OK]
_OVER_NAME = _CODE_NAMES[rls_pb2.RateLimitResponse.OVER_LIMIT]


def _result(answer: _Answered | _Failure) -> str:
    """The call's result for the span and the latency metric: a code's name."""
    code = answer[0]
    return answer[1] if isinstance(code, bytes) else str(code.name)


class RateLimitServicer:
    """ShouldRateLimit through the limiter; every failure becomes a definite status.

    The request arrives as bytes and is parsed here: grpc would answer UNKNOWN for a payload
    it cannot deserialize, and Envoy lets UNKNOWN through; a corrupt request is our
    INVALID_ARGUMENT.
    """

    def __init__(
        self,
        limiter: Limiter,
        telemetry: Telemetry,
        options: ResponseOptions | None = None,
        pool: guards.Pool | None = None,
        reader: guards.Reader | None = None,
    ) -> None:
        self.limiter = limiter
        budgets = guards.Budgets.of(Settings())
        self.pool = pool or guards.Pool(RLS_KIND, budgets.rls, RLS_WHAT)
        self.reader = reader or guards.Reader(budgets.read_timeout)
        self.telemetry = telemetry  # spans and the latency metric; the limiter counts hits
        # the calls past their message: a full budget gives up the longest store wait of one
        self._deciding: set[asyncio.Task[Any]] = set()
        self.pool.relieve = functools.partial(limiter.policy.relieve, self._deciding)
        self._prepared: dict[bytes, _Kept] = {}
        self.options = options or ResponseOptions()

    def handler(self) -> grpc.GenericRpcHandler:
        # A stream of one on the server's side (the same bytes on the wire): the handler
        # starts as the call does, so it can give up on a message that does not come.
        method = grpc.stream_unary_rpc_method_handler(
            self.ShouldRateLimit,
            request_deserializer=None,
            response_serializer=None,  # serialized here (convert.Reply)
        )
        return grpc.method_handlers_generic_handler(RLS_SERVICE, {"ShouldRateLimit": method})

    async def ShouldRateLimit(  # the name is the RPC's
        self, _: object, context: grpc.aio.ServicerContext
    ) -> bytes:
        """The serialized RateLimitResponse: one span per call, its parent the W3C context
        Envoy sends in the metadata.

        Where no tracer provider records spans (no OTLP traces endpoint), the context is not
        extracted and no span is made: nothing would read either, and it costs ~15 µs a call.
        """
        pool = self.pool
        if not pool.admit() and not await pool.wait_for_place():
            self.telemetry.refused(RLS_KIND, "busy")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, pool.detail)
        task = asyncio.current_task()
        try:
            try:
                payload = await self.reader.first(context, pool, task)
            except guards.TooSlow as slow:
                self.telemetry.refused(RLS_KIND, slow.why)
                await context.abort(*self.reader.details(pool, slow))
            if payload is grpc.aio.EOF:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
            telemetry = self.telemetry
            started = time.perf_counter()
            if task is not None:
                self._deciding.add(task)
            if telemetry.tracing:
                answer, result = await self._traced(payload, context)
            else:
                answer = await self._answer(payload, INVALID_SPAN, context.time_remaining())
                result = _result(answer)
            telemetry.rpc_finished(time.perf_counter() - started, result)
        finally:
            pool.leave()
            if task is not None:
                self._deciding.discard(task)
        code = answer[0]
        if not isinstance(code, bytes):
            await context.abort(code, answer[1])
            raise AssertionError("unreachable: abort raises")
        return code

    async def _traced(
        self, payload: bytes, context: grpc.aio.ServicerContext
    ) -> tuple[_Answered | _Failure, str]:
        carrier = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        with self.telemetry.rpc_span(_SPAN, carrier, _SPAN_ATTRIBUTES) as span:
            answer = await self._answer(payload, span, context.time_remaining())
            result = _result(answer)
            if answer[0] in _FAILED:
                span.set_status(StatusCode.ERROR, answer[1])
            span.set_attribute("ratelimit.result", result)
        return answer, result

    async def _answer(
        self, payload: bytes, span: Span, remaining: float | None
    ) -> _Answered | _Failure:
        """The response's bytes and its code's name, or the status code and message to
        abort with; ``remaining`` is the seconds left until the call's deadline
        (grpc-timeout), None without one."""
        kept = self._prepared.get(payload)
        if kept is None or not self.limiter.current(kept[1]):
            try:
                kept = self._prepare(payload, span)
            except DecodeError as exc:
                return grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}"
            except RequestError as exc:
                return grpc.StatusCode.INVALID_ARGUMENT, str(exc) or type(exc).__name__
        else:
            if span.is_recording():
                _describe(span, kept[0])
            if not kept[3]:  # seen again: worth its one step
                again = self.limiter.quicken(kept[1])
                kept = self._prepared[payload] = (kept[0], again, kept[2], True)
        request, prepared, reply, _ = kept
        quick = prepared.fast
        try:
            # in one step (flows/fast.py), unless the call is to be shed, traced or given
            # headers; its failures are the generic path's (INTERNAL, logged)
            if (
                quick is not None
                and span is INVALID_SPAN
                and not self.options.any
                and (remaining is None or remaining > 0)
            ):
                answer = quick.decide(self.limiter.clock.now())
                if isinstance(answer, Decision):  # from a lease block (flows/fast.py)
                    return reply.decision(answer), _name(answer)
                if answer is not None:
                    assert quick.reported is not None  # a plan of plain counters'
                    return reply.answer(quick.reported, answer), (
                        _OVER_NAME if answer[0] else _OK_NAME
                    )
            decision = await self.limiter.decide(prepared, remaining)
        except Exception as exc:
            code = next((c for kind, c in _STATUS_CODES if isinstance(exc, kind)), None)
            if code is None:
                log.exception("ShouldRateLimit failed")
                code = grpc.StatusCode.INTERNAL
            return code, str(exc) or type(exc).__name__
        span.set_attribute("ratelimit.backend_seconds", decision.backend_seconds)
        if not self.options.any:
            return reply.decision(decision), _name(decision)
        response = response_to_proto(decision, self.options.rule_names)
        add_extras(response, request, decision.statuses, self.options)
        return response.SerializeToString(), _name(decision)

    def _prepare(self, payload: bytes, span: Span) -> _Kept:
        """Parse, validate and plan ``payload`` (DecodeError, RequestError); kept for reuse."""
        request = lenient.request(payload)  # values that are no UTF-8: a client's header bytes
        _describe(span, request)
        # no one-step decision yet: at a public edge many payloads are seen once (a client
        # that asks once), and making one cost such a request on Redis about 6% of its CPU
        prepared = self.limiter.prepare(request_from_proto(request), quick=False)
        kept = (request, prepared, Reply(self.options.rule_names), False)
        if len(payload) <= PREPARED_MAX_BYTES and prepared.reusable:
            if len(self._prepared) >= PREPARED_CACHE_SIZE:
                self._prepared.clear()
            self._prepared[payload] = kept
        return kept


def _name(decision: Decision) -> str:
    """The name of ``decision``'s overall code in the response."""
    return _OVER_NAME if decision.code is Code.OVER_LIMIT else _OK_NAME


def _describe(span: Span, request: rls_pb2.RateLimitRequest) -> None:
    span.set_attribute("ratelimit.domain", request.domain)
    span.set_attribute("ratelimit.descriptor_count", len(request.descriptors))


class GrpcServer:
    """The gRPC server: RLS, RLQS (given a quota service), health (NOT_SERVING while
    draining) and reflection."""

    def __init__(
        self,
        limiter: Limiter,
        telemetry: Telemetry,
        address: str,
        tls: TlsFiles | None = None,
        reuse_port: bool = False,
        options: ResponseOptions | None = None,
        max_age: tuple[float | None, float | None] = (None, None),
        quota: QuotaService | None = None,
        *,
        budgets: guards.Budgets | None = None,
    ) -> None:
        budgets = budgets or guards.Budgets.of(Settings())
        # SO_REUSEPORT only where workers share the port on purpose: otherwise a second server
        # on a busy port must fail to bind rather than quietly take half of its connections.
        server_options = [("grpc.so_reuseport", int(reuse_port)), *guards.server_options(budgets)]
        # upstream's GRPC_MAX_CONNECTION_AGE(_GRACE): clients reconnect (and re-resolve)
        for name, seconds in zip(("max_connection_age", "max_connection_age_grace"), max_age,
                                 strict=True):  # fmt: skip
            if seconds is not None:
                server_options.append((f"grpc.{name}_ms", int(seconds * 1000)))
        self.server = grpc.aio.server(options=server_options)
        self.reader = guards.Reader(budgets.read_timeout)
        self._sweep: asyncio.Task[None] | None = None
        self.options = options or ResponseOptions()  # /json adds the same parts
        rls_pool = guards.Pool(RLS_KIND, budgets.rls, RLS_WHAT)
        servicer = RateLimitServicer(limiter, telemetry, self.options, rls_pool, self.reader)
        self.server.add_generic_rpc_handlers((servicer.handler(),))  # first: the hot path
        self.quota = None if quota is None else QuotaServicer(quota)
        self.health = health.aio.HealthServicer()
        names = (
            rls_pb2.DESCRIPTOR.services_by_name["RateLimitService"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
            *((RLQS_SERVICE,) if quota is not None else ()),
        )
        # The other services, each under its kind's budget and the read deadline.
        other = _Collected()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, other)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            reflection.aio.ReflectionServicer(names), other
        )
        other_pool = guards.Pool("other", budgets.other, OTHER_WHAT)  # health and reflection
        guarded = [(handler, other_pool) for handler in other.handlers]
        if self.quota is not None:
            rlqs_pool = guards.Pool("rlqs", budgets.rlqs, RLQS_WHAT, queued=0)
            guarded.insert(0, (self.quota.handler(), rlqs_pool))
        self.server.add_generic_rpc_handlers(
            [guards.Guarded(h, pool, self.reader, telemetry.refused) for h, pool in guarded]
        )
        pools = self.reader.pools = [rls_pool, *{id(p): p for _, p in guarded}.values()]
        self._pools = pools
        telemetry.count_calls(lambda: [(pool.kind, pool.busy) for pool in pools])
        if tls is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, tls.credentials())
        if self.port == 0:
            raise OSError(f"cannot bind gRPC address {address}")

    async def start(self) -> None:
        await self.server.start()
        self._sweep = asyncio.create_task(self.reader.sweep())
        for name in HEALTH_NAMES:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def set_serving(self, serving: bool) -> None:
        """Health SERVING or NOT_SERVING (no domain loaded yet, with --healthy-with-config)."""
        status = health_pb2.HealthCheckResponse
        for name in HEALTH_NAMES:
            await self.health.set(name, status.SERVING if serving else status.NOT_SERVING)

    async def drain(self, grace: float) -> None:
        """Say NOT_SERVING, answer every call that reached the server, stop: all within
        ``grace`` seconds.

        Calls are served until they stop coming (``_settle``), so that none is waiting to
        be taken up when grpc's stop cancels those; then stop lets the calls in progress
        finish in what is left of ``grace`` (STOP_GRACE at the least).
        """
        loop = asyncio.get_running_loop()
        end = loop.time() + grace
        for name in HEALTH_NAMES:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.quota is not None:
            self.quota.end_streams()  # long-lived: they would hold the whole grace period
        await self._settle(end - min(STOP_GRACE, grace))
        if self.quota is not None:
            self.quota.end_streams()  # opened while settling
        await self.server.stop(max(end - loop.time(), min(STOP_GRACE, grace)))
        if self._sweep is not None:
            self._sweep.cancel()

    async def _settle(self, until: float) -> None:
        """Wait until no call has started for SETTLE_QUIET seconds of the process running
        and no rate-limit call is in progress (the loop has taken up every call that came),
        or until ``until``."""
        loop = asyncio.get_running_loop()
        rls = self._pools[0]
        seen, quiet_since = -1, loop.time()
        while (now := loop.time()) < until:
            started = sum(pool.started for pool in self._pools)
            if started != seen or rls.busy or rls.queue:
                seen, quiet_since = started, now
            elif now - quiet_since >= SETTLE_QUIET:
                return
            await asyncio.sleep(min(SETTLE_STEP, max(until - now, 0.0)))
            if loop.time() - now > SETTLE_STEP + SETTLE_LAG:
                quiet_since = loop.time()  # the process did not run: calls may wait unseen

    async def wait(self) -> None:
        await self.server.wait_for_termination()


class _Collected:
    """Where a generated add_*_to_server function registers its service: the handlers are
    kept, to be put under a budget before the server gets them."""

    def __init__(self) -> None:
        self.handlers: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.handlers.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: object) -> None:
        """Not kept: the generic handler of the same service serves the same methods."""
