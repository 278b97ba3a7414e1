"""Counter storage behind one narrow contract: memory (default) and Redis."""

from fairlimit.errors import SettingsError
from fairlimit.store.base import Store
from fairlimit.store.memory import MemoryStore


def open_store(url: str) -> Store:
    """The store for a ``--backend`` URL."""
    scheme = url.partition("://")[0]
    if scheme == "memory":
        return MemoryStore()
    raise SettingsError(f"--backend: {scheme}:// is not supported by this build; use memory://")
