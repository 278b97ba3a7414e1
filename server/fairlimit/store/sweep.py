"""The memory store's expiry in steps, and the memory handed back after it.

Expiry is driven by deadlines (store/deadlines.py), so memory stays bounded by the live
state. It runs in steps: a call looks at EXPIRE_STEP deadlines of each table at most, and
when more is due (a window of 200k clients ends at one instant) a background task on the
loop takes the rest in steps of the same size. What a step drops is not freed at once but
put in a pile, freed RELEASE_STEP at a time, in the order it was made, once nothing is
due: freed a step at a time between calls, the holes of every memory block would take the
calls' new objects and keep all the blocks (bench/expiry.py measured 21 MB of 32 kept per
100k keys that way, 2-4 freed in these few steps). Then the tables are compacted and the
memory handed back (a full collection, malloc_trim). No call waits for more than one step.
"""

import asyncio
import ctypes
import gc
from collections.abc import Callable

from fairlimit.store.deadlines import Due

EXPIRE_STEP = 512  # deadlines of each table a call, or one step of the sweep, looks at
RELEASE_STEP = 65_536  # expired objects freed at once (2 a counter: about 10 ms)
# A table is compacted, and the memory handed back (a full collection, malloc_trim), only
# once it has held this many: a smaller one's table is a few kilobytes, and a full
# collection holds the loop for milliseconds (63 ms in a test process's heap). Without it a
# few clients gone at once (five counters expiring, one coming back) set one off.
COMPACT_FLOOR = 1024
_SHRINK = 4  # compact a table once it holds under a quarter of its high mark


def worth_compacting(size: int, high: int) -> bool:
    """Whether a table holding ``size`` entries, ``high`` at most since it was last
    compacted, is to be copied to its live size (and the memory handed back)."""
    return high >= COMPACT_FLOOR and size * _SHRINK < high
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_MMAP_THRESHOLD = 128 * 1024  # glibc's initial value


def _glibc(function: str) -> Callable[..., int] | None:
    """A glibc malloc function, or None where the C library is another (the process's own
    symbols, so no library search: ctypes.util alone would cost 2 MB)."""
    found: Callable[..., int] | None = getattr(ctypes.CDLL(None), function, None)
    return found


def fix_mmap_threshold() -> None:
    """Keep glibc's mmap threshold where it starts.

    glibc raises it each time a mapped block is freed, so after one spike of clients the
    big tables of the next come from the heap, whose free middle it rarely gives back
    (bench/memory.py: 44 MB left after a second wave of 200k hour clients, 31 MB with this).
    """
    mallopt = _glibc("mallopt")
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


def trim_malloc() -> None:
    """glibc's malloc_trim(0): return free heap pages to the system."""
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(0)


class Sweep:
    """When and how a store's tables are expired, its pile freed and its tables compacted.

    ``step(now)`` drops what ended by ``now`` (EXPIRE_STEP deadlines of each table at most)
    into ``dropped`` and says whether more is due; ``compact_due()`` whether a table should
    be copied to its live size; ``compact()`` copies them. ``due``: the earliest instant
    anything is due (``step`` sets it, the tables lower it): before it, and with nothing
    left to free or compact, a call has nothing to do here.
    """

    def __init__(
        self,
        step: Callable[[float], bool],
        compact_due: Callable[[], bool],
        compact: Callable[[], None],
        due: Due,
    ) -> None:
        self._step = step
        self._compact_due = compact_due
        self._compact = compact
        self._next = due
        self.latest = 0.0  # the latest time a call came with: what the sweep expires to
        self.dropped: list[object] = []  # what expired, until freed (see the docstring)
        self._sweeping: asyncio.Task[None] | None = None
        self._pending = False  # the last step left something to free or compact

    def expire(self, now: float) -> None:
        """One step of expiry at ``now``, on the request path; the rest in the background."""
        if now > self.latest:
            self.latest = now
        if now < self._next.at:  # nothing is due: the step would do nothing, and...
            if not self._pending:
                return  # ...nothing was left to free or compact
            sweeping = self._sweeping
            if sweeping is not None and not sweeping.done():
                return  # ...the sweep out does it (_soon would leave it to that one)
        self._pending = self._step(now) or self._due()
        if self._pending:
            self._soon()

    def _due(self) -> bool:
        return bool(self.dropped) or self._compact_due()

    def _soon(self) -> None:
        """Have the rest of the expiry, and the compaction, done in the background."""
        if self._sweeping is not None and not self._sweeping.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # driven without a loop (bench/inproc.py): nobody waits
            self.sweep()
            return
        self._sweeping = loop.create_task(self._in_steps())

    async def _in_steps(self) -> None:
        # each step is EXPIRE_STEP deadlines per table: the calls that come meanwhile are
        # answered between two steps (sleep(0) lets every ready callback run first)
        while self._step(self.latest):
            await asyncio.sleep(0)
        dropped = self.dropped
        while len(dropped) > RELEASE_STEP:
            del dropped[:RELEASE_STEP]
            await asyncio.sleep(0)
        dropped.clear()
        if self._due():
            await asyncio.sleep(0)
            self._shrink()

    def sweep(self) -> None:
        """Everything due at the latest time a call came with, at once, then the compaction
        (where no event loop runs: nothing is waiting)."""
        while self._step(self.latest):
            pass
        self.dropped.clear()
        if self._due():
            self._shrink()

    async def swept(self) -> None:
        """Wait for a background sweep that is out (tests, benches)."""
        if self._sweeping is not None:
            await asyncio.shield(self._sweeping)

    def _shrink(self) -> None:
        """Give the memory of a spike of clients back, now that it is all free."""
        # Python keeps freed tuples and floats on free lists, and each one left in a block
        # of memory (a 1 MiB arena) keeps that whole block: a full collection empties the
        # lists, so the blocks the expired clients filled are released. This runs before
        # anything new is allocated (the expiry comes first in a request), so the next
        # objects go to blocks that stay anyway. Then the C allocator returns its free
        # pages, and a dict, which never gives back the table it grew to, is copied into
        # one of its live size. bench/memory.py measures the effect.
        gc.collect()
        trim_malloc()
        self._compact()

    def close(self) -> None:
        if self._sweeping is not None:
            self._sweeping.cancel()
        self.dropped.clear()
