"""Serve settings from a mapping (the environment) and the command line; read once in cli.py.

Plain values, checked for shape only: whether a backend URL names a store that exists is the
store's to say (``open_store``), when the server starts.
"""

import enum
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fairlimit.errors import SettingsError

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


class FailureMode(enum.Enum):
    """What the limiter answers while the backend is down."""

    OPEN = "open"  # answer OK when the backend is down, and count it
    CLOSED = "closed"  # answer UNAVAILABLE so Envoy's failure_mode_deny decides


def bundled_descriptors() -> Path:
    """The descriptors shipped with fairlimit: the checkout's, else the installed copy."""
    checkout = Path(__file__).resolve().parents[2] / "descriptors"
    if checkout.is_dir():
        return checkout
    return Path(sys.prefix) / "share" / "fairlimit" / "descriptors"


def _flag(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SettingsError(f"{name}: expected true or false, got {text!r}")


def parse_address(name: str, text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); SettingsError when malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or not host:
        raise SettingsError(f"{name}: expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything ``fairlimit serve`` needs, validated."""

    config: tuple[Path, ...] = field(default_factory=lambda: (bundled_descriptors(),))
    backend: str = "memory://"
    grpc_addr: str = "0.0.0.0:8081"
    admin_addr: str = "127.0.0.1:8080"
    strict: bool = False
    failure_mode: FailureMode = FailureMode.OPEN
    shadow: bool = False
    workers: int = 1
    max_connection_age: float = 300.0  # seconds; 0: connections live for ever
    max_connection_age_grace: float = 10.0
    log_format: str = "text"
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "Settings":
        """Defaults overridden by FAIRLIMIT_* variables of ``environ``."""
        raw: dict[str, str] = {}
        for name in cls.__dataclass_fields__:
            value = environ.get(f"FAIRLIMIT_{name.upper()}")
            if value is not None:
                raw[name] = value
        return cls().override(raw, source="FAIRLIMIT_")

    def override(self, raw: Mapping[str, object], source: str = "--") -> "Settings":
        """A copy with ``raw`` (strings or lists of strings, by field name) applied."""
        values: dict[str, object] = {n: getattr(self, n) for n in self.__dataclass_fields__}
        for name, value in raw.items():
            label = (
                f"FAIRLIMIT_{name.upper()}"
                if source == "FAIRLIMIT_"
                else f"--{name.replace('_', '-')}"
            )
            values[name] = _convert(label, name, value)
        settings = Settings(**values)  # type: ignore[arg-type]  # each value converted above
        settings.validate()
        return settings

    def validate(self) -> None:
        scheme, sep, _ = self.backend.partition("://")
        if not sep or not scheme:
            raise SettingsError(f"--backend: expected a URL (SCHEME://...), got {self.backend!r}")
        parse_address("--grpc-addr", self.grpc_addr)
        parse_address("--admin-addr", self.admin_addr)
        if self.workers < 1:
            raise SettingsError(f"--workers: must be 1 or more, got {self.workers}")
        if self.workers > 1 and scheme == "memory":
            raise SettingsError(
                "--workers: several workers need shared state; memory:// keeps counters per "
                "process, so use a redis:// backend or --workers 1"
            )
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


def _convert(label: str, name: str, value: object) -> object:
    if name == "config":
        items = value.split(os.pathsep) if isinstance(value, str) else list(value)  # type: ignore[call-overload]  # list of str from argparse
        if not items or not all(items):
            raise SettingsError(f"{label}: expected one or more paths")
        return tuple(Path(str(i)) for i in items)
    if isinstance(value, bool):
        return value
    text = str(value)
    if name.startswith("tls_"):
        return Path(text) if text else None
    if name in ("strict", "shadow"):
        return _flag(label, text)
    if name == "workers":
        if not text.isdigit():
            raise SettingsError(f"{label}: expected a whole number, got {text!r}")
        return int(text)
    if name.startswith("max_connection_age"):
        try:
            seconds = float(text)
        except ValueError:
            seconds = -1.0
        if not seconds >= 0 or seconds == float("inf"):
            raise SettingsError(f"{label}: expected seconds (0 or more), got {text!r}")
        return seconds
    if name == "failure_mode":
        try:
            return FailureMode(text.lower())
        except ValueError:
            raise SettingsError(f"{label}: expected open or closed, got {text!r}") from None
    return text
