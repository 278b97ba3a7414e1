"""Hot reload: watch the ``--config`` files and directories; on a change, load all or nothing.

watchfiles (inotify, FSEvents, ReadDirectoryChangesW; polling where ``WATCHFILES_FORCE_POLLING``
asks) watches each directory given, recursively, and the parent directory of each file given:
editors and Kubernetes ConfigMap updates replace files (rename, symlink swap) rather than
write them in place, and a watch on the old inode would miss that. A burst of changes is
debounced into one reload. Whether a reload is accepted is the caller's business: ``apply``
gets the new ``Loaded``, ``reject`` gets the ConfigError, and the running config stays.
"""

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import watchfiles

from fairlimit.config.loader import load
from fairlimit.core.rules import Loaded
from fairlimit.errors import ConfigError

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0  # after the watch itself failed (a watched directory vanished, say)


class ConfigWatcher:
    """Reloads on file changes (``run``) and on demand (``reload``, for SIGHUP)."""

    def __init__(
        self,
        paths: Sequence[Path],
        *,
        strict: bool,
        merge_domains: bool = False,
        allow_empty: bool = False,
        apply: Callable[[Loaded], None],
        reject: Callable[[ConfigError], None],
        debounce_ms: int = 300,
        charge_over_limit: bool = False,
        ignore_dotfiles: bool = False,
    ) -> None:
        self.paths = tuple(paths)  # loaded as given, so messages name files as at start
        self._watched = tuple(Path(p).absolute() for p in paths)  # events carry absolute paths
        self.strict = strict
        self.merge_domains = merge_domains
        self.allow_empty = allow_empty
        self.charge_over_limit = charge_over_limit
        self.ignore_dotfiles = ignore_dotfiles
        self._apply, self._reject = apply, reject
        self.debounce_ms = debounce_ms
        self._stop = asyncio.Event()
        self._lock = asyncio.Lock()  # one reload at a time: a watch event and SIGHUP together
        self.reloads = 0  # reloads attempted, accepted or not
        self._ignored = watchfiles.DefaultFilter()  # editor swap files, .git, caches

    def _targets(self) -> list[Path]:
        return sorted({p if p.is_dir() else p.parent for p in self._watched})

    def _relevant(self, change: watchfiles.Change, path: str) -> bool:
        changed = Path(path)
        return self._ignored(change, path) and any(
            changed == p or (p.is_dir() and p in changed.parents) for p in self._watched
        )

    async def reload(self) -> bool:
        """Load every configured path now; True when the new config was applied."""
        async with self._lock:
            self.reloads += 1
            try:  # in a thread: reading and parsing must not stall the requests on the loop
                loaded = await asyncio.to_thread(
                    load,
                    self.paths,
                    strict=self.strict,
                    merge_domains=self.merge_domains,
                    allow_empty=self.allow_empty,
                    charge_over_limit=self.charge_over_limit,
                    ignore_dotfiles=self.ignore_dotfiles,
                )
            except ConfigError as exc:
                self._reject(exc)
                return False
            self._apply(loaded)  # on the loop, between two requests
            return True

    async def run(self) -> None:
        """Reload on every debounced burst of changes until ``stop``."""
        while not self._stop.is_set():
            try:
                async for _ in watchfiles.awatch(
                    *self._targets(),
                    watch_filter=self._relevant,
                    debounce=self.debounce_ms,
                    stop_event=self._stop,
                ):
                    await self.reload()
            except (OSError, RuntimeError) as exc:  # watchfiles raises these for lost paths
                log.error("config watch failed (%s); retrying in %.0fs", exc, RETRY_SECONDS)
                try:
                    await asyncio.wait_for(self._stop.wait(), RETRY_SECONDS)
                except TimeoutError:
                    continue

    def stop(self) -> None:
        self._stop.set()
