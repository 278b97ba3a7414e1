"""What bounds the RLQS work of a process: the buckets it may hold, and the pace of its
long steps on the event loop.

A stream holds at most ``per_stream`` buckets and the process ``total`` subscriptions (a
stream's bucket); a new bucket past either is refused (``QuotaService.report`` says how).
Once the subscriptions fall far below their high mark, the memory they took is handed back.
Long work (a big report, a division, the peers' exchange) pauses between its steps
(``Pace``), so that RLS calls are answered meanwhile.
"""

import asyncio
import gc
import logging
import time
from collections.abc import Mapping

from fairlimit.quota.stream import QuotaStream
from fairlimit.store.sweep import trim_malloc
from fairlimit.telemetry.quota import QuotaTelemetry

log = logging.getLogger(__name__)

# At most this many buckets a stream, and subscriptions (a stream's bucket) a process
# (--rlqs-max-buckets-per-stream, --rlqs-max-buckets). A division of one cap over
# MAX_BUCKETS holders takes about 40 ms on the event loop (bench/quota_division.py), one
# Envoy cannot take more than a tenth of a process's room, and 20,000 buckets on one stream
# took 60 MB and stalled the server for seconds.
MAX_BUCKETS_PER_STREAM = 1000
MAX_BUCKETS = 10_000
# The caps a new bucket can be refused at, and the flags that set them.
CAP_FLAGS = {"stream": "--rlqs-max-buckets-per-stream", "process": "--rlqs-max-buckets"}
# Once the subscriptions fall to a quarter of their high mark, and that mark was at least
# this many, the next drip hands the freed memory back to the system (a full collection,
# then malloc_trim), as the memory store does after a spike of clients.
RELEASE_FROM = 1000
# Between steps, RLQS work pauses for PAUSE seconds once it has run for SLICE (in wall
# time, since its last pause): an RLS call takes several turns of the event loop, and with
# a step in every turn it waited for several steps. bench/rlqs_buckets.py, 20 streams
# filling 10,000 buckets, RLS p99 during the arrival: 163-254 ms with 1 ms every 4 ms,
# 80-103 ms with 2 ms every 2 ms, the arrival as long (the machine's CPU bounds it).
SLICE = 0.002
PAUSE = 0.002


class Room:
    """The subscriptions held, against the bucket caps."""

    def __init__(self, per_stream: int, total: int) -> None:
        self.per_stream, self.total = per_stream, total
        self.held = 0  # subscriptions: the buckets of every stream
        self._high = 0  # the most held since the memory was last handed back
        self.release = False  # the next drip hands the freed memory back

    def full(self, stream: QuotaStream) -> str | None:
        """The cap (a CAP_FLAGS key) a new bucket of ``stream`` is refused at, if any."""
        if len(stream.buckets) >= self.per_stream:
            return "stream"
        if self.held >= self.total:
            return "process"
        return None

    def took(self) -> None:
        """A new subscription."""
        self.held += 1
        self._high = max(self._high, self.held)

    def dropped(self, count: int) -> None:
        """``count`` subscriptions went: after a large fall, the next drip hands the memory
        back."""
        self.held -= count
        if self._high >= RELEASE_FROM and self.held * 4 < self._high:
            self.release = True

    def release_memory(self) -> None:
        """Hand the memory of the subscriptions gone back: Python's free lists emptied (a
        freed object left in a 1 MiB arena pins it), then glibc's free pages."""
        gc.collect()
        trim_malloc()
        self._high, self.release = self.held, False

    def refuse(
        self, stream: QuotaStream, refused: Mapping[str, int], telemetry: QuotaTelemetry
    ) -> None:
        """Count the new buckets a report had refused at each cap; log the first refusal of
        each cap on the stream."""
        stream.refused = sum(refused.values())
        for cap, count in refused.items():
            telemetry.refused(stream.domain, cap, count)
            if cap in stream.told:
                continue
            stream.told.add(cap)
            limit = self.per_stream if cap == "stream" else self.total
            where = "buckets a stream" if cap == "stream" else "buckets over this process's streams"
            log.warning("RLQS: stream %d (domain %r) reported new buckets past the cap of %d %s"
                        " (%s): %d of this report refused; they are not tracked or counted at"
                        " the caps, each is assigned its own limit or a newcomer's share, and"
                        " they are taken when reported again with room. Logged once per stream;"
                        " fairlimit.rlqs.refused_buckets counts each", stream.ident,
                        stream.domain, limit, where,
                        CAP_FLAGS[cap], count)  # fmt: skip


class Pace:
    """The pauses between the steps of RLQS work."""

    def __init__(self) -> None:
        self._paused_at = 0.0  # perf_counter() at the end of the last pause

    async def pause(self) -> None:
        """Let the event loop turn, and pause for PAUSE once the work has run for SLICE
        (only the pace depends on the time read here)."""
        if time.perf_counter() - self._paused_at < SLICE:
            await asyncio.sleep(0)
            return
        await asyncio.sleep(PAUSE)
        self._paused_at = time.perf_counter()
