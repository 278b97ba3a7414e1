"""The retries a simulated client has due in one tick (kept apart from the run that sends them)."""

from collections import deque


class RetryPool:
    """One client's retries due in one tick, as runs of [last tick they may go, count].

    A client's retries all wait the same ``backoff``, so the pool due at tick t + b is filled
    only while tick t runs, in order of expiry; it moves on whole when the client is refused.
    """

    __slots__ = ("runs", "total")

    def __init__(self) -> None:
        self.runs: deque[list[int]] = deque()
        self.total = 0

    def add(self, expiry: int, count: int) -> None:
        if self.runs and self.runs[-1][0] == expiry:
            self.runs[-1][1] += count
        else:
            self.runs.append([expiry, count])
        self.total += count

    def push_front(self, expiry: int) -> None:
        """Put back one retry expiring no later than any in the pool."""
        if self.runs and self.runs[0][0] == expiry:
            self.runs[0][1] += 1
        else:
            self.runs.appendleft([expiry, 1])
        self.total += 1

    def take(self) -> int:
        """Remove one retry (the soonest to expire); its expiry."""
        run = self.runs[0]
        run[1] -= 1
        self.total -= 1
        if not run[1]:
            self.runs.popleft()
        return run[0]

    def drop_expired(self, tick: int) -> None:
        while self.runs and self.runs[0][0] < tick:
            self.total -= self.runs.popleft()[1]
