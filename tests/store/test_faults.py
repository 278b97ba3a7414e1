"""Redis failures under load, through a real fairlimit server process.

Redis-only: memory has no failover. Each test runs a paced load loop against the server
(``--failure-mode closed``, so an outage shows as UNAVAILABLE), breaks Redis the way
production does (a Sentinel master killed, a Cluster master killed and its replica promoted,
a TLS Redis restarted), waits for the answers to come back, then checks that fresh clients
get exactly their limit: no window is exceeded once Redis has recovered. The answers by code
and the recovery time are recorded as test properties (and printed, see ``pytest -rP``).
"""

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from redis_servers import RedisProcess, ReplicatedCluster, SentinelFailover, free_port
from servers import ServerProcess

pytestmark = pytest.mark.process

LIMIT = 5
CONFIG = f"""\
domain: edge
descriptors:
  - key: client_id
    rate_limit: {{unit: hour, requests_per_unit: {LIMIT}}}
"""
# Answers a fault may bring: the verdicts, and UNAVAILABLE while Redis is away (closed mode).
EXPECTED = {"OK", "OVER_LIMIT", "UNAVAILABLE"}
PACE = 0.004  # seconds between two calls of the load loop: ~200 calls/s, light on 2 cores
MAX_CALLS = 20_000  # the loop's bound, whatever happens
RECOVERED = 40  # consecutive answered calls that count as recovered
RECOVERY_TIMEOUT = 60.0
D = ratelimit_pb2.RateLimitDescriptor


def _request(client: str) -> rls_pb2.RateLimitRequest:
    entries = [D.Entry(key="client_id", value=client)]
    return rls_pb2.RateLimitRequest(domain="edge", descriptors=[D(entries=entries)])


def _call(stub: rls_pb2_grpc.RateLimitServiceStub, client: str) -> tuple[str, int]:
    """The answer's code name, and the seconds its window has left (-1 on an error)."""
    try:
        reply = stub.ShouldRateLimit(_request(client), timeout=5)
    except grpc.RpcError as error:
        return str(error.code().name), -1
    code = rls_pb2.RateLimitResponse.Code.Name(reply.overall_code)
    return code, int(reply.statuses[0].duration_until_reset.seconds)


@dataclass
class Load:
    """A paced loop of calls over 10 clients, recording when each answer came, for whom, and
    its code."""

    stub: rls_pb2_grpc.RateLimitServiceStub
    answers: list[tuple[float, str]] = field(default_factory=list)
    admitted: Counter[str] = field(default_factory=Counter)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        prefix = uuid.uuid4().hex[:8]
        for i in range(MAX_CALLS):
            if self.stop.wait(PACE):
                return
            client = f"load-{prefix}-{i % 10}"
            code, _ = _call(self.stub, client)
            self.answers.append((time.monotonic(), code))
            self.admitted[client] += code == "OK"

    def recovered_since(self, fault: float) -> float | None:
        """Seconds from ``fault`` to the first of RECOVERED answered calls in a row after the
        last failed one; None while that has not happened."""
        after = [(t, code) for t, code in list(self.answers) if t > fault]
        failed = [i for i, (_, code) in enumerate(after) if code == "UNAVAILABLE"]
        first = failed[-1] + 1 if failed else 0
        if len(after) - first < RECOVERED:
            return None
        return after[first][0] - fault

    def codes(self) -> Counter[str]:
        return Counter(code for _, code in self.answers)

    def excess(self) -> int:
        """Admissions beyond the clients' limits: counts a failover lost (replication is
        asynchronous, and a restarted Redis without persistence starts empty)."""
        return sum(max(0, n - LIMIT) for n in self.admitted.values())


@contextmanager
def _under_load(server: ServerProcess) -> Iterator[Load]:
    with grpc.insecure_channel(server.target) as channel:
        load = Load(rls_pb2_grpc.RateLimitServiceStub(channel))
        thread = threading.Thread(target=load.run, daemon=True)
        thread.start()
        try:
            yield load
        finally:
            load.stop.set()
            thread.join(30)


def _wait(condition: Callable[[], bool], what: Callable[[], str]) -> None:
    deadline = time.monotonic() + RECOVERY_TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, what()
        time.sleep(0.05)


def _fault(server: ServerProcess, kill: Callable[[], None], name: str,
           record: Callable[[str, object], None]) -> tuple[float, Counter[str]]:  # fmt: skip
    """Break Redis under load; the seconds until the answers came back, the answers by code."""
    with _under_load(server) as load:
        _wait(lambda: load.recovered_since(0.0) is not None,
              lambda: f"no answers before the fault: {dict(load.codes())}")  # fmt: skip
        fault = time.monotonic()
        kill()
        _wait(lambda: load.recovered_since(fault) is not None,
              lambda: f"{name}: never recovered: {dict(load.codes())}")  # fmt: skip
        recovery = load.recovered_since(fault)
    assert recovery is not None
    codes = load.codes()
    record(f"{name}_recovery_seconds", round(recovery, 2))
    record(f"{name}_answers", dict(codes))
    record(f"{name}_excess_admissions", load.excess())
    print(f"{name}: recovered {recovery:.2f}s after the fault; answers {dict(codes)}; "
          f"{load.excess()} admissions beyond a limit")  # fmt: skip
    return recovery, codes


def _no_window_exceeded(server: ServerProcess) -> None:
    """Ten fresh clients, LIMIT + 3 calls each: exactly LIMIT admitted per window."""
    prefix = uuid.uuid4().hex[:8]
    with grpc.insecure_channel(server.target) as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        for n in range(10):
            answers = [_call(stub, f"after-{prefix}-{n}") for _ in range(LIMIT + 3)]
            codes = [code for code, _ in answers]
            resets = [left for _, left in answers]
            if resets != sorted(resets, reverse=True):
                continue  # the hour turned mid-sequence: two windows, nothing to compare
            assert codes == ["OK"] * LIMIT + ["OVER_LIMIT"] * 3, (n, codes)


def _serve(tmp_path: Path, url: str) -> ServerProcess:
    config = tmp_path / "edge.yaml"
    config.write_text(CONFIG)
    return ServerProcess(["--config", str(config), "--backend", url, "--failure-mode", "closed"])


class TestFailover:
    """Redis-only: a failover is something only Redis does."""

    def test_sentinel_failover_is_followed(
        self,
        sentinel_failover: SentinelFailover,
        tmp_path: Path,
        record_property: Callable[[str, object], None],
    ) -> None:
        """The Sentinel master killed: the server finds the promoted replica and counts on."""
        old = sentinel_failover.master_port()
        server = _serve(tmp_path, sentinel_failover.url + "?timeout=0.25")
        try:
            _, codes = _fault(server, sentinel_failover.master.stop, "sentinel", record_property)
            _no_window_exceeded(server)
            new = sentinel_failover.master_port()
        finally:
            code = server.stop()
        assert new == sentinel_failover.replica.port != old
        assert set(codes) <= EXPECTED and codes["OK"] > 0 and code == 0

    def test_cluster_master_killed_and_replica_promoted(
        self,
        replicated_cluster: ReplicatedCluster,
        tmp_path: Path,
        record_property: Callable[[str, object], None],
    ) -> None:
        """A Cluster master killed: once its replica is promoted, every slot answers again."""
        server = _serve(tmp_path, replicated_cluster.url + "?timeout=0.25")
        try:
            killed = replicated_cluster.nodes[0]
            _, codes = _fault(server, killed.stop, "cluster", record_property)
            promoted = replicated_cluster.promoted()
            _no_window_exceeded(server)
        finally:
            code = server.stop()
        assert promoted
        assert set(codes) <= EXPECTED and codes["OK"] > 0 and code == 0

    def test_tls_redis_restarted(
        self,
        tls_files: dict[str, Path],
        tmp_path: Path,
        record_property: Callable[[str, object], None],
    ) -> None:
        """A TLS Redis killed and started again on its port: the server reconnects over TLS."""
        port = free_port()
        redis = RedisProcess(
            tmp_path, None, "--tls-port", str(port),
            "--tls-cert-file", str(tls_files["server.crt"]),
            "--tls-key-file", str(tls_files["server.key"]),
            "--tls-ca-cert-file", str(tls_files["ca.crt"]), "--tls-auth-clients", "no",
        )  # fmt: skip
        redis.start()
        # 1 s, not the others' 0.25 s: each new connection is a TLS handshake, which a
        # loaded machine may take longer than 0.25 s over (a run at a load of 30 answered
        # no 40 calls in a row in 60 s); a killed Redis refuses at once whatever the timeout.
        url = f"rediss://127.0.0.1:{port}/?timeout=1&ssl_ca_certs={tls_files['ca.crt']}"
        server = _serve(tmp_path, url)
        try:
            _, codes = _fault(server, lambda: _restart(redis), "tls", record_property)
            _no_window_exceeded(server)
        finally:
            code = server.stop()
            redis.stop()
        assert set(codes) <= EXPECTED and codes["OK"] > 0 and code == 0


def _restart(redis: RedisProcess) -> None:
    redis.stop()
    redis.start()
