"""In-process reservations of token budgets (core/reserve.py): by record key, bounded.

A record is open from the admission that reserved it until its settlement, then kept as
settled (so that a duplicate settlement changes nothing) until ``max_duration`` after it
was reserved; then it goes. A new reservation by an id that is still open is refused
(store/memory.py raises ReservationOpen before charging); one by a settled or expired id
replaces it. A heap of expiries drops them in steps (``expire``: any call to the store takes
one, its background sweep the rest), so memory is bounded by the reservations of the last
``max_duration``, and at most MAX_RECORDS are kept: past that a reservation is charged but
not kept (it stays charged at its estimate, as one whose settlement never came). Once most
have gone, ``compact`` copies the table into one of its live size: a dict never gives back
the table it grew to (bench/expiry.py --reservations).
"""

from dataclasses import dataclass

from fairlimit.store.deadlines import Deadlines, Due
from fairlimit.store.sweep import worth_compacting

MAX_RECORDS = 200_000


@dataclass(slots=True)
class Record:
    """One reservation: the hits reserved, when, and whether it was settled."""

    hits: int
    at: float
    expiry: float
    settled: bool = False


class MemoryReservations:
    """Every reservation this process's store keeps."""

    def __init__(self, capacity: int = MAX_RECORDS, due: Due | None = None) -> None:
        self._capacity = capacity
        self._records: dict[str, Record] = {}
        self._due = due or Due()  # the store's, lowered by each expiry
        self._expiries = Deadlines(1.0, self._due)  # a record is dropped up to a second late
        self._high = 0  # the most records held since the table was last compacted

    def __len__(self) -> int:
        return len(self._records)

    def expire(self, now: float, budget: int, dropped: list[object] | None = None) -> bool:
        """Drop the records whose time is up by ``now``, ``budget`` at most; True when more
        are due. ``dropped``: where they go, to be freed later (store/sweep.py says why)."""
        expiries, records = self._expiries, self._records
        if not expiries.due(now):
            return False
        self._high = max(self._high, len(records))
        for key in expiries.take(now, budget):
            record = records.get(key)
            if record is not None and record.expiry <= now:  # not one made again since
                del records[key]
                if dropped is not None:
                    dropped.append(record)
                    dropped.append(key)
        return expiries.due(now)

    def first(self) -> float:
        """The earliest instant a record is due (infinity when none)."""
        return self._expiries.first()

    @property
    def compact_due(self) -> bool:
        return worth_compacting(len(self._records), self._high)

    def compact(self) -> None:
        """Copy the table into one of its live size (after most records expired)."""
        self._records = dict(self._records)
        self._high = len(self._records)

    def is_open(self, key: str, now: float) -> bool:
        """Whether ``key`` holds a reservation not yet settled nor past its time."""
        record = self._records.get(key)
        return record is not None and not record.settled and record.expiry > now

    def keep(self, key: str, hits: int, now: float, ttl: float) -> bool:
        """Keep a reservation (replacing a settled or expired one under the same key); False
        when the key holds an open one (the first is kept) or the table is full."""
        if self.is_open(key, now):
            return False
        if key not in self._records and len(self._records) >= self._capacity:
            self.expire(now, len(self._records))  # full: what is due goes first, at once
            self._due.by(now)  # and the store's sweep looks at once (a compaction may be due)
            if len(self._records) >= self._capacity:
                return False
        expiry = now + ttl
        self._records[key] = Record(hits, now, expiry)  # an expired one's deadline stays
        self._expiries.push(expiry, key)
        return True

    def settle(self, key: str, now: float) -> Record | None:
        """The open reservation under ``key``, now marked settled; None when there is none
        (unknown, expired or settled already)."""
        record = self._records.get(key)
        if record is None or record.settled or record.expiry <= now:
            return None
        record.settled = True
        return record

    def clear(self) -> None:
        self._records.clear()
        self._expiries.clear()
        self._high = 0
