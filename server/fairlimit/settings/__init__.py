"""Serve settings from a mapping (the environment) and the command line; read once in cli.py.

Plain values, checked for shape only (and the TLS files, for being a usable pair): whether a
backend URL names a store that exists is the store's to say (``open_store``), at start.
"""

import enum
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fairlimit.errors import SettingsError
from fairlimit.settings.upstream import boolean, translate, unsupported_warning
from fairlimit.settings.xds import XdsSection, XdsTlsFiles, pairs

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


ADMIN_JSON = ("loopback", "on", "off")  # --admin-json


class FailureMode(enum.Enum):
    """What the limiter answers while the backend is down."""

    OPEN = "open"  # answer OK when the backend is down, and count it
    CLOSED = "closed"  # answer UNAVAILABLE so Envoy's failure_mode_deny decides
    LOCAL = "local"  # decide alone, to this process's part of every limit (policy/local.py)


def bundled_descriptors() -> Path:
    """The descriptors shipped with fairlimit: the checkout's, else the installed copy."""
    checkout = Path(__file__).resolve().parents[3] / "descriptors"
    if checkout.is_dir():
        return checkout
    return Path(sys.prefix) / "share" / "fairlimit" / "descriptors"


def _flag(name: str, text: str) -> bool:
    return boolean(name, text, _TRUE, _FALSE)


def parse_address(name: str, text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); SettingsError when malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or not host:
        raise SettingsError(f"{name}: expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


MAX_TOP_CLIENTS = 1000  # the top-clients summaries are sorted as they fill: keep them small


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything ``fairlimit serve`` needs, validated."""

    config: tuple[Path, ...] = field(default_factory=lambda: (bundled_descriptors(),))
    backend: str = "memory://"
    grpc_addr: str = "0.0.0.0:8081"
    admin_addr: str = "127.0.0.1:8080"
    strict: bool = False
    failure_mode: FailureMode = FailureMode.OPEN
    # Pods sharing the backend, for --failure-mode local: each process (pod x worker) keeps
    # 1/(replicas x workers) of every limit, or 1/(processes last seen) when more; 0: only
    # the processes last seen count.
    replicas: int = 0
    shadow: bool = False
    workers: int = 1
    log_format: str = "text"
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    top_clients: int = 16  # counters per cap for ``GET /top`` (memory: 2x this); 0 = off
    log_level: str = "info"
    debug_addr: str | None = None  # upstream's DEBUG_PORT listener (text /rlconfig)
    max_connection_age: float | None = None  # seconds; None: connections are kept
    max_connection_age_grace: float | None = None
    quota_mode: bool = False
    merge_domains: bool = False
    near_limit_ratio: float = 0.8
    response_headers: bool = False
    header_limit: str = "RateLimit-Limit"
    header_remaining: str = "RateLimit-Remaining"
    header_reset: str = "RateLimit-Reset"
    response_metadata: bool = False
    # Upstream's HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED: /healthcheck, /readyz and gRPC
    # health fail until a config with at least one domain is loaded.
    healthy_with_config: bool = False
    # A config that limits nothing (no descriptor file in a directory given, no limit at
    # all) is refused at start and on reload unless this is set.
    allow_empty_config: bool = False
    # The largest gRPC message received. Envoy's requests are a few hundred bytes, and an RLQS
    # report about 100 bytes a bucket: 256 KiB holds a report of a stream's most buckets with
    # room to spare. 0: the largest request the bounds admit (~2.1 MB), for callers that send
    # requests near every bound. These call budgets' defaults are the only ones
    # (grpc_api/guards.py's Budgets are made from them).
    grpc_max_receive_bytes: int = 256 * 1024
    # Rate-limit calls served at once; beyond, RESOURCE_EXHAUSTED. With the RLQS streams and
    # the receive limit it bounds the memory a flood of maximal requests can take.
    grpc_max_concurrent: int = 32
    rlqs_max_streams: int = 64  # RLQS streams open at once (one per Envoy that uses RLQS)
    # RLQS buckets one stream may hold, and subscriptions (a stream's bucket) all of this
    # process's streams; a new bucket past either is refused (quota/service.py says why
    # these defaults).
    rlqs_max_buckets_per_stream: int = 1000
    rlqs_max_buckets: int = 10_000
    # HTTP/2 streams open on one connection (SETTINGS_MAX_CONCURRENT_STREAMS); 0: none sent.
    # Streams a fresh connection opens past it before reading the setting are reset
    # (REFUSED_STREAM), which Envoy counts as a failed call and lets through: the budgets
    # above bound the load instead.
    grpc_max_streams_per_connection: int = 0
    grpc_read_timeout: float = 1.0  # seconds a call has to deliver its (first) message
    # On SIGTERM, seconds to keep answering while health says NOT_SERVING, before draining.
    drain_delay: float = 0.0
    # Admin HTTP: seconds a client may take to send a request's headers, or its body.
    admin_timeout: float = 10.0
    # Where POST /json is served (it spends real quota): on a loopback-bound admin port, any, none.
    admin_json: str = "loopback"
    metrics_compat: bool = False  # upstream's Prometheus names next to ours
    metrics_addr: str | None = None  # a listener of its own for /metrics (PROMETHEUS_ADDR)
    metrics_path: str = "/metrics"
    config_source: str = "file"  # or "xds": CONFIG_TYPE=GRPC_XDS_SOTW
    xds_server: str = "localhost:18000"
    xds_node_id: str = "default"
    xds_node_metadata: str = ""  # "key=value,key2=value2"
    xds_headers: str = ""  # "name:value,name2:value2", sent with the stream
    xds_retry: float = 3.0  # seconds between reconnections
    xds_tls: bool = False
    xds_server_ca: Path | None = None
    xds_client_cert: Path | None = None
    xds_client_key: Path | None = None
    xds_server_san: str = ""  # the name to verify instead of the server URL's host
    # upstream's FORCE_START_WITHOUT_INITIAL_CONFIG: with xDS, serve at once rather than
    # after the management server's first config
    force_start: bool = False
    # What a rate limit that does not say charge_when_over_limit does: True, every hit
    # counts, refused or not (upstream's); False, a refused request consumes nothing.
    # None: True for xDS (a RateLimitConfig cannot say) and under upstream's variables
    # (settings/upstream.py sets it), False for fairlimit's own files.
    charge_when_over_limit: bool | None = None
    # Whether statuses are named by their rule (current_limit.name, so Envoy's quota policy
    # says name="<rule>"), with RateLimit-Policy/RateLimit headers and the fairlimit metadata.
    # None: off for xDS and under upstream's layout (upstream's exact response: Envoy
    # Gateway's conformance tests read X-RateLimit-Limit whole), on for fairlimit's files.
    rule_names: bool | None = None
    ignore_dotfiles: bool = False  # upstream's RUNTIME_IGNOREDOTFILES: skip a dir's .* files
    # upstream's RUNTIME_ROOT (when its layout names the config) and RUNTIME_WATCH_ROOT: a
    # swap of the root (a symlink) to another directory reloads the config
    runtime_root: Path | None = None
    watch_root: bool = True
    unsupported_upstream: tuple[str, ...] = ()  # set upstream variables with no effect

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "Settings":
        """Defaults, then envoyproxy/ratelimit's variables, then FAIRLIMIT_* (which win)."""
        upstream = translate(environ)
        base = cls(unsupported_upstream=tuple(sorted(upstream.unsupported)))
        raw: dict[str, str] = {}
        for name in cls.__dataclass_fields__:
            value = environ.get(f"FAIRLIMIT_{name.upper()}")
            if value is not None:
                raw[name] = value
        return base.override(upstream.values, upstream.sources).override(raw, "FAIRLIMIT_")

    @property
    def names_rules(self) -> bool:
        """Whether statuses and the optional response parts name their rule."""
        if self.rule_names is not None:
            return self.rule_names
        return self.config_source != "xds"

    @property
    def charges_over_limit(self) -> bool:
        """Whether a limit that does not say charge_when_over_limit counts refused hits."""
        if self.charge_when_over_limit is not None:
            return self.charge_when_over_limit
        return self.config_source == "xds"

    @property
    def xds(self) -> XdsSection:
        """The xDS settings, typed (CONFIG_TYPE=GRPC_XDS_SOTW)."""
        tls = None
        if self.xds_tls:
            name = self.xds_server_san or None
            tls = XdsTlsFiles(self.xds_server_ca, self.xds_client_cert, self.xds_client_key, name)
        headers = tuple((name.lower(), value) for name, value in pairs(self.xds_headers, ":"))
        return XdsSection(self.xds_server, self.xds_node_id, pairs(self.xds_node_metadata, "="),
                          headers, self.xds_retry, tls)  # fmt: skip

    def upstream_warning(self) -> str | None:
        """The one startup warning naming set upstream variables that have no effect."""
        return unsupported_warning(self.unsupported_upstream)

    def override(
        self, raw: Mapping[str, object], source: str | Mapping[str, str] = "--"
    ) -> "Settings":
        """A copy with ``raw`` (strings or lists of strings, by field name) applied.

        ``source`` names where the values came from, for messages: ``"--"`` (flags),
        ``"FAIRLIMIT_"``, or the upstream variables behind each field.
        """
        values: dict[str, object] = {n: getattr(self, n) for n in self.__dataclass_fields__}
        for name, value in raw.items():
            if not isinstance(source, str):
                label = source.get(name, name)
            elif source == "FAIRLIMIT_":
                label = f"FAIRLIMIT_{name.upper()}"
            else:
                label = f"--{name.replace('_', '-')}"
            values[name] = _convert(label, name, value)
        settings = Settings(**values)  # type: ignore[arg-type]  # each value converted above
        settings.validate()
        return settings

    def validate(self) -> None:
        scheme, sep, _ = self.backend.partition("://")
        if not sep or not scheme:
            raise SettingsError(f"--backend: expected a URL (SCHEME://...), got {self.backend!r}")
        if not self.grpc_addr.startswith("unix:"):
            parse_address("--grpc-addr", self.grpc_addr)
        for flag, address in (("--admin-addr", self.admin_addr), ("--debug-addr", self.debug_addr),
                              ("--metrics-addr", self.metrics_addr)):  # fmt: skip
            if address is not None:
                parse_address(flag, address)
        if self.config_source not in ("file", "xds"):
            raise SettingsError(
                f"--config-source: expected file or xds, got {self.config_source!r}"
            )
        if not 0 <= self.near_limit_ratio <= 1:
            raise SettingsError(f"--near-limit-ratio: expected 0 to 1, got {self.near_limit_ratio}")
        if self.log_level not in _LOG_LEVELS:
            raise SettingsError(
                f"--log-level: expected one of {', '.join(_LOG_LEVELS)}, got {self.log_level!r}"
            )
        if not 0 <= self.drain_delay < float("inf"):
            raise SettingsError(
                f"--drain-delay: expected seconds, 0 or more, got {self.drain_delay}"
            )
        if not 0 < self.admin_timeout < float("inf"):
            raise SettingsError(f"--admin-timeout: must be above 0, got {self.admin_timeout}")
        for flag, count in (("--grpc-max-concurrent", self.grpc_max_concurrent),
                            ("--rlqs-max-streams", self.rlqs_max_streams),
                            ("--rlqs-max-buckets-per-stream", self.rlqs_max_buckets_per_stream),
                            ("--rlqs-max-buckets", self.rlqs_max_buckets)):  # fmt: skip
            if count < 1:
                raise SettingsError(f"{flag}: must be 1 or more, got {count}")
        if not 0 < self.grpc_read_timeout < float("inf"):
            timeout = self.grpc_read_timeout
            raise SettingsError(f"--grpc-read-timeout: must be above 0, got {timeout}")
        if self.workers < 1:
            raise SettingsError(f"--workers: must be 1 or more, got {self.workers}")
        if self.workers > 1 and self.grpc_addr.startswith("unix:"):
            raise SettingsError("--workers: several workers share a TCP port, not a unix socket")
        if self.workers > 1 and scheme == "memory":
            raise SettingsError(
                "--workers: several workers need shared state; memory:// keeps counters per "
                "process, so use a redis:// backend or --workers 1"
            )
        if not 0 <= self.top_clients <= MAX_TOP_CLIENTS:
            raise SettingsError(
                f"--top-clients: expected 0 to {MAX_TOP_CLIENTS}, got {self.top_clients}"
            )
        if self.admin_json not in ADMIN_JSON:
            choices = ", ".join(ADMIN_JSON)
            raise SettingsError(f"--admin-json: expected {choices}, got {self.admin_json!r}")
        if self.log_format not in ("text", "json"):
            raise SettingsError(f"--log-format: expected text or json, got {self.log_format!r}")
        self._validate_tls()

    def _validate_tls(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SettingsError("--tls-cert and --tls-key: give both, or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise SettingsError("--tls-client-ca: mTLS needs --tls-cert and --tls-key too")
        for flag, path in (
            ("--tls-cert", self.tls_cert),
            ("--tls-key", self.tls_key),
            ("--tls-client-ca", self.tls_client_ca),
        ):
            if path is not None and not path.is_file():
                raise SettingsError(f"{flag}: no such file: {path}")
        if self.tls_cert is None:
            return
        import ssl  # here: 4 MB that only a TLS server needs (limiter imports this module)

        if self.tls_key is not None:
            try:
                check_tls_pair(self.tls_cert, self.tls_key)
            except (OSError, ssl.SSLError) as exc:
                raise SettingsError(
                    f"--tls-key: {self.tls_key} is not the private key of --tls-cert "
                    f"{self.tls_cert}, or one of them is not PEM ({exc})"
                ) from None
        if self.tls_client_ca is not None:
            try:
                ssl.create_default_context(cafile=self.tls_client_ca)
            except (OSError, ssl.SSLError) as exc:
                problem = f"no PEM CA certificate in {self.tls_client_ca} ({exc})"
                raise SettingsError(f"--tls-client-ca: {problem}") from None


def check_tls_pair(cert: Path, key: Path) -> None:
    """Raise ssl.SSLError (or OSError) unless ``key`` is the private key of ``cert``."""
    import ssl  # see Settings._validate_tls

    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)


_FLAGS = frozenset({"strict", "shadow", "quota_mode", "merge_domains", "response_headers",
                    "response_metadata", "healthy_with_config", "metrics_compat",
                    "xds_tls", "allow_empty_config", "force_start",
                    "charge_when_over_limit", "ignore_dotfiles", "watch_root",
                    "rule_names"})  # fmt: skip
_XDS_FILES = frozenset({"xds_server_ca", "xds_client_cert", "xds_client_key"})
_NUMBERS = frozenset(
    {
        "near_limit_ratio",
        "max_connection_age",
        "max_connection_age_grace",
        "xds_retry",
        "drain_delay",
        "admin_timeout",
        "grpc_read_timeout",
    }
)
_COUNTS = frozenset({"workers", "top_clients", "grpc_max_receive_bytes", "grpc_max_concurrent",
                     "rlqs_max_streams", "grpc_max_streams_per_connection",
                     "replicas", "rlqs_max_buckets_per_stream", "rlqs_max_buckets"})  # fmt: skip
_LOG_LEVELS = ("debug", "info", "warning", "warn", "error", "critical", "trace", "fatal", "panic")


def _number(label: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise SettingsError(f"{label}: expected a number, got {text!r}") from None


def _convert(label: str, name: str, value: object) -> object:
    if name == "config":
        items = value.split(os.pathsep) if isinstance(value, str) else list(value)  # type: ignore[call-overload]  # list of str from argparse
        if not items or not all(items):
            raise SettingsError(f"{label}: expected one or more paths")
        return tuple(Path(str(i)) for i in items)
    if isinstance(value, bool):
        return value
    text = str(value)
    if name.startswith("tls_") or name in _XDS_FILES or name == "runtime_root":
        return Path(text) if text else None
    if name in _FLAGS:
        return _flag(label, text)
    if name in _NUMBERS:
        return _number(label, text)
    if name in ("debug_addr", "metrics_addr"):
        return text or None
    if name == "unsupported_upstream":
        return tuple(v for v in text.split(",") if v)
    if name in _COUNTS:
        if not text.isdigit():
            raise SettingsError(f"{label}: expected a whole number, got {text!r}")
        return int(text)
    if name == "failure_mode":
        try:
            return FailureMode(text.lower())
        except ValueError:
            choices = "open, closed or local"
            raise SettingsError(f"{label}: expected {choices}, got {text!r}") from None
    return text
