"""A deterministic traffic driver for fairness tests: fixed-rate clients, injected clock."""

import math
from collections import defaultdict
from dataclasses import dataclass, field

from fairlimit.core.admission import Code
from fairlimit.limiter import Limiter
from helpers import FakeClock, desc, req


@dataclass
class Tally:
    """Per client and per 1-second window: attempted and admitted hits."""

    attempted: dict[str, dict[int, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int))
    )
    admitted: dict[str, dict[int, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int))
    )

    def window_total(self, window: int) -> int:
        return sum(per[window] for per in self.admitted.values())

    def in_window(self, client: str, window: int) -> int:
        return self.admitted[client][window]


async def drive(
    limiter: Limiter,
    clock: FakeClock,
    rates: dict[str, float],
    seconds: int,
    *,
    route: str = "public",
    retry: frozenset[str] = frozenset(),
    retries: int = 3,
    tick: float = 0.02,
) -> Tally:
    """Send each client's rate, spread evenly; ``retry`` clients resend each rejection on the
    next tick, up to ``retries`` times (a retry storm that stays bounded).

    Windows are numbered from 0 at the clock's start, which must be window-aligned.
    """
    start = clock.t
    assert start == math.floor(start)
    tally = Tally()
    due = dict.fromkeys(rates, 0.0)
    backlog: dict[str, list[int]] = {c: [] for c in rates}  # tries already made, per retry
    for step in range(round(seconds / tick)):
        clock.t = start + step * tick
        window = int(clock.t - start)
        sends: list[tuple[str, int]] = []
        for client, rate in rates.items():
            due[client] += rate * tick
            fresh = math.floor(due[client] + 1e-9)
            due[client] -= fresh
            sends.extend([(client, 0)] * fresh + [(client, t) for t in backlog[client]])
            backlog[client] = []
        for client, tries in _interleave(sends):
            request = req("edge", desc(f"route={route}", f"client_id={client}"))
            decision = await limiter.should_rate_limit(request)
            tally.attempted[client][window] += 1
            if decision.code is Code.OK:
                tally.admitted[client][window] += 1
            elif client in retry and tries < retries:
                backlog[client].append(tries + 1)
    return tally


def _interleave(sends: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Round-robin the clients' sends within a tick, so no client always goes first."""
    queues: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for send in sends:
        queues[send[0]].append(send)
    order: list[tuple[str, int]] = []
    while queues:
        for client in list(queues):
            order.append(queues[client].pop())
            if not queues[client]:
                del queues[client]
    return order
