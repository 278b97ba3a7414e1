"""The decision: whether a plan is admitted from counter values, and each descriptor's status.

A request is all or nothing: it is admitted only if every counter and every fair-share
claim it touches admits it, and only then does any counter move, except its forced levels
(``charge_when_over_limit``, or every level under upstream's semantics), which a refused
request moves too. The store applies this rule atomically (``store/memory.py`` in Python,
``store/redis/lua/admit/`` for Redis); this module says what the rule is
(``core/plan.py`` says what a request charges).
"""

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from fairlimit.core.keys import key_path
from fairlimit.core.plan import Charge, Counter, DescriptorPlan, Plan, Share
from fairlimit.core.rules import RateLimit, Rule, most_within
from fairlimit.core.units import bounds, seconds_until, seconds_until_reset

UNLIMITED_REMAINING = 4294967295
_EPSILON = 1e-9


class Code(enum.Enum):
    OK = 1
    OVER_LIMIT = 2


def counter_over(counter: Counter, count: int) -> bool:
    """Whether ``counter`` standing at ``count`` refuses this request (shadow never does)."""
    return not counter.shadow and count + max(counter.hits, 1) > counter.limit


def share_over(share: Share, admitted: float, bound: float) -> bool:
    """Whether the client's claim at the cap exceeds its bound (shadow caps never do)."""
    return not share.shadow and admitted + max(share.hits, 1) > bound + _EPSILON


def admits(
    plan: Plan, counts: Sequence[int], shared: Sequence[int], bounds: Sequence[float]
) -> bool:
    """The all-or-nothing decision from the counters as they stand."""
    for c, n in zip(plan.counters, counts, strict=True):
        if counter_over(c, n):
            return False
    # a loop, not any() over a generator: per request, and most plans have one share
    for s, a, b in zip(plan.shares, shared, bounds, strict=True):  # noqa: SIM110
        if share_over(s, a, b):
            return False
    return True


def forced(plan: Plan, descriptor: int) -> bool:
    """Whether a level of the plan's ``descriptor`` is charged even when refused."""
    return any(
        plan.counters[c.counter].force or (c.share is not None and plan.shares[c.share].force)
        for c in plan.descriptors[descriptor].charges
    )


def below(plan: Plan) -> list[tuple[list[int], list[int]]]:
    """Per share: the counters and shares below it in the first descriptor that charges it
    (its own limits, then the deeper caps with their counters; not the other limits of its
    own cap)."""
    out: list[tuple[list[int], list[int]] | None] = [None] * len(plan.shares)
    for dplan in plan.descriptors:
        counters = [c.counter for c in dplan.charges if c.share is None]
        shares: list[int] = []
        node: Rule | None = None
        level: tuple[list[int], list[int]] = ([], [])  # the cap node's own, until left
        for charge in reversed([c for c in dplan.charges if c.share is not None]):
            at = charge.share
            assert at is not None
            if charge.rule is not node:
                counters, shares, node = counters + level[0], shares + level[1], charge.rule
                level = ([], [])
            if out[at] is None:
                out[at] = (list(counters), list(shares))
            level[0].append(charge.counter)
            level[1].append(at)
    return [found or ([], []) for found in out]


def above(plan: Plan) -> list[int]:
    """Per share: the index of the share one cap above it in the first descriptor that
    charges it (-1 for an outermost cap): of that cap's limits, the one of the same window,
    else its first. A nested cap divides at most what its parent gives it, so its verdict
    waits for the parent's."""
    out: list[int | None] = [None] * len(plan.shares)
    for dplan in plan.descriptors:
        parents: list[int] = []  # the shares of the cap node above
        current: list[int] = []
        node: Rule | None = None
        for charge in dplan.charges:  # the caps outermost first
            at = charge.share
            if at is None:
                continue
            if charge.rule is not node:
                parents, current, node = current, [], charge.rule
            if out[at] is None:
                out[at] = _parent(plan, at, parents)
            current.append(at)
    return [-1 if found is None else found for found in out]


def _parent(plan: Plan, at: int, parents: Sequence[int]) -> int:
    if not parents:
        return -1
    window = plan.shares[at].window
    return next((p for p in parents if plan.shares[p].window == window), parents[0])


def demand_seen(
    plan: Plan, counts: Sequence[int], shared: Sequence[float], bounds: Sequence[float]
) -> list[bool]:
    """Per share: whether the cap sees this request as demand. A cap sees what the levels
    below it admit, so a nested cap's demand for a child is what that child can use, and a
    client over its own limit is no demand upstream."""
    return [
        not any(counter_over(plan.counters[c], counts[c]) for c in counters)
        and not any(share_over(plan.shares[s], shared[s], bounds[s]) for s in shares)
        for counters, shares in below(plan)
    ]


# The outcome and the statuses are built on every request, so they are slotted but not
# frozen: a frozen dataclass's __init__ sets each field through object.__setattr__, about
# five times the cost. Nothing changes one after it is built.
@dataclass(slots=True)
class Outcome:
    """What the store saw: the counters before the charge, and whether it was made."""

    admitted: bool
    counts: tuple[int, ...]  # per Plan.counters
    shared: tuple[int, ...]  # per Plan.shares: the client's admitted count at the cap
    bounds: tuple[float, ...]  # per Plan.shares: min(L_i, fair share) in force
    now: float | None = None  # the store's own clock when it keeps one (Redis TIME)
    # per Plan.counters, when the plan has sliding or GCRA ones: when each is full again
    # after this request (store clock; 0 for the others, whose window end says it)
    full_at: tuple[float, ...] = ()


@dataclass(slots=True)  # not frozen: built per request (see Outcome)
class Status:
    """One descriptor's answer: the level that denied it, else the one closest to its limit."""

    code: Code
    current_limit: RateLimit | None
    limit_remaining: int
    duration_until_reset: float
    rule: Rule | None = None
    shadowed: bool = False  # over a shadow-mode limit, answered OK
    # what the limit reported is: the rule's path (the cap's, when the cap's own total is the
    # level reported), or the descriptor's key path for an override no rule matched
    name: str | None = None


def _level(plan: Plan, outcome: Outcome, dplan: DescriptorPlan, charge: Charge
           ) -> tuple[bool, int, RateLimit, str]:  # fmt: skip
    """One charge (one level of a descriptor) as a status would report it: whether it is
    over, what is left after the request, the limit and the name reported (its reset is
    ``_reset`` of its counter, worked out only for the level reported)."""
    counter = plan.counters[charge.counter]
    before = outcome.counts[charge.counter]
    # what is left after this request: a refused one moved only its forced levels
    # (charge_when_over_limit), so an OVER_LIMIT there says 0 left, as upstream does
    hits = counter.hits
    charged = hits if outcome.admitted or counter.force else 0
    # against the counter's limit: the tightest of the descriptors sharing its key
    # (core/plan.py), and this process's part of it while it limits alone (core/parts.py)
    over = counter.limit < before + (hits if hits > 1 else 1)  # max(hits, 1)
    remaining = counter.limit - before - charged
    at = charge.share
    # an own level reports its own limit (a rule may have several), named by the
    # descriptor's matched rule (an override's too); a cap's level by the cap's rule; an
    # override no rule matched by its descriptor's key path
    rule = dplan.rule if at is None else charge.rule
    name = key_path(counter.key) if rule is None else rule.path
    limit = charge.limit  # its own; at a cap, the cap's total unless the share is tighter
    if at is not None:
        share = plan.shares[at]
        bound = outcome.bounds[at]
        had = outcome.shared[at]
        over = over or share_over(share, had, bound)
        if bound != math.inf:
            claimed = share.hits if outcome.admitted or share.force else 0
            room = math.floor(bound + _EPSILON) - had - claimed
            if room <= remaining:  # the client's share holds it: named by the client's rule
                leaf = dplan.charges[0].limit
                remaining, limit = room, _effective_limit(leaf, charge, bound)
                name = name if dplan.rule is None else dplan.rule.path
    return over, remaining if remaining > 0 else 0, limit, name


def _effective_limit(leaf: RateLimit, charge: Charge, fair: float) -> RateLimit:
    """The client's bound at a cap as a limit in the cap's unit, when tighter than its own
    in the cap's window (a share of 6 a second is tighter than 1000 an hour, which may all
    be spent in one second, though 6/s is above its average 0.278/s)."""
    if fair == math.inf:
        return leaf
    cap = charge.limit
    # a bound below zero (a held client's, once the cap's reserve for light clients is held
    # back from it: docs/fairness.md) reports 0 a window; a negative limit cannot be sent
    whole = max(0, math.floor(fair + _EPSILON))
    if whole >= most_within((leaf,), cap.window):
        return leaf
    return RateLimit(whole, cap.unit, name=leaf.name, seconds=cap.seconds)


def _reset(plan: Plan, outcome: Outcome, index: int, now: float) -> int:
    """Whole seconds until counter ``index`` is back to its full limit."""
    counter = plan.counters[index]
    shape = counter.shape
    if shape is None:
        return seconds_until_reset(counter.window, now)
    if shape.calendar is not None:
        return seconds_until(bounds(counter.window, shape, now)[1], now)
    return seconds_until(outcome.full_at[index], now)


def _status(plan: Plan, outcome: Outcome, dplan: DescriptorPlan, now: float) -> Status:
    """A charged descriptor's status: the level that denied it (the least left of those
    over), else the level with the least left; levels run out together wait for the last.
    Limit, remaining and name all come from that one level, so a 429 names what refused.
    Over a shadow-mode level (its own rule's: the counter may be shared with one that is
    not) it says OK and ``shadowed``."""
    charges = dplan.charges
    if len(charges) == 1:  # one level (most descriptors): it is the one reported
        charge = charges[0]
        over, remaining, limit, name = _level(plan, outcome, dplan, charge)
        reset = _reset(plan, outcome, charge.counter, now)
        if charge.shadow:
            return Status(Code.OK, limit, remaining, reset, dplan.rule, over, name)
        code = Code.OVER_LIMIT if over else Code.OK
        return Status(code, limit, remaining, reset, dplan.rule, False, name)
    # one pass (a descriptor under a cap has two levels or more): the least left of the
    # levels denying, else of all; of levels tied there, the tightest (a share below the
    # own limit), the first of those tied in both
    chosen: tuple[bool, int, RateLimit, str] | None = None
    tied: list[int] = []  # the counters of the levels at the chosen one's remaining
    denying = shadowed = False
    for charge in charges:
        level = _level(plan, outcome, dplan, charge)
        if charge.shadow:
            shadowed = shadowed or level[0]
            level = (False, *level[1:])
        elif level[0] and not denying:  # the first level denying: only those count now
            denying, chosen, tied = True, None, []
        if level[0] != denying:
            continue
        if chosen is None or level[1] < chosen[1]:
            chosen, tied = level, [charge.counter]
        elif level[1] == chosen[1]:
            tied.append(charge.counter)
            if level[2].per_second < chosen[2].per_second:
                chosen = level
    assert chosen is not None
    # levels run out together wait for the last
    reset = max([_reset(plan, outcome, counter, now) for counter in tied])
    code = Code.OVER_LIMIT if denying else Code.OK
    return Status(code, chosen[2], chosen[1], reset, dplan.rule, shadowed, chosen[3])


def statuses(plan: Plan, outcome: Outcome, now: float) -> tuple[Status, ...]:
    """Each descriptor's status from the plan and what the store saw."""
    out: list[Status] = []
    for dplan in plan.descriptors:
        if dplan.unlimited:
            out.append(Status(Code.OK, None, UNLIMITED_REMAINING, 0.0, dplan.rule))
        elif not dplan.charges:
            out.append(Status(Code.OK, None, 0, 0.0, dplan.rule))
        else:
            out.append(_status(plan, outcome, dplan, now))
    return tuple(out)


@dataclass(slots=True)
class Said:
    """A kept plan's statuses last worked out whole, for ``moved`` to move from: the
    outcome, the time (the store's clock when it gives one) and the statuses."""

    outcome: Outcome | None = None
    at: float = 0.0
    statuses: tuple[Status, ...] = ()


def moved(
    plan: Plan, before: Outcome, then: float, said: Sequence[Status], outcome: Outcome, now: float
) -> tuple[Status, ...] | None:
    """``statuses(plan, outcome, now)`` worked out from ``said``, the statuses of ``before``
    at ``then``, when ``outcome`` is ``before`` with every count and every claim at a cap
    moved by the same hits (a lease block's next request: core/lease.py), else None.

    Each level's remaining is its limit (or its room under its bound at a cap) less its
    count: when every count moves by ``d``, so does every level's remaining, the level with
    the least left stays the one reported, and its status says ``d`` less. That holds while
    nothing is refused or cut at 0: every status of ``said`` OK, with at least ``d + 1``
    left (the least of its levels: none over after it). Fixed windows only, and the same
    whole second: their reset is the window's end in whole seconds (``_reset``)."""
    if not (before.admitted and outcome.admitted) or before.bounds != outcome.bounds:
        return None
    if now // 1 != then // 1:  # math.floor's, as floats
        return None
    counts, was = outcome.counts, before.counts
    d = counts[0] - was[0] if counts else -1
    if d < 0:
        return None
    for c, n, m in zip(plan.counters, counts, was, strict=True):
        if n - m != d or c.shape is not None:
            return None
    for a, b in zip(outcome.shared, before.shared, strict=True):
        if a - b != d:
            return None
    if d == 0:
        return tuple(said)
    out = []
    for dplan, status in zip(plan.descriptors, said, strict=True):
        if dplan.unlimited or not dplan.charges:
            out.append(status)  # the same whatever the counts
            continue
        left = status.limit_remaining - d
        if status.code is not Code.OK or status.shadowed or left < 1:
            return None
        out.append(Status(Code.OK, status.current_limit, left, status.duration_until_reset,
                          status.rule, False, status.name))  # fmt: skip
    return tuple(out)


def is_quota(status: Status, quota_all: bool) -> bool:
    """Whether ``status`` counts as a quota descriptor (quota_mode, or every rule's when
    ``quota_all``, upstream's QUOTA_MODE); an unlimited one never does."""
    rule = status.rule
    if rule is not None and rule.rate_limit is not None and rule.rate_limit.unlimited:
        return False
    return quota_all or (rule is not None and rule.quota_mode and status.current_limit is not None)


def _group(status: Status) -> str:
    """The quota group of a quota descriptor's status ("" for the implicit one)."""
    rule = status.rule
    return "" if rule is None or rule.quota_group is None else rule.quota_group


def refusing(statuses_: Sequence[Status], quota_all: bool) -> list[Status]:
    """The statuses that refuse the request, in order: every ordinary descriptor over,
    then the members of each quota group whose members are all over (empty: it passes).

    Quota descriptors (``quota_mode``) of one ``quota_group`` pass when any of them passes,
    and every group must pass; those without a group are one group, as envoyproxy/ratelimit
    decides (a request fails only when every one of its quota descriptors is over).
    """
    out: list[Status] = []
    groups: dict[str, list[Status]] | None = None
    for status in statuses_:
        if is_quota(status, quota_all):
            if groups is None:
                groups = {}
            groups.setdefault(_group(status), []).append(status)
        elif status.code is Code.OVER_LIMIT:
            out.append(status)
    for members in (groups or {}).values():
        if all(m.code is Code.OVER_LIMIT for m in members):
            out.extend(members)
    return out


def overall(statuses_: Sequence[Status], quota_all: bool) -> Code:
    """OVER_LIMIT when an ordinary descriptor is over, or every quota descriptor of a
    quota group is (``refusing``), else OK."""
    return Code.OVER_LIMIT if refusing(statuses_, quota_all) else Code.OK


def reported(statuses_: Sequence[Status], quota_all: bool) -> Status | None:
    """The status a response's headers and metadata describe: on a refusal, the one that
    refused (the first ordinary descriptor over, else the least left of a quota group all
    over); else the least left of those not over (a quota descriptor over in a group that
    passed refused nothing). None when no status has a limit."""
    refused = [s for s in refusing(statuses_, quota_all) if s.current_limit is not None]
    if refused:
        ordinary = [s for s in refused if not is_quota(s, quota_all)]
        return ordinary[0] if ordinary else min(refused, key=lambda s: s.limit_remaining)
    limited = [s for s in statuses_ if s.current_limit is not None]
    passed = [s for s in limited if s.code is Code.OK] or limited
    return min(passed, key=lambda s: s.limit_remaining) if passed else None
