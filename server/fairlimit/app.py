"""Composition root: settings -> config -> store -> limiter -> servers, and the serve loop."""

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Coroutine

from prometheus_client import CollectorRegistry

from fairlimit.admin import AdminServer, JsonCodec
from fairlimit.config.loader import load
from fairlimit.config.watch import ConfigWatcher
from fairlimit.core.rules import Loaded
from fairlimit.errors import ConfigError
from fairlimit.grpc_api.proto_json import request_from_json, response_to_json
from fairlimit.grpc_api.servicer import GrpcServer, TlsFiles
from fairlimit.limiter import Limiter
from fairlimit.quota import QuotaService
from fairlimit.settings import Settings, parse_address
from fairlimit.store import open_store
from fairlimit.telemetry import Telemetry
from fairlimit.telemetry.quota import QuotaTelemetry

log = logging.getLogger("fairlimit")

DRAIN_SECONDS = 5.0
REFRESH_SECONDS = 5.0  # how often the fairness gauges are re-read from the store for OTLP
DRIP_SECONDS = 0.2  # how often RLQS usage owed is paid into the counters (quota/usage.py)


def _tls(settings: Settings) -> TlsFiles | None:
    """The TLS files named by the settings, read once at start."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    ca = settings.tls_client_ca.read_bytes() if settings.tls_client_ca else None
    return TlsFiles(settings.tls_cert.read_bytes(), settings.tls_key.read_bytes(), ca)


class App:
    """A running fairlimit: the limiter and the servers around it."""

    def __init__(
        self,
        settings: Settings,
        *,
        telemetry: Telemetry | None = None,
        metrics_registry: CollectorRegistry | None = None,
        worker: int = 0,
    ) -> None:
        self.settings = settings
        self.worker = worker  # with --workers N, this process's index; admin HTTP in 0 only
        self.telemetry = telemetry or Telemetry()  # the global providers cli.py installed
        loaded = load(settings.config, strict=settings.strict)
        for line in loaded.warnings:
            log.warning("%s", line)
        self.store = open_store(settings.backend)
        self.limiter = Limiter(
            loaded,
            self.store,
            shadow=settings.shadow,
            failure_mode=settings.failure_mode,
            telemetry=self.telemetry,
        )
        limiter = self.limiter
        self.quota = QuotaService(
            lambda: limiter.loaded,
            self.store,
            limiter.clock.now,
            shadow=settings.shadow,
            telemetry=QuotaTelemetry() if self.telemetry.enabled else QuotaTelemetry.off(),
        )
        if settings.workers > 1 and not worker:
            log.warning(
                "RLQS: each of the %d workers divides every cap among the Envoy streams it"
                " holds; serve RLQS from a single process (docs/rlqs.md)",
                settings.workers,
            )
        reuse_port = settings.workers > 1  # the workers share the port (workers.py)
        self.grpc = GrpcServer(
            self.limiter,
            self.telemetry,
            settings.grpc_addr,
            _tls(settings),
            reuse_port,
            quota=self.quota,
        )
        self.admin = None if worker else self._admin(metrics_registry)
        self.watcher = ConfigWatcher(
            settings.config, strict=settings.strict, apply=self._apply, reject=self._reject
        )
        self._tasks: set[asyncio.Task[object]] = set()
        self._stopping = asyncio.Event()

    def _admin(self, registry: CollectorRegistry | None) -> AdminServer:
        host, port = parse_address("--admin-addr", self.settings.admin_addr)
        codec = JsonCodec(request_from_json, response_to_json)
        return AdminServer(self.limiter, host, port, codec, registry, self.quota.describe)

    async def start(self) -> None:
        await self.grpc.start()
        if self.admin is not None:
            await self.admin.start()
        self.telemetry.config_load(True)
        _log_loaded("config loaded", self.limiter.loaded)
        log.info("serving gRPC on %s (port %d)", self.settings.grpc_addr, self.grpc.port)
        if self.admin is not None:
            log.info(
                "serving admin HTTP on %s (port %d)", self.settings.admin_addr, self.admin.port
            )
        else:
            log.info("worker %d: admin HTTP is served by worker 0 only", self.worker)
        self._spawn(self.watcher.run())
        self._spawn(self._refresh_fairness())
        self._spawn(self._drip_quota())

    def _spawn(self, work: Coroutine[object, object, object]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    def _apply(self, loaded: Loaded) -> None:
        for line in loaded.warnings:
            log.warning("%s", line)
        self.limiter.swap(loaded)
        self.telemetry.config_load(True)
        _log_loaded("config reloaded", loaded)

    def _reject(self, error: ConfigError) -> None:
        for line in error.problems:
            log.error("%s", line)
        self.telemetry.config_load(False)
        log.error("config rejected: keeping the running config (%d problems)", len(error.problems))

    def reload(self) -> None:
        """Reload the config now (SIGHUP), as a change on disk would."""
        self._spawn(self.watcher.reload())

    async def _refresh_fairness(self) -> None:
        # Ends on the stop event, not only on cancellation: a cancel that lands inside a
        # Redis call may come out of redis-py as a timeout, which the store reports as
        # unavailable; the loop then went on for ever and a SIGTERM soon after start never
        # finished draining (tests/test_workers.py kills a worker seconds after start).
        while not self._stopping.is_set():
            try:
                await self.limiter.refresh_fairness()
            except Exception:  # a gauge refresh must never take the server down
                log.exception("refreshing the fairness figures failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), REFRESH_SECONDS)

    async def _drip_quota(self) -> None:
        # Ends on the stop event, like the refresh loop (see there).
        while not self._stopping.is_set():
            try:
                await self.quota.drip()
            except Exception:  # the drip must never take the server down
                log.exception("paying RLQS usage into the counters failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), DRIP_SECONDS)

    def stop(self) -> None:
        """Ask the serve loop to drain and exit."""
        self._stopping.set()

    async def run(self, on_ready: Callable[["App"], None] | None = None) -> None:
        """Serve until SIGTERM/SIGINT or ``stop()``: then NOT_SERVING, drain, exit.

        The handlers go in before the servers log that they serve: a signal sent as soon as
        that line appears must find them.
        """
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        await self.start()
        if on_ready is not None:
            on_ready(self)
        await self._stopping.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        """NOT_SERVING and /readyz 503, drain in-flight calls, stop the rest."""
        self._stopping.set()  # also when called without stop(): the refresh loop ends on it
        log.info("draining: health NOT_SERVING, finishing in-flight calls")
        if self.admin is not None:
            self.admin.draining = True
        self.watcher.stop()
        await self.grpc.drain(DRAIN_SECONDS)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.admin is not None:
            await self.admin.stop()
        await self.store.close()
        log.info("stopped")


def _log_loaded(what: str, loaded: Loaded) -> None:
    files = ", ".join(str(p) for p in loaded.files)
    log.info(
        "%s: %d domains from %s (%d warnings)",
        what,
        len(loaded.config.domains),
        files or "(no files)",
        len(loaded.warnings),
    )
