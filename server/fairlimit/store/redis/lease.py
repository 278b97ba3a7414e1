"""Local leases: a replica admits from blocks of a counter's budget reserved in Redis.

One Redis round trip per call caps a replica at a few thousand calls a second. With
``?leases=on``, a request on plain counters (no ``fair_share`` cap above any of them, no
shadow mode) goes to Redis through lease.lua, which admits it exactly as admit.lua would
and also reserves for this replica a block of each counter's remaining budget; the
requests after it are admitted here, with no await, until a block runs out or its window
ends. Then the next request goes to Redis again, and asks for a new block.

- Never over-admits: a block is charged to the counter in Redis when it is reserved, so
  the hits admitted here were counted there first. A replica that dies loses what it had
  not used of its blocks (under-admission, until the window ends); on shutdown it gives it
  back (lease_return.lua).
- A block is about LEASE_SECONDS of this replica's own demand on the counter, at most
  what is left / (2 x the replicas holding blocks of that counter in this window), and
  none below one hit: when little budget remains, every request takes the exact path.
  What the other replicas hold is counted against a request on the exact path; that is
  the under-admission leases trade for throughput, at most half of what was left when the
  blocks were taken.
- A block ends MARGIN before its window does by this process's clock, so that it is never
  used in the next window (the window start is Redis's, the expiry is local).
- Caps are left out: a fair-share cap's bound moves with every client's demand and λ is
  computed from global demand each period; a block of a cap would let this replica admit
  past a bound another replica has lowered meanwhile.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fairlimit.core.admission import Outcome
from fairlimit.core.plan import Plan
from fairlimit.store.redis.script import Layout

LEASE = Layout(
    "lease",
    cap_keys=(),
    head=("now", "replica"),
    counter=("limit", "window", "hits", "want"),
    cap=(),
    share=(),
)
RETURN = Layout(
    "lease_return",
    cap_keys=(),
    head=("replica",),
    counter=("window_start", "unused"),
    cap=(),
    share=(),
)
LEASE_SECONDS = 0.2  # a block is about this long of the replica's own demand
MIN_WANT, MAX_WANT = 4, 1_000_000
MARGIN = 0.005  # seconds; with the caller's clock (tests) there is no skew and no margin


@dataclass(slots=True)
class Block:
    """Hits reserved for this replica on one counter, in one window."""

    name: str  # the counter's Redis key
    window_start: str  # as lease.lua wrote it into the counter
    until: float  # when it may no longer be used, on the store's local clock
    room: int  # hits left to admit from it
    count: int  # the counter as this replica sees it (its own blocks not counted as used)
    taken_at: float
    offset: float  # the store's clock (Redis TIME) minus the local clock, at the grant
    used: int = 0


def eligible(plan: Plan) -> bool:
    """Whether ``plan`` may be admitted from leases: plain counters only, none shadowed and
    none of a charge_when_over_limit rule (a refused charge must still reach its counter)."""
    return (
        bool(plan.counters)
        and not plan.shares
        and not any(c.shadow or c.force for c in plan.counters)
    )


class Leases:
    """This replica's blocks, by counter key, and what it asks for next."""

    def __init__(self, replica: str, margin: float = MARGIN) -> None:
        self.replica = replica
        self.margin = margin
        self.blocks: dict[str, Block] = {}
        self.answers = 0  # requests admitted here, with no Redis call

    def take(self, plan: Plan, base: float) -> Outcome | None:
        """Admit ``plan`` from this replica's blocks at local time ``base``, or None when
        some counter has no live block with room for it."""
        blocks = []
        for counter in plan.counters:
            block = self.blocks.get(counter.key)
            if block is None or base >= block.until or block.room < max(counter.hits, 1):
                return None
            blocks.append(block)
        counts = []
        for counter, block in zip(plan.counters, blocks, strict=True):
            counts.append(block.count)
            block.room -= counter.hits
            block.count += counter.hits
            block.used += counter.hits
        self.answers += 1
        return Outcome(True, tuple(counts), (), (), base + blocks[0].offset)

    def args(self, plan: Plan, now: str, base: float, want: bool = True) -> list[str | int]:
        """lease.lua's ARGV for ``plan``, asking for a block of each counter (or none)."""
        args: list[str | int] = [now, self.replica, len(plan.counters)]
        for c in plan.counters:
            args += [c.limit, c.window, c.hits, self._want(c.key, base) if want else 0]
        return args

    def _want(self, key: str, base: float) -> int:
        """About LEASE_SECONDS of this replica's demand on ``key``, from its last block."""
        block = self.blocks.get(key)
        if block is None:
            return MIN_WANT
        rate = block.used / max(base - block.taken_at, 0.001)
        return min(MAX_WANT, max(MIN_WANT, math.ceil(rate * LEASE_SECONDS)))

    def learn(self, plan: Plan, names: Sequence[str], reply: Sequence[Any], base: float
              ) -> Outcome:  # fmt: skip
        """The outcome of lease.lua's ``reply`` (``names``: the counters' Redis keys); keeps
        the blocks it reserved."""
        admitted, now = int(reply[0]) == 1, float(reply[1])
        counts = tuple(int(x) for x in reply[2])
        for i, (counter, granted) in enumerate(zip(plan.counters, reply[3], strict=True)):
            if int(granted) > 0:
                seen = counts[i] + counter.hits
                self._keep(counter.key, names[i], counter.window, seen, int(granted), now, base)
        return Outcome(admitted, counts, (), (), now)

    def _keep(self, key: str, name: str, window: int, count: int, granted: int, now: float,
              base: float) -> None:  # fmt: skip
        start = math.floor(now / window) * window
        ws = f"{start:.0f}"
        block = self.blocks.get(key)
        if block is not None and block.window_start == ws and base < block.until:
            block.room += granted  # the same window: what was left of it is still ours
            block.count = count
            return
        until = base + (start + window - now) - self.margin
        self.blocks[key] = Block(name, ws, until, granted, count, base, now - base)

    def unused(self, base: float) -> list[tuple[str, str, int]]:
        """(Redis key, window start, hits) of every live block with room left; forgets them
        all (to give back on shutdown)."""
        out = [(b.name, b.window_start, b.room) for b in self.blocks.values()
               if b.room > 0 and base < b.until]  # fmt: skip
        self.blocks.clear()
        return out
