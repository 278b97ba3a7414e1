"""gRPC request bodies for ShouldRateLimit: a 5-byte length prefix, then the protobuf."""

import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2  # noqa: E402
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2  # noqa: E402

METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
_D = ratelimit_pb2.RateLimitDescriptor


def message(route: str, client: str, domain: str = "edge") -> bytes:
    """A serialized RateLimitRequest: one descriptor (route=ROUTE),(client_id=CLIENT)."""
    entries = [_D.Entry(key="route", value=route), _D.Entry(key="client_id", value=client)]
    request = rls_pb2.RateLimitRequest(domain=domain, descriptors=[_D(entries=entries)])
    return request.SerializeToString()


def frame(payload: bytes) -> bytes:
    """One uncompressed gRPC message: flag 0, big-endian length, payload."""
    return struct.pack(">BI", 0, len(payload)) + payload


def write_body(path: Path, route: str, client: str) -> Path:
    """A file h2load posts as the request body (``-d``)."""
    path.write_bytes(frame(message(route, client)))
    return path


def overall_code(response: bytes) -> str:
    """OK / OVER_LIMIT / ... of a serialized RateLimitResponse."""
    parsed = rls_pb2.RateLimitResponse.FromString(response)
    return str(rls_pb2.RateLimitResponse.Code.Name(parsed.overall_code))
