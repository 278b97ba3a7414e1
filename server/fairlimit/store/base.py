"""The Store protocol: the narrow contract every backend keeps."""

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from fairlimit.core.admission import Outcome
from fairlimit.core.concurrency import Claim, SlotOutcome
from fairlimit.core.fairshare import CapReport
from fairlimit.core.plan import Plan
from fairlimit.core.reserve import Settle, Settled, Usage

REDIS_SCHEMES = ("redis", "rediss", "redis+sentinel", "redis+cluster")
BACKEND_SCHEMES = ("memory", *REDIS_SCHEMES)


class Store(Protocol):
    """Where counters live. ``admit`` is atomic: all of a plan's counters move, or none."""

    async def admit(self, plan: Plan, now: float) -> Outcome:
        """Check ``plan`` against the counters at ``now`` and charge it if every level admits.

        Demand at each cap is recorded whether or not the request is admitted.
        Raises StoreUnavailable when the backend cannot answer.
        """
        ...

    async def acquire(self, claims: Sequence[Claim], now: float) -> SlotOutcome:
        """Take a slot for each claim's request id in each of its pools, atomically: all or
        none. A pool's expired slots are given back first; an id already holding a slot
        (a duplicate) is refused. Raises StoreUnavailable when the backend cannot answer.
        """
        ...

    async def release(self, claims: Sequence[Claim], now: float) -> tuple[bool, ...]:
        """Give back each (request id, pool) slot of ``core.concurrency.taken(claims)``;
        True where one was held. An id holding nothing changes nothing."""
        ...

    async def settle(self, plan: Plan, settle: Settle, now: float) -> Settled:
        """Settle the open reservation of ``settle.request_id`` at the levels of ``plan``'s
        one descriptor, once (core/reserve.py): the unused part back in the windows it was
        reserved in, a cost above it charged as debt. An id holding no open reservation
        changes nothing. Raises StoreUnavailable when the backend cannot answer."""
        ...

    async def usage(self, plan: Plan, now: float) -> Usage:
        """The count of ``plan``'s one descriptor's own counter in its window at ``now`` and
        the hits of the reservations made in that window and not settled (0 and 0 when it
        has none); nothing is charged. Raises StoreUnavailable when the backend cannot
        answer."""
        ...

    async def exchange_demand(
        self, consumer: str, report: str, now: float, ttl: float
    ) -> Mapping[str, str]:
        """Keep ``consumer``'s RLQS demand ``report`` (opaque text) for ``ttl`` seconds, and
        return every other consumer's still kept, by consumer: the RLQS processes sharing
        this store divide each cap over all of them (quota/peers.py). Raises
        StoreUnavailable when the backend cannot answer."""
        ...

    async def caps(self) -> Mapping[str, CapReport]:
        """The fairness state of every live cap instance, by cap key."""
        ...

    async def ping(self) -> None:
        """Return when the backend answers; raise StoreUnavailable when it does not."""
        ...

    async def close(self) -> None: ...


# ``admit`` of a plan from this process's lease block of its shape, without a coroutine;
# None, nothing done, when the block does not cover it (store/redis/store.py ``from_block``)
FromBlock = Callable[[Plan, tuple[str, ...], float], Outcome | None]


@runtime_checkable
class BlockStore(Protocol):
    """A store that may admit a plan's requests from a lease block held here."""

    def blocks(self) -> FromBlock | None:
        """Its ``from_block`` while it leases, else None."""
        ...
