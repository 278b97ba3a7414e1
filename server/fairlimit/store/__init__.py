"""Counter storage behind one narrow contract: memory (default) and Redis."""

from fairlimit.errors import UnsupportedBackend
from fairlimit.store.base import BACKEND_SCHEMES, REDIS_SCHEMES, Store
from fairlimit.store.memory import MemoryStore


def open_store(url: str) -> Store:
    """The store for a backend URL; UnsupportedBackend says what is wrong with it."""
    scheme, sep, _ = url.partition("://")
    if sep and scheme == "memory":
        return MemoryStore()
    if sep and scheme in REDIS_SCHEMES:
        # Imported here so that memory:// deployments never load the Redis client.
        from fairlimit.store.redis import open_redis

        return open_redis(url)
    raise UnsupportedBackend(
        f"unknown backend URL {url!r}; use one of " + ", ".join(f"{s}://" for s in BACKEND_SCHEMES)
    )
