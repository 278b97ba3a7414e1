"""SIGTERM with a drain delay: health NOT_SERVING at once, calls answered for the delay.

Kubernetes removes a terminating pod from its endpoints only after the pod got SIGTERM;
until Envoy learns of it, calls keep arriving. Through a real server process.
"""

import asyncio
import signal
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from servers import ROOT, ServerProcess

pytestmark = pytest.mark.process

D = ratelimit_pb2.RateLimitDescriptor
REQUEST = rls_pb2.RateLimitRequest(
    domain="edge", descriptors=[D(entries=[D.Entry(key="route", value="public")])]
)


def _readyz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code


def _on_a_new_connection(target: str) -> tuple[str, str]:
    """Health and a ShouldRateLimit answer, on a connection opened now."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(target, options) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        reply = rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(REQUEST, timeout=5)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
    return status, rls_pb2.RateLimitResponse.Code.Name(reply.overall_code)


class TestDrainDelay:
    def test_sigterm_keeps_answering_for_the_drain_delay(self) -> None:
        """--drain-delay: after SIGTERM, health says NOT_SERVING and /readyz 503, yet new
        connections are answered; a second SIGTERM ends the delay and the server exits 0."""
        server = ServerProcess(["--config", str(ROOT / "descriptors"), "--drain-delay", "300"])
        try:
            admin = server.admin_port
            server.process.send_signal(signal.SIGTERM)
            server.wait_for(r"answering calls for 300s more")
            during = _on_a_new_connection(server.target), _readyz(admin)
            server.process.send_signal(signal.SIGTERM)
            code = server.process.wait(30)
        finally:
            server.stop()
        assert during == (("NOT_SERVING", "OK"), 503)
        assert code == 0
        assert any("draining: health NOT_SERVING" in line for line in server.lines)

    def test_the_delay_is_off_by_default(self) -> None:
        """Without --drain-delay, SIGTERM drains at once, as before."""
        server = ServerProcess(["--config", str(ROOT / "descriptors")])
        code = server.stop()
        assert code == 0
        assert not any("answering calls for" in line for line in server.lines)


HEAVY_CONFIG = """\
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 100000000}
    fair_share:
      active_clients: 100
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 1000000}
"""
CONNECTIONS = 4  # each carries at most 10 calls at once: under the 16 streams it may open
_E = D.Entry
LOCAL = [("grpc.use_local_subchannel_pool", 1)]  # a connection of the channel's own


def _heavy(tag: str) -> bytes:
    """64 descriptors (the most a request may have), each a client under a fair-share cap."""
    descriptors = [
        D(entries=[_E(key="route", value="public"), _E(key="client_id", value=f"{tag}{i}")])
        for i in range(64)
    ]
    return rls_pb2.RateLimitRequest(domain="edge", descriptors=descriptors).SerializeToString()


async def _code(channel: grpc.aio.Channel, payload: bytes) -> str:
    call = channel.unary_unary("/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
    try:
        await call(payload, timeout=30)
    except grpc.aio.AioRpcError as error:
        return str(error.code().name)
    return "OK"


class TestDrainAnswersEveryCall:
    """grpc's stop cancels the calls that reached the server but that its loop had not taken
    up yet: the drain serves until calls stop coming, then stops (issue 38)."""

    async def test_calls_sent_just_before_sigterm_are_all_answered(self, tmp_path: Path) -> None:
        """40 calls of 64 descriptors, SIGTERM 10 ms later: each answered OK, exit 0 (30
        ended CANCELLED; the log showed the drain and the stop 9 ms apart)."""
        config = tmp_path / "edge.yaml"
        config.write_text(HEAVY_CONFIG)
        server = ServerProcess(["--config", str(config)])
        try:
            channels = [grpc.aio.insecure_channel(server.target, LOCAL) for _ in range(CONNECTIONS)]
            for channel in channels:
                assert await _code(channel, _heavy("warm")) == "OK"
            calls = [asyncio.create_task(_code(channels[i % CONNECTIONS], _heavy(f"c{i}-")))
                     for i in range(40)]  # fmt: skip
            await asyncio.sleep(0.01)
            server.terminate()
            codes = await asyncio.gather(*calls)
            for channel in channels:
                await channel.close()
            exit_code = await asyncio.to_thread(server.process.wait, 30)
        finally:
            server.stop()
        assert Counter(codes) == {"OK": 40}
        assert exit_code == 0

    async def test_calls_during_and_after_the_drain_delay_are_answered(
        self, tmp_path: Path
    ) -> None:
        """About 200 calls a second on 4 connections through SIGTERM, --drain-delay 1 and
        0.5 s past it, then none (Envoy has learnt the pod is going): every call answered OK,
        none cancelled when the delay ended (11-18 were), exit 0."""
        config = tmp_path / "edge.yaml"
        config.write_text(HEAVY_CONFIG)
        server = ServerProcess(["--config", str(config), "--drain-delay", "1"])
        loop = asyncio.get_running_loop()
        try:
            channels = [grpc.aio.insecure_channel(server.target, LOCAL) for _ in range(CONNECTIONS)]
            for channel in channels:
                assert await _code(channel, _heavy("warm")) == "OK"
            calls: list[asyncio.Task[str]] = []
            signalled = False
            start = loop.time()
            end = start + 0.5 + 1.0 + 0.5  # SIGTERM after 0.5 s, the delay, 0.5 s more
            while loop.time() < end and len(calls) < 1000:
                if not signalled and loop.time() >= start + 0.5:
                    server.terminate()
                    signalled = True
                channel = channels[len(calls) % CONNECTIONS]
                calls.append(asyncio.create_task(_code(channel, _heavy(f"c{len(calls)}-"))))
                await asyncio.sleep(0.005)
            codes = await asyncio.gather(*calls)
            for channel in channels:
                await channel.close()
            exit_code = await asyncio.to_thread(server.process.wait, 30)
        finally:
            server.stop()
        assert signalled
        assert Counter(codes) == {"OK": len(calls)}
        assert exit_code == 0
