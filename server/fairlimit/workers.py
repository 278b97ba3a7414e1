"""``--workers N``: N serve processes on one gRPC port (SO_REUSEPORT), and their parent.

Python serves one request at a time per process, so a Redis deployment scales on one host
by running several processes that share the port: the kernel spreads incoming connections
over them. State is shared through Redis only (settings refuse ``memory://`` with N > 1).
The admin HTTP server runs in worker 0 alone; its ``/metrics`` shows every worker's series,
labelled ``worker`` (the others hand theirs over through a directory: telemetry/pooled.py).

The parent binds the port first (without listening, so it takes no connections) with
SO_REUSEPORT: that turns a port of 0 into one real port every worker can bind, and keeps it
held while they run. It forwards SIGTERM and SIGINT to every worker, and SIGHUP too (each
worker reloads its config). A worker that crashes is logged and started again, up to
``RESTARTS`` times in ``RESTART_WINDOW`` seconds; past that, or when a worker refuses its
config or settings (a restart cannot mend those), the parent stops the others and exits
non-zero, so a supervisor sees the whole server go. Workers die with the parent, however it
dies (SIGKILL included): no stale process stays on the port.
"""

import collections
import ctypes
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType

from fairlimit.settings import Settings, parse_address
from fairlimit.telemetry.pooled import DIRECTORY_ENV

log = logging.getLogger("fairlimit")

Worker = Callable[[Settings, int], None]  # a module-level function (spawn pickles it by name)
_GRACEFUL = (0, -signal.SIGTERM, -signal.SIGINT)
_UNUSABLE = 2  # the CLI's exit code for a config or settings error: restarting cannot help
RESTARTS = 5
RESTART_WINDOW = 60.0
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def reserve_port(address: str) -> tuple[socket.socket, str]:
    """A socket bound (not listening) with SO_REUSEPORT to ``address``, and the address with
    its real port."""
    host, port = parse_address("--grpc-addr", address)
    family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(where)
    real = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return sock, f"{shown}:{real}"


def _follow_parent(parent: int) -> None:
    """Have this worker receive SIGTERM (and drain) when its parent process dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    else:  # elsewhere, the pipe multiprocessing keeps to the parent closes when it dies
        spawner = multiprocessing.parent_process()
        if spawner is not None:
            threading.Thread(target=_on_close, args=(spawner.sentinel,), daemon=True).start()
    if os.getppid() != parent:  # the parent died before the line above took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _on_close(sentinel: int) -> None:
    wait([sentinel])
    os.kill(os.getpid(), signal.SIGTERM)


def _worker_main(worker: Worker, settings: Settings, index: int, parent: int) -> None:
    """A worker process: follow the parent, then serve."""
    # A SIGHUP before the server installs its reload handler would kill the worker by
    # default; the config it is about to load is the current one anyway.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _follow_parent(parent)
    worker(settings, index)


class Parent:
    """Starts the workers, forwards signals, restarts crashed ones, waits for all of them."""

    def __init__(self, settings: Settings, worker: Worker) -> None:
        self.held, address = reserve_port(settings.grpc_addr)
        self.settings = dataclasses.replace(settings, grpc_addr=address)
        self.context = multiprocessing.get_context("spawn")  # never fork a process with grpc
        self.worker = worker
        self.workers = [self._process(i) for i in range(settings.workers)]
        self.stopping = False
        self.failure: int | None = None  # the exit code that brought the server down
        self.restarts: collections.deque[float] = collections.deque()
        # Where workers 1..N-1 leave their metrics for worker 0's /metrics (telemetry/pooled).
        self.metrics_dir = tempfile.mkdtemp(prefix="fairlimit-metrics-")

    def _process(self, index: int) -> BaseProcess:
        return self.context.Process(
            target=_worker_main,
            args=(self.worker, self.settings, index, os.getpid()),
            name=f"fairlimit-worker-{index}",
        )

    def _signal_all(self, signum: int) -> None:
        for process in self.workers:
            if process.pid is not None and process.exitcode is None:
                os.kill(process.pid, signum)

    def _forward(self, signum: int, frame: FrameType | None = None) -> None:
        self.stopping = True
        self._signal_all(signum)

    def _reload(self, signum: int, frame: FrameType | None = None) -> None:
        log.info("SIGHUP: every worker reloads its config")
        self._signal_all(signal.SIGHUP)

    def run(self) -> int:
        """Serve until every worker has exited; 0 when they all stopped cleanly."""
        handlers = {signal.SIGTERM: self._forward, signal.SIGINT: self._forward,
                    signal.SIGHUP: self._reload}  # fmt: skip
        previous = {s: signal.signal(s, h) for s, h in handlers.items()}
        os.environ[DIRECTORY_ENV] = self.metrics_dir  # a spawned worker inherits it
        try:
            for process in self.workers:
                process.start()
            pids = ", ".join(str(p.pid) for p in self.workers)
            log.info(
                "%d workers (pids %s) share gRPC %s (SO_REUSEPORT); admin HTTP in worker 0",
                len(self.workers), pids, self.settings.grpc_addr,
            )  # fmt: skip
            self._wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.held.close()
            os.environ.pop(DIRECTORY_ENV, None)
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        codes = [p.exitcode for p in self.workers]
        log.info("workers exited: %s", ", ".join(str(c) for c in codes))
        failed = [c for c in (self.failure, *codes) if c is not None and c not in _GRACEFUL]
        return next((c if c > 0 else 1 for c in failed), 0)

    def _wait(self) -> None:
        while any(p.exitcode is None for p in self.workers):
            wait([p.sentinel for p in self.workers if p.exitcode is None], timeout=0.5)
            if self.stopping:
                continue
            for index, process in enumerate(self.workers):
                if process.exitcode is not None:
                    self._crashed(index, process)
        for process in self.workers:
            process.join()

    def _crashed(self, index: int, process: BaseProcess) -> None:
        """Restart worker ``index`` that exited on its own, or stop them all."""
        code = process.exitcode
        now = time.monotonic()
        while self.restarts and self.restarts[0] <= now - RESTART_WINDOW:
            self.restarts.popleft()
        if code != _UNUSABLE and len(self.restarts) < RESTARTS:
            self.restarts.append(now)
            self.workers[index] = fresh = self._process(index)
            fresh.start()
            log.error("worker %s (pid %s) exited with %s: restarted as pid %s",
                      process.name, process.pid, code, fresh.pid)  # fmt: skip
            return
        why = "a config it cannot load" if code == _UNUSABLE else "crashing too often"
        log.error("worker %s exited with %s (%s): stopping the others", process.name, code, why)
        self.failure = code
        self._forward(signal.SIGTERM)


def run_workers(settings: Settings, worker: Worker) -> int:
    """Run ``settings.workers`` processes of ``worker(settings, index)``; their exit code."""
    return Parent(settings, worker).run()
