"""Hot reload: all or nothing, between requests, counters of unchanged rules kept; SIGHUP."""

import asyncio
import logging
import re
import signal
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.wrappers_pb2 import UInt64Value
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from fairlimit.app import App
from fairlimit.config.loader import load
from fairlimit.config.watch import ConfigWatcher
from fairlimit.errors import ConfigError
from fairlimit.limiter import Limiter
from fairlimit.settings import Settings
from fairlimit.store.memory import MemoryStore
from fairlimit.telemetry import Telemetry
from helpers import FakeClock, desc, req
from servers import ServerProcess

pytestmark = pytest.mark.behaviour

EDGE = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {{unit: minute, requests_per_unit: {limit}}}
  - key: route
    value: other
    rate_limit: {{unit: minute, requests_per_unit: {other}}}
"""
EXTRA = """
domain: extra
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 7}
"""
BROKEN = "domain: edge\ndescriptors: [\n"
BROKEN_PROBLEM = (
    "line 3 column 1: invalid YAML: expected the node content, but found '<stream end>'"
)
WAIT = 10.0  # seconds: a bound on every wait for a file event, never reached when all is well


def write(directory: Path, name: str, text: str) -> None:
    """Replace a file as editors do: write aside, then rename over it."""
    aside = directory / f".{name}.tmp"
    aside.write_text(text)
    aside.rename(directory / name)


class TestReloadSemantics:
    async def test_counters_of_unchanged_rules_survive(self, tmp_path: Path) -> None:
        """A reload that changes another rule leaves this rule's window count as it was."""
        write(tmp_path, "edge.yaml", EDGE.format(limit=5, other=1))
        limiter = Limiter(load([tmp_path]), MemoryStore(), FakeClock())
        watcher = ConfigWatcher([tmp_path], strict=False, apply=limiter.swap, reject=print)
        public = req("edge", desc("route=public"))
        for _ in range(3):
            await limiter.should_rate_limit(public)
        write(tmp_path, "edge.yaml", EDGE.format(limit=5, other=9))
        assert await watcher.reload()
        decision = await limiter.should_rate_limit(public)
        assert decision.statuses[0].limit_remaining == 1  # 5 - 4: the count went on
        other = await limiter.should_rate_limit(req("edge", desc("route=other")))
        assert other.statuses[0].current_limit.requests_per_unit == 9  # type: ignore[union-attr]

    async def test_an_invalid_change_keeps_the_running_config(self, tmp_path: Path) -> None:
        """Broken YAML in one file rejects the whole reload; the old limits keep applying."""
        write(tmp_path, "edge.yaml", EDGE.format(limit=5, other=1))
        write(tmp_path, "extra.yaml", EXTRA)
        limiter = Limiter(load([tmp_path]), MemoryStore(), FakeClock())
        rejected: list[ConfigError] = []
        watcher = ConfigWatcher(
            [tmp_path], strict=False, apply=limiter.swap, reject=rejected.append
        )
        write(tmp_path, "edge.yaml", EDGE.format(limit=50, other=1))
        write(tmp_path, "extra.yaml", BROKEN)
        assert not await watcher.reload()
        (error,) = rejected
        assert error.problems == [f"{tmp_path / 'extra.yaml'}: {BROKEN_PROBLEM}"]
        decision = await limiter.should_rate_limit(req("edge", desc("route=public")))
        assert decision.statuses[0].current_limit.requests_per_unit == 5  # type: ignore[union-attr]


def _check(domain: str, key: str, value: str) -> rls_pb2.RateLimitRequest:
    """A request that checks without consuming (hits_addend 0), to read the limit in force."""
    D = ratelimit_pb2.RateLimitDescriptor
    descriptor = D(entries=[D.Entry(key=key, value=value)], hits_addend=UInt64Value(value=0))
    return rls_pb2.RateLimitRequest(domain=domain, descriptors=[descriptor])


class Client:
    """Sends requests without pause, recording the limits it saw and every failure."""

    def __init__(self, stub: rls_pb2_grpc.RateLimitServiceStub) -> None:
        self.stub = stub
        self.seen: list[tuple[int | None, int | None]] = []
        self.failures: list[BaseException] = []

    async def limits(self) -> tuple[int | None, int | None]:
        """(edge route=public limit, extra k=v limit); None where no limit applies."""
        out = []
        for request in (_check("edge", "route", "public"), _check("extra", "k", "v")):
            status = (await self.stub.ShouldRateLimit(request)).statuses[0]
            out.append(status.current_limit.requests_per_unit if status.HasField("current_limit")
                       else None)  # fmt: skip
        return out[0], out[1]

    async def run(self) -> None:
        while True:
            try:
                self.seen.append(await self.limits())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failures.append(exc)
            await asyncio.sleep(0.002)

    async def until(self, wanted: tuple[int | None, int | None]) -> None:
        deadline = time.monotonic() + WAIT
        while not self.seen or self.seen[-1] != wanted:
            assert time.monotonic() < deadline, f"still {self.seen[-1:]}, waiting for {wanted}"
            await asyncio.sleep(0.01)


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[tuple[App, Client, InMemoryMetricReader]]:
    write(tmp_path, "edge.yaml", EDGE.format(limit=100, other=1))
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    settings = Settings(config=(tmp_path,), grpc_addr="127.0.0.1:0", admin_addr="127.0.0.1:0")
    app = App(settings, telemetry=Telemetry(provider, TracerProvider()))
    assert isinstance(app.source, ConfigWatcher)  # the files are the source
    app.source.debounce_ms = 50
    await app.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc.port}") as channel:
        client = Client(rls_pb2_grpc.RateLimitServiceStub(channel))
        task = asyncio.create_task(client.run())
        yield app, client, reader
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await app.shutdown()
    provider.shutdown()


class TestLiveReload:
    async def test_edit_add_delete_while_serving(
        self,
        running: tuple[App, Client, InMemoryMetricReader],
        tmp_path: Path,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """Edits, additions and deletions reach a serving App; a broken file is refused."""
        app, client, reader = running
        caplog.set_level(logging.INFO, logger="fairlimit")
        await client.until((100, None))
        write(tmp_path, "edge.yaml", EDGE.format(limit=200, other=1))  # edit
        await client.until((200, None))
        write(tmp_path, "extra.yaml", EXTRA)  # add
        await client.until((200, 7))
        watcher = app.source
        assert isinstance(watcher, ConfigWatcher)
        reloads = watcher.reloads
        write(tmp_path, "edge.yaml", BROKEN)  # refused: the old limits stay
        deadline = time.monotonic() + WAIT
        while watcher.reloads == reloads:
            assert time.monotonic() < deadline, "the broken file was never noticed"
            await asyncio.sleep(0.01)
        seen = len(client.seen)
        while len(client.seen) < seen + 3:
            await asyncio.sleep(0.01)
        assert client.seen[-1] == (200, 7)
        write(tmp_path, "edge.yaml", EDGE.format(limit=300, other=1))
        (tmp_path / "extra.yaml").unlink()  # delete
        await client.until((300, None))

        assert client.failures == []  # no request failed during any swap
        assert set(client.seen) <= {(100, None), (200, None), (200, 7), (300, 7), (300, None)}
        messages = [r.getMessage() for r in caplog.records]
        assert f"{tmp_path / 'edge.yaml'}: {BROKEN_PROBLEM}" in messages
        assert "config rejected: keeping the running config (1 problems)" in messages
        loads = {
            dict(p.attributes)["result"]: p.value
            for m in reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics  # type: ignore[union-attr]
            if m.name == "fairlimit.config.loads"
            for p in m.data.data_points  # type: ignore[union-attr]
        }
        assert loads["failure"] == 1 and loads["success"] >= 4  # the start and three changes


@pytest.mark.process
class TestSighup:
    def test_sighup_forces_a_reload(self, tmp_path: Path) -> None:
        """SIGHUP to a serving process reloads the config and counts the load at /metrics."""
        write(tmp_path, "edge.yaml", EDGE.format(limit=100, other=1))
        server = ServerProcess(["--config", str(tmp_path)])
        try:
            admin = server.admin_port
            server.process.send_signal(signal.SIGHUP)
            server.wait_for(r"config reloaded", WAIT)
            url = f"http://127.0.0.1:{admin}/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
            assert re.search(
                r'fairlimit_config_loads_total\{[^}]*result="success"[^}]*\} 2\.0', text
            )
        finally:
            assert server.stop() == 0
