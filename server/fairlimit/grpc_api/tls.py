"""gRPC server TLS from certificate files, read again when they change (rotation)."""

import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from fairlimit.settings import check_tls_pair

log = logging.getLogger(__name__)

_Stamp = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """Where the serving certificate chain, its key and (for mTLS) the client CA live.

    grpc asks for a new configuration at each handshake; the files are stat'ed then and
    read again when one changed (cert-manager and Kubernetes Secret mounts swap them in
    place). A changed set that does not load (a key that does not match its certificate,
    a half-written file) is logged and the previous certificate stays.
    """

    cert: Path
    key: Path
    client_ca: Path | None = None

    def _files(self) -> tuple[Path, ...]:
        return (self.cert, self.key) + ((self.client_ca,) if self.client_ca else ())

    def stamp(self) -> _Stamp:
        """What identifies the files' current versions (follows symlinks)."""
        stats = [p.stat() for p in self._files()]
        return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in stats)

    def configuration(self) -> object:
        """The files' contents as a grpc certificate configuration, the pair checked."""
        check_tls_pair(self.cert, self.key)
        ca = self.client_ca.read_bytes() if self.client_ca else None
        pair = (self.key.read_bytes(), self.cert.read_bytes())
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials that pick up changed files at the next handshake."""
        return grpc.dynamic_ssl_server_credentials(
            self.configuration(),
            _Fetcher(self).fetch,
            require_client_authentication=self.client_ca is not None,
        )


class _Fetcher:
    """grpc's certificate configuration fetcher: None while nothing changed."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self.seen = files.stamp()

    def fetch(self) -> object | None:
        try:
            stamp = self.files.stamp()
            if stamp == self.seen:
                return None
            self.seen = stamp
            configuration = self.files.configuration()
        except (OSError, ssl.SSLError) as exc:  # a rotation caught half-way, or a bad pair
            log.error("TLS files changed but cannot be used (%s): keeping the last good ones", exc)
            return None
        log.info("TLS certificate reloaded from %s", self.files.cert)
        return configuration
