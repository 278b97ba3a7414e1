"""The xDS section of the settings: where the management server is, and who we are to it.

The flat ``xds_*`` settings (one flag or variable each) are read here into typed values,
so that the xDS client (``grpc_api/xds.py``) gets no strings to parse.
"""

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class XdsTlsFiles:
    """TLS to the management server; a client certificate makes it mTLS."""

    server_ca: Path | None = None  # None: the system's roots
    client_cert: Path | None = None
    client_key: Path | None = None
    server_name: str | None = None  # the name to verify instead of the target's host


@dataclass(frozen=True, slots=True)
class XdsSection:
    """CONFIG_TYPE=GRPC_XDS_SOTW: the management server and this node."""

    target: str  # host:port
    node_id: str = "default"
    node_metadata: tuple[tuple[str, str], ...] = ()
    headers: tuple[tuple[str, str], ...] = ()  # sent with the stream; names in lower case
    retry_seconds: float = 3.0  # between reconnections
    tls: XdsTlsFiles | None = None  # None: plaintext


def pairs(text: str, sep: str) -> tuple[tuple[str, str], ...]:
    """``"a=1,b=2"`` (with ``sep`` between name and value) -> pairs. Items without ``sep``
    or a name are dropped, as upstream drops them."""
    split = (item.partition(sep) for item in text.split(","))
    return tuple((name.strip(), value.strip()) for name, found, value in split if found and name)
