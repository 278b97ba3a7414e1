"""The Store protocol: the narrow contract every backend keeps, and the shared cap report."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from fairlimit.core.admission import Outcome
from fairlimit.core.fairshare import FairnessFigures
from fairlimit.core.plan import Plan

REDIS_SCHEMES = ("redis", "rediss", "redis+sentinel", "redis+cluster")
BACKEND_SCHEMES = ("memory", *REDIS_SCHEMES)


@dataclass(frozen=True, slots=True)
class CapReport:
    """A cap instance's state for telemetry: λ in force and the last full period's figures."""

    cap: str
    level: float | None  # None: no history yet (equal split among clients seen)
    declared_clients: int
    figures: FairnessFigures | None


class Store(Protocol):
    """Where counters live. ``admit`` is atomic: all of a plan's counters move, or none."""

    async def admit(self, plan: Plan, now: float) -> Outcome:
        """Check ``plan`` against the counters at ``now`` and charge it if every level admits.

        Demand at each cap is recorded whether or not the request is admitted.
        Raises StoreUnavailable when the backend cannot answer.
        """
        ...

    async def caps(self) -> Mapping[str, CapReport]:
        """The fairness state of every live cap instance, by cap key."""
        ...

    async def ping(self) -> None:
        """Return when the backend answers; raise StoreUnavailable when it does not."""
        ...

    async def close(self) -> None: ...
