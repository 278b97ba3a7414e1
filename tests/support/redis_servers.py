"""Real redis-server processes on free loopback ports, and stores on them (a pytest plugin).

Session fixtures start one standalone server and one three-master Redis Cluster; the
``*_store_factory`` fixtures hand the behaviour suite a store on a flushed database. Where
``redis-server`` is missing the Redis tests are skipped with a message, except under
CI=true, where that is a failure: CI must run them.
"""

import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import redis

from helpers import STARTUP_SECONDS, require

PORT_TRIES = 3  # first starts on a picked port (RedisProcess.start)

# Generous: the behaviour suite must not fail on a busy 2-core CI machine; the fault tests
# pass their own small timeouts. Not 2 s: at a load average of 26 on 2 cores, one of three
# runs of TestSizedCap and the Redis fairness scenarios had a call in each of two tests time
# out after 2 s, answered by the failure mode: their admissions, exact otherwise, failed.
SUITE_TIMEOUT = 10.0


def require_redis() -> str:
    """The redis-server path; skip (or fail under CI) when it is not installed."""
    require("redis-cli", "Debian package redis-server")
    return require("redis-server", "Debian package redis-server")


def free_port(also_free: int = 0) -> int:
    """A loopback port nobody listens on (and ``port + also_free``, for a cluster bus)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not also_free:
            return port
        if port + also_free < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + also_free))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair found")


class PortTaken(RuntimeError):
    """redis-server could not bind its port (or its cluster bus port): taken meanwhile."""


class RedisProcess:
    """One redis-server on 127.0.0.1, started and stopped explicitly (same port on restart)."""

    def __init__(self, workdir: Path, port: int | None = None, *extra: str) -> None:
        self.binary = require_redis()
        self.workdir = workdir
        self.extra = extra
        # a port picked here may be taken before the server binds it (as a client's local
        # port; a cluster node's bus, port + 10000, too): its first start then picks again
        self.picked = port is None
        self.port = port or self._pick()
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    def _pick(self) -> int:
        return free_port(10000 if "--cluster-enabled" in self.extra else 0)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> "RedisProcess":
        """Start the server and wait until it answers; a first start on a picked port that
        was taken meanwhile picks another (PORT_TRIES in all)."""
        for _ in range(PORT_TRIES - 1):
            try:
                return self._start()
            except PortTaken:
                if not self.picked:
                    raise
                self.port = self._pick()
                self.dir = self.workdir / f"redis-{self.port}"
                self.dir.mkdir(parents=True, exist_ok=True)
        return self._start()

    def _start(self) -> "RedisProcess":
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "", "--appendonly", "no",
                "--protected-mode", "no", *self.extra]  # fmt: skip
        with (self.dir / "redis.log").open("ab") as log:  # the child keeps its own copy
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.dir / "redis.log"
                if "Address already in use" in log.read_text(errors="replace"):
                    raise PortTaken(f"port {self.port} (or its cluster bus) taken; see {log}")
                raise RuntimeError(f"redis-server exited; see {log}")
            try:
                with redis.Redis(port=self.port, socket_timeout=0.5) as client:
                    client.ping()
                self.picked = False  # it has its port: a restart keeps it
                return self
            except redis.RedisError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not answer")

    def stop(self) -> None:
        """Kill the server at once (SIGKILL: a crash, not a shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def client(self) -> "redis.Redis":
        return redis.Redis(port=self.port, socket_timeout=2, decode_responses=True)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """One standalone redis-server for the whole session."""
    server = RedisProcess(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_process(tmp_path: Path) -> Iterator[RedisProcess]:
    """A redis-server of this test's own, which the test may kill and restart."""
    server = RedisProcess(tmp_path).start()
    yield server
    server.stop()


class RedisSentinel:
    """One Sentinel watching ``master`` under the service name ``mymaster``."""

    def __init__(self, master: RedisProcess) -> None:
        self.port = free_port()
        self.conf = master.dir / "sentinel.conf"
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {master.dir}\n"
            f"sentinel monitor mymaster 127.0.0.1 {master.port} 1\n"
        )
        self.proc = subprocess.Popen(
            [master.binary, str(self.conf), "--sentinel"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            try:
                with redis.Redis(port=self.port, socket_timeout=0.5) as client:
                    if client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster"):
                        return
            except redis.RedisError:
                pass
            time.sleep(0.02)
        raise RuntimeError("redis sentinel did not start")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(5)


@pytest.fixture
def redis_sentinel(redis_process: RedisProcess) -> Iterator[RedisSentinel]:
    """A Sentinel over this test's own redis-server."""
    sentinel = RedisSentinel(redis_process)
    yield sentinel
    sentinel.stop()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    require("openssl", "Debian package openssl: cannot make test certificates")
    d = tmp_path_factory.mktemp("tls")
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d, timeout=30)

    openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=fairlimit-test-ca")  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}")  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.crt", "-days", "2",
                "-extfile", "san.ext")  # fmt: skip
    return {name: d / name for name in ("ca.crt", "server.crt", "server.key", "client.crt",
                                        "client.key")}  # fmt: skip


class RedisClusterProcesses:
    """Three masters, no replicas: enough to spread slots over several nodes."""

    def __init__(self, workdir: Path) -> None:
        extra = ("--cluster-enabled", "yes", "--cluster-node-timeout", "2000",
                 "--cluster-config-file", "nodes.conf")  # fmt: skip
        self.nodes = [RedisProcess(workdir, None, *extra) for _ in range(3)]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        return f"redis+cluster://{hosts}"

    def start(self) -> "RedisClusterProcesses":
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0",
             "--cluster-yes"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if all(self._ready(n) for n in self.nodes):
                return self
            time.sleep(0.05)
        raise RuntimeError("Redis Cluster did not reach cluster_state:ok")

    @staticmethod
    def _ready(node: RedisProcess) -> bool:
        with node.client() as client:
            info = client.execute_command("CLUSTER", "INFO")
            slots = client.execute_command("CLUSTER", "SLOTS")
        text = info if isinstance(info, str) else info.decode()
        return "cluster_state:ok" in text and len(slots) == 3

    def flush(self) -> None:
        for node in self.nodes:
            with node.client() as client:
                client.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    """One three-master Redis Cluster for the whole session (its nodes stopped even when
    one fails to start: those started would outlive the suite)."""
    cluster = RedisClusterProcesses(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


StoreFactory = Callable[..., Awaitable[object]]


def suite_url(url: str, **options: object) -> str:
    """``url`` with the suite's options: the caller's (injected) clock, a generous timeout,
    and leases off unless asked for. Leases are on by default for users (issue 41), but the
    behaviour suite compares Redis's exact path with the memory store step by step, and a
    lease block by design answers from what it reserved at its grant (core/lease.py, "the
    slack"); the lease tests (tests/store/test_redis_lease.py, the fairness cases with
    leases) pass ``leases="on"``, and every test that starts a server runs the default."""
    query = {"clock": "caller", "timeout": SUITE_TIMEOUT, "leases": "off", **options}
    return url + "/?" + "&".join(f"{k}={v}" for k, v in query.items())


@pytest.fixture
def redis_store_factory(redis_server: RedisProcess) -> StoreFactory:
    """An async factory of RedisStores on the flushed standalone server (injected clock)."""
    from fairlimit.store.redis import open_redis

    async def make(**options: object) -> object:
        with redis_server.client() as client:
            client.flushall()
        return open_redis(suite_url(redis_server.url, **options))

    return make


@pytest.fixture
def redis_cluster_store_factory(redis_cluster: RedisClusterProcesses) -> StoreFactory:
    """An async factory of RedisStores on the flushed Redis Cluster (injected clock)."""
    from fairlimit.store.redis import open_redis

    async def make(**options: object) -> object:
        redis_cluster.flush()
        return open_redis(suite_url(redis_cluster.url, **options))

    return make


def _wait(condition: Callable[[], bool], what: str, timeout: float = STARTUP_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} within {timeout:.0f}s")


_PROMPT_SYNC = ("--repl-diskless-sync-delay", "0")  # a replica syncs at once, not after 5 s


class SentinelFailover:
    """A master, its replica and one Sentinel that fails over about a second after a kill.

    One Sentinel is a quorum of one: enough to elect itself and promote the replica, and
    the leanest set-up that still goes through Sentinel's real failover.
    """

    def __init__(self, workdir: Path) -> None:
        self.master = RedisProcess(workdir, None, *_PROMPT_SYNC)
        self.replica = RedisProcess(workdir)  # of the master, once it has its port (start)
        self.port = free_port()
        self.conf = workdir / f"sentinel-{self.port}.conf"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/mymaster"

    def start(self) -> "SentinelFailover":
        self.master.start()  # a first start may pick another port than the one it had
        self.replica.extra = ("--replicaof", "127.0.0.1", str(self.master.port))
        self.replica.start()
        _wait(lambda: _streams_to_replica(self.master), "the replica did not sync")
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.conf.parent}\n"
            f"sentinel monitor mymaster 127.0.0.1 {self.master.port} 1\n"
            "sentinel down-after-milliseconds mymaster 500\n"
            "sentinel failover-timeout mymaster 5000\n"
        )
        with (self.conf.parent / f"sentinel-{self.port}.log").open("ab") as log:
            self.proc = subprocess.Popen([self.master.binary, str(self.conf), "--sentinel"],
                                         stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        _wait(lambda: bool(self._ask("SENTINEL", "REPLICAS", "mymaster")),
              "the Sentinel did not find the replica")  # fmt: skip
        return self

    def _ask(self, *command: str) -> object:
        with redis.Redis(port=self.port, socket_timeout=0.5, decode_responses=True) as client:
            return client.execute_command(*command)

    def master_port(self) -> int:
        """The port of the master the Sentinel names now."""
        reply = self._ask("SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster")
        assert isinstance(reply, list | tuple)
        return int(reply[1])

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
        self.master.stop()
        self.replica.stop()


def _info(server: RedisProcess, section: str) -> dict[str, object]:
    with redis.Redis(port=server.port, socket_timeout=0.5, decode_responses=True) as client:
        info: dict[str, object] = client.info(section)
        return info


def _streams_to_replica(master: RedisProcess) -> bool:
    """Whether ``master``'s writes reach its replica. The replica's side says the link is up
    as soon as it has loaded the first copy, but the master streams writes only after the
    replica's first acknowledgement, up to a second later: a kill before that loses every
    write since. WAIT returns once the replica has acknowledged a write of ours."""
    with redis.Redis(port=master.port, socket_timeout=2) as client:
        for key in (f"replica-probe-{i}" for i in range(1000)):
            try:
                client.set(key, 1)
            except redis.ResponseError:  # MOVED: in a cluster, that slot is another master's
                continue
            acknowledged = int(client.execute_command("WAIT", 1, 1000))
            client.delete(key)
            return acknowledged == 1
    return False


@pytest.fixture
def sentinel_failover(tmp_path: Path) -> Iterator[SentinelFailover]:
    """A master, a replica and a Sentinel of this test's own, for it to kill."""
    group = SentinelFailover(tmp_path)
    try:
        yield group.start()
    finally:
        group.stop()


class ReplicatedCluster(RedisClusterProcesses):
    """Three masters and a replica of the first, with a one-second node timeout."""

    def __init__(self, workdir: Path) -> None:
        extra = ("--cluster-enabled", "yes", "--cluster-node-timeout", "1000",
                 "--cluster-config-file", "nodes.conf", *_PROMPT_SYNC)  # fmt: skip
        self.nodes = [RedisProcess(workdir, None, *extra) for _ in range(3)]
        self.replica = RedisProcess(workdir, None, *extra)

    def start(self) -> "ReplicatedCluster":
        super().start()
        first = self.nodes[0]
        with first.client() as client:
            first_id = str(client.execute_command("CLUSTER", "MYID"))
        self.replica.start()
        subprocess.run(
            ["redis-cli", "--cluster", "add-node", f"127.0.0.1:{self.replica.port}",
             f"127.0.0.1:{first.port}", "--cluster-slave", "--cluster-master-id", first_id],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        _wait(lambda: _streams_to_replica(first), "the cluster replica did not sync", 30)
        return self

    def promoted(self) -> bool:
        """Whether the replica has become a master that serves slots."""
        return _info(self.replica, "replication").get("role") == "master" and self._serves(
            self.replica
        )

    @staticmethod
    def _serves(node: RedisProcess) -> bool:
        with node.client() as client:
            return "cluster_state:ok" in str(client.execute_command("CLUSTER", "INFO"))

    def stop(self) -> None:
        super().stop()
        self.replica.stop()


@pytest.fixture
def replicated_cluster(tmp_path: Path) -> Iterator[ReplicatedCluster]:
    """A Redis Cluster of this test's own whose first master has a replica to promote."""
    cluster = ReplicatedCluster(tmp_path)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
