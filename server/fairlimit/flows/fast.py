"""A hot payload's rate decision in one step: plans in this process's memory, and plans a
Redis lease block held here covers.

Envoy sends the same bytes for a client on a route again and again, and the servicer keeps
each payload's prepared request (grpc_api/servicer.py). In the server a call costs what it
touches more than what it computes (docs/benchmarks.md, "Sixth pass"): the generic path runs
through the limiter, the rates flow, the failure policy and the memory store, and builds an
outcome, a status per descriptor and a decision on the way. For the most common plan, fixed
windows counted in this process with no cap above them, ``fast`` works out once per payload
what stays the same from call to call (each counter's key, window, limit and hits; each
descriptor's limit and its series of the rule counters) and ``FastRates.decide`` does the
rest with the same rule on the same store: the same counts, answers and metrics. Any other
plan on the memory store (a cap, a calendar, sliding or GCRA limit, a shadow rule,
charge_when_over_limit, watched global buckets, top clients, upstream's stat names) gets a
``FastMemory``: the store's own admission, then the statuses, telemetry and decision as the
rates flow works them out, without the layers around them.

The generic path takes the rest (``fast`` gives None): a plan charging no counter, a quota
rule (a quota over is charged again without it: a second admission), reservations, slots or
tokens, a store that is not this process's memory, shadow mode, quota mode, ``--failure-mode
local``. So does a call that finds the breaker not closed (``decide`` gives None).
tests/grpc_api/test_fast.py holds the paths to the same answers, store state (counters and
caps), RLQS tally and metrics over random configurations and requests.

On Redis with leases (the default), a plan a lease block serves is admitted here from this
process's block, with no Redis call, until the block runs out (store/redis/leasing.py).
``leased`` works out once per payload what that admission needs (the plan's lease shape)
and ``FastLeased.decide`` takes the request from the block and decides it: a plan of plain
counters as ``FastRates`` answers (``Plain``: its statuses from its counters' counts), any
other as the rates flow would (its statuses, the telemetry, the decision), without the
limiter, the flow, the policy's call or the store's ``admit`` around it. A request the
block does not cover, or that finds the breaker not closed or a wait on Redis stalled,
takes the generic path, which may wait for a block or ask Redis. Not under
``--failure-mode local`` or quota mode, nor for a plan with a quota rule.
tests/grpc_api/test_fast_leased.py holds the two paths to the same answers, script calls,
metrics and Redis state on a real redis-server.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from fairlimit.core import lease
from fairlimit.core.admission import UNLIMITED_REMAINING, Code, Outcome, Said, overall
from fairlimit.core.keys import key_path
from fairlimit.core.plan import Plan
from fairlimit.core.request import Request
from fairlimit.core.rules import RateLimit
from fairlimit.core.tally import Tally
from fairlimit.core.units import seconds_until_reset
from fairlimit.flows.decision import Decision
from fairlimit.policy.answers import statuses as statuses_of
from fairlimit.policy.guarded import FailurePolicy
from fairlimit.store.base import FromBlock
from fairlimit.store.memory import MemoryStore
from fairlimit.telemetry import Telemetry
from fairlimit.telemetry.rules import Key


@dataclass(frozen=True, slots=True)
class Reported:
    """What a descriptor's status reports that stays the same from call to call."""

    limit: RateLimit | None  # None: unlimited, or nothing charged (``remaining`` says which)
    name: str | None  # what its status names the limit by: its rule's path, or key path
    counter: int  # index into the plan's counters (-1 without a limit)
    remaining: int  # without a limit: what its status says is left
    series: Key | None  # its series of the rule counters (None: it counts in none)
    hits: int  # the hits it counts there


# whether refused, and per descriptor (over, remaining, whole seconds until reset)
Answer = tuple[bool, tuple[tuple[bool, int, int], ...]]


class Plain:
    """The statuses of a plan of plain counters (fixed windows, no cap, one level a
    descriptor) as its counters' counts give them: what they report that stays the same
    from call to call worked out once, and the rule counters counted as ``Telemetry.decided``
    counts the same statuses."""

    __slots__ = ("_telemetry", "hits", "limits", "reported", "windows")

    def __init__(self, plan: Plan, request: Request, telemetry: Telemetry) -> None:
        counters = plan.counters  # each counter's window, limit and hits, in plan order
        self.windows = tuple([c.window for c in counters])
        self.limits = tuple([c.limit for c in counters])
        self.hits = tuple([c.hits for c in counters])
        self._telemetry = telemetry
        self.reported = tuple(
            [_reported(plan, request, i, telemetry) for i in range(len(plan.descriptors))]
        )

    def answer(
        self, counts: Sequence[int], overs: Sequence[bool], admitted: bool, now: float
    ) -> Answer:
        """The answer of a request that found its counters at ``counts`` (before it), each
        over or not, and was ``admitted`` (charged) or refused (nothing charged)."""
        limits, hits, windows = self.limits, self.hits, self.windows
        out = []
        refused = False
        for r in self.reported:
            i = r.counter
            if i < 0:
                out.append((False, r.remaining, 0))
                continue
            over = overs[i]
            refused = refused or over
            left = limits[i] - counts[i] - (hits[i] if admitted else 0)
            out.append((over, left if left > 0 else 0, seconds_until_reset(windows[i], now)))
        if self._telemetry.enabled:
            self._count(out)
        return refused, tuple(out)

    def _count(self, out: list[tuple[bool, int, int]]) -> None:
        telemetry = self._telemetry
        try:
            for r, (over, remaining, _) in zip(self.reported, out, strict=True):
                key, limit = r.series, r.limit
                if key is not None and limit is not None:
                    telemetry.count_rule(key, r.hits, over, limit.requests_per_unit, remaining)
        except Exception:
            telemetry.failed()


def plain(plan: Plan, request: Request, telemetry: Telemetry) -> Plain | None:
    """``Plain`` of ``plan`` when its statuses are plain counters' (the module's docstring:
    fixed windows, no shadow, no cap, no quota rule, one level a descriptor) and telemetry
    counts no more of them than the rule counters; else None."""
    if not plan.counters or plan.shares:
        return None
    if any([c.shape is not None or c.shadow for c in plan.counters]):
        return None
    paths = []
    for dplan in plan.descriptors:
        rule = dplan.rule
        if rule is not None:
            if rule.quota_mode:
                return None
            paths.append(rule.path)
        if dplan.unlimited or not dplan.charges:
            continue
        if len(dplan.charges) != 1 or dplan.charges[0].share is not None:
            return None
        if dplan.charges[0].shadow:
            return None
    if not telemetry.counts_only(paths):
        return None
    return Plain(plan, request, telemetry)


class FastRates:
    """``Limiter.decide`` of one prepared request of plain counters, in one step."""

    __slots__ = ("_keys", "_needs", "_plain", "_policy", "_store", "reported")

    def __init__(self, plan: Plan, store: MemoryStore, policy: FailurePolicy, part: Plain) -> None:
        counters = plan.counters  # their windows, limits and hits: ``part``'s
        self._keys = tuple([c.key for c in counters])
        self._needs = tuple([max(c.hits, 1) for c in counters])
        self._store = store
        self._policy = policy
        self._plain = part
        self.reported = part.reported

    def decide(self, now: float) -> Answer | None:
        """The request decided at ``now`` and charged; None, nothing done, when it is for the
        generic path (the breaker is not closed: the policy's path notes what changes)."""
        policy = self._policy
        breaker = policy.breaker
        if not policy.steady:
            return None
        store = self._store
        store.expire(now)
        counter_at = store.counters.counter
        part = self._plain
        limits, needs = part.limits, self._needs
        counters = [counter_at(k, w, now) for k, w in zip(self._keys, part.windows, strict=True)]
        counts = [c.count for c in counters]
        # each counter over, as admission.counter_over (no shadow here): all or nothing
        overs = [n + need > limit for n, need, limit in zip(counts, needs, limits, strict=True)]
        admitted = not any(overs)
        if admitted:
            for counter, hits in zip(counters, part.hits, strict=True):
                counter.count += hits
        breaker.answered_at = now  # the store answered, as the policy notes it
        return part.answer(counts, overs, admitted, now)


def _decided(plan: Plan, request: Request, outcome: Outcome, now: float, said: Said,
             telemetry: Telemetry, shadow: bool) -> Decision:  # fmt: skip
    """The rates flow's decision of what the store admitted (flows/rates.py): the statuses
    (moved from ``said`` when they can be), counted by telemetry, and the overall code (no
    quota rule on a one-step path: nothing to charge again), OK whatever it says in shadow
    mode. No backend_seconds: only a traced call's span reads it, and those go the long way."""
    statuses = statuses_of(plan, outcome, now, said)
    code = Code.OK if shadow else overall(statuses, False)
    telemetry.decided(request, statuses, now, plan)
    return Decision(code, statuses)


class FastMemory:
    """The rates flow's decision of one prepared request of any other plan on this
    process's memory store (a cap, a sliding, GCRA or calendar limit, a shadow level, a
    level charged when refused), in one step: the store's admission as the failure policy
    asks it while the breaker is closed, then the statuses, the telemetry and the decision
    as the rates flow works them out, without the limiter, the flow or the policy's call
    around them (no coroutine: the memory store never waits)."""

    __slots__ = ("_admit", "_plan", "_policy", "_request", "_said", "_tally", "_telemetry")

    reported = None  # answered as a Decision, never as plain counters' ``Answer``

    def __init__(
        self,
        plan: Plan,
        request: Request,
        store: MemoryStore,
        policy: FailurePolicy,
        telemetry: Telemetry,
        tally: Tally,
        said: Said,
    ) -> None:
        self._plan, self._request = plan, request
        self._admit = store.admit_now
        self._policy = policy
        self._telemetry = telemetry
        self._tally = tally if plan.shares else None  # RLS demand at caps, when wanted
        self._said = said  # its plan's last statuses worked out whole (policy/answers.py)

    def decide(self, now: float) -> Decision | None:
        """The request decided at ``now`` and charged as the store admits it; None, nothing
        done, when it is for the generic path (the breaker is not closed)."""
        policy = self._policy
        breaker = policy.breaker
        if not policy.steady:
            return None
        plan, request = self._plan, self._request
        tally = self._tally
        if tally is not None and tally.on:
            tally.add(request, plan)
        outcome = self._admit(plan, now)
        breaker.answered_at = now  # the store answered, as the policy notes it
        return _decided(plan, request, outcome, now, self._said, self._telemetry, False)


def fast(
    plan: Plan | None,
    request: Request,
    store: MemoryStore,
    policy: FailurePolicy,
    telemetry: Telemetry,
    tally: Tally,
    said: Said,
) -> FastRates | FastMemory | None:
    """The one-step decision of ``plan`` when it and the process qualify (the module's
    docstring), else None: ``FastRates`` for plain counters, else ``FastMemory``."""
    if plan is None or plan.reserve or not plan.counters:
        return None  # nothing charged: the generic path asks no store
    # a refusal charges a forced counter: not all or nothing, so not as plain counters
    if not any([c.force for c in plan.counters]):
        part = plain(plan, request, telemetry)
        if part is not None:
            return FastRates(plan, store, policy, part)
    if any([d.rule is not None and d.rule.quota_mode for d in plan.descriptors]):
        return None  # a quota over is charged again without it: a second admission
    return FastMemory(plan, request, store, policy, telemetry, tally, said)


def _reported(plan: Plan, request: Request, index: int, telemetry: Telemetry) -> Reported:
    dplan, descriptor = plan.descriptors[index], request.descriptors[index]
    if dplan.unlimited:
        return Reported(None, None, -1, UNLIMITED_REMAINING, None, 0)
    if not dplan.charges:
        return Reported(None, None, -1, 0, None, 0)
    charge, rule = dplan.charges[0], dplan.rule
    name = key_path(plan.counters[charge.counter].key) if rule is None else rule.path
    hits = request.hits_for(descriptor)
    series = None if rule is None or hits == 0 else telemetry.rule_series(request, descriptor, rule)
    return Reported(charge.limit, name, charge.counter, 0, series, hits)


class FastLeased:
    """The rates flow's decision of one prepared request admitted from a lease block held
    here, in one step (no coroutine: a block's admission never waits). A plan of plain
    counters is answered as ``FastRates`` answers (``reported``), any other as the rates
    flow decides (a ``Decision``)."""

    __slots__ = ("_clear", "_from_block", "_plain", "_plan", "_policy", "_request", "_said",
                 "_shadow", "_shape", "_tally", "_telemetry", "reported")  # fmt: skip

    def __init__(
        self,
        plan: Plan,
        request: Request,
        from_block: FromBlock,
        policy: FailurePolicy,
        telemetry: Telemetry,
        tally: Tally,
        shadow: bool,
        said: Said,
    ) -> None:
        self._plan, self._request = plan, request
        self._shape = lease.shape(plan)
        self._from_block = from_block
        self._policy = policy
        self._telemetry = telemetry
        self._tally = tally if plan.shares else None  # RLS demand at caps, when wanted
        self._shadow = shadow
        # shadow mode answers OK whatever the statuses say: the generic form says so
        self._plain = None if shadow else plain(plan, request, telemetry)
        self.reported = None if self._plain is None else self._plain.reported
        self._clear = (False,) * len(plan.counters)  # a block covers every counter
        self._said = said  # its plan's last statuses worked out whole (policy/answers.py)

    def decide(self, now: float) -> Answer | Decision | None:
        """The request admitted from its block at ``now`` and decided; None, nothing done,
        when the block does not cover it or the policy would not ask the store now (the
        breaker not closed, a wait on the store stalled: the policy's path)."""
        policy = self._policy
        breaker = policy.breaker
        if not policy.steady:
            return None
        if breaker.stalled(now, policy.waits) is not None:
            return None
        plan = self._plan
        outcome = self._from_block(plan, self._shape, now)
        if outcome is None:
            return None
        breaker.answered_at = now  # the store answered, as the policy notes it
        tally = self._tally
        if tally is not None and tally.on:
            tally.add(self._request, plan)
        at = now if outcome.now is None else outcome.now  # the store's clock: its windows
        part = self._plain
        if part is not None:
            return part.answer(outcome.counts, self._clear, True, at)
        return _decided(plan, self._request, outcome, now, self._said, self._telemetry,
                        self._shadow)  # fmt: skip


def leased(
    plan: Plan | None,
    request: Request,
    from_block: FromBlock,
    policy: FailurePolicy,
    telemetry: Telemetry,
    tally: Tally,
    shadow: bool,
    said: Said,
) -> FastLeased | None:
    """The one-step decision of ``plan`` from lease blocks when a block may serve it (an
    eligible plan with no reservation) and no rule of it is a quota (a quota over is
    charged again without it, a second store call), else None."""
    if plan is None or plan.reserve or not lease.eligible(plan):
        return None
    if any([d.rule is not None and d.rule.quota_mode for d in plan.descriptors]):
        return None
    return FastLeased(plan, request, from_block, policy, telemetry, tally, shadow, said)
