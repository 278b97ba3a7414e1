"""Deadline-aware answers: a call whose deadline has passed is shed (failure mode, counted),
and a backend call is bounded by what the caller's deadline leaves, not a fixed timeout."""

import math
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from fairlimit.core.admission import Code
from fairlimit.errors import DeadlineExceeded
from fairlimit.limiter import Limiter
from fairlimit.settings import FailureMode
from fairlimit.store import deadline
from fairlimit.store.memory import MemoryStore
from fairlimit.telemetry import Telemetry
from helpers import FakeClock, desc, load_text, req
from redis_servers import RedisProcess
from servers import fairlimit_server

CONFIG = """
    domain: edge
    descriptors:
      - key: client_id
        rate_limit: {unit: minute, requests_per_unit: 1}
"""


def _limiter(tmp_path: Path, mode: FailureMode) -> tuple[Limiter, InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    telemetry = Telemetry(MeterProvider(metric_readers=[reader]), TracerProvider())
    loaded = load_text(tmp_path, CONFIG)
    limiter = Limiter(loaded, MemoryStore(), FakeClock(), failure_mode=mode, telemetry=telemetry)
    return limiter, reader


def _shed_calls(reader: InMemoryMetricReader) -> float:
    data = reader.get_metrics_data()
    return sum(
        float(point.value)  # type: ignore[attr-defined]  # a counter's points have one
        for resource in (data.resource_metrics if data else ())
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "fairlimit.rpc.shed"
        for point in metric.data.data_points
    )


@pytest.mark.behaviour
class TestShed:
    async def test_passed_deadline_is_answered_open_and_counted(self, tmp_path: Path) -> None:
        limiter, reader = _limiter(tmp_path, FailureMode.OPEN)
        prepared = limiter.prepare(req("edge", desc("client_id=a")))
        for _ in range(3):  # the limit is 1: shed calls charge nothing
            decision = await limiter.decide(prepared, remaining=0.0)
            assert (decision.code, decision.shed) == (Code.OK, True)
        assert _shed_calls(reader) == 3
        kept = await limiter.decide(prepared, remaining=5.0)
        assert (kept.code, kept.shed, kept.statuses[0].limit_remaining) == (Code.OK, False, 0)

    async def test_closed_mode_raises(self, tmp_path: Path) -> None:
        limiter, reader = _limiter(tmp_path, FailureMode.CLOSED)
        with pytest.raises(DeadlineExceeded):
            await limiter.decide(limiter.prepare(req("edge", desc("client_id=a"))), -1.0)
        assert _shed_calls(reader) == 1


@pytest.mark.unit
class TestTimeout:
    """The per-call timeout a store derives (deadline instants far from now: no timing)."""

    def test_no_deadline_keeps_the_default(self) -> None:
        assert deadline.timeout(0.015) == 0.015

    def test_a_distant_deadline_is_capped(self) -> None:
        token = deadline.DEADLINE.set(time.monotonic() + 60)
        try:
            assert deadline.timeout(0.015) == deadline.CEILING
        finally:
            deadline.DEADLINE.reset(token)

    def test_a_passed_deadline_raises(self) -> None:
        token = deadline.DEADLINE.set(time.monotonic() - 1)
        try:
            with pytest.raises(DeadlineExceeded):
                deadline.timeout(0.015)
        finally:
            deadline.DEADLINE.reset(token)


@pytest.mark.unit
class TestTimeoutAtTheEdges:
    """The same with the module's clock stopped at 0 (monkeypatched): exact amounts left."""

    @pytest.fixture(autouse=True)
    def _stopped_clock(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(deadline, "time", SimpleNamespace(monotonic=lambda: 0.0))

    @staticmethod
    def _timeout_at(instant: float) -> float:
        token = deadline.DEADLINE.set(instant)
        try:
            return deadline.timeout(0.015)
        finally:
            deadline.DEADLINE.reset(token)

    def test_the_reserve_is_kept_back(self) -> None:
        """100 ms left: a backend call gets 100 - 0.5 (RESERVE) = 99.5 ms."""
        assert math.isclose(self._timeout_at(0.1), 0.0995)

    def test_exactly_the_floor_left_is_still_a_call(self) -> None:
        """1.5 ms left less 0.5 reserved is 1 ms, FLOOR itself: the call is made."""
        assert self._timeout_at(0.0015) == deadline.FLOOR

    def test_under_the_floor_the_error_says_what_is_left(self) -> None:
        """1.44975 ms less 0.5 reserved: 0.94975 ms, shown as 0.9 ms (a scale a thousandth
        off would round it to 1.0)."""
        with pytest.raises(DeadlineExceeded) as caught:
            self._timeout_at(0.00144975)
        assert str(caught.value) == "the caller's deadline leaves 0.9 ms"

    def test_a_passed_deadline_leaves_nothing(self) -> None:
        with pytest.raises(DeadlineExceeded) as caught:
            self._timeout_at(-1.0)
        assert str(caught.value) == "the caller's deadline leaves 0.0 ms"


def _metric(admin_port: int, name: str, timeout: float = 5) -> float:
    url = f"http://127.0.0.1:{admin_port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.partition("{")[0].partition(" ")[0] == name)  # fmt: skip


@pytest.mark.process
def test_paused_redis_is_bounded_by_the_callers_deadline(
    redis_process: RedisProcess, tmp_path: Path
) -> None:
    """Redis paused (CLIENT PAUSE, 5 s) and ``?timeout=30``: the second call of a client
    allowed 1 a minute comes back OK, so by --failure-mode open, counted as a backend
    error: its Redis call was bounded by the client's deadline (at most CEILING), and the
    server did not wait out the pause, which would have answered OVER_LIMIT."""
    config = tmp_path / "edge.yaml"
    config.write_text(CONFIG.replace("\n    ", "\n"))
    url = redis_process.url + "/?timeout=30"
    with fairlimit_server("--config", str(config), "--backend", url) as server:
        entries = [ratelimit_pb2.RateLimitDescriptor.Entry(key="client_id", value="a")]
        request = rls_pb2.RateLimitRequest(
            domain="edge", descriptors=[ratelimit_pb2.RateLimitDescriptor(entries=entries)]
        )
        with grpc.insecure_channel(server.target) as channel:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            stub.ShouldRateLimit(request, timeout=10)  # connected, script loaded
            with redis_process.client() as admin:  # the pause ends by itself
                admin.execute_command("CLIENT", "PAUSE", "5000", "ALL")
            answer = stub.ShouldRateLimit(request, timeout=10)
        assert answer.overall_code == rls_pb2.RateLimitResponse.OK
        # /metrics reads the caps' figures from Redis, with no caller's deadline: it waits
        # out the rest of the pause (?timeout=30), 4.7 s of it or more, so more than 5 s
        assert _metric(server.admin_port, "fairlimit_backend_errors_total", timeout=30) >= 1
