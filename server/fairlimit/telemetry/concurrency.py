"""Concurrency instruments: slots in flight, refused acquires and expired slots, per rule.

Attributes are ``domain`` and ``rule`` (the pool's rule path: a cap, or the per-client rule
whose pools are summed); never a client value or a request id. ``in_flight`` is an
up-down counter each process moves by what it acquired, released and saw expire, so the
sum over the replicas behind one store is the number of slots held. Expiry is seen by the
next acquire at the same pool: slots of a pool no request touches again until its state is
dropped are never reported expired and stay in ``in_flight`` (a per-client pool of a client
that never comes back after its proxy crashed).
"""

from collections.abc import Callable, Sequence

from opentelemetry.metrics import Meter

from fairlimit.core.concurrency import Claim, Pool, SlotOutcome


class SlotInstruments:
    """The three concurrency instruments; recording failures go to ``failed``."""

    def __init__(self, meter: Meter, failed: Callable[[], None]) -> None:
        self._failed = failed
        self._in_flight = meter.create_up_down_counter(
            "fairlimit.concurrency.in_flight", "{request}", "Slots held, per pool rule"
        )
        self._refused = meter.create_counter(
            "fairlimit.concurrency.rejected",
            "{request}",
            "Acquires refused (OVER_LIMIT) for want of a slot, by the claimed rule",
        )
        self._expired = meter.create_counter(
            "fairlimit.concurrency.expired",
            "{slot}",
            "Slots given back by expiry (max_duration passed without a release)",
        )

    def acquired(self, domain: str, pools: Sequence[Pool], outcome: SlotOutcome) -> None:
        """One acquire: its pools' expired slots, and the slots taken when admitted."""
        try:
            for pool, gone in zip(pools, outcome.expired, strict=True):
                attributes = {"domain": domain, "rule": pool.rule.path}
                if gone:
                    self._expired.add(gone, attributes)
                    self._in_flight.add(-gone, attributes)
                if outcome.admitted:
                    self._in_flight.add(1, attributes)
        except Exception:
            self._failed()

    def refused(self, domain: str, claims: Sequence[Claim]) -> None:
        try:
            for claim in claims:
                self._refused.add(1, {"domain": domain, "rule": claim.pools[-1].rule.path})
        except Exception:
            self._failed()

    def released(self, domain: str, pools: Sequence[Pool], given_back: Sequence[bool]) -> None:
        try:
            for pool, given in zip(pools, given_back, strict=True):
                if given:
                    self._in_flight.add(-1, {"domain": domain, "rule": pool.rule.path})
        except Exception:
            self._failed()
