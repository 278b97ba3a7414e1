"""Hot reload: watch the ``--config`` files and directories; on a change, load all or nothing.

watchfiles (inotify, FSEvents, ReadDirectoryChangesW; polling where ``WATCHFILES_FORCE_POLLING``
asks) watches each directory given, recursively, and the parent directory of each file given:
editors and Kubernetes ConfigMap updates replace files (rename, symlink swap) rather than
write them in place, and a watch on the old inode would miss that. A burst of changes is
debounced into one reload. Whether a reload is accepted is the caller's business: ``apply``
gets the new ``Loaded``, ``reject`` gets the ConfigError, and the running config stays.
The watcher is the files' ``ConfigSource`` (``config/source.py``).

``roots`` (upstream's RUNTIME_ROOT under RUNTIME_WATCH_ROOT): paths, usually symlinks, whose
swap to another directory is a change too. Each is looked at every ROOT_SECONDS (its own
parent may be ``/``, far too much to watch); when it leads elsewhere the config is reloaded
and the watches start again where the paths now lead.
"""

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import watchfiles

from fairlimit.config.loader import load
from fairlimit.config.source import Apply, Reject
from fairlimit.core.rules import Loaded
from fairlimit.errors import ConfigError

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0  # after the watch itself failed (a watched directory vanished, say)
ROOT_SECONDS = 1.0  # how often each root is looked at


def _lead(root: Path) -> tuple[str, int, int] | None:
    """Where ``root`` leads now: the directory's real path and identity (None: nowhere)."""
    try:
        found = os.stat(root)
    except OSError:
        return None
    return os.path.realpath(root), found.st_dev, found.st_ino


class ConfigWatcher:
    """Loads at start (``initial``), reloads on file changes (``run``) and on demand
    (``reload``, for SIGHUP)."""

    def __init__(
        self,
        paths: Sequence[Path],
        *,
        strict: bool,
        merge_domains: bool = False,
        allow_empty: bool = False,
        apply: Apply,
        reject: Reject,
        debounce_ms: int = 300,
        charge_over_limit: bool = False,
        ignore_dotfiles: bool = False,
        roots: Sequence[Path] = (),
    ) -> None:
        self.paths = tuple(paths)  # loaded as given, so messages name files as at start
        self.name = ", ".join(str(p) for p in self.paths)
        self.applied = asyncio.Event()  # set by ``initial``: the files have a config at start
        self._watched = tuple(Path(p).absolute() for p in paths)  # events carry absolute paths
        self.strict = strict
        self.merge_domains = merge_domains
        self.allow_empty = allow_empty
        self.charge_over_limit = charge_over_limit
        self.ignore_dotfiles = ignore_dotfiles
        self._apply, self._reject = apply, reject
        self.debounce_ms = debounce_ms
        self._stop = asyncio.Event()
        self._round = asyncio.Event()  # ends the current watch: stopping, or a root moved
        self.roots = tuple(Path(r).absolute() for r in roots)
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

    def _load(self) -> Loaded:
        return load(
            self.paths,
            strict=self.strict,
            merge_domains=self.merge_domains,
            allow_empty=self.allow_empty,
            charge_over_limit=self.charge_over_limit,
            ignore_dotfiles=self.ignore_dotfiles,
        )

    def initial(self) -> Loaded:
        """The config at start, loaded now (ConfigError when refused: nothing to keep)."""
        loaded = self._load()
        self.applied.set()
        return loaded

    async def reload(self) -> bool:
        """Load every configured path now; True when the new config was applied."""
        async with self._lock:
            self.reloads += 1
            try:  # in a thread: reading and parsing must not stall the requests on the loop
                loaded = await asyncio.to_thread(self._load)
            except ConfigError as exc:
                self._reject(exc)
                return False
            self._apply(loaded)  # on the loop, between two requests
            return True

    async def run(self) -> None:
        """Reload on every debounced burst of changes, and when a root leads elsewhere,
        until ``stop``."""
        follow = asyncio.ensure_future(self._follow_roots()) if self.roots else None
        try:
            while not self._stop.is_set():
                self._round = asyncio.Event()
                await self._watch(self._round)
        finally:
            if follow is not None:
                follow.cancel()
                await asyncio.gather(follow, return_exceptions=True)

    async def _watch(self, until: asyncio.Event) -> None:
        try:
            async for _ in watchfiles.awatch(
                *self._targets(),
                watch_filter=self._relevant,
                debounce=self.debounce_ms,
                stop_event=until,
            ):
                await self.reload()
        except (OSError, RuntimeError) as exc:  # watchfiles raises these for lost paths
            log.error("config watch failed (%s); retrying in %.0fs", exc, RETRY_SECONDS)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), RETRY_SECONDS)

    async def _follow_roots(self) -> None:
        """Reload when a root leads to another directory, then watch where it leads."""
        leads = [_lead(r) for r in self.roots]
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), ROOT_SECONDS)
            now = [_lead(r) for r in self.roots]
            if now == leads or self._stop.is_set():
                continue
            moved = [str(r) for r, a, b in zip(self.roots, leads, now, strict=True) if a != b]
            leads = now
            log.info("%s now leads elsewhere: reloading", ", ".join(moved))
            await self.reload()
            self._round.set()  # the watches follow the old directories: start them again

    def stop(self) -> None:
        self._stop.set()
        self._round.set()
