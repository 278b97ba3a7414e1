"""``serve --workers N``: real processes sharing one gRPC port (SO_REUSEPORT) and one Redis.

Redis-only: several workers share state through Redis; memory:// with --workers is refused
(tests/app/test_cli.py). Linux-only checks read /proc to see which process holds which socket.
"""

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from helpers import skip_or_fail
from redis_servers import RedisProcess
from servers import ServerProcess

pytestmark = pytest.mark.process

CONFIG = """\
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: minute, requests_per_unit: 10}
"""
CONNECTIONS = 24  # one request each: the kernel spreads them over the workers
OK, OVER = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT
_LISTEN, _ESTABLISHED = "0A", "01"


def _ask(channel: grpc.Channel, client: str) -> int:
    entry = ratelimit_pb2.RateLimitDescriptor.Entry(key="client_id", value=client)
    message = rls_pb2.RateLimitRequest(
        domain="edge", descriptors=[ratelimit_pb2.RateLimitDescriptor(entries=[entry])]
    )
    stub = rls_pb2_grpc.RateLimitServiceStub(channel)
    return int(stub.ShouldRateLimit(message, timeout=10).overall_code)


def _wait_for_log(server: ServerProcess, text: str, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while "".join(server.lines).count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} not logged {count} times"
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _sockets_on(port: int, state: str) -> set[str]:
    """Inodes of the TCP sockets on local ``port`` in ``state`` (grpc binds IPv6 sockets that
    also take IPv4, so both tables are read)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == state:
                found.add(fields[9])
    return found


def _workers_holding(server: ServerProcess, inodes: set[str]) -> set[int]:
    """Which worker processes (children of the parent) own one of ``inodes``."""
    return {pid for pid in _children(server.process.pid) if _socket_inodes(pid) & inodes}


class TestWorkers:
    """Two worker processes on one Redis: one port, one limit."""

    @pytest.fixture(autouse=True)
    def _linux_proc(self) -> None:
        if not Path("/proc/net/tcp").exists():
            skip_or_fail("reads Linux /proc to see which worker holds which socket")

    def test_two_workers_answer_on_one_port_and_share_one_limit(
        self, redis_server: RedisProcess, tmp_path: Path
    ) -> None:
        """Both workers listen and answer on the port; a client gets its 10 across them."""
        with redis_server.client() as client:
            client.flushall()
        config = tmp_path / "edge.yaml"
        config.write_text(CONFIG)
        # the exact path: with lease blocks (the default) a block one worker holds counts as
        # used for the other until it is used or expires, so a refusal may come a hit early
        # (docs/redis.md); the order asserted below is the exact path's
        url = redis_server.url + "?timeout=0.5&leases=off"
        server = ServerProcess(["--config", str(config), "--backend", url, "--workers", "2"])
        channels: list[grpc.Channel] = []
        try:
            _wait_for_log(server, "serving gRPC on", 2)
            listeners = _workers_holding(server, _sockets_on(server.grpc_port, _LISTEN))
            options = [("grpc.use_local_subchannel_pool", 1)]  # a connection per channel
            channels = [grpc.insecure_channel(server.target, options) for _ in range(CONNECTIONS)]
            answers = [_ask(channel, "alice") for channel in channels]
            answering = _workers_holding(server, _sockets_on(server.grpc_port, _ESTABLISHED))
        finally:
            for channel in channels:
                channel.close()
            code = server.stop()
        assert len(listeners) == 2
        assert len(answering) == 2
        assert answers.count(OK) == 10
        assert answers[:10] == [OK] * 10 and set(answers[10:]) == {OVER}
        assert code == 0
        _wait_for_log(server, "workers exited", 1)  # the log is read by a thread
        log = "".join(server.lines)
        assert log.count("admin HTTP is served by worker 0 only") == 1
        assert "workers exited: 0, 0" in log

    def test_a_worker_that_dies_is_logged_and_restarted(
        self, redis_server: RedisProcess, tmp_path: Path
    ) -> None:
        """One worker killed: the parent logs it, starts another, and the port answers on."""
        server = _serve_workers(redis_server, tmp_path)
        try:
            workers = _listening_workers(server)
            assert len(workers) == 2, workers  # with one, "the other answers on" is vacuous
            os.kill(workers[0], signal.SIGKILL)
            _wait_for_log(server, "restarted as pid", 1)
            _wait_for_log(server, "serving gRPC on", 3)
            replaced = _listening_workers(server)
            with grpc.insecure_channel(server.target) as channel:
                answer = _ask(channel, "restart")
        finally:
            code = server.stop()
        assert len(replaced) == 2 and workers[0] not in replaced and workers[1] in replaced
        assert answer == OK and code == 0
        assert f"exited with -{int(signal.SIGKILL)}" in "".join(server.lines)

    def test_sighup_reloads_every_worker_and_the_parent_stays(
        self, redis_server: RedisProcess, tmp_path: Path
    ) -> None:
        """SIGHUP to the parent (systemd's ExecReload): each worker reloads, none exits."""
        server = _serve_workers(redis_server, tmp_path)
        try:
            workers = _listening_workers(server)
            server.process.send_signal(signal.SIGHUP)
            _wait_for_log(server, "config reloaded", 2)
            alive = server.process.poll() is None
            after = _listening_workers(server)
        finally:
            code = server.stop()
        assert alive and after == workers and code == 0
        assert "restarted" not in "".join(server.lines)

    def test_workers_die_with_a_killed_parent(
        self, redis_server: RedisProcess, tmp_path: Path
    ) -> None:
        """SIGKILL of the parent: its workers stop too, and nobody is left on the port."""
        server = _serve_workers(redis_server, tmp_path)
        try:
            workers = _listening_workers(server)
            server.process.kill()
            server.process.wait(10)
            _wait_until(lambda: not any(_alive(pid) for pid in workers))
            listening = _sockets_on(server.grpc_port, _LISTEN)
        finally:
            for pid in workers:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
            server.stop()  # the parent is gone: this closes its log pipe
        assert listening == set()


def _serve_workers(redis_server: RedisProcess, tmp_path: Path) -> ServerProcess:
    config = tmp_path / "edge.yaml"
    config.write_text(CONFIG)
    url = redis_server.url + "?timeout=0.5"
    server = ServerProcess(["--config", str(config), "--backend", url, "--workers", "2"])
    _wait_for_log(server, "serving gRPC on", 2)
    return server


def _listening_workers(server: ServerProcess) -> list[int]:
    """The workers (children of the parent) that hold a listening socket on the port."""
    return sorted(_workers_holding(server, _sockets_on(server.grpc_port, _LISTEN)))


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for init to reap it counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
