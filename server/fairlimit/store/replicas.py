"""How many processes share the store, and this one's place among them.

At least ``--replicas`` x ``--workers``, and at least the processes that handed the store a
report at the last exchange (``quota/peers.py``; every process does, RLQS or not). A process
limiting alone (``--failure-mode local``, policy/local.py) takes its part of every limit by
this place (``core.parts.part``).
"""

from collections.abc import Iterable


class Replicas:
    """How many processes share the store, and this one's place among them."""

    def __init__(self, configured: int = 0) -> None:
        self.configured = configured  # --replicas x --workers (0: not given)
        self.consumer: str | None = None  # this process's id in the demand exchange
        self.seen: tuple[str, ...] = ()  # the ids of the last exchange, this one's included

    def saw(self, consumer: str, others: Iterable[str]) -> None:
        """The processes of an exchange that reached the store (``others``: the rest)."""
        self.consumer = consumer
        self.seen = tuple(sorted({consumer, *others}))

    def place(self) -> tuple[int, int]:
        """(processes, this one's index): at least the configured count and the processes
        last seen; the index in the sorted ids of those seen when they are all ``n``, so
        that processes that saw every one take different places. A process that saw fewer
        takes the last place, the one that never gets a remainder (``core.parts.part``):
        its index among a part of them could be another's (two processes that each saw
        only themselves would both take the first place, and the parts would pass the
        limit)."""
        n = max(self.configured, len(self.seen), 1)
        if len(self.seen) == n and self.consumer is not None and self.consumer in self.seen:
            return n, self.seen.index(self.consumer)
        return n, n - 1
