"""Counter storage behind one narrow contract: memory (default) and Redis."""

from fairlimit.errors import SettingsError
from fairlimit.store.base import REDIS_SCHEMES, Store
from fairlimit.store.memory import MemoryStore


def open_store(url: str) -> Store:
    """The store for a ``--backend`` URL."""
    scheme = url.partition("://")[0]
    if scheme == "memory":
        return MemoryStore()
    if scheme in REDIS_SCHEMES:
        # Imported here so that memory:// deployments never load the Redis client.
        from fairlimit.store.redis import open_redis

        return open_redis(url)
    raise SettingsError(
        f"--backend: {scheme}:// is not supported; use memory:// or one of "
        + ", ".join(f"{s}://" for s in REDIS_SCHEMES)
    )
