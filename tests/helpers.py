"""Small builders for requests in tests."""

from fairlimit.core.request import Descriptor, Request
from fairlimit.core.rules import RateLimit


def desc(*pairs: str, hits: int | None = None, limit: RateLimit | None = None) -> Descriptor:
    """A descriptor from ``"key=value"`` strings."""
    entries = tuple(tuple(p.split("=", 1)) for p in pairs)
    return Descriptor(entries, limit, hits)  # type: ignore[arg-type]


def req(domain: str, *descriptors: Descriptor, hits: int = 0) -> Request:
    return Request(domain, tuple(descriptors), hits)
