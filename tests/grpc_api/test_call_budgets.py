"""Budgets per kind of call and the read deadline, on a real server process.

Before them one budget (--grpc-max-concurrent, 32) counted every open call: 32 idle RLQS
streams, or 32 calls that sent headers and never their message, made every rate-limit call
RESOURCE_EXHAUSTED for as long as they stayed open.
"""

import asyncio
import contextlib
import functools
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.rate_limit_quota.v3 import rlqs_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from servers import ServerProcess

pytestmark = pytest.mark.process

RLS = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
RLQS = "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas"
HEALTH = "/grpc.health.v1.Health/Check"
D = ratelimit_pb2.RateLimitDescriptor
CONFIG = """\
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: minute, requests_per_unit: 1000}
"""
REQUEST = rls_pb2.RateLimitRequest(
    domain="edge", descriptors=[D(entries=[D.Entry(key="client_id", value="a")])]
).SerializeToString()
REPORT = rlqs_pb2.RateLimitQuotaUsageReports(domain="edge").SerializeToString()


def _serve(tmp_path: Path, *args: str) -> ServerProcess:
    config = tmp_path / "edge.yaml"
    config.write_text(CONFIG)
    return ServerProcess(["--config", str(config), *args])


def _channel(target: str) -> grpc.aio.Channel:
    """A channel with a connection of its own (channels with equal arguments share one)."""
    return grpc.aio.insecure_channel(target, [("grpc.use_local_subchannel_pool", 1)])


async def _silence(release: asyncio.Event, first: bytes | None = None) -> AsyncIterator[bytes]:
    """A request stream that sends headers (and ``first``, if given), then nothing until
    ``release`` is set."""
    if first is not None:
        yield first
    await release.wait()


async def _code(call: "grpc.aio.Call") -> str:
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:  # type: ignore[attr-defined]
                pass
        else:
            await call
    except grpc.aio.AioRpcError as error:
        return str(error.code().name)
    return "OK"


async def _ask(target: str, n: int) -> list[str]:
    """``n`` rate-limit calls, one after another on a fresh connection: their codes."""
    async with _channel(target) as channel:
        rls = channel.unary_unary(RLS)
        return [await _code(rls(REQUEST, timeout=1)) for _ in range(n)]


def _refused(server: ServerProcess, kind: str) -> dict[str, float]:
    """fairlimit.rpc.refused for ``kind``, by reason."""
    samples = server.samples("fairlimit_rpc_refused_total")
    return {labels["reason"]: value for labels, value in samples if labels["kind"] == kind}


def _in_progress(server: ServerProcess) -> dict[str, float]:
    """fairlimit.rpc.in_progress by kind."""
    samples = server.samples("fairlimit_rpc_in_progress")
    return {labels["kind"]: value for labels, value in samples}


async def _until(condition: Callable[[], bool], what: Callable[[], object]) -> None:
    """Wait (10 s at most) until ``condition()`` holds; ``what()`` says what was seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"still {what()}")
        await asyncio.sleep(0.02)


KINDS = {RLS: "rls", RLQS: "rlqs", HEALTH: "other"}
Stalled = tuple[list[grpc.aio.Channel], list["asyncio.Task[str]"]]


async def _stalled(
    server: ServerProcess,
    method: str,
    count: int,
    release: asyncio.Event,
    *,
    channels: int,
    held: int,
    first: bytes | None = None,
) -> Stalled:
    """``count`` calls of ``method`` that send headers only (or ``first`` and no more),
    spread over ``channels`` connections; returns once ``held`` calls of that kind are in
    progress, with the channels and a task per call giving its final code."""
    opened = [_channel(server.target) for _ in range(channels)]
    for channel in opened:
        await channel.channel_ready()
    tasks = []
    for i in range(count):
        channel = opened[i % channels]
        open_call = channel.stream_stream if method == RLQS else channel.stream_unary
        call = open_call(method)(_silence(release, first), timeout=30)
        tasks.append(asyncio.create_task(_code(call)))
    kind = KINDS[method]
    await _until(lambda: _in_progress(server).get(kind) == held, lambda: _in_progress(server))
    return opened, tasks


async def _close(
    channels: list[grpc.aio.Channel], release: asyncio.Event, tasks: list["asyncio.Task[str]"]
) -> list[str]:
    """Let the stalled calls go on (those still open end their request stream), wait for
    their codes, then close their connections."""
    release.set()
    try:
        return await asyncio.wait_for(asyncio.gather(*tasks), 10)
    finally:
        for channel in channels:
            await channel.close()


async def _drop(channels: list[grpc.aio.Channel], tasks: list["asyncio.Task[str]"]) -> None:
    """Close the stalled calls' connections; how the calls end is not under test."""
    for channel in channels:
        await channel.close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class TestBudgetsPerKind:
    def test_idle_rlqs_streams_and_stalled_health_checks_leave_rate_limit_calls_served(
        self, tmp_path: Path
    ) -> None:
        """40 RLQS streams and 8 health checks that never send a message, each on its own
        connection, stay open (a long read deadline); rate-limit calls are all answered."""
        server = _serve(tmp_path, "--grpc-read-timeout", "60")

        async def scenario() -> list[str]:
            release = asyncio.Event()
            streams, waiting = await _stalled(server, RLQS, 40, release, channels=40, held=40)
            checks, stalled = await _stalled(server, HEALTH, 8, release, channels=8, held=8)
            try:
                return await _ask(server.target, 50)
            finally:
                await _drop(streams + checks, waiting + stalled)

        try:
            codes = asyncio.run(scenario())
        finally:
            server.stop()
        assert codes == ["OK"] * 50

    def test_calls_beyond_a_kinds_budget_are_refused_naming_its_flag(self, tmp_path: Path) -> None:
        """--rlqs-max-streams 3, three streams that have reported: a fourth stream is
        RESOURCE_EXHAUSTED at once, the message names the flag; rate-limit calls are served
        meanwhile."""
        server = _serve(tmp_path, "--rlqs-max-streams", "3")

        async def scenario() -> tuple[str, str, list[str]]:
            release = asyncio.Event()
            streams, tasks = await _stalled(
                server, RLQS, 3, release, channels=3, held=3, first=REPORT
            )
            try:
                async with _channel(server.target) as channel:
                    # headers only: the refusal comes before anything is read, and a report
                    # still being written when it came made grpc's client answer INTERNAL
                    # ("Internal error from Core") now and then, main's code as this
                    call = channel.stream_stream(RLQS)(_silence(release), timeout=5)
                    refused = (await _code(call), await call.details() or "")
                return (*refused, await _ask(server.target, 5))
            finally:
                await _drop(streams, tasks)

        try:
            code, detail, served = asyncio.run(scenario())
        finally:
            server.stop()
        assert code == "RESOURCE_EXHAUSTED"
        assert "--rlqs-max-streams" in detail
        assert served == ["OK"] * 5

    def test_one_connection_takes_no_more_than_the_budget(self, tmp_path: Path) -> None:
        """No stream limit per connection by default: 40 stalled rate-limit calls on one
        connection hold the budget's 32 places, the first 8 gave theirs up, and calls on
        another connection are all served (the first takes a stalled call's place)."""
        server = _serve(tmp_path, "--grpc-read-timeout", "60")

        async def scenario() -> tuple[list[str], dict[str, float]]:
            release = asyncio.Event()
            hostile, tasks = await _stalled(server, RLS, 40, release, channels=1, held=32)
            evicted = functools.partial(_refused, server, "rls")
            await _until(lambda: evicted().get("evicted") == 8, evicted)  # all 40 are in
            try:
                return await _ask(server.target, 5), _refused(server, "rls")
            finally:
                await _drop(hostile, tasks)

        try:
            served, refused = asyncio.run(scenario())
        finally:
            server.stop()
        assert served == ["OK"] * 5
        assert refused == {"busy": 0, "evicted": 9}

    def test_many_calls_at_once_on_a_fresh_connection_are_all_answered(
        self, tmp_path: Path
    ) -> None:
        """100 rate-limit calls at once on one channel, four times, on five fresh channels:
        each is answered. A stream limit per connection (16 before issue 37) reset the
        streams a fresh connection opened past it before reading it (UNAVAILABLE,
        RST_STREAM error code 7)."""
        server = _serve(tmp_path)

        async def scenario() -> Counter[str]:
            codes: Counter[str] = Counter()
            for _ in range(5):
                async with _channel(server.target) as channel:
                    rls = channel.unary_unary(RLS)
                    for _ in range(4):
                        calls = [_code(rls(REQUEST, timeout=30)) for _ in range(100)]
                        codes.update(await asyncio.gather(*calls))
            return codes

        try:
            codes = asyncio.run(scenario())
        finally:
            server.stop()
        assert codes == {"OK": 2000}

    def test_a_stream_limit_set_holds_one_connection_to_it(self, tmp_path: Path) -> None:
        """--grpc-max-streams-per-connection 16 (an operator's choice), 40 stalled
        rate-limit calls on one connection that has read the limit, under a budget of 100:
        HTTP/2 lets 16 of them open; the rest wait at the client."""
        server = _serve(
            tmp_path, "--grpc-read-timeout", "60", "--grpc-max-concurrent", "100",
            "--grpc-max-streams-per-connection", "16",
        )  # fmt: skip

        async def scenario() -> tuple[float, list[str]]:
            release = asyncio.Event()
            hostile, tasks = await _stalled(server, RLS, 40, release, channels=1, held=16)
            try:
                served = await _ask(server.target, 5)
                return _in_progress(server)["rls"], served
            finally:
                await _drop(hostile, tasks)

        try:
            held, served = asyncio.run(scenario())
        finally:
            server.stop()
        assert held == 16
        assert served == ["OK"] * 5


class TestReadDeadline:
    def test_calls_waiting_for_their_message_give_their_place_to_new_calls(
        self, tmp_path: Path
    ) -> None:
        """40 rate-limit calls that send headers only, each on its own connection, fill the
        budget of 32 (a long read deadline): each new call takes the place of the one that
        has waited longest for its message, which ends RESOURCE_EXHAUSTED. Real calls are
        all served; the stalled ones left end INVALID_ARGUMENT when they close unsent (the
        8 evictions come within milliseconds)."""
        server = _serve(tmp_path, "--grpc-read-timeout", "60")

        async def scenario() -> tuple[list[str], list[str]]:
            release = asyncio.Event()
            hostile, tasks = await _stalled(server, RLS, 40, release, channels=40, held=32)
            evicted = functools.partial(_refused, server, "rls")
            await _until(lambda: evicted().get("evicted") == 8, evicted)  # all 40 are in
            try:
                served = await _ask(server.target, 20)
            finally:
                codes = await _close(hostile, release, tasks)
            return served, codes

        try:
            served, codes = asyncio.run(scenario())
            counted = _refused(server, "rls")
        finally:
            server.stop()
        assert served == ["OK"] * 20
        # the first real call found the budget full: it took a place, then gave it back
        assert sorted(codes) == ["INVALID_ARGUMENT"] * 31 + ["RESOURCE_EXHAUSTED"] * 9
        assert counted == {"busy": 0, "evicted": 9}

    def test_a_new_call_in_a_full_budget_ends_the_oldest_stalled_call(self, tmp_path: Path) -> None:
        """A budget of 4 filled by 4 stalled rate-limit calls opened one after another: a
        fifth ends the oldest at once with RESOURCE_EXHAUSTED, and the three younger stay
        open (once given an end of stream they end INVALID_ARGUMENT, unsent), as does the
        fifth. Evicting the youngest instead would shed the call a slow client is about to
        complete, and keep the one most likely dead."""
        server = _serve(tmp_path, "--grpc-read-timeout", "60", "--grpc-max-concurrent", "4")

        async def scenario() -> tuple[list[str], list[bool], dict[str, float]]:
            release = asyncio.Event()
            channels: list[grpc.aio.Channel] = []
            tasks: list[asyncio.Task[str]] = []
            try:
                for held in range(1, 6):  # one at a time: their order is known
                    opened, started = await _stalled(
                        server, RLS, 1, release, channels=1, held=min(held, 4)
                    )
                    channels += opened
                    tasks += started
                evicted = functools.partial(_refused, server, "rls")
                await _until(lambda: evicted().get("evicted") == 1, evicted)
                await asyncio.wait(tasks, timeout=10, return_when=asyncio.FIRST_COMPLETED)
                done = [task.done() for task in tasks]
                counted = _refused(server, "rls")
            except BaseException:
                await _drop(channels, tasks)
                raise
            return await _close(channels, release, tasks), done, counted

        try:
            codes, done, counted = asyncio.run(scenario())
        finally:
            server.stop()
        assert done == [True, False, False, False, False]
        assert codes == ["RESOURCE_EXHAUSTED"] + ["INVALID_ARGUMENT"] * 4
        assert counted == {"busy": 0, "evicted": 1}

    def test_calls_without_a_message_end_at_the_read_deadline(self, tmp_path: Path) -> None:
        """40 rate-limit calls that send headers only, each on its own connection: 8 take
        the places of the first 8, the other 32 end with DEADLINE_EXCEEDED at
        --grpc-read-timeout (0.5 s); then calls are served again. Each is counted by kind
        and reason."""
        server = _serve(tmp_path, "--grpc-read-timeout", "0.5")

        async def scenario() -> tuple[list[str], list[str]]:
            release = asyncio.Event()
            hostile, tasks = await _stalled(server, RLS, 40, release, channels=40, held=0)
            codes = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            await _close(hostile, release, [])
            return codes, await _ask(server.target, 5)

        try:
            codes, after = asyncio.run(scenario())
            counted = _refused(server, "rls")
        finally:
            server.stop()
        assert sorted(codes) == ["DEADLINE_EXCEEDED"] * 32 + ["RESOURCE_EXHAUSTED"] * 8
        assert after == ["OK"] * 5
        assert counted == {"busy": 0, "evicted": 8, "read_timeout": 32}

    @pytest.mark.parametrize("method", [RLQS, HEALTH])
    def test_every_kind_of_call_has_the_read_deadline(self, tmp_path: Path, method: str) -> None:
        """An RLQS stream or a health check that sends no message ends with
        DEADLINE_EXCEEDED, naming the flag; one that does is served."""
        server = _serve(tmp_path, "--grpc-read-timeout", "0.5")

        async def scenario() -> tuple[str, str]:
            async with _channel(server.target) as channel:
                release = asyncio.Event()
                if method == RLQS:
                    call = channel.stream_stream(method)(_silence(release), timeout=10)
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        async for _ in call:
                            pass
                else:
                    call = channel.stream_unary(method)(_silence(release), timeout=10)
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await call
                release.set()
                return (await call.code()).name, await call.details() or ""

        async def served() -> str:
            async with _channel(server.target) as channel:
                if method == HEALTH:
                    check = channel.unary_unary(
                        method, response_deserializer=health_pb2.HealthCheckResponse.FromString
                    )
                    reply = await check(health_pb2.HealthCheckRequest().SerializeToString())
                    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
                stream = channel.stream_stream(method)

                async def one_report() -> AsyncIterator[bytes]:
                    yield REPORT
                    await asyncio.sleep(1.0)  # open past the read deadline, then half-close

                call = stream(one_report(), timeout=10)
                async for _ in call:
                    pass
                return str((await call.code()).name)

        try:
            code, detail = asyncio.run(scenario())
            answer = asyncio.run(served())
        finally:
            server.stop()
        assert code == "DEADLINE_EXCEEDED"
        assert "--grpc-read-timeout" in detail
        assert answer == ("SERVING" if method == HEALTH else "OK")
