"""A stalled Redis under load: every call is answered by the failure mode (issue 38).

A stopped Redis fails nothing until each call's timeout has passed. The calls waiting on it
held their places in --grpc-max-concurrent and in their connection's streams, so new calls
were refused: with --failure-mode open, 7-8% of the answers during a 3 s SIGSTOP at 200
calls/s were RESOURCE_EXHAUSTED or UNAVAILABLE (a refused stream), and 5.8-9.6% under
repeated 300 ms stalls. Through a real server process, a real redis-server stopped with
SIGSTOP, and a real gRPC client on 4 connections, as Envoy's workers open several.
"""

import asyncio
import os
import signal
from collections import Counter
from pathlib import Path

import aiohttp
import grpc
import pytest

from envoy_proxy import envoy_in_front, http_get
from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from redis_servers import RedisProcess
from servers import ServerProcess

pytestmark = pytest.mark.process

METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
D = ratelimit_pb2.RateLimitDescriptor
CONFIG = """\
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: second, requests_per_unit: 1000}
"""
RATE = 200  # calls a second, open loop: a call is sent on time whatever the others do
CONNECTIONS = 4
# each call's grpc-timeout, seconds: past 0.25 s the server waits on the store no longer
# (store/deadline.py), so 2 s gets what 1 s does from the server, and leaves room for a test
# process starved on a loaded machine
DEADLINE = 2.0
# What the failure mode answers: open OK, closed UNAVAILABLE (its message from the server,
# not a refused stream's), local this process's part (OK or OVER_LIMIT)
ANSWERS = {"open": {"OK"}, "closed": {"OK", "UNAVAILABLE"}, "local": {"OK", "OVER_LIMIT"}}


def _request(client: int) -> bytes:
    entry = D.Entry(key="client_id", value=f"c{client}")
    request = rls_pb2.RateLimitRequest(domain="edge", descriptors=[D(entries=[entry])])
    return request.SerializeToString()


async def _call(channel: grpc.aio.Channel, payload: bytes) -> tuple[str, str]:
    """The call's code and, for a failure, its details."""
    try:
        reply = await channel.unary_unary(METHOD)(payload, timeout=DEADLINE)
    except grpc.aio.AioRpcError as error:
        return str(error.code().name), str(error.details())
    code = rls_pb2.RateLimitResponse.FromString(reply).overall_code
    return str(rls_pb2.RateLimitResponse.Code.Name(code)), ""


async def _connected(channel: grpc.aio.Channel) -> None:
    """Once ``channel``'s call is answered OK (before the fault), for 30 s at most: the
    server's first call to Redis opens a connection within the backend's 15 ms timeout,
    which a loaded machine can miss (under ``closed`` an UNAVAILABLE answer)."""
    deadline = asyncio.get_running_loop().time() + 30
    answered = await _call(channel, _request(0))
    while answered[0] != "OK" and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)  # a bounded poll of the server, not a wait for time to pass
        answered = await _call(channel, _request(0))
    assert answered[0] == "OK", answered


async def _under_load(target: str, fault: "asyncio.Task[None]") -> list[tuple[str, str]]:
    """RATE calls a second over CONNECTIONS (20 clients in turn) until ``fault`` is done
    and 0.3 s more; every call's code and details."""
    loop = asyncio.get_running_loop()
    options = [("grpc.use_local_subchannel_pool", 1)]  # a connection of each channel's own
    channels = [grpc.aio.insecure_channel(target, options) for _ in range(CONNECTIONS)]
    try:
        for channel in channels:
            await _connected(channel)
        calls: list[asyncio.Task[tuple[str, str]]] = []
        start, end = loop.time(), None
        while end is None or loop.time() < end:
            if end is None and fault.done():
                end = loop.time() + 0.3
            channel = channels[len(calls) % CONNECTIONS]
            calls.append(asyncio.create_task(_call(channel, _request(len(calls) % 20))))
            await asyncio.sleep(max(0.0, start + len(calls) / RATE - loop.time()))
            assert len(calls) < 60 * RATE, "the fault never ended"
        await fault
        return list(await asyncio.gather(*calls))
    finally:
        for channel in channels:
            await channel.close()


async def _stop(redis: RedisProcess, after: float, seconds: float, times: int = 1) -> None:
    """SIGSTOP ``redis`` for ``seconds``, ``times`` times, ``after`` seconds apart."""
    assert redis.proc is not None
    for _ in range(times):
        await asyncio.sleep(after)
        os.kill(redis.proc.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            os.kill(redis.proc.pid, signal.SIGCONT)


def _serve(tmp_path: Path, redis: RedisProcess, mode: str) -> ServerProcess:
    config = tmp_path / "edge.yaml"
    config.write_text(CONFIG)
    return ServerProcess(["--config", str(config), "--backend", redis.url,
                          "--failure-mode", mode, "--replicas", "1"])  # fmt: skip


def _check(answers: list[tuple[str, str]], mode: str) -> Counter[str]:
    codes = Counter(code for code, _ in answers)
    assert set(codes) <= ANSWERS[mode], (codes, Counter(d for _, d in answers))
    refused = [details for code, details in answers if "RST_STREAM" in details]
    assert not refused, f"{len(refused)} streams refused: {refused[:3]}"
    return codes


class TestStalledRedis:
    @pytest.mark.parametrize("mode", ["open", "closed", "local"])
    async def test_a_stopped_redis_is_answered_by_the_failure_mode(
        self, redis_process: RedisProcess, tmp_path: Path, mode: str
    ) -> None:
        """Redis SIGSTOPped for 3 s under 200 calls/s with a 2 s deadline: every answer is
        the failure mode's (open: all OK), none RESOURCE_EXHAUSTED, refused or late."""
        server = _serve(tmp_path, redis_process, mode)
        try:
            fault = asyncio.create_task(_stop(redis_process, 0.5, 3.0))
            answers = await _under_load(server.target, fault)
        finally:
            server.stop()
        codes = _check(answers, mode)
        assert sum(codes.values()) > 2 * RATE  # the load went on through the stop
        if mode == "closed":
            assert codes["UNAVAILABLE"] > 0  # the backend's failure, not a refusal

    async def test_repeated_short_stalls_are_answered_ok_when_failing_open(
        self, redis_process: RedisProcess, tmp_path: Path
    ) -> None:
        """Ten 300 ms stalls, 300 ms apart, under 200 calls/s: every answer OK (5.8-9.6%
        were RESOURCE_EXHAUSTED)."""
        server = _serve(tmp_path, redis_process, "open")
        try:
            fault = asyncio.create_task(_stop(redis_process, 0.3, 0.3, times=10))
            answers = await _under_load(server.target, fault)
        finally:
            server.stop()
        assert _check(answers, "open") == {"OK": len(answers)}


async def _http_under_load(url: str, fault: "asyncio.Task[None]") -> list[int]:
    """RATE GETs a second through Envoy (50 clients in turn) until ``fault`` is done and
    0.3 s more; each one's HTTP status."""
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def get(client: int) -> int:
            headers = {"x-client-id": f"c{client}"}
            async with http.get(url, headers=headers, timeout=aiohttp.ClientTimeout(10)) as r:
                await r.read()
                return r.status

        calls: list[asyncio.Task[int]] = []
        start, end = loop.time(), None
        while end is None or loop.time() < end:
            if end is None and fault.done():
                end = loop.time() + 0.3
            calls.append(asyncio.create_task(get(len(calls) % 50)))
            await asyncio.sleep(max(0.0, start + len(calls) / RATE - loop.time()))
            assert len(calls) < 60 * RATE, "the fault never ended"
        await fault
        return list(await asyncio.gather(*calls))


class TestThroughEnvoy:
    async def test_envoy_denying_on_failure_lets_every_request_through(
        self, redis_process: RedisProcess, tmp_path: Path
    ) -> None:
        """Envoy with failure_mode_deny: true in front of fairlimit with --failure-mode
        open: Redis SIGSTOPped for 3 s under 200 requests/s, every request gets 200, and
        Envoy counts no rate-limit error (each RESOURCE_EXHAUSTED was a 500). Envoy's
        timeout is 5 s: the server waits on the store 0.25 s at most whatever the deadline,
        and a machine at a load of 20 has starved the processes for 2 s."""
        server = ServerProcess(["--backend", redis_process.url, "--failure-mode", "open"])
        edits = {"failure_mode_deny: false": "failure_mode_deny: true",
                 "timeout: 0.25s": "timeout: 5s"}  # fmt: skip
        try:
            with envoy_in_front(server.grpc_port, tmp_path, edits) as proxy:
                assert (await asyncio.to_thread(http_get, proxy.url))[0] == 200
                fault = asyncio.create_task(_stop(redis_process, 0.5, 3.0))
                statuses = await _http_under_load(proxy.url, fault)
                errors = proxy.stat("cluster.ok.ratelimit.error")
                allowed = proxy.stat("cluster.ok.ratelimit.failure_mode_allowed")
                answered = proxy.stat("cluster.ok.ratelimit.ok")
        finally:
            server.stop()
        assert Counter(statuses) == {200: len(statuses)}
        assert (errors, allowed) == (0, 0)
        assert answered > len(statuses) / 2  # fairlimit's OK, not Envoy's failure mode
