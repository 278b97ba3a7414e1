"""Composition root: settings -> config -> store -> limiter -> servers, and the serve loop.

``build.py`` makes each part from the settings; here they are held, started and stopped.
"""

import asyncio
import contextlib
import functools
import gc
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path

from prometheus_client import CollectorRegistry

from fairlimit.admin import AdminServer, JsonCodec
from fairlimit.admin.rlqs import rlqs_report
from fairlimit.app import build
from fairlimit.app.build import DRIP_SECONDS
from fairlimit.config.loader import assemble
from fairlimit.config.source import limits_nothing
from fairlimit.core.rules import Loaded
from fairlimit.errors import ConfigError
from fairlimit.grpc_api.proto_json import request_from_json, response_to_json
from fairlimit.limiter import BREAK_SECONDS
from fairlimit.settings import Settings, parse_address
from fairlimit.store.replicas import Replicas
from fairlimit.telemetry import Telemetry, pooled
from fairlimit.telemetry.latency import RpcLatency

log = logging.getLogger("fairlimit")

DRAIN_SECONDS = 5.0
REFRESH_SECONDS = 5.0  # how often the fairness gauges are re-read from the store for OTLP


class App:
    """A running fairlimit: the limiter and the servers around it."""

    def __init__(
        self,
        settings: Settings,
        *,
        telemetry: Telemetry | None = None,
        metrics_registry: CollectorRegistry | None = None,
        worker: int = 0,
        metrics_dir: Path | None = None,
        rpc_latency: RpcLatency | None = None,
    ) -> None:
        """``rpc_latency``: where the SDK's readers find the latency histogram
        (``telemetry.sdk.Sdk.latency``); used when no ``telemetry`` is given."""
        build.check_listeners(settings, worker)  # before anything is made: one line, not a trace
        self.settings = settings
        self.worker = worker  # with --workers N, this process's index; admin HTTP in 0 only
        self.metrics_registry = metrics_registry
        self.metrics_dir = metrics_dir  # with --workers N: where workers share their metrics
        self.telemetry = build.telemetry(settings, telemetry, rpc_latency)
        self.source = build.config_source(settings, self._apply, self._reject)
        loaded = self.source.initial()
        self._count_initial = loaded is not None  # a source's later configs count themselves
        if loaded is None:  # nothing until the source sends a first config
            loaded = assemble([], (), charge_over_limit=settings.charges_over_limit)
        _log_notes(loaded)
        # --failure-mode local: each process's part of a limit (store/replicas.py); the RLQS
        # demand exchange says which processes share the store
        replicas = Replicas(settings.replicas * settings.workers)
        self.limiter = build.limiter(settings, loaded, self.telemetry, replicas)
        self.store = self.limiter.store
        self.quota = build.quota(settings, self.limiter, self.telemetry, replicas)
        self.grpc = build.grpc(settings, self.limiter, self.quota)
        self.admin = None if worker else self._admin(metrics_registry)
        self.side = [] if self.admin is None else build.side_listeners(settings, self.admin)
        self._tasks: set[asyncio.Task[object]] = set()
        self._stopping = asyncio.Event()
        self._hurry = asyncio.Event()  # a second SIGTERM: no more drain delay
        self._started = False  # the servers were started (not while waiting for a config)

    def _admin(self, registry: CollectorRegistry | None) -> AdminServer:
        host, port = parse_address("--admin-addr", self.settings.admin_addr)
        codec = JsonCodec(
            request_from_json, functools.partial(response_to_json, options=self.grpc.options)
        )
        if registry is not None and self.metrics_dir is not None:
            registry = pooled.pooled_registry(registry, self.metrics_dir, self.worker)
        upstream = self.telemetry.upstream
        return AdminServer(
            self.limiter,
            host,
            port,
            codec,
            registry,
            healthy_with_config=self.settings.healthy_with_config,
            upstream_metrics=None if upstream is None else upstream.render,
            rlqs=functools.partial(rlqs_report, self.quota),
            timeout=self.settings.admin_timeout,
            json_from=self.settings.admin_json,
        )

    def _has_config(self, loaded: Loaded) -> bool:
        """Ready as far as the config goes: always, unless readiness needs a domain loaded."""
        return bool(loaded.config.domains) or not self.settings.healthy_with_config

    async def _config_ready(self, ready: bool) -> None:
        if self.admin is not None:
            self.admin.config_missing = not ready
        await self.grpc.set_serving(ready)

    async def start(self) -> None:
        self._spawn(self.source.run())
        if not self.source.applied.is_set():
            # As upstream: serve only once the source has sent a config, unless forced to
            # start (FORCE_START_WITHOUT_INITIAL_CONFIG): then with none until then.
            if self.settings.force_start:
                log.info("serving before a first config from %s (force start)", self.source.name)
            else:
                log.info("waiting for the first config from %s", self.source.name)
                if not await self._first_config():
                    return  # SIGTERM before any config: nothing was started
        self._started = True
        await self.grpc.start()
        if self.admin is not None:
            await self.admin.start()
        for listener in self.side:
            await listener.start()
            log.info("serving %s:%d", listener.host, listener.port)
        await self._config_ready(self._has_config(self.limiter.loaded))
        if self._count_initial:
            self.telemetry.config_load(True)
        _log_loaded("config loaded", self.limiter.loaded)
        log.info("serving gRPC on %s (port %d)", self.settings.grpc_addr, self.grpc.port)
        if self.admin is not None:
            log.info(
                "serving admin HTTP on %s (port %d)", self.settings.admin_addr, self.admin.port
            )
        else:
            log.info("worker %d: admin HTTP is served by worker 0 only", self.worker)
        self._spawn(self._every(REFRESH_SECONDS, self.limiter.refresh_fairness,
                                "refreshing the fairness figures failed"))  # fmt: skip
        if self.limiter.local is not None:
            # --failure-mode local: while this process limits alone, ping the backend every
            # BREAK_SECONDS, so that it returns as soon as the backend does, with traffic or
            # without (its write-back is what the other processes' counts miss meanwhile)
            self._spawn(self._every(BREAK_SECONDS, self.limiter.watch_backend,
                                    "watching the backend failed"))  # fmt: skip
        if self.worker and self.metrics_dir is not None and self.metrics_registry is not None:
            # this worker's metrics for worker 0's /metrics, until stopping and once more
            share = functools.partial(_share_metrics, self.metrics_registry, self.metrics_dir,
                                      self.worker)  # fmt: skip
            self._spawn(self._every(pooled.DUMP_SECONDS, share, "sharing metrics failed",
                                    last=True))  # fmt: skip
        # Everything made so far (modules, config, SDK, grpc) lives as long as the process:
        # out of the collector's sight, a full collection no longer walks it mid-request.
        gc.collect()
        gc.freeze()
        self._spawn(self._every(DRIP_SECONDS, self.quota.drip,
                                "paying RLQS usage into the counters failed"))  # fmt: skip

    async def _first_config(self) -> bool:
        """Wait for the source's first config; False when asked to stop first."""
        applied = asyncio.ensure_future(self.source.applied.wait())
        stopping = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({applied, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for waiter in (applied, stopping):
            waiter.cancel()
        return self.source.applied.is_set()

    def _spawn(self, work: Coroutine[object, object, object]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    def _apply(self, loaded: Loaded) -> None:
        _log_notes(loaded)
        self.limiter.swap(loaded)
        self.telemetry.config_load(True)
        if self.admin is not None:
            self.admin.reload_failure = None
        if not self._stopping.is_set():  # a drain has said NOT_SERVING: a reload keeps it
            self._spawn(self._config_ready(self._has_config(loaded)))
        _log_loaded("config reloaded", loaded)

    def _reject(self, error: ConfigError) -> None:
        for line in error.problems:
            log.error("%s", line)
        self.telemetry.config_load(False)
        if self.admin is not None:
            self.admin.reload_failure = f"{len(error.problems)} problems: {error.problems[0]}"
        log.error("config rejected: keeping the running config (%d problems)", len(error.problems))

    def reload(self) -> None:
        """Reload the config now (SIGHUP), as a change on disk would (files only: the xDS
        management server pushes every change itself)."""
        self._spawn(self.source.reload())

    async def _every(
        self, seconds: float, work: Callable[[], Awaitable[object]], failed: str,
        *, last: bool = False,
    ) -> None:  # fmt: skip
        """Do ``work`` every ``seconds`` until stopping (and once more then, if ``last``);
        a failure is logged as ``failed`` and never takes the server down.

        Ends on the stop event, not only on cancellation: a cancel that lands inside a
        Redis call may come out of redis-py as a timeout, which the store reports as
        unavailable; a loop then went on for ever and a SIGTERM soon after start never
        finished draining (tests/app/test_workers.py kills a worker seconds after start)."""
        while last or not self._stopping.is_set():
            try:
                await work()
            except Exception:
                log.exception(failed)
            if self._stopping.is_set():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), seconds)

    def stop(self) -> None:
        """Ask the serve loop to drain and exit; asked again, cut the drain delay short."""
        if self._stopping.is_set():
            self._hurry.set()
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
        """NOT_SERVING and /readyz 503; answer on for the drain delay; drain in-flight calls,
        stop the rest.

        The delay is for Kubernetes: endpoints learn of a terminating pod after the pod has
        got its SIGTERM, and until they do, Envoy keeps sending it calls; a server that had
        stopped accepting would fail them.
        """
        self._stopping.set()  # also when called without stop(): the refresh loop ends on it
        if not self._started:  # stopped while waiting for a first xDS config
            await self._stop_tasks()
            await self.store.close()
            log.info("stopped before serving")
            return
        if self.admin is not None:
            self.admin.draining = True
        await self.grpc.set_serving(False)
        delay = self.settings.drain_delay
        if delay > 0:
            log.info("health NOT_SERVING; answering calls for %gs more (--drain-delay)", delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._hurry.wait(), delay)
        log.info("draining: health NOT_SERVING, finishing in-flight calls")
        self.source.stop()
        await self.grpc.drain(DRAIN_SECONDS)
        await self._stop_tasks()
        if self.admin is not None:
            await self.admin.stop()
        for listener in self.side:
            await listener.stop()
        await self.limiter.close()  # a write-back of local decisions, when one is out
        await self.store.close()
        log.info("stopped")

    async def _stop_tasks(self) -> None:
        self.source.stop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _share_metrics(registry: CollectorRegistry, directory: Path, worker: int) -> None:
    """Hand this worker's metrics to worker 0's /metrics (pooled.py)."""
    try:
        pooled.dump(registry, directory, worker)
    except OSError as exc:  # the parent's directory gone: it is stopping
        log.debug("metrics not shared: %s", exc)


def _log_notes(loaded: Loaded) -> None:
    """A config's warnings and notes, as it is loaded or applied."""
    for line in loaded.warnings:
        log.warning("%s", line)
    for line in loaded.notes:
        log.info("%s", line)


def _log_loaded(what: str, loaded: Loaded) -> None:
    files = ", ".join(str(p) for p in loaded.files)
    log.info(
        "%s: %d domains from %s (%d warnings)",
        what,
        len(loaded.config.domains),
        files or "(no files)",
        len(loaded.warnings),
    )
    if limits_nothing(loaded.config):  # an empty xDS snapshot, say: a valid state, said so
        log.warning("%s: no rate limit in any domain: every request is allowed", what)
