"""``--failure-mode local``'s course: from the first failure, through the store's return and
the write-back, to the end of the local state.

A request the store cannot decide is decided by this process alone, to its part of every
limit (policy/local.py, core/parts.py), from the first failure on. Once the store answers
again, what was admitted alone is written back into it, and for RETURN_GRACE seconds a
request must be admitted both by this process's part and by the store: the other processes
come back (and write back) a little later, and until they have, the store's counters miss
what they admitted alone. Then the local state goes.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from fairlimit.core.admission import Outcome
from fairlimit.core.concurrency import Claim, SlotOutcome
from fairlimit.core.plan import Plan
from fairlimit.errors import StoreUnavailable
from fairlimit.policy.answers import DecidedHere
from fairlimit.policy.local import LocalLimits
from fairlimit.store.base import Store
from fairlimit.telemetry import Telemetry

log = logging.getLogger(__name__)
PAY_ROUNDS = 4  # write-backs in a row, while more is decided locally as one goes
RETURN_GRACE = 1.0  # seconds the local parts still bound admissions once the store is back


class Alone:
    """The local limits of this process, and when it uses them."""

    def __init__(
        self,
        local: LocalLimits,
        store: Store,
        now: Callable[[], float],
        telemetry: Telemetry,
        failed: Callable[[StoreUnavailable], None],
    ) -> None:
        self.local = local
        self._store = store
        self._now = now
        self._telemetry = telemetry
        self._failed = failed  # a write-back failed: the store is away again
        self._paying: asyncio.Task[None] | None = None  # the write-back, when out

    async def admit(
        self, plan: Plan, now: float, ask: Callable[[], Awaitable[Outcome | None]]
    ) -> Outcome:
        """``plan`` decided with the local limits around ``ask`` (the store's answer, None
        when it failed): a store that is down leaves the decision to this process alone (the
        outcome of the plan scaled to its part); one that is back admits only what this
        process's part admits too, for RETURN_GRACE."""
        local = self.local
        checked = False
        if local.returned_at is not None:
            self.end_if_due(now)
            if local.active:
                refused = await local.check(plan, now)
                if refused is not None:
                    return self._here(*refused)
                checked = True
        outcome = await ask()
        # Decided here at the time it is decided, not when the call came: one that waited
        # for the store into the next window counts in that window's part (never twice in
        # a window: the parts add up to the limit exactly, docs/failure-modes.md).
        at = self._now()
        if outcome is None:
            return self._here(*await self.begun().admit(plan, at))
        local.saw(plan, outcome, now)
        if local.active and not checked and outcome.admitted:
            # The answer that brought the store back: nothing is written back yet. Refused
            # by the part, it stays charged in the store (once per return).
            refused = await local.check(plan, at)
            if refused is not None:
                return self._here(*refused)
        return outcome

    def _here(self, outcome: Outcome, scaled: Plan) -> DecidedHere:
        self._telemetry.decided_locally()
        return DecidedHere.of(outcome, scaled)

    async def acquire(self, claims: Sequence[Claim]) -> SlotOutcome:
        """Slots the store could not give, taken here in pools of this process's part."""
        return await self.begun().acquire(claims, self._now())

    def begun(self) -> LocalLimits:
        """The local limits, begun (and logged) when this process was not yet alone."""
        local = self.local
        if not local.active:
            local.begin(self._now())
            self._telemetry.degraded(True)
            processes, index = local.place
            log.warning(
                "limiting locally until the backend is back (--failure-mode local): this "
                "process admits its part of every limit, about 1/%d (place %d of %d; %d "
                "processes last seen, --replicas x --workers %d); e.g. 100 a window -> %d",
                processes, index + 1, processes, len(local.replicas.seen),
                local.replicas.configured, local.part_of(100),
            )  # fmt: skip
        return local

    def back(self) -> None:
        """The store answers again: the grace starts (once), and what was decided alone is
        written back (in the background, one write-back at a time)."""
        if self.local.returned_at is None:
            self.local.returned_at = self._now()
        if self._paying is None or self._paying.done():
            self._paying = asyncio.get_running_loop().create_task(self._pay())

    async def _pay(self) -> None:
        local = self.local
        for _ in range(PAY_ROUNDS):
            try:
                failed = await local.pay(self._store, self._now())
            except Exception:  # a write-back must never take the server down
                log.exception("writing back what was decided locally failed")
                return
            if failed is not None:
                self._failed(failed)  # still away: alone still, owed kept
                return
            local.paid_at = self._now()
            if not local.owes:
                return
        # decided alone again meanwhile: the next answer pays the rest

    def end_if_due(self, now: float) -> None:
        """Drop the local state once the store has answered for RETURN_GRACE, everything
        decided alone is written back, and no write-back is out."""
        local = self.local
        if local.returned_at is None or now < local.returned_at + RETURN_GRACE or local.owes:
            return
        if self._paying is not None and not self._paying.done():
            return
        log.info(
            "backend back: limiting locally ended after %.1f s (%d decisions made here, %d "
            "admitted; written back into the store under %d plans, %.2f s after it answered)",
            now - local.since, local.decisions, local.admitted, local.paid,
            local.paid_at - local.returned_at,
        )  # fmt: skip
        local.end()
        self._telemetry.degraded(False)

    async def close(self) -> None:
        """Let a write-back that is out finish (for at most a second)."""
        paying = self._paying
        if paying is not None and not paying.done():
            try:
                await asyncio.wait_for(asyncio.shield(paying), 1.0)
            except TimeoutError:
                log.warning("what was decided locally was not all written back in time")
