"""The config watcher (config/watch.py): what a reload loads, what a change is, how it stops."""

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import watchfiles

from fairlimit.config.watch import ConfigWatcher
from fairlimit.core.rules import Loaded
from fairlimit.errors import ConfigError

pytestmark = pytest.mark.behaviour

# A fixed-value limit outside any cap (a global bucket).
GLOBAL = """
domain: {domain}
descriptors:
  - key: route
    value: {value}
    rate_limit: {{unit: minute, requests_per_unit: 10}}
"""

CONTENDED = Path(__file__).parents[1] / "fixtures" / "validation" / "contended.yaml"
HANG_GUARD = 60.0  # seconds: only a hung watcher ever gets near it


class Outcomes:
    """The configs a watcher applied and the errors it rejected, in order."""

    def __init__(self) -> None:
        self.applied: list[Loaded] = []
        self.rejected: list[ConfigError] = []

    def watcher(self, paths: list[Path], **options: bool) -> ConfigWatcher:
        return ConfigWatcher(
            paths, apply=self.applied.append, reject=self.rejected.append, **options
        )


def _write(path: Path, domain: str = "edge", value: str = "public") -> Path:
    path.write_text(GLOBAL.format(domain=domain, value=value))
    return path


Changes = set[tuple[watchfiles.Change, str]]
Filter = Callable[[watchfiles.Change, str], bool]
AWATCH_DEFAULT_FILTER = watchfiles.DefaultFilter()  # what awatch filters by when not told


class ScriptedChanges:
    """Stands in for ``watchfiles.awatch`` (the OS's notifications), keeping its contract: each
    scripted batch of raw changes is filtered by ``watch_filter`` (watchfiles' DefaultFilter
    when none is given, everything when it is None) and yielded only when a change is left;
    then it waits for ``stop_event``. ``drained`` is set once the last batch was handled."""

    def __init__(self, *batches: Changes) -> None:
        self.batches = batches
        self.drained = asyncio.Event()

    async def __call__(
        self,
        *paths: Path,
        watch_filter: Filter | None = AWATCH_DEFAULT_FILTER,
        stop_event: asyncio.Event,
        **options: object,
    ) -> AsyncIterator[Changes]:
        for batch in self.batches:
            kept = {(c, p) for c, p in batch if watch_filter is None or watch_filter(c, p)}
            if kept:
                yield kept
        self.drained.set()
        await stop_event.wait()


class TestReloadLoadsAsConfigured:
    async def test_strict_refuses_a_warning(self) -> None:
        """strict=True turns a contended cap's warning into a rejected reload."""
        outcomes = Outcomes()
        watcher = outcomes.watcher([CONTENDED], strict=True)
        assert not await watcher.reload()
        assert len(outcomes.rejected) == 1 and outcomes.applied == []

    async def test_two_files_of_one_domain_need_merge_domains(self, tmp_path: Path) -> None:
        """Without merge_domains (the default) a domain in two files is refused."""
        files = [_write(tmp_path / "a.yaml"), _write(tmp_path / "b.yaml", value="private")]
        outcomes = Outcomes()
        assert not await outcomes.watcher(files, strict=False).reload()
        assert await outcomes.watcher(files, strict=False, merge_domains=True).reload()
        assert len(outcomes.rejected) == 1 and len(outcomes.applied) == 1

    async def test_reloads_counts_every_attempt(self, tmp_path: Path) -> None:
        """reloads starts at 0 and counts accepted and refused reloads alike."""
        path = _write(tmp_path / "a.yaml")
        watcher = Outcomes().watcher([path], strict=True)
        assert watcher.reloads == 0
        await watcher.reload()
        await watcher.reload()
        assert watcher.reloads == 2

    async def test_an_empty_config_is_refused_unless_allowed(self, tmp_path: Path) -> None:
        """A directory with no descriptor file is refused by default, applied with allow_empty."""
        (tmp_path / "conf").mkdir()
        outcomes = Outcomes()
        assert not await outcomes.watcher([tmp_path / "conf"], strict=False).reload()
        assert await outcomes.watcher([tmp_path / "conf"], strict=False, allow_empty=True).reload()
        assert len(outcomes.rejected) == 1 and len(outcomes.applied) == 1
        assert outcomes.applied[0].config.domains == {}


class TestWhatIsWatched:
    def test_a_file_is_watched_through_its_directory(self, tmp_path: Path) -> None:
        """Editors and ConfigMaps replace files: the parent directory is what is watched."""
        (tmp_path / "dir").mkdir()
        watcher = Outcomes().watcher([tmp_path / "a.yaml", tmp_path / "dir"], strict=False)
        assert watcher._targets() == [tmp_path, tmp_path / "dir"]

    def test_only_the_watched_files_and_directories_count(self, tmp_path: Path) -> None:
        """A sibling of a watched file is no change; a file in a watched directory is."""
        (tmp_path / "dir").mkdir()
        watcher = Outcomes().watcher([tmp_path / "a.yaml", tmp_path / "dir"], strict=False)
        changed = watchfiles.Change.modified
        assert watcher._relevant(changed, str(tmp_path / "a.yaml"))
        assert watcher._relevant(changed, str(tmp_path / "dir" / "b.yaml"))
        assert not watcher._relevant(changed, str(tmp_path / "other.yaml"))

    def test_editor_droppings_do_not_count(self, tmp_path: Path) -> None:
        """A swap file inside a watched directory is not a change to the config."""
        watcher = Outcomes().watcher([tmp_path], strict=False)
        assert not watcher._relevant(watchfiles.Change.added, str(tmp_path / ".a.yaml.swp"))

    async def test_a_change_beside_a_watched_file_does_not_reload(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """While running, a batch that only touches a sibling file is no reload; the next is."""
        path = _write(tmp_path / "a.yaml")
        changes = ScriptedChanges(
            {(watchfiles.Change.modified, str(tmp_path / "other.yaml"))},
            {(watchfiles.Change.modified, str(path))},
        )
        monkeypatch.setattr(watchfiles, "awatch", changes)
        outcomes = Outcomes()
        watcher = outcomes.watcher([path], strict=False)
        task = asyncio.create_task(watcher.run())
        await asyncio.wait_for(changes.drained.wait(), HANG_GUARD)
        watcher.stop()
        await asyncio.wait_for(task, HANG_GUARD)
        assert watcher.reloads == 1 and len(outcomes.applied) == 1


class TestRunUntilStopped:
    async def test_stop_ends_a_running_watch(self, tmp_path: Path) -> None:
        """run returns once stop is called, with no change ever seen."""
        watcher = Outcomes().watcher([_write(tmp_path / "a.yaml")], strict=False)
        task = asyncio.create_task(watcher.run())
        await asyncio.sleep(0)  # let the watch start
        watcher.stop()
        await asyncio.wait_for(task, HANG_GUARD)
        assert watcher.reloads == 0

    async def test_a_lost_path_is_logged_and_retried_until_stop(self, tmp_path: Path) -> None:
        """A watched directory that is not there: an error, a retry a second later, then stop."""
        failures: list[logging.LogRecord] = []
        second = asyncio.Event()

        class Seen(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                failures.append(record)
                if len(failures) == 2:
                    second.set()

        logger = logging.getLogger("fairlimit.config.watch")
        handler = Seen(logging.ERROR)
        logger.addHandler(handler)
        watcher = Outcomes().watcher([tmp_path / "gone" / "a.yaml"], strict=False)
        try:
            task = asyncio.create_task(watcher.run())
            retried = asyncio.create_task(second.wait())
            await asyncio.wait({task, retried}, timeout=HANG_GUARD, return_when="FIRST_COMPLETED")
            assert retried.done() and not task.done()  # still watching after a failure
            watcher.stop()
            await asyncio.wait_for(task, HANG_GUARD)
        finally:
            logger.removeHandler(handler)
        text = failures[0].getMessage()
        reason = text.removeprefix("config watch failed (").removesuffix("); retrying in 1s")
        assert reason not in (text, "", "None")
