"""In-process reservations of token budgets (core/reserve.py): by record key, bounded.

A record is open from the admission that reserved it until its settlement, then kept as
settled (so that a duplicate settlement changes nothing) until ``max_duration`` after it
was reserved; then it goes. A new reservation by an id that is still open is refused
(store/memory.py raises ReservationOpen before charging); one by a settled id replaces it.
A heap of expiries drops them in any later call, so memory is bounded by the
reservations of the last ``max_duration``, and at most MAX_RECORDS are kept: past that a
reservation is charged but not kept (it stays charged at its estimate, as one whose
settlement never came).
"""

import heapq
from dataclasses import dataclass

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

    def __init__(self, capacity: int = MAX_RECORDS) -> None:
        self._capacity = capacity
        self._records: dict[str, Record] = {}
        self._expiries: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._records)

    def _expire(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            expiry, key = heapq.heappop(self._expiries)
            record = self._records.get(key)
            if record is not None and record.expiry == expiry:
                del self._records[key]

    def is_open(self, key: str, now: float) -> bool:
        """Whether ``key`` holds a reservation not yet settled (nor expired)."""
        self._expire(now)
        record = self._records.get(key)
        return record is not None and not record.settled

    def keep(self, key: str, hits: int, now: float, ttl: float) -> bool:
        """Keep a reservation (replacing a settled one under the same key); False when the
        key holds an open one (the first is kept) or the table is full."""
        self._expire(now)
        known = self._records.get(key)
        if known is not None and not known.settled:
            return False
        if known is None and len(self._records) >= self._capacity:
            return False
        expiry = now + ttl
        self._records[key] = Record(hits, now, expiry)
        heapq.heappush(self._expiries, (expiry, key))
        return True

    def settle(self, key: str, now: float) -> Record | None:
        """The open reservation under ``key``, now marked settled; None when there is none
        (unknown, expired or settled already)."""
        self._expire(now)
        record = self._records.get(key)
        if record is None or record.settled:
            return None
        record.settled = True
        return record

    def clear(self) -> None:
        self._records.clear()
        self._expiries.clear()
