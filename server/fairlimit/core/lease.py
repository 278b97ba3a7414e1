"""Leases: a consumer admits a client's requests from an allowance the store reserved for it.

A *consumer* is a fairlimit process serving RLS from a shared store (Redis). Without leases
every request costs one store call. With them, the store's exact admission of a request may
also reserve a *block*: ``b`` more hits at every level of the request's plan (each counter,
and the client's row at every ``fair_share`` cap above it), charged there at once, as if
admitted. The consumer then admits the plan's next requests from the block, with no store
call, until the block runs out or expires; the next request goes to the store again and may
take a new block.

The block's size (``size``; lua/admit/lease.lua computes the same):

- at most the consumer's ``want``: about ``LEASE_SECONDS`` of its own demand on the plan
  (``pace``: what it used of its last block, and the rate before it for the rest of
  LEASE_SECONDS; ``MIN_WANT`` for a first one, at most ``max_block``), and no more than
  it will use before the first of the plan's windows ends, less ``margin`` (none while
  that window may not have ended at the store: its clock is known up to how long the
  last grant's call took); none at the first request of a plan, nor at one after
  ``RECENT`` seconds without a request or a block: a client that asks once takes no
  block it would leave unused (given back, that was a second store call for its one
  request). The store layer adds the hits of the requests that wait for the call
  (store/redis/refills.py: one block call of a shape at a time; the requests that come
  meanwhile, and those a block cannot serve, wait for the next and are admitted from
  it);
- at each counter, at most ``(limit - count - hits) / (2 x holders)``, ``holders`` the
  consumers holding blocks of that counter in this window: what is left is never reserved
  away by one consumer, and when little is left every request takes the exact path;
- at each cap, at most ``min(bound, wanted) - admitted - hits``: ``bound`` the client's
  verdict under fairness v3 (core/sharing.py), its weighted max-min share with the other
  clients' predicted use covered, and ``wanted`` its own want with this request (what it
  asked and is predicted to ask this window, ``core.sharing.want``), which the division
  has counted. A block never takes more than the exact path would have admitted to this
  client by now, nor more than the division expects it to use (a burst at a cap not yet
  contended takes blocks only as fast as its prediction grows, so the request that makes
  the cap contended still finds its share there);
- none at all at a cap not sized for its clients (``cap < active_clients x limit``) that
  is contended (its division holds some client at its share), has no history yet (its
  first window, paced by the elapsed window), or where the client is held: there every
  request is divided by the exact path, so the shares stay exact.
  Leases serve the caps that are not contended, the common case; a cap that becomes
  contended finds at most the blocks already out (``LEASE_TTL`` of their clients' demand);
- none below one hit, none for a refused request, and none for a plan with a shadow level
  or a ``charge_when_over_limit`` claim at a cap (a refusal there moves the client's row).

Where refused hits are charged (``charge_when_over_limit``: every level under upstream's
semantics), a counter counts them too. A block admits nothing it was not charged for, so a
refusal is still found by the store's exact call or by the over-limit cache (the counter is
known over), and a refusal the cache answers here charges its forced counters later: its
hits travel with the consumer (``core/owed.py``) and reach the counters at the next sweep (every
``LEASE_TTL``), before the plan's next exact call, and on close.

A block is seen through its own shape: its counts are the levels as its requests saw them.
So another shape's charge of one of its levels here (``Leases.note``) makes it stale: it
answers nothing more, and is given back before the next script call of either shape, whose
count must not include its unused hits; a level two shapes took turns at within RECENT
takes no block. A request too large for what is left of its block takes that rest
(``Leases.rest``) and asks the store only for the other hits (``smaller``).

What it guarantees:

- **Never over-admission.** A block is charged before it is used, so every hit a consumer
  admits from it was counted at every level first, in the window it is used in (a block
  expires ``margin`` before the first of its windows ends; a request that waited for the
  block's call since before it was sent is admitted from it even after that: it came
  before the call's script ran, in the window the block was charged in, and is admitted
  as of then, as an exact call would have admitted it). Each window of each counter and
  cap admits at most its limit, with leases as without.
- **Demand stays visible.** The reserved hits count as the client's demand at the cap
  (``asked``) when they are reserved, so λ sees them; a block given back (``expired``,
  ``unused``) takes its unused hits out of both. A request a block cannot cover goes to the
  store, which records it as demand whether it admits it or not: nothing is refused locally.
- **The slack** is what blocks hold unused: at a cap, at most the sum over the clients'
  live blocks, each at most ``max_block`` hits and ``LEASE_TTL`` seconds old. It is never
  admitted past a limit; it is share the other clients cannot take until it is used or given
  back (at the next request of that plan after expiry, at the consumer's periodic sweep, or
  on shutdown), so a consumer that dies strands it until the window ends.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from fairlimit.core.admission import Outcome
from fairlimit.core.plan import Plan
from fairlimit.core.units import Algorithm, bounds

LEASE_SECONDS = 0.2  # a block is about this long of the consumer's own demand on the plan
LEASE_TTL = 0.25  # seconds a block may be used after it is granted
MIN_WANT = 4  # hits a first block asks for
RECENT = LEASE_TTL  # a plan asked again within this (or whose block just ended) takes blocks
MAX_BLOCK = 1_000_000  # hits a block may hold at most (the lease_max setting lowers it)
MARGIN = 0.005  # seconds before its window ends that a block stops being used
EPSILON = 1e-9  # as core/sharing.EPSILON: a bound is compared with this slack


def eligible(plan: Plan) -> bool:
    """Whether ``plan`` may be admitted from blocks: it charges a counter, every level the
    same hits (one block serves them all), no level is shadowed and no claim at a cap is
    charged when refused (a counter may be: what a block admits was charged first, and a
    refusal's charge goes to the store), and every counter counts a fixed window (a sliding
    or GCRA count changes with time alone, so a block of it cannot be held)."""
    if not plan.counters:
        return False
    if any(c.shape is not None and c.shape.algorithm is not Algorithm.FIXED for c in plan.counters):
        return False
    hits = plan.counters[0].hits
    if any(c.shadow or c.hits != hits for c in plan.counters):
        return False
    return not any(s.shadow or s.force or s.hits != hits for s in plan.shares)


def shape(plan: Plan) -> tuple[str, ...]:
    """What identifies a plan's blocks: its counters' keys and limits, and its clients at
    their caps (the hits of a request are not part of it). The limit is part of it: a block
    sized under one limit must not admit a request that overrides it with a smaller one."""
    keys = [f"{c.key}@{c.limit}" for c in plan.counters]
    for s in plan.shares:
        keys.append(s.cap)
        keys.append(s.client)
    return tuple(keys)


def size(want: int, counter_rooms: Iterable[float], share_rooms: Iterable[float]) -> int:
    """The block for ``want`` hits, given each counter's ``(limit - count - hits) / (2 x
    holders)`` and each cap's ``min(bound, wanted) - admitted - hits`` (0 at a contended
    cap): the least of them, whole, and 0 below one hit."""
    block = float(want)
    for room in counter_rooms:
        block = min(block, room)
    for room in share_rooms:
        block = min(block, room + EPSILON)
    whole = math.floor(block)
    return whole if whole >= 1 else 0


def levels(plan: Plan) -> list[str]:
    """What ``plan`` charges that its shape alone should charge here, named: each counter's
    key, and the client's row at each cap; not a cap's own total, which every client's
    shape charges (a block at a cap is bounded by the client's share, not by what it saw
    of the total, and the division sees the others)."""
    totals = {s.total for s in plan.shares}
    named = [c.key for i, c in enumerate(plan.counters) if i not in totals]
    return named + [f"{s.cap}\n{s.client}" for s in plan.shares]


def smaller(plan: Plan, hits: int) -> Plan:
    """``plan`` with ``hits`` fewer at every level (those a block of it already holds)."""
    counters = tuple(replace(c, hits=c.hits - hits) for c in plan.counters)
    shares = tuple(replace(s, hits=s.hits - hits) for s in plan.shares)
    return Plan(plan.descriptors, counters, shares, plan.reserve)


def mine(outcome: Outcome, hits: int) -> Outcome:
    """What the store saw for a ``smaller`` plan, as the whole request sees it: each level
    before the ``hits`` it took from a block, which the store already counted."""
    counts = tuple(n - hits for n in outcome.counts)
    shared = tuple(n - hits for n in outcome.shared)
    return Outcome(outcome.admitted, counts, shared, outcome.bounds, outcome.now,
                   outcome.full_at)  # fmt: skip


def _first_end(plan: Plan, now: float) -> float:
    """When the first of the windows of ``plan``'s counters ends, after ``now``."""
    return min(bounds(c.window, c.shape, now)[1] for c in plan.counters)


@dataclass(slots=True)
class Block:
    """Hits reserved for this consumer at every level of one plan shape, in one window."""

    ref: object  # what the store needs to give the block back (opaque here)
    until: float  # when it may no longer be used, on the consumer's clock
    room: int  # hits left to admit from it
    counts: list[int]  # each counter as this consumer sees it (its own block not counted)
    shared: list[int]  # the client's admitted count at each cap, seen the same way
    bounds: tuple[float, ...]  # the client's bound at each cap when the block was granted
    taken_at: float
    offset: float  # the store's clock minus the consumer's, at the grant
    used: int = 0
    levels: tuple[str, ...] = ()  # its plan's ``levels``
    marks: tuple[int, ...] = ()  # the version of each of them at the grant
    rate: float | None = None  # hits a second its shape was used at before it (``pace``)
    spread: float = 0.0  # how long its grant's call took: ``offset`` is up to that late


def pace(block: Block, base: float) -> float:
    """Hits a second the shape of ``block`` is used at by ``base``: over about the last
    LEASE_SECONDS, its own use since its grant and, for the part of them before it, the
    rate it was granted with (a block granted just now, or one that served little before
    its window ended, does not make the shape look idle); its own use alone when that
    rate is not known (the first block of a shape)."""
    life = max(base - block.taken_at, 0.001)
    if block.rate is None:
        return block.used / life
    before = max(0.0, LEASE_SECONDS - life)
    return (block.used + block.rate * before) / (life + before)


class Leases:
    """One consumer's blocks, by plan shape, and what it asks for next."""

    def __init__(self, consumer: str, margin: float = MARGIN, max_block: int = MAX_BLOCK) -> None:
        self.consumer = consumer
        self.margin = margin
        self.max_block = max_block
        self.blocks: dict[tuple[str, ...], Block] = {}
        # shapes without a block: when last asked at the store or last holding one, and
        # the block that ended then (until the next is kept, or RECENT has passed)
        self.seen: dict[tuple[str, ...], float] = {}
        self.ended: dict[tuple[str, ...], Block] = {}
        # per level (``levels``): the shape that last charged it here, and how often that
        # changed; a block is seen through its own shape only, so another shape's charge
        # makes it stale (what it tells of the level, hence ``remaining``, would be old)
        self.writer: dict[str, tuple[str, ...]] = {}
        self.version: dict[str, int] = {}
        self.changed: dict[str, float] = {}  # when its writer last changed
        # per level: the shapes whose block holds it (a block is looked up by its shape, so
        # a shape listed here whose block has gone holds nothing; pruned at ``expired``)
        self.holders: dict[str, set[tuple[str, ...]]] = {}

    def note(self, plan: Plan, key: tuple[str, ...], base: float) -> None:
        """``plan`` (of shape ``key``) charged its levels here at ``base``, from a block or
        not."""
        for level in levels(plan):
            writer = self.writer.get(level)
            if writer != key:
                self.writer[level] = key
                self.version[level] = self.version.get(level, 0) + 1
                if writer is not None:  # another shape's before
                    self.changed[level] = base

    def shared(self, plan: Plan, key: tuple[str, ...], base: float) -> bool:
        """Whether another shape charged one of ``plan``'s levels here last, or did within
        RECENT seconds (a block would go stale at its next charge)."""
        for level in levels(plan):
            if self.writer.get(level, key) != key:
                return True
            if base - self.changed.get(level, -math.inf) < RECENT:
                return True
        return False

    def others(self, plan: Plan, key: tuple[str, ...]) -> list[Block]:
        """The blocks of other shapes that hold a level of ``plan``, forgotten (to give
        back before its script call, which must not count their unused hits as used).
        Each of them, not only the block of the level's last writer here: a third shape
        that charged the level since (a refusal the over-limit cache answered) hid the
        holder's block, whose unused hits the call then counted (issue 41)."""
        out = []
        for level in levels(plan):
            shapes = self.holders.get(level)
            if not shapes:
                continue
            for other in [s for s in shapes if s != key]:
                shapes.discard(other)
                block = self.blocks.pop(other, None)
                if block is not None and block.room > 0:
                    out.append(block)
        return out

    def stale(self, key: tuple[str, ...]) -> Block | None:
        """The block of shape ``key`` when another shape has charged one of its levels
        here since its grant, forgotten (to give back first: the script call that follows
        must not count its unused hits as used)."""
        block = self.blocks.get(key)
        if block is None or self._fresh(block):
            return None
        del self.blocks[key]
        return block if block.room > 0 else None

    def _fresh(self, block: Block) -> bool:
        version = self.version
        return all(version.get(level, 0) == mark
                   for level, mark in zip(block.levels, block.marks, strict=True))  # fmt: skip

    def take(
        self, plan: Plan, key: tuple[str, ...], base: float, waited: Block | None = None
    ) -> Outcome | None:
        """Admit ``plan`` (of shape ``key``) from its block at the consumer's time ``base``,
        or None when it has no live block with room for the request's hits. ``waited``: the
        block granted by the script call this request waited for since before it was sent,
        which admits it even past the block's end: the request came before the call's
        script ran, in the window the block was charged in, and is admitted as of then
        (its hits were asked for it, so they do not count as the rate of ``want``)."""
        block = self.blocks.get(key)
        if block is None or (base >= block.until and block is not waited):
            return None
        hits = plan.counters[0].hits  # every level's (``eligible``)
        if block.room < max(hits, 1) or not self._fresh(block):
            return None
        counts, shared = tuple(block.counts), tuple(block.shared)
        block.room -= hits
        if block is not waited:
            block.used += hits
        block.counts = [n + hits for n in block.counts]
        block.shared = [n + hits for n in block.shared]
        return Outcome(True, counts, shared, block.bounds, base + block.offset)

    def rest(self, plan: Plan, key: tuple[str, ...], base: float) -> tuple[Block, int] | None:
        """Take what is left of the live block of shape ``key`` for a request of ``plan``
        too large for it (None when there is none): the request uses it, and its script
        call asks only for the rest of its hits (``smaller``). Counted at the store
        already, the block's hits would otherwise weigh against this request twice, and
        refuse it where the exact path admits it."""
        block = self.blocks.get(key)
        hits = plan.counters[0].hits  # every level's (``eligible``)
        if block is None or base >= block.until or not 0 < block.room < hits:
            return None
        taken = block.room
        block.room = 0
        block.used += taken
        return block, taken

    def restore(self, key: tuple[str, ...], block: Block, hits: int) -> bool:
        """Put back ``hits`` that ``rest`` took from ``block`` for a request refused with
        nothing charged; False when the block has been replaced since (the caller gives
        them back)."""
        block.room += hits
        block.used -= hits
        return self.blocks.get(key) is block

    def want(self, plan: Plan, key: tuple[str, ...], base: float) -> int:
        """About LEASE_SECONDS of this consumer's demand on the shape, from its last block,
        and no more than it will use before the first of the plan's windows ends (what a
        block holds then is lost to everyone until the window ends)."""
        if self.shared(plan, key, base):
            return 0  # a block would go stale at another shape's next charge
        block = self.blocks.get(key)
        least = 1
        if block is None:
            last = self.seen.get(key)
            self.seen[key] = base
            if last is None or base - last > RECENT:
                return 0  # its first request (for a while): maybe its only one
            block = self.ended.get(key)
            if block is None:
                return min(MIN_WANT, self.max_block)
            least = MIN_WANT  # its block just ended
        # the store's clock is at most ``now`` (the offset was taken before the grant's
        # call), and at least ``spread`` less: while a window may not have ended there,
        # its end is the one that counts
        now = base + block.offset
        horizon = min(LEASE_SECONDS, _first_end(plan, now - block.spread) - now - self.margin)
        if horizon <= 0:
            return 0  # a block now would end before it is used
        return min(self.max_block, max(least, math.ceil(pace(block, base) * horizon)))

    def keep(
        self,
        plan: Plan,
        key: tuple[str, ...],
        outcome: Outcome,
        granted: int,
        ref: object,
        base: float,
        reply: float | None = None,
    ) -> Block | None:
        """Keep the block of ``granted`` hits the store reserved with ``outcome`` (its
        clock in ``outcome.now``; the consumer's was ``base`` when the call was made and
        ``reply`` when it answered); returns the block it replaces when that one still
        has room, expired or not (for the caller to give back: once replaced, no sweep
        finds it)."""
        assert outcome.now is not None
        now = outcome.now
        until = base + min(_first_end(plan, now) - now - self.margin, LEASE_TTL)
        counts = [n + c.hits for n, c in zip(outcome.counts, plan.counters, strict=True)]
        shared = [n + s.hits for n, s in zip(outcome.shared, plan.shares, strict=True)]
        old = self.blocks.get(key)
        before = old if old is not None else self.ended.pop(key, None)
        rate = pace(before, base) if before is not None else None
        self.seen.pop(key, None)
        self.note(plan, key, base)
        named = tuple(levels(plan))
        marks = tuple(self.version.get(level, 0) for level in named)
        for level in named:
            self.holders.setdefault(level, set()).add(key)
        spread = 0.0 if reply is None else max(0.0, reply - base)
        self.blocks[key] = Block(ref, until, granted, counts, shared, outcome.bounds, base,
                                 now - base, levels=named, marks=marks, rate=rate,
                                 spread=spread)  # fmt: skip
        if old is not None and old.room > 0:
            return old
        return None

    def expired(self, base: float) -> list[Block]:
        """The blocks past their time with room left (forgotten here, to give back); those
        used up are forgotten too."""
        gone = [k for k, b in self.blocks.items() if base >= b.until]
        out = []
        for k in gone:
            block = self.blocks.pop(k)
            self.seen[k] = base  # its next request may take a block at once
            self.ended[k] = block  # sized by its use
            if block.room > 0:
                out.append(block)
        for k in [k for k, t in self.seen.items() if base - t > RECENT]:
            del self.seen[k]
            self.ended.pop(k, None)
        # what is known of levels no block holds and no shape took over within RECENT
        self.holders = {}
        for k, block in self.blocks.items():
            for level in block.levels:
                self.holders.setdefault(level, set()).add(k)
        held = self.holders.keys()
        for level in [lv for lv in self.writer if lv not in held
                      and not base - self.changed.get(lv, -math.inf) < RECENT]:  # fmt: skip
            del self.writer[level]
            self.version.pop(level, None)
            self.changed.pop(level, None)
        return out

    def unused(self) -> list[Block]:
        """Every block with room left, expired or not (the sweep may not have reached it
        yet); forgets them all (to give back on shutdown)."""
        out = [b for b in self.blocks.values() if b.room > 0]
        self.blocks.clear()
        self.seen.clear()
        self.ended.clear()
        self.writer.clear()
        self.version.clear()
        self.changed.clear()
        self.holders.clear()
        return out
