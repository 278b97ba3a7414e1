"""Composition root: settings -> config -> store -> limiter -> servers, and the serve loop."""

import asyncio
import contextlib
import functools
import gc
import logging
import signal
import socket
from collections.abc import Callable, Coroutine
from pathlib import Path

from prometheus_client import CollectorRegistry

from fairlimit.admin import AdminServer, JsonCodec, SideListener
from fairlimit.config.loader import assemble, load
from fairlimit.config.watch import ConfigWatcher
from fairlimit.core.rules import Loaded
from fairlimit.errors import ConfigError, SettingsError
from fairlimit.grpc_api.extras import ResponseOptions
from fairlimit.grpc_api.guards import Budgets
from fairlimit.grpc_api.proto_json import request_from_json, response_to_json
from fairlimit.grpc_api.servicer import GrpcServer
from fairlimit.grpc_api.tls import TlsFiles
from fairlimit.grpc_api.xds import XdsConfigSource, XdsSettings, XdsTls
from fairlimit.limiter import BREAK_SECONDS, Limiter
from fairlimit.quota import QuotaService
from fairlimit.settings import Settings, parse_address
from fairlimit.store import open_store
from fairlimit.store.degraded import Replicas
from fairlimit.telemetry import Telemetry, pooled
from fairlimit.telemetry.quota import QuotaTelemetry
from fairlimit.telemetry.upstream import UpstreamStats

log = logging.getLogger("fairlimit")

DRAIN_SECONDS = 5.0
REFRESH_SECONDS = 5.0  # how often the fairness gauges are re-read from the store for OTLP
DRIP_SECONDS = 0.2  # how often RLQS usage owed is paid into the counters (quota/usage.py)


# What sets each listening address: named when it cannot be had.
_SET_BY = {
    "gRPC": "--grpc-addr, FAIRLIMIT_GRPC_ADDR or GRPC_HOST/GRPC_PORT",
    "admin HTTP": "--admin-addr, FAIRLIMIT_ADMIN_ADDR or HOST/PORT",
    "the debug port": "FAIRLIMIT_DEBUG_ADDR or DEBUG_HOST/DEBUG_PORT",
    "metrics": "FAIRLIMIT_METRICS_ADDR or PROMETHEUS_ADDR",
}


def check_listen(what: str, address: str, reuse_port: bool = False) -> None:
    """SettingsError, one line naming ``address`` and what sets it, when it cannot be
    listened on now (a port another process holds, an address not of this host): bound
    and let go at once, with the options the servers use, before any server is made."""
    host, port = parse_address(what, address)
    if port == 0:
        return
    fix = f"set another with {_SET_BY[what]}"
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SettingsError(
            f"cannot listen for {what} on {address}: {exc.strerror}; {fix}"
        ) from None
    for family, kind, proto, _, where in found:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(where)
            except OSError as exc:
                cause = (exc.strerror or str(exc)).lower()
                raise SettingsError(
                    f"cannot listen for {what} on {address}: {cause}; {fix}"
                ) from None


def _check_listeners(settings: Settings, worker: int) -> None:
    if not settings.grpc_addr.startswith("unix:"):
        check_listen("gRPC", settings.grpc_addr, reuse_port=settings.workers > 1)
    if worker:
        return  # the admin port and its side listeners are worker 0's
    check_listen("admin HTTP", settings.admin_addr)
    if settings.debug_addr is not None:
        check_listen("the debug port", settings.debug_addr)
    if settings.metrics_addr is not None:
        check_listen("metrics", settings.metrics_addr)


def _roots(settings: Settings) -> tuple[Path, ...]:
    """RUNTIME_ROOT when a swap of it is to reload (RUNTIME_WATCH_ROOT, upstream's default);
    said once at start when it is a symlink whose swap will not be seen."""
    root = settings.runtime_root
    if root is None or settings.config_source != "file":
        return ()
    if settings.watch_root:
        return (root,)
    if root.is_symlink():
        log.warning(
            "RUNTIME_ROOT %s is a symlink and RUNTIME_WATCH_ROOT=false: swapping it reloads "
            "nothing until SIGHUP (changes inside the config directory still do)",
            root,
        )
    return ()


def _tls(settings: Settings) -> TlsFiles | None:
    """The TLS files named by the settings (read at start and again when they change)."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    return TlsFiles(settings.tls_cert, settings.tls_key, settings.tls_client_ca)


def _response_options(settings: Settings) -> ResponseOptions:
    """upstream's optional response parts, as the settings ask for them."""
    return ResponseOptions(
        headers=settings.response_headers,
        limit_header=settings.header_limit,
        remaining_header=settings.header_remaining,
        reset_header=settings.header_reset,
        metadata=settings.response_metadata,
        quota_all=settings.quota_mode,
        rule_names=settings.names_rules,
    )


def _pairs(text: str, sep: str) -> list[tuple[str, str]]:
    """``"a=1,b=2"`` (with ``sep`` between name and value) -> pairs; malformed items dropped."""
    pairs = (item.partition(sep) for item in text.split(","))
    return [(name.strip(), value.strip()) for name, found, value in pairs if found and name]


def _xds_tls(settings: Settings) -> XdsTls | None:
    """The TLS files for the management server, read once at start."""
    if not settings.xds_tls:
        return None

    def read(path: Path | None) -> bytes | None:
        return None if path is None else path.read_bytes()

    return XdsTls(
        read(settings.xds_server_ca),
        read(settings.xds_client_cert),
        read(settings.xds_client_key),
        settings.xds_server_san or None,
    )


def _xds_source(
    settings: Settings, apply: Callable[[Loaded], None], reject: Callable[[ConfigError], None]
) -> XdsConfigSource | None:
    """The xDS config source when CONFIG_TYPE=GRPC_XDS_SOTW asks for it."""
    if settings.config_source != "xds":
        return None
    xds = XdsSettings(
        settings.xds_server,
        settings.xds_node_id,
        dict(_pairs(settings.xds_node_metadata, "=")),
        tuple((name.lower(), value) for name, value in _pairs(settings.xds_headers, ":")),
        settings.xds_retry,
        _xds_tls(settings),
    )
    return XdsConfigSource(
        xds, strict=settings.strict, merge_domains=settings.merge_domains, apply=apply,
        reject=reject, charge_over_limit=settings.charges_over_limit,
    )  # fmt: skip


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
    ) -> None:
        _check_listeners(settings, worker)  # before anything is made: one line, not a trace
        self.settings = settings
        self.worker = worker  # with --workers N, this process's index; admin HTTP in 0 only
        self.metrics_registry = metrics_registry
        self.metrics_dir = metrics_dir  # with --workers N: where workers share their metrics
        # the global providers cli.py installed
        self.telemetry = telemetry or Telemetry(top_clients=settings.top_clients)
        self.telemetry.near_limit_ratio = settings.near_limit_ratio
        if settings.metrics_compat:
            self.telemetry.upstream = UpstreamStats(settings.near_limit_ratio)
        self.xds = _xds_source(settings, self._apply, self._reject)
        loaded = (
            # nothing until the management server sends the first set
            assemble([], (), charge_over_limit=settings.charges_over_limit)
            if self.xds is not None
            else load(
                settings.config,
                strict=settings.strict,
                merge_domains=settings.merge_domains,
                allow_empty=settings.allow_empty_config,
                charge_over_limit=settings.charges_over_limit,
                ignore_dotfiles=settings.ignore_dotfiles,
            )
        )
        for line in loaded.warnings:
            log.warning("%s", line)
        for line in loaded.notes:
            log.info("%s", line)
        self.store = open_store(settings.backend)
        # --failure-mode local: each process's part of a limit (store/degraded.py); the RLQS
        # demand exchange says which processes share the store
        replicas = Replicas(settings.replicas * settings.workers)
        self.limiter = Limiter(
            loaded,
            self.store,
            shadow=settings.shadow,
            failure_mode=settings.failure_mode,
            telemetry=self.telemetry,
            quota_mode=settings.quota_mode,
            replicas=replicas,
        )
        limiter = self.limiter
        self.quota = QuotaService(
            lambda: limiter.loaded,
            self.store,
            limiter.clock.now,
            shadow=settings.shadow,
            telemetry=QuotaTelemetry() if self.telemetry.enabled else QuotaTelemetry.off(),
            divide_gap=DRIP_SECONDS,  # a put-off division runs at the next drip
            tally=limiter.tally,  # RLS demand at caps counts in the RLQS division
            replicas=replicas,
            max_buckets_per_stream=settings.rlqs_max_buckets_per_stream,
            max_buckets=settings.rlqs_max_buckets,
        )
        reuse_port = settings.workers > 1  # the workers share the port (workers.py)
        self.grpc = GrpcServer(
            self.limiter,
            self.telemetry,
            settings.grpc_addr,
            _tls(settings),
            reuse_port,
            _response_options(settings),
            (settings.max_connection_age, settings.max_connection_age_grace),
            quota=self.quota,
            budgets=Budgets(
                rls=settings.grpc_max_concurrent,
                rlqs=settings.rlqs_max_streams,
                per_connection=settings.grpc_max_streams_per_connection,
                read_timeout=settings.grpc_read_timeout,
                max_receive=settings.grpc_max_receive_bytes,
            ),
        )
        self.admin = None if worker else self._admin(metrics_registry)
        self.side = [] if self.admin is None else self._side_listeners(self.admin)
        self.watcher = ConfigWatcher(
            settings.config,
            strict=settings.strict,
            merge_domains=settings.merge_domains,
            allow_empty=settings.allow_empty_config,
            apply=self._apply,
            reject=self._reject,
            charge_over_limit=settings.charges_over_limit,
            ignore_dotfiles=settings.ignore_dotfiles,
            roots=_roots(settings),
        )
        self._tasks: set[asyncio.Task[object]] = set()
        self._stopping = asyncio.Event()
        self._hurry = asyncio.Event()  # a second SIGTERM: no more drain delay
        self._started = False  # the servers were started (not while waiting for xDS)

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
            rlqs=self.quota.describe,
            timeout=self.settings.admin_timeout,
            json_from=self.settings.admin_json,
        )

    def _side_listeners(self, admin: AdminServer) -> list[SideListener]:
        """upstream's debug port (text /rlconfig) and PROMETHEUS_ADDR, where asked for."""
        listeners = []
        if self.settings.debug_addr is not None:
            host, port = parse_address("--debug-addr", self.settings.debug_addr)
            routes = {"/rlconfig": admin.rlconfig_text}
            listeners.append(SideListener(host, port, routes, self.settings.admin_timeout))
        if self.settings.metrics_addr is not None:
            host, port = parse_address("--metrics-addr", self.settings.metrics_addr)
            routes = {self.settings.metrics_path: admin.metrics}
            listeners.append(SideListener(host, port, routes, self.settings.admin_timeout))
        return listeners

    def _has_config(self, loaded: Loaded) -> bool:
        """Ready as far as the config goes: always, unless readiness needs a domain loaded."""
        return bool(loaded.config.domains) or not self.settings.healthy_with_config

    async def _config_ready(self, ready: bool) -> None:
        if self.admin is not None:
            self.admin.config_missing = not ready
        await self.grpc.set_serving(ready)

    async def start(self) -> None:
        if self.xds is not None:
            # As upstream: serve only once the management server has sent a config, unless
            # forced to start (FORCE_START_WITHOUT_INITIAL_CONFIG): then with none until then.
            self._spawn(self.xds.run())
            if self.settings.force_start:
                log.info("serving before a first config from xDS server %s (force start)",
                         self.settings.xds_server)  # fmt: skip
            else:
                log.info("waiting for the first config from xDS server %s",
                         self.settings.xds_server)  # fmt: skip
                if not await self._first_config(self.xds):
                    return  # SIGTERM before any config: nothing was started
        self._started = True
        await self.grpc.start()
        if self.admin is not None:
            await self.admin.start()
        for listener in self.side:
            await listener.start()
            log.info("serving %s:%d", listener.host, listener.port)
        await self._config_ready(self._has_config(self.limiter.loaded))
        if self.xds is None:  # the xDS source counts each config it applies, the first too
            self.telemetry.config_load(True)
        _log_loaded("config loaded", self.limiter.loaded)
        log.info("serving gRPC on %s (port %d)", self.settings.grpc_addr, self.grpc.port)
        if self.admin is not None:
            log.info(
                "serving admin HTTP on %s (port %d)", self.settings.admin_addr, self.admin.port
            )
        else:
            log.info("worker %d: admin HTTP is served by worker 0 only", self.worker)
        if self.xds is None:
            self._spawn(self.watcher.run())
        self._spawn(self._refresh_fairness())
        if self.limiter.local is not None:
            self._spawn(self._watch_backend())
        if self.worker and self.metrics_dir is not None and self.metrics_registry is not None:
            self._spawn(self._share_metrics(self.metrics_registry, self.metrics_dir))
        # Everything made so far (modules, config, SDK, grpc) lives as long as the process:
        # out of the collector's sight, a full collection no longer walks it mid-request.
        gc.collect()
        gc.freeze()
        self._spawn(self._drip_quota())

    async def _first_config(self, xds: XdsConfigSource) -> bool:
        """Wait for the management server's first config; False when asked to stop first."""
        applied = asyncio.ensure_future(xds.applied.wait())
        stopping = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({applied, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for waiter in (applied, stopping):
            waiter.cancel()
        return xds.applied.is_set()

    def _spawn(self, work: Coroutine[object, object, object]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    def _apply(self, loaded: Loaded) -> None:
        for line in loaded.warnings:
            log.warning("%s", line)
        for line in loaded.notes:
            log.info("%s", line)
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
        if self.xds is None:
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

    async def _watch_backend(self) -> None:
        """--failure-mode local: while this process limits alone, ping the backend every
        BREAK_SECONDS, so that it returns as soon as the backend does, with traffic or
        without (its write-back is what the other processes' counts miss meanwhile)."""
        while not self._stopping.is_set():  # ends on the stop event (see _refresh_fairness)
            try:
                await self.limiter.watch_backend()
            except Exception:  # must never take the server down
                log.exception("watching the backend failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), BREAK_SECONDS)

    async def _share_metrics(self, registry: CollectorRegistry, directory: Path) -> None:
        """Hand this worker's metrics to worker 0's /metrics until stopping, and once more."""
        while True:
            try:
                pooled.dump(registry, directory, self.worker)
            except OSError as exc:  # the parent's directory gone: it is stopping
                log.debug("metrics not shared: %s", exc)
            if self._stopping.is_set():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), pooled.DUMP_SECONDS)

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
        self.watcher.stop()
        if self.xds is not None:
            self.xds.stop()
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
        if self.xds is not None:
            self.xds.stop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _log_loaded(what: str, loaded: Loaded) -> None:
    files = ", ".join(str(p) for p in loaded.files)
    log.info(
        "%s: %d domains from %s (%d warnings)",
        what,
        len(loaded.config.domains),
        files or "(no files)",
        len(loaded.warnings),
    )
