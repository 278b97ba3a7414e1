"""Budgets per kind of call and the read deadline, on a real server process.

Before them one budget (--grpc-max-concurrent, 32) counted every open call: 32 idle RLQS
streams, or 32 calls that sent headers and never their message, made every rate-limit call
RESOURCE_EXHAUSTED for as long as they stayed open.
"""

import asyncio
import contextlib
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

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


async def _silence(release: asyncio.Event) -> AsyncIterator[bytes]:
    """A request stream that sends headers and no message until ``release`` is set."""
    await release.wait()
    if False:  # pragma: no cover  # an async generator that yields nothing
        yield b""


async def _code(call: "grpc.aio.Call") -> str:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return str(error.code().name)
    return "OK"


async def _ask(target: str, n: int) -> list[str]:
    """``n`` rate-limit calls, one after another on a fresh connection: their codes."""
    async with _channel(target) as channel:
        rls = channel.unary_unary(RLS)
        return [await _code(rls(REQUEST, timeout=1)) for _ in range(n)]


Stalled = tuple[list[grpc.aio.Channel], list["asyncio.Task[str]"]]


async def _stalled(
    target: str, method: str, count: int, release: asyncio.Event, channels: int
) -> Stalled:
    """``count`` calls of ``method`` that send headers only, spread over ``channels``
    connections; returns the channels and a task per call giving its final code."""
    opened = [_channel(target) for _ in range(channels)]
    for channel in opened:
        await channel.channel_ready()
    tasks = []
    for i in range(count):
        channel = opened[i % channels]
        if method == RLQS:
            call: grpc.aio.Call = channel.stream_stream(method)(_silence(release), timeout=30)

            async def finish(call: grpc.aio.Call = call) -> str:
                try:
                    async for _ in call:  # type: ignore[attr-defined]
                        pass
                except grpc.aio.AioRpcError as error:
                    return str(error.code().name)
                return "OK"

            tasks.append(asyncio.create_task(finish()))
        else:
            call = channel.stream_unary(method)(_silence(release), timeout=30)
            tasks.append(asyncio.create_task(_code(call)))
    await asyncio.sleep(0.5)  # every call has reached the server
    return opened, tasks


async def _close(channels: list[grpc.aio.Channel], release: asyncio.Event) -> None:
    release.set()
    for channel in channels:
        await channel.close()


def _refused(server: ServerProcess, kind: str) -> dict[str, float]:
    """fairlimit.rpc.refused for ``kind``, by reason, from the server's /metrics."""
    url = f"http://127.0.0.1:{server.admin_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "fairlimit_rpc_refused_total" and sample.labels.get("kind") == kind
    }


class TestBudgetsPerKind:
    def test_idle_rlqs_streams_and_stalled_health_checks_leave_rate_limit_calls_served(
        self, tmp_path: Path
    ) -> None:
        """40 RLQS streams and 8 health checks that never send a message, each on its own
        connection, stay open (a long read deadline); rate-limit calls are all answered."""
        server = _serve(tmp_path, "--grpc-read-timeout", "60")

        async def scenario() -> list[str]:
            release = asyncio.Event()
            streams, _ = await _stalled(server.target, RLQS, 40, release, channels=40)
            checks, _ = await _stalled(server.target, HEALTH, 8, release, channels=8)
            try:
                return await _ask(server.target, 50)
            finally:
                await _close(streams + checks, release)

        try:
            codes = asyncio.run(scenario())
        finally:
            server.stop()
        assert codes == ["OK"] * 50

    def test_calls_beyond_a_kinds_budget_are_refused_naming_its_flag(self, tmp_path: Path) -> None:
        """--rlqs-max-streams 3: a fourth stream is RESOURCE_EXHAUSTED at once, the message
        names the flag; rate-limit calls are served meanwhile."""
        server = _serve(tmp_path, "--rlqs-max-streams", "3", "--grpc-read-timeout", "60")

        async def scenario() -> tuple[str, str, list[str]]:
            release = asyncio.Event()
            streams, _ = await _stalled(server.target, RLQS, 3, release, channels=3)
            try:
                async with _channel(server.target) as channel:
                    call = channel.stream_stream(RLQS)(_silence(release), timeout=5)
                    try:
                        async for _ in call:
                            pass
                        refused = ("OK", "")
                    except grpc.aio.AioRpcError as error:
                        refused = (error.code().name, error.details() or "")
                return (*refused, await _ask(server.target, 5))
            finally:
                await _close(streams, release)

        try:
            code, detail, served = asyncio.run(scenario())
        finally:
            server.stop()
        assert code == "RESOURCE_EXHAUSTED"
        assert "--rlqs-max-streams" in detail
        assert served == ["OK"] * 5

    def test_one_connection_cannot_take_the_whole_budget(self, tmp_path: Path) -> None:
        """40 stalled rate-limit calls on one connection: HTTP/2 lets 16 of them open
        (--grpc-max-streams-per-connection), so calls on other connections are served."""
        server = _serve(tmp_path, "--grpc-read-timeout", "60")

        async def scenario() -> list[str]:
            release = asyncio.Event()
            hostile, _ = await _stalled(server.target, RLS, 40, release, channels=1)
            try:
                return await _ask(server.target, 20)
            finally:
                await _close(hostile, release)

        try:
            codes = asyncio.run(scenario())
        finally:
            server.stop()
        assert codes == ["OK"] * 20


class TestReadDeadline:
    def test_calls_without_a_message_end_at_the_read_deadline(self, tmp_path: Path) -> None:
        """40 rate-limit calls that send headers only, each on its own connection: those
        past the budget of 32 are RESOURCE_EXHAUSTED at once, the rest end with
        DEADLINE_EXCEEDED at --grpc-read-timeout (0.5 s); then calls are served again. The
        refusals are counted by kind and reason."""
        server = _serve(tmp_path, "--grpc-read-timeout", "0.5")

        async def scenario() -> tuple[list[str], list[str]]:
            release = asyncio.Event()
            hostile, tasks = await _stalled(server.target, RLS, 40, release, channels=40)
            try:
                codes = await asyncio.wait_for(asyncio.gather(*tasks), 10)
                return codes, await _ask(server.target, 5)
            finally:
                await _close(hostile, release)

        try:
            codes, after = asyncio.run(scenario())
            counted = _refused(server, "rls")
        finally:
            server.stop()
        assert sorted(codes) == ["DEADLINE_EXCEEDED"] * 32 + ["RESOURCE_EXHAUSTED"] * 8
        assert after == ["OK"] * 5
        assert counted == {"busy": 8, "read_timeout": 32}

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
