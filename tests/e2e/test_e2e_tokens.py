"""End to end: HTTP -> a real Envoy (examples/envoy/llm-tokens.yaml) -> a real fairlimit
(llm-tokens-descriptors.yaml), with a small fake LLM on 127.0.0.1 that holds each stream
until released and reports its usage in x-tokens-used (and x-tokens-unused).

Ten parallel streams from one tenant, each reserving x-max-tokens = 4000 of its 20 000 an
hour: five fit, five are refused while the five run; once they end, the tenant's counter is
exactly the tokens the five really used (settled: unused given back, excess charged). The
Envoy-native style (is_negative_hits with x-tokens-unused) gives back the unused part only.

Waits are events or bounded polls of Envoy's counters; no duration is asserted.
"""

import http.server
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from envoy_proxy import EnvoyProcess, bootstrap, envoy_on, http_get
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from servers import ROOT, fairlimit_server

pytestmark = pytest.mark.process

EXAMPLE = ROOT / "examples" / "envoy" / "llm-tokens.yaml"
DESCRIPTORS = ROOT / "examples" / "envoy" / "llm-tokens-descriptors.yaml"
BUDGET = 20_000  # the tenant's tokens an hour (llm-tokens-descriptors.yaml)
ESTIMATE = 4000  # x-max-tokens of every stream: five fit in the budget
# The real cost of each stream: some under the estimate, two above it (debt); any five sum
# to at most 18 500, under the budget, so the counter shows them all.
COSTS = (1000, 1500, 2000, 2500, 3000, 3500, 4500, 5000, 1200, 800)
DEADLINE = 30.0
NEGATIVE = {
    'hits_addend: {format: "%RESP(x-tokens-used)%"}':
        'hits_addend: {format: "%RESP(x-tokens-unused)%", is_negative_hits: true}',
}  # fmt: skip


class FakeLLM(http.server.ThreadingHTTPServer):
    """Answers each request once released, with x-tokens-used = x-simulated-tokens and
    x-tokens-unused = x-max-tokens minus that (at least 0)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.release = threading.Event()
        self.arrived = 0
        self.lock = threading.Lock()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeLLM

    def do_GET(self) -> None:
        with self.server.lock:
            self.server.arrived += 1
        self.server.release.wait(DEADLINE)
        used = int(self.headers.get("x-simulated-tokens", "0"))
        unused = max(0, int(self.headers.get("x-max-tokens", "0")) - used)
        body = b"completion\n"
        self.send_response(200)
        self.send_header("x-tokens-used", str(used))
        self.send_header("x-tokens-unused", str(unused))
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def fake_llm() -> Iterator[FakeLLM]:
    server = FakeLLM()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()


def _rls_calls(proxy: EnvoyProcess) -> int:
    return proxy.stat("cluster.fairlimit.upstream_rq_completed")


def _wait(condition: object, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)  # a poll interval, not a wait for an outcome


def _remaining(grpc_port: int, tenant: str) -> int:
    """The tenant's tokens left this hour, by a check that charges nothing."""
    entries = [{"key": "provider", "value": "llm"}, {"key": "tenant", "value": tenant}]
    descriptor = rls_pb2.RateLimitRequest(domain="edge", descriptors=[{"entries": entries}])
    descriptor.descriptors[0].hits_addend.value = 0
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        answer = rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(descriptor, timeout=5)
    return int(answer.statuses[0].limit_remaining)


def _streams(proxy: EnvoyProcess, llm: FakeLLM, tenant: str, grpc_port: int
             ) -> tuple[list[tuple[int, int]], int]:  # fmt: skip
    """The ten streams at once: (status, real cost) each, and the tenant's tokens left
    while the admitted ones were still running."""
    out: list[tuple[int, int]] = []
    lock = threading.Lock()

    def one(cost: int) -> None:
        headers = {"x-tenant": tenant, "x-max-tokens": str(ESTIMATE),
                   "x-simulated-tokens": str(cost)}  # fmt: skip
        status = http_get(proxy.url, headers)[0]
        with lock:
            out.append((status, cost))

    threads = [threading.Thread(target=one, args=(cost,)) for cost in COSTS]
    for thread in threads:
        thread.start()
    _wait(lambda: llm.arrived + len(out) == len(COSTS), "the streams did not all arrive")
    during = _remaining(grpc_port, tenant)
    llm.release.set()
    for thread in threads:
        thread.join(DEADLINE)
    # the stream-done calls: one per admitted stream (for a 429 there is no x-tokens-used,
    # so Envoy has no hits_addend to send and makes no call)
    admitted = sum(1 for status, _ in out if status == 200)
    _wait(lambda: _rls_calls(proxy) >= len(COSTS) + admitted, "stream-done calls missing")
    return out, during


@contextmanager
def _stack(tmp_path: Path, edits: dict[str, str] | None = None
           ) -> Iterator[tuple[EnvoyProcess, FakeLLM, int]]:  # fmt: skip
    with fake_llm() as llm, fairlimit_server("--config", str(DESCRIPTORS)) as server:
        text = bootstrap(EXAMPLE, {"port_value: 8000": f"port_value: {llm.server_port}",
                                   **(edits or {})})  # fmt: skip
        with envoy_on(text, server.grpc_port, tmp_path) as proxy:
            yield proxy, llm, server.grpc_port


class TestTenParallelStreams:
    def test_reserved_while_running_and_exact_once_settled(self, tmp_path: Path) -> None:
        """Five of ten fit (4000 each of 20 000); while they run the counter holds their
        reservations; settled, it holds what they really used (two used more than their
        estimate: that is charged too). The overspend is no more than real minus reserved."""
        with _stack(tmp_path) as (proxy, llm, grpc_port):
            assert _remaining(grpc_port, "t1") == BUDGET
            results, during = _streams(proxy, llm, "t1", grpc_port)
            after = _remaining(grpc_port, "t1")
        admitted = [cost for status, cost in results if status == 200]
        refused = [cost for status, cost in results if status == 429]
        assert (len(admitted), len(refused)) == (BUDGET // ESTIMATE, len(COSTS) - 5)
        assert during == BUDGET - len(admitted) * ESTIMATE  # the reservations, all visible
        assert BUDGET - after == sum(admitted)  # settled: exactly the tokens really used
        overspend = max(0, sum(admitted) - BUDGET)
        assert overspend <= max(0, sum(admitted) - len(admitted) * ESTIMATE)
        print(f"\nreserve/settle: {len(admitted)} of {len(COSTS)} admitted, reserved "
              f"{len(admitted) * ESTIMATE}, really used {sum(admitted)}, counter "
              f"{BUDGET - after} of {BUDGET}")  # fmt: skip

    def test_envoy_native_refunds_give_back_the_unused_part(self, tmp_path: Path) -> None:
        """is_negative_hits with x-tokens-unused: each admitted stream keeps min(real,
        estimate) charged; a refund never gives back more than was reserved."""
        with _stack(tmp_path, NEGATIVE) as (proxy, llm, grpc_port):
            results, during = _streams(proxy, llm, "t2", grpc_port)
            after = _remaining(grpc_port, "t2")
        admitted = [cost for status, cost in results if status == 200]
        assert len(admitted) == BUDGET // ESTIMATE
        assert during == BUDGET - len(admitted) * ESTIMATE
        assert BUDGET - after == sum(min(cost, ESTIMATE) for cost in admitted)
