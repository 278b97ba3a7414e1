"""``--workers N``: N serve processes on one gRPC port (SO_REUSEPORT), and their parent.

Python serves one request at a time per process, so a Redis deployment scales on one host
by running several processes that share the port: the kernel spreads incoming connections
over them. State is shared through Redis only (settings refuse ``memory://`` with N > 1).
The admin HTTP server runs in worker 0 alone; its ``/metrics`` shows every worker's series,
labelled ``worker`` (the others hand theirs over through a directory: telemetry/pooled.py).

The parent binds the port first (without listening, so it takes no connections) with
SO_REUSEPORT: that turns a port of 0 into one real port every worker can bind, and keeps it
held while they run. It forwards SIGTERM and SIGINT to every worker, and when one worker
exits on its own it stops the others, so a supervisor sees the whole server go.
"""

import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable
from multiprocessing.connection import wait
from types import FrameType

from fairlimit.settings import Settings, parse_address
from fairlimit.telemetry.pooled import DIRECTORY_ENV

log = logging.getLogger("fairlimit")

Worker = Callable[[Settings, int], None]  # a module-level function (spawn pickles it by name)
_GRACEFUL = (0, -signal.SIGTERM, -signal.SIGINT)


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


class Parent:
    """Starts the workers, forwards stop signals, waits for all of them."""

    def __init__(self, settings: Settings, worker: Worker) -> None:
        self.held, address = reserve_port(settings.grpc_addr)
        self.settings = dataclasses.replace(settings, grpc_addr=address)
        context = multiprocessing.get_context("spawn")  # never fork a process that has grpc
        self.workers = [
            context.Process(target=worker, args=(self.settings, i), name=f"fairlimit-worker-{i}")
            for i in range(settings.workers)
        ]
        self.stopping = False
        # Where workers 1..N-1 leave their metrics for worker 0's /metrics (telemetry/pooled).
        self.metrics_dir = tempfile.mkdtemp(prefix="fairlimit-metrics-")

    def _forward(self, signum: int, frame: FrameType | None = None) -> None:
        self.stopping = True
        for process in self.workers:
            if process.pid is not None and process.exitcode is None:
                os.kill(process.pid, signum)

    def run(self) -> int:
        """Serve until every worker has exited; 0 when they all stopped cleanly."""
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGINT)}
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
        failed = [c for c in codes if c not in _GRACEFUL]
        log.info("workers exited: %s", ", ".join(str(c) for c in codes))
        return next((c if c and c > 0 else 1 for c in failed), 0)

    def _wait(self) -> None:
        running = list(self.workers)
        while running:
            wait([p.sentinel for p in running], timeout=0.5)
            # Each exit code read once: a worker reaped between two reads would otherwise
            # leave the running list without being seen to end.
            exited = [p.exitcode is not None for p in running]
            ended = [p for p, gone in zip(running, exited, strict=True) if gone]
            running = [p for p, gone in zip(running, exited, strict=True) if not gone]
            if ended and running and not self.stopping:
                first = ended[0]
                log.error("worker %s exited with %s: stopping the others", first.name,
                          first.exitcode)  # fmt: skip
                self._forward(signal.SIGTERM)
        for process in self.workers:
            process.join()


def run_workers(settings: Settings, worker: Worker) -> int:
    """Run ``settings.workers`` processes of ``worker(settings, index)``; their exit code."""
    return Parent(settings, worker).run()
