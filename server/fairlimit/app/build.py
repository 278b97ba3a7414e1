"""What the app is made of, built from the settings: the listening addresses checked, the
config source, the limiter, the quota service and the gRPC server."""

import logging
import socket
from pathlib import Path

from fairlimit.admin import AdminServer, SideListener
from fairlimit.config.source import Apply, ConfigSource, Reject
from fairlimit.config.watch import ConfigWatcher
from fairlimit.core.rules import Loaded
from fairlimit.errors import SettingsError
from fairlimit.grpc_api.guards import Budgets
from fairlimit.grpc_api.headers import ResponseOptions
from fairlimit.grpc_api.servicer import GrpcServer
from fairlimit.grpc_api.tls import TlsFiles
from fairlimit.grpc_api.xds import XdsConfigSource
from fairlimit.limiter import Limiter
from fairlimit.quota import QuotaService
from fairlimit.settings import Settings, parse_address
from fairlimit.store import open_store
from fairlimit.store.replicas import Replicas
from fairlimit.telemetry import Telemetry
from fairlimit.telemetry.latency import RpcLatency
from fairlimit.telemetry.quota import QuotaTelemetry
from fairlimit.telemetry.upstream import UpstreamStats

log = logging.getLogger("fairlimit")

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


def check_listeners(settings: Settings, worker: int) -> None:
    if not settings.grpc_addr.startswith("unix:"):
        check_listen("gRPC", settings.grpc_addr, reuse_port=settings.workers > 1)
    if worker:
        return  # the admin port and its side listeners are worker 0's
    check_listen("admin HTTP", settings.admin_addr)
    if settings.debug_addr is not None:
        check_listen("the debug port", settings.debug_addr)
    if settings.metrics_addr is not None:
        check_listen("metrics", settings.metrics_addr)


def roots(settings: Settings) -> tuple[Path, ...]:
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


def tls(settings: Settings) -> TlsFiles | None:
    """The TLS files named by the settings (read at start and again when they change)."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    return TlsFiles(settings.tls_cert, settings.tls_key, settings.tls_client_ca)


def response_options(settings: Settings) -> ResponseOptions:
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


def config_source(settings: Settings, apply: Apply, reject: Reject) -> ConfigSource:
    """The files, or the xDS management server when CONFIG_TYPE=GRPC_XDS_SOTW asks for it."""
    if settings.config_source == "xds":
        return XdsConfigSource(
            settings.xds, strict=settings.strict, merge_domains=settings.merge_domains,
            apply=apply, reject=reject, charge_over_limit=settings.charges_over_limit,
        )  # fmt: skip
    return ConfigWatcher(
        settings.config,
        strict=settings.strict,
        merge_domains=settings.merge_domains,
        allow_empty=settings.allow_empty_config,
        apply=apply,
        reject=reject,
        charge_over_limit=settings.charges_over_limit,
        ignore_dotfiles=settings.ignore_dotfiles,
        roots=roots(settings),
    )


def telemetry(
    settings: Settings, given: Telemetry | None, rpc_latency: RpcLatency | None = None
) -> Telemetry:
    """``given``, or one of our own (on the global providers cli.py installed, the latency
    histogram kept in ``rpc_latency``, which ``telemetry.sdk`` exports); set up."""
    telemetry = given or Telemetry(top_clients=settings.top_clients, rpc_latency=rpc_latency)
    telemetry.near_limit_ratio = settings.near_limit_ratio
    if settings.metrics_compat:
        telemetry.upstream = UpstreamStats(settings.near_limit_ratio)
    return telemetry


def side_listeners(settings: Settings, admin: AdminServer) -> list[SideListener]:
    """upstream's debug port (text /rlconfig) and PROMETHEUS_ADDR, where asked for."""
    listeners = []
    if settings.debug_addr is not None:
        host, port = parse_address("--debug-addr", settings.debug_addr)
        routes = {"/rlconfig": admin.rlconfig_text}
        listeners.append(SideListener(host, port, routes, settings.admin_timeout))
    if settings.metrics_addr is not None:
        host, port = parse_address("--metrics-addr", settings.metrics_addr)
        routes = {settings.metrics_path: admin.metrics}
        listeners.append(SideListener(host, port, routes, settings.admin_timeout))
    return listeners


def limiter(
    settings: Settings, loaded: Loaded, telemetry: Telemetry, replicas: Replicas
) -> Limiter:
    return Limiter(
        loaded,
        open_store(settings.backend),
        shadow=settings.shadow,
        failure_mode=settings.failure_mode,
        telemetry=telemetry,
        quota_mode=settings.quota_mode,
        replicas=replicas,
    )


def quota(
    settings: Settings, limiter: Limiter, telemetry: Telemetry, replicas: Replicas
) -> QuotaService:
    return QuotaService(
        lambda: limiter.loaded,
        limiter.store,
        limiter.clock.now,
        shadow=settings.shadow,
        telemetry=QuotaTelemetry() if telemetry.enabled else QuotaTelemetry.off(),
        divide_gap=DRIP_SECONDS,  # a put-off division runs at the next drip
        tally=limiter.tally,  # RLS demand at caps counts in the RLQS division
        replicas=replicas,
        max_buckets_per_stream=settings.rlqs_max_buckets_per_stream,
        max_buckets=settings.rlqs_max_buckets,
    )


def grpc(settings: Settings, limiter: Limiter, quota: QuotaService) -> GrpcServer:
    return GrpcServer(
        limiter,
        limiter.telemetry,
        settings.grpc_addr,
        tls(settings),
        settings.workers > 1,  # reuse_port: the workers share the port (workers.py)
        response_options(settings),
        (settings.max_connection_age, settings.max_connection_age_grace),
        quota=quota,
        budgets=Budgets.of(settings),
    )
