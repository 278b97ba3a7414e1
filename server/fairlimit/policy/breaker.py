"""The backend breaker: when the store is not asked at all, and the failure mode answers.

After BREAK_AFTER store calls in a row fail and the store has not answered for BREAK_QUIET
seconds, or as soon as a call has waited STALLED seconds with no answer from the store
meanwhile (a stopped Redis fails nothing until the timeouts pass: the calls waiting are
given up, answered by the failure mode too), calls are answered by the failure mode at once
for BREAK_SECONDS; then one call at a time tries the store, the others answered at once,
until one gets an answer. A stopped Redis otherwise holds every call for its timeout, and
the calls waiting filled --grpc-max-concurrent and each connection's streams: fail-open
became RESOURCE_EXHAUSTED and UNAVAILABLE (7-8% under a 3 s SIGSTOP at 200 calls/s, issue
38). The quiet time keeps a loaded but answering store (a few timeouts in a row between
successes) from tripping it; and before it trips for either reason the loop listens for HEAR
(policy/guarded.py): a process short of CPU found no answer only because it had not read
them yet, and answered every call by the failure mode for BREAK_SECONDS with a healthy Redis
(issue 41).
"""

import math

from fairlimit.store.waits import Waits

BREAK_AFTER = 3
BREAK_QUIET = 0.1
BREAK_SECONDS = 0.25
STALLED = 0.05  # a call waiting this long with no answer from the store meanwhile trips it
# Seconds the loop listens before a trip: a process held (short of CPU) reads the answers
# that came meanwhile, and sends the calls it had not sent yet (issue 41)
HEAR = 0.01


class Breaker:
    """The store's recent answers and failures, and whether it is to be asked now."""

    def __init__(self) -> None:
        self.failures = 0  # store calls failed in a row
        self.answered_at = -math.inf  # when the store last answered
        self._broken_until = -math.inf  # calls are answered without the store until then
        self.tripped = False  # it opened and no answer came since: one call tries the store

    def skip(self, now: float, waits: Waits) -> str | None:
        """Why the store is not to be asked now (the breaker is open), or None: open for
        BREAK_SECONDS once tripped, then while one call tries the store."""
        if now < self._broken_until <= now + BREAK_SECONDS:
            return "breaker open"
        if self.tripped and waits.busy:
            return "breaker open, a call is trying the backend"
        return None

    def stalled(self, now: float, waits: Waits) -> float | None:
        """When the longest wait began, if it has lasted STALLED with no answer from the
        store since; else None."""
        oldest = waits.oldest()
        if oldest is not None and now - oldest >= STALLED and self.answered_at < oldest:
            return oldest
        return None

    def stall(self, now: float, waits: Waits, oldest: float) -> str:
        """Trip it for a wait that stalled since ``oldest``, and give up every wait (each
        would wait for its timeout, holding its place); why, for the failure counted."""
        self._trip(now)
        waits.give_up_all()
        return f"no answer for {now - oldest:.2f} s: breaker open"

    def answered(self, now: float) -> None:
        """The store answered: the breaker closes."""
        self.failures, self._broken_until, self.tripped = 0, -math.inf, False
        self.answered_at = now

    def trips(self, now: float) -> bool:
        """Whether one more failure now would open it."""
        return self.failures + 1 >= BREAK_AFTER and now - self.answered_at >= BREAK_QUIET

    def failed(self, now: float) -> None:
        """A call the store was asked failed: BREAK_AFTER in a row with no answer for
        BREAK_QUIET open the breaker for BREAK_SECONDS."""
        self.failures += 1
        if self.failures >= BREAK_AFTER and now - self.answered_at >= BREAK_QUIET:
            self._trip(now)

    def _trip(self, now: float) -> None:
        self._broken_until, self.tripped = now + BREAK_SECONDS, True
