"""envoyproxy/ratelimit's environment variables, read as aliases of fairlimit's settings.

``translate(environ)`` gives the settings (by field name, as text) that upstream variables
ask for, and the names of set upstream variables that fairlimit does not honour, for one
startup warning. ``FAIRLIMIT_*`` variables and flags are applied after these, so they win.
Variables whose purpose fairlimit serves another way without a setting (the goruntime
dot-file and watch knobs, pipelining, key expiry jitter) are accepted quietly.
"""

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from urllib.parse import quote

from fairlimit.errors import SettingsError

# Accepted with no setting behind them: fairlimit's behaviour already covers their purpose.
QUIET = frozenset({
    "EXPIRATION_JITTER_MAX_SECONDS",  # keys expire with their window
    "REDIS_PIPELINE_WINDOW", "REDIS_PIPELINE_LIMIT", "REDIS_CLUSTER_PIPELINE_PARALLELISM",
    "LOCAL_CACHE_SIZE_IN_BYTES",  # the over-limit cache is always on (local_cache= entries)
    "REDIS_POOL_ON_EMPTY_BEHAVIOR",  # the pool waits, within the request's timeout
    "BACKEND_TYPE",  # redis: the default; memcache is refused below
    "USE_STATSD", "DISABLE_STATS", "STATS_FLUSH_INTERVAL",  # see _stats
})  # fmt: skip

# Recognised, and named in the startup warning when set: fairlimit has no equivalent.
UNSUPPORTED = frozenset({
    "GRPC_CLIENT_TLS_SAN", "STATSD_HOST", "STATSD_PORT",
    "USE_DOG_STATSD", "USE_DOG_STATSD_MOGRIFIERS", "EXTRA_TAGS", "PROMETHEUS_MAPPER_YAML",
    "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS", "CACHE_KEY_PREFIX", "REDIS_PERSECOND",
    "REDIS_PERSECOND_SOCKET_TYPE", "REDIS_PERSECOND_TYPE", "REDIS_PERSECOND_URL",
    "REDIS_PERSECOND_POOL_SIZE", "REDIS_PERSECOND_AUTH", "REDIS_PERSECOND_TLS",
    "REDIS_PERSECOND_SENTINEL_AUTH", "REDIS_PERSECOND_PIPELINE_WINDOW",
    "REDIS_PERSECOND_PIPELINE_LIMIT", "REDIS_PERSECOND_CLUSTER_PIPELINE_PARALLELISM",
    "REDIS_PERSECOND_TIMEOUT", "REDIS_PERSECOND_POOL_ON_EMPTY_BEHAVIOR",
    "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION", "REDIS_STARTUP_INITIAL_INTERVAL",
    "REDIS_STARTUP_MAX_INTERVAL", "REDIS_STARTUP_MAX_ELAPSED_TIME",
    "MEMCACHE_HOST_PORT", "MEMCACHE_MAX_IDLE_CONNS",
    "MEMCACHE_SRV", "MEMCACHE_SRV_REFRESH", "MEMCACHE_TLS", "MEMCACHE_TLS_CLIENT_CERT",
    "MEMCACHE_TLS_CLIENT_KEY", "MEMCACHE_TLS_CACERT", "MEMCACHE_TLS_SKIP_HOSTNAME_VERIFICATION",
    "TRACING_ENABLED", "TRACING_SERVICE_NAME", "TRACING_SERVICE_NAMESPACE",
    "TRACING_SERVICE_INSTANCE_ID", "TRACING_EXPORTER_PROTOCOL", "TRACING_SAMPLING_RATE",
    "XDS_CLIENT_BACKOFF_JITTER",
    "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "XDS_CLIENT_BACKOFF_MAX_INTERVAL",
    "XDS_CLIENT_BACKOFF_RANDOM_FACTOR", "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES",
})  # fmt: skip

# Upstream variable -> Settings field, by how the value is read.
_BOOLEANS = (
    ("SHADOW_MODE", "shadow"), ("QUOTA_MODE", "quota_mode"),
    ("MERGE_DOMAIN_CONFIG", "merge_domains"), ("RESPONSE_DYNAMIC_METADATA", "response_metadata"),
    ("LIMIT_RESPONSE_HEADERS_ENABLED", "response_headers"),
    ("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", "healthy_with_config"),
    ("USE_PROMETHEUS", "metrics_compat"),
    ("FORCE_START_WITHOUT_INITIAL_CONFIG", "force_start"),
    ("RUNTIME_IGNOREDOTFILES", "ignore_dotfiles"),
)  # fmt: skip
_TEXT = (
    ("LIMIT_LIMIT_HEADER", "header_limit"), ("LIMIT_REMAINING_HEADER", "header_remaining"),
    ("LIMIT_RESET_HEADER", "header_reset"), ("LOG_LEVEL", "log_level"),
    ("LOG_FORMAT", "log_format"), ("NEAR_LIMIT_RATIO", "near_limit_ratio"),
    ("PROMETHEUS_PATH", "metrics_path"),
)  # fmt: skip
_DURATIONS = (
    ("GRPC_MAX_CONNECTION_AGE", "max_connection_age"),
    ("GRPC_MAX_CONNECTION_AGE_GRACE", "max_connection_age_grace"),
)
_XDS_TEXT = (
    ("CONFIG_GRPC_XDS_SERVER_URL", "xds_server"), ("CONFIG_GRPC_XDS_NODE_ID", "xds_node_id"),
    ("CONFIG_GRPC_XDS_NODE_METADATA", "xds_node_metadata"),
    ("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", "xds_headers"),
)  # fmt: skip
_XDS_TLS = (
    ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "xds_server_ca"),
    ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "xds_client_cert"),
    ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "xds_client_key"),
    ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "xds_server_san"),
)
_TRUE = frozenset({"1", "t", "true", "yes", "on"})  # Go's strconv.ParseBool, lower-cased
_FALSE = frozenset({"0", "f", "false", "no", "off"})
_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
_SCALE = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def boolean(name: str, text: str, true: frozenset[str], false: frozenset[str]) -> bool:
    """``text`` as a boolean by the given spellings (case aside); SettingsError naming ``name``."""
    value = text.strip().lower()
    if value in true:
        return True
    if value in false:
        return False
    raise SettingsError(f"{name}: expected true or false, got {text!r}")


def go_bool(name: str, text: str) -> bool:
    """A boolean as upstream's envconfig reads it (Go's ParseBool)."""
    return boolean(name, text, _TRUE, _FALSE)


def go_duration(name: str, text: str) -> float:
    """A Go duration (``24h``, ``1h30m``, ``500ms``, ``0``) in seconds."""
    value = text.strip()
    if value in ("0", "+0"):
        return 0.0
    parts = _DURATION.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise SettingsError(f"{name}: expected a duration such as 24h or 500ms, got {text!r}")
    return sum(float(n) * _SCALE[u] for n, u in parts)


@dataclass(slots=True)
class Translation:
    """What upstream variables ask of fairlimit's settings."""

    values: dict[str, str] = field(default_factory=dict)  # by Settings field name
    unsupported: list[str] = field(default_factory=list)  # set, and not honoured
    sources: dict[str, str] = field(default_factory=dict)  # field -> the variables behind it

    def set(self, name: str, value: str, source: str) -> None:
        """Setting ``name`` to ``value``, asked for by the upstream variable(s) ``source``."""
        self.values[name] = value
        self.sources[name] = source

    def warning(self) -> str | None:
        """The one startup warning naming every set upstream variable that has no effect."""
        return unsupported_warning(self.unsupported)


def unsupported_warning(names: Sequence[str]) -> str | None:
    """One line naming ``names``, the set upstream variables fairlimit does not honour."""
    if not names:
        return None
    return (
        f"envoyproxy/ratelimit settings not supported by fairlimit, ignored: "
        f"{', '.join(sorted(names))} (see docs/migrating-from-envoy-ratelimit.md)"
    )


def _address(env: Mapping[str, str], host: str, port: str, default_host: str,
             default_port: str) -> str | None:  # fmt: skip
    if host not in env and port not in env:
        return None
    text = env.get(port, default_port).strip()
    if not text.isdigit():
        raise SettingsError(f"{port}: expected a port number, got {text!r}")
    name = env.get(host, default_host).strip() or "0.0.0.0"
    return f"[{name}]:{text}" if ":" in name else f"{name}:{text}"


def _listeners(env: Mapping[str, str], out: Translation) -> None:
    if env.get("GRPC_UDS", "").strip():
        out.set("grpc_addr", "unix:" + env["GRPC_UDS"].strip(), "GRPC_UDS")
    elif (grpc := _address(env, "GRPC_HOST", "GRPC_PORT", "0.0.0.0", "8081")) is not None:
        out.set("grpc_addr", grpc, "GRPC_HOST/GRPC_PORT")
    if (admin := _address(env, "HOST", "PORT", "0.0.0.0", "8080")) is not None:
        out.set("admin_addr", admin, "HOST/PORT")
    if (debug := _address(env, "DEBUG_HOST", "DEBUG_PORT", "0.0.0.0", "6070")) is not None:
        out.set("debug_addr", debug, "DEBUG_HOST/DEBUG_PORT")
    for name, target in _DURATIONS:
        if name in env:
            out.set(target, str(go_duration(name, env[name])), name)


def _tls(env: Mapping[str, str], out: Translation) -> None:
    if not go_bool("GRPC_SERVER_USE_TLS", env.get("GRPC_SERVER_USE_TLS", "false")):
        return
    out.set("tls_cert", env.get("GRPC_SERVER_TLS_CERT", ""), "GRPC_SERVER_TLS_CERT")
    out.set("tls_key", env.get("GRPC_SERVER_TLS_KEY", ""), "GRPC_SERVER_TLS_KEY")
    if env.get("GRPC_CLIENT_TLS_CACERT"):
        out.set("tls_client_ca", env["GRPC_CLIENT_TLS_CACERT"], "GRPC_CLIENT_TLS_CACERT")


def _xds(env: Mapping[str, str], out: Translation) -> None:
    """CONFIG_TYPE=GRPC_XDS_SOTW: the management server, who we are, and TLS to it."""
    out.set("config_source", "xds", "CONFIG_TYPE")
    for name, target in _XDS_TEXT:
        if name in env:
            out.set(target, env[name], name)
    use_tls = "CONFIG_GRPC_XDS_SERVER_USE_TLS"
    if go_bool(use_tls, env.get(use_tls, "false")):
        out.set("xds_tls", "true", use_tls)
        for name, target in _XDS_TLS:
            if env.get(name):
                out.set(target, env[name], name)
    retry = "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL"
    if retry in env:
        out.set("xds_retry", str(go_duration(retry, env[retry])), retry)


def _config(env: Mapping[str, str], out: Translation) -> None:
    kind = env.get("CONFIG_TYPE", "FILE").strip().upper()
    if kind == "GRPC_XDS_SOTW":
        _xds(env, out)
        return
    if kind != "FILE":
        raise SettingsError(f"CONFIG_TYPE: expected FILE or GRPC_XDS_SOTW, got {kind!r}")
    layout = ("RUNTIME_ROOT", "RUNTIME_SUBDIRECTORY", "RUNTIME_APPDIRECTORY")
    if any(name in env for name in layout):
        root = env.get("RUNTIME_ROOT", "/srv/runtime_data/current")
        parts = [env.get("RUNTIME_SUBDIRECTORY", ""), env.get("RUNTIME_APPDIRECTORY", "config")]
        source = "RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY"
        out.set("config", str(PurePosixPath(root, *[p for p in parts if p])), source)
        # upstream's files cannot say charge_when_over_limit: every hit counts, as there
        out.set("charge_when_over_limit", "true", source)
        out.set("rule_names", "false", source)  # and its response, exactly
        # upstream loads a directory without limits (no file, or domains without rules) as
        # a config that limits nothing; so does fairlimit under upstream's layout
        out.set("allow_empty_config", "true", source)
        out.set("runtime_root", root, "RUNTIME_ROOT")
        if "RUNTIME_WATCH_ROOT" in env:  # true (upstream's default): a swap of it reloads
            watch = go_bool("RUNTIME_WATCH_ROOT", env["RUNTIME_WATCH_ROOT"])
            out.set("watch_root", str(watch).lower(), "RUNTIME_WATCH_ROOT")


def _flags(env: Mapping[str, str], out: Translation) -> None:
    for name, target in _BOOLEANS:
        if name in env:
            out.set(target, str(go_bool(name, env[name])).lower(), name)
    for name, target in _TEXT:
        if name in env:
            out.set(
                target, env[name].strip().lower() if name.startswith("LOG") else env[name], name
            )
    if out.values.get("metrics_compat") == "true":
        # upstream serves its Prometheus sink on PROMETHEUS_ADDR, :9090 unless set
        host, _, port = env.get("PROMETHEUS_ADDR", ":9090").rpartition(":")
        out.set("metrics_addr", f"{host or '0.0.0.0'}:{port}", "PROMETHEUS_ADDR")


def _stats(env: Mapping[str, str], out: Translation) -> None:
    # Upstream sends statsd by default; fairlimit exports OpenTelemetry (OTLP and /metrics).
    # Asking for statsd explicitly is named, leaving it at its default is not.
    if "USE_STATSD" in env and go_bool("USE_STATSD", env["USE_STATSD"]):
        out.unsupported.append("USE_STATSD")
    stop = "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT"
    if stop in env:  # true: a refused request consumes nothing (upstream still counts the
        # keys that went over: docs/migrating-from-envoy-ratelimit.md)
        out.set("charge_when_over_limit", str(not go_bool(stop, env[stop])).lower(), stop)


def _redis_hosts(env: Mapping[str, str]) -> tuple[str, str]:
    """(scheme, host list and path) for REDIS_TYPE and REDIS_URL."""
    kind = env.get("REDIS_TYPE", "SINGLE").strip().lower()
    url = env["REDIS_URL"].strip()
    if kind == "sentinel":
        master, _, hosts = url.partition(",")
        if not master or not hosts:
            raise SettingsError("REDIS_URL: for SENTINEL, the master name then host:port, ...")
        return "redis+sentinel", f"{hosts}/{master}"
    if kind == "cluster":
        return "redis+cluster", url
    if kind != "single":
        raise SettingsError(f"REDIS_TYPE: expected SINGLE, SENTINEL or CLUSTER, got {kind!r}")
    return "redis", url


def _redis(env: Mapping[str, str], out: Translation) -> None:
    if env.get("BACKEND_TYPE", "redis").strip().lower() == "memcache":
        raise SettingsError("BACKEND_TYPE: memcache is not supported; use Redis (REDIS_URL)")
    if "REDIS_URL" not in env:
        return  # upstream's default is a nutcracker socket; fairlimit keeps memory://
    if env.get("REDIS_SOCKET_TYPE", "unix").strip().lower() == "unix" and "/" in env["REDIS_URL"]:
        raise SettingsError("REDIS_SOCKET_TYPE: unix sockets are not supported; use tcp")
    scheme, hosts = _redis_hosts(env)
    tls = go_bool("REDIS_TLS", env.get("REDIS_TLS", "false"))
    if tls and scheme == "redis":
        scheme = "rediss"
    auth = env.get("REDIS_AUTH", "")
    user, _, secret = auth.rpartition(":") if ":" in auth else ("", "", auth)
    userinfo = f"{quote(user, safe='')}:{quote(secret, safe='')}@" if auth else ""
    query = [f"{k}={quote(v, safe='/')}" for k, v in _redis_query(env, tls)]
    suffix = "?" + "&".join(query) if query else ""
    out.set("backend", f"{scheme}://{userinfo}{hosts}{suffix}", "REDIS_URL")


def _redis_query(env: Mapping[str, str], tls: bool) -> list[tuple[str, str]]:
    query: list[tuple[str, str]] = []
    if "REDIS_POOL_SIZE" in env:
        query.append(("max_connections", env["REDIS_POOL_SIZE"].strip()))
    if "REDIS_TIMEOUT" in env:
        query.append(("timeout", str(go_duration("REDIS_TIMEOUT", env["REDIS_TIMEOUT"]))))
    if env.get("REDIS_SENTINEL_AUTH"):
        query.append(("sentinel_password", env["REDIS_SENTINEL_AUTH"].rpartition(":")[2]))
    if tls:
        for name, key in (("REDIS_TLS_CACERT", "ssl_ca_certs"),
                          ("REDIS_TLS_CLIENT_CERT", "ssl_certfile"),
                          ("REDIS_TLS_CLIENT_KEY", "ssl_keyfile")):  # fmt: skip
            if env.get(name):
                query.append((key, env[name]))
        skip = env.get("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", "false")
        if go_bool("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", skip):
            query.append(("ssl_check_hostname", "false"))
        if env.get("REDIS_TYPE", "").strip().lower() in ("sentinel", "cluster"):
            query.append(("ssl", "true"))
    return query


_STEPS: tuple[Callable[[Mapping[str, str], Translation], None], ...] = (
    _listeners, _tls, _config, _flags, _stats, _redis
)  # fmt: skip


def translate(environ: Mapping[str, str]) -> Translation:
    """The settings that ``environ``'s upstream variables ask for (SettingsError if malformed)."""
    out = Translation()
    for step in _STEPS:
        step(environ, out)
    out.unsupported.extend(name for name in UNSUPPORTED if name in environ)
    return out
