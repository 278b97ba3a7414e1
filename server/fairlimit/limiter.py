"""The use case: a request -> the core's plan -> the store's atomic admission -> statuses.

Concurrency (core/concurrency.py) is all or nothing together with the rate limits, in two
atomic steps: the request's slots are acquired first (one atomic store call, all or none),
then the rates are admitted, and when the rates reject the slots are released at once. So
a request refused a slot never reaches the rate counters and consumes no rate capacity, and
a request refused by a rate holds no slot once it is answered. The window between the two
steps (one store call) can only make a concurrent request see a slot taken that is about to
come back - a spurious refusal, never an admission past a limit. If that release fails
(backend gone) the slot expires after its rule's max_duration.

Under ``--failure-mode local`` a request the store cannot decide is decided by this process
alone, to its part of every limit (policy/local.py, core/parts.py), from the first
failure on. Once the store answers again, what was admitted alone is written back into it,
and for RETURN_GRACE seconds a request must be admitted both by this process's part and by
the store: the other processes come back (and write back) a little later, and until they
have, the store's counters miss what they admitted alone. Then the local state goes.
"""

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from fairlimit.core import admission
from fairlimit.core.admission import Code, Outcome, Status
from fairlimit.core.concurrency import Claim, SlotOutcome, Slots, declared, split, taken
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import Plan
from fairlimit.core.plan import plan as make_plan
from fairlimit.core.request import Descriptor, Request, validate
from fairlimit.core.reserve import (
    Averages,
    Reserve,
    Settle,
    Settled,
    TokenReport,
    Tokens,
    own_counter,
)
from fairlimit.core.reserve import declared as reserves
from fairlimit.core.reserve import split as split_tokens
from fairlimit.core.rules import Loaded, walk
from fairlimit.core.tally import Tally
from fairlimit.errors import DeadlineExceeded, ReservationOpen, StoreUnavailable
from fairlimit.policy.local import LocalLimits
from fairlimit.settings import FailureMode
from fairlimit.store.base import Store
from fairlimit.store.deadline import DEADLINE
from fairlimit.store.replicas import Replicas
from fairlimit.store.waits import Waits
from fairlimit.telemetry import Telemetry
from fairlimit.telemetry.fairness import CapRow
from fairlimit.telemetry.top import TopRow

log = logging.getLogger(__name__)
_T = TypeVar("_T")
# The backend breaker: after BREAK_AFTER store calls in a row fail and the store has not
# answered for BREAK_QUIET seconds, or as soon as a call has waited STALLED seconds with no
# answer from the store meanwhile (a stopped Redis fails nothing until the timeouts pass:
# the calls waiting are given up, answered by the failure mode too), calls are answered by
# the failure mode at once for BREAK_SECONDS; then one
# call at a time tries the store, the others answered at once, until one gets an answer.
# A stopped Redis otherwise holds every call for its timeout, and the calls waiting filled
# --grpc-max-concurrent and each connection's streams: fail-open became RESOURCE_EXHAUSTED
# and UNAVAILABLE (7-8% under a 3 s SIGSTOP at 200 calls/s, issue 38). The quiet time keeps
# a loaded but answering store (a few timeouts in a row between successes) from tripping it.
BREAK_AFTER = 3
BREAK_QUIET = 0.1
BREAK_SECONDS = 0.25
STALLED = 0.05  # a call waiting this long with no answer from the store meanwhile trips it
PAY_ROUNDS = 4  # write-backs in a row, while more is decided locally as one goes
RETURN_GRACE = 1.0  # seconds the local parts still bound admissions once the store is back


class Clock(Protocol):
    """Where the limiter reads the time: once per request."""

    def now(self) -> float: ...


class SystemClock:
    """Wall-clock Unix time."""

    def now(self) -> float:
        return time.time()


# Made on every request, so slotted but not frozen: a frozen dataclass's __init__ sets each
# field through object.__setattr__ (0.8 µs for this one, 0.15 µs unfrozen). Nothing changes
# one after it is made.
@dataclass(slots=True)
class Decision:
    """The answer to one request."""

    code: Code
    statuses: tuple[Status, ...]
    backend_failed: bool = False
    backend_seconds: float = 0.0  # time spent waiting for the store, for the trace
    shed: bool = False  # the caller's deadline had passed or left the store no time


@dataclass(frozen=True, slots=True)
class _Active:
    loaded: Loaded
    matcher: Matcher
    slots: bool  # the config declares concurrency somewhere (else no request takes a slot)
    anonymous: bool  # ... and some released by negative hits (slots without request ids)
    tokens: bool  # the config declares a reservation somewhere (core/reserve.py)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated request and its plan under one configuration: pure of time, so a caller
    that sees the same request again may decide it again without rebuilding the plan
    (``Limiter.current`` says whether the configuration is still the one in force)."""

    request: Request
    plan: Plan | None  # None when the request takes or gives back slots or tokens
    slots: Slots | None
    active: object  # the configuration it was planned under
    tokens: Tokens | None = None  # its reservations and settlements, when it has any


def _open_statuses(descriptors: int) -> tuple[Status, ...]:
    """What ``--failure-mode open`` answers: OK for every descriptor, no limit."""
    return tuple(Status(Code.OK, None, 0, 0.0) for _ in range(descriptors))


class Limiter:
    """Answers ShouldRateLimit against the current config and the store."""

    def __init__(
        self,
        loaded: Loaded,
        store: Store,
        clock: Clock | None = None,
        *,
        shadow: bool = False,
        failure_mode: FailureMode = FailureMode.OPEN,
        telemetry: Telemetry | None = None,
        quota_mode: bool = False,
        replicas: Replicas | None = None,
    ) -> None:
        self._active = _active(loaded)
        self.store = store
        self.clock = clock or SystemClock()
        self.shadow = shadow
        self.quota_mode = quota_mode  # upstream's QUOTA_MODE: every rule a quota
        self.failure_mode = failure_mode
        self.backend_healthy = True
        self._failures = 0  # store calls failed in a row
        self._answered_at = -math.inf  # when the store last answered
        self._broken_until = -math.inf  # the breaker answers without the store until then
        self._tripped = False  # the breaker opened and no answer came since: one call tries
        self.waits = Waits()  # the calls waiting on the store (a full call budget gives one up)
        self.telemetry = telemetry or Telemetry.off()
        self.telemetry.use(loaded)
        self.tally = Tally()  # RLS demand at caps, while an RLQS division wants it
        # --failure-mode local: the last counts seen, and the limits of this process alone
        local = failure_mode is FailureMode.LOCAL
        self.local = LocalLimits(replicas or Replicas()) if local else None
        self._paying: asyncio.Task[None] | None = None  # the write-back, when out
        self.averages = Averages()  # recent real costs: the estimate of last resort
        self._origin, self._made = uuid.uuid4().hex[:12], 0  # anonymous slot ids
        self._unpaired_seen: set[str] = set()  # rules whose unpaired refunds were logged
        self._id_open_logged = False  # a reservation by an open id was logged

    @property
    def loaded(self) -> Loaded:
        return self._active.loaded

    def swap(self, loaded: Loaded) -> None:
        """Serve ``loaded`` from the next request on (one reference swap, so atomic)."""
        self._active = _active(loaded)
        self.telemetry.use(loaded)

    async def should_rate_limit(self, request: Request) -> Decision:
        """Decide ``request``; RequestError for a malformed one, StoreUnavailable if closed."""
        return await self.decide(self.prepare(request))

    def prepare(self, request: Request) -> Prepared:
        """Validate ``request`` (RequestError) and plan it under the configuration in force:
        its slots, when it takes or gives back any, else the plan of its rates."""
        validate(request)
        active = self._active
        if active.tokens or any([d.negative for d in request.descriptors]):
            tokens = split_tokens(request, active.matcher, self.averages)
            if tokens is not None:
                return Prepared(request, None, None, active, tokens)
        if active.slots:
            slots = split(request, active.matcher, self._anonymous(active))
            if slots.acquire or slots.release:
                return Prepared(request, None, slots, active)
        return Prepared(request, make_plan(request, active.matcher), None, active)

    def _anonymous(self, active: _Active) -> str:
        """A fresh id for the slots of rules released by negative hits ("" without any):
        unique across the processes sharing a store."""
        if not active.anonymous:
            return ""
        self._made += 1
        return f"~{self._origin}-{self._made}"

    def current(self, prepared: Prepared) -> bool:
        """Whether ``prepared`` was planned under the configuration in force now."""
        return prepared.active is self._active

    async def decide(self, prepared: Prepared, remaining: float | None = None) -> Decision:
        """Decide a prepared request now; StoreUnavailable if the store fails and closed.

        ``remaining``: seconds until the caller's deadline (None: no deadline). A call whose
        deadline has passed, or leaves the store no time, is shed: answered at once by the
        failure mode and counted, since nobody waits for its answer.
        """
        request = prepared.request
        if remaining is not None and remaining <= 0:
            return self._shed(request)
        now = self.clock.now()
        token = None if remaining is None else DEADLINE.set(time.monotonic() + remaining)
        try:
            if prepared.tokens is not None:
                decision = await self._with_tokens(request, prepared.tokens, now)
            elif prepared.slots is not None:
                decision = await self._with_slots(request, prepared.slots, now)
            else:
                decision = await self._rates(request, now, prepared.plan)
        except DeadlineExceeded:
            return self._shed(request)
        finally:
            if token is not None:
                DEADLINE.reset(token)
        if decision.backend_failed:
            self.telemetry.failed_open()
        return decision

    def _shed(self, request: Request) -> Decision:
        """The failure mode's answer for a call past (or too near) its deadline, counted."""
        self.telemetry.shed()
        if self.failure_mode is FailureMode.CLOSED:
            raise DeadlineExceeded("the call's deadline passed before it could be decided")
        return Decision(Code.OK, _open_statuses(len(request.descriptors)), shed=True)

    async def _with_tokens(self, request: Request, tokens: Tokens, now: float) -> Decision:
        """Settle, then decide the rest with its reservations (core/reserve.py); settling
        and unpaired descriptors answer OK (Envoy ignores the stream-done answer)."""
        for settle in tokens.settle:
            await self._settle(request.domain, settle, now)
        for rule in tokens.unpaired:
            self.telemetry.tokens.settled(request.domain, rule, Settled(False))
            if rule not in self._unpaired_seen and len(self._unpaired_seen) < 1024:
                self._unpaired_seen.add(rule)
                log.warning(
                    "negative hits paired with no reservation were ignored (logged "
                    "once per rule): domain %s, rule %s",
                    request.domain,
                    rule or "-",
                )
        statuses = [Status(Code.OK, None, 0, 0.0) for _ in request.descriptors]
        rates = tokens.rates
        if not rates.descriptors:
            return Decision(Code.OK, tuple(statuses))
        active = self._active
        slots = split(rates, active.matcher, self._anonymous(active)) if active.slots else None
        try:
            if slots is not None and (slots.acquire or slots.release):
                kept = {at: i for i, at in enumerate(slots.positions)}
                moved = tuple([_moved(r, kept[r.descriptor]) for r in tokens.reserve])
                inner = await self._with_slots(rates, slots, now, moved)
            else:
                inner = await self._rates(rates, now, reserve=tokens.reserve)
        except ReservationOpen:
            return self._id_open(request, tokens, statuses)
        if inner.code is Code.OK and tokens.reserve and not inner.backend_failed:
            for r in tokens.reserve:
                self.telemetry.tokens.reserved(request.domain, r.rule.path, r.hits)
        for position, status in zip(tokens.positions, inner.statuses, strict=True):
            statuses[position] = status
        return Decision(inner.code, tuple(statuses), inner.backend_failed,
                        inner.backend_seconds, inner.shed)  # fmt: skip

    def _id_open(self, request: Request, tokens: Tokens, statuses: list[Status]) -> Decision:
        """OVER_LIMIT for a request reserving by a request id whose reservation is still
        open: the store kept and charged nothing (two requests by one id would settle each
        other's reservation)."""
        rules = [r.rule.path for r in tokens.reserve]
        self.telemetry.tokens.id_open(request.domain, rules)
        if not self._id_open_logged:
            self._id_open_logged = True
            log.warning("a reservation by a request id that is still open was refused (logged "
                        "once; fairlimit.tokens.id_open counts them): domain %s, rule %s",
                        request.domain, rules[0] if rules else "-")  # fmt: skip
        for r in tokens.reserve:
            statuses[tokens.positions[r.descriptor]] = Status(Code.OVER_LIMIT, None, 0, 0.0, r.rule)
        return Decision(Code.OK if self.shadow else Code.OVER_LIMIT, tuple(statuses))

    async def _settle(self, domain: str, settle: Settle, now: float) -> None:
        """One settlement; a store that is down leaves the reservation as charged."""
        plan = make_plan(Request(domain, (settle.descriptor,)), self._active.matcher)
        settled = await self._store_call(self.store.settle(plan, settle, now))
        if settled is None:
            return
        self.telemetry.tokens.settled(domain, settle.rule.path, settled)
        own = own_counter(plan, 0)
        if settled.found and not settle.negative and own is not None:
            self.averages.add(plan.counters[own].key, settle.amount)

    async def _with_slots(
        self, request: Request, slots: Slots, now: float, reserve: tuple[Reserve, ...] = ()
    ) -> Decision:
        """Release, then acquire, then the rates (see the module docstring)."""
        if slots.release:
            await self._release(request.domain, slots.release, now)
        held: SlotOutcome | None = None
        if slots.acquire:
            held = await self._store_call(self.store.acquire(slots.acquire, now))
            if held is None and self.local is not None:
                held = await self._alone().acquire(slots.acquire, self.clock.now())
            if held is not None:
                pools = [p for _, p in taken(slots.acquire)]
                self.telemetry.slots.acquired(request.domain, pools, held)
                if not held.admitted:
                    self.telemetry.slots.refused(request.domain, slots.acquire)
                    return self._refused(request, slots)
        rates = None
        if slots.rates.descriptors:
            rates = await self._rates(slots.rates, now, reserve=reserve)
        if held is not None and rates is not None and rates.code is Code.OVER_LIMIT:
            await self._release(request.domain, slots.acquire, now)
        return _placed(request, slots, rates)

    async def _release(self, domain: str, claims: tuple[Claim, ...], now: float) -> None:
        """Give slots back; a failure is logged and left to the slots' expiry."""
        if self.local is not None:
            await self.local.release(claims, now)  # those taken alone, if any
        try:
            given = await self.waits.wait(self.store.release(claims, now), now)
        except StoreUnavailable as exc:
            self._backend_state(exc)
            log.warning("slots not released (they expire after max_duration): %s", exc)
            return
        self.telemetry.slots.released(domain, [p for _, p in taken(claims)], given)

    def _refused(self, request: Request, slots: Slots) -> Decision:
        statuses = [Status(Code.OK, None, 0, 0.0) for _ in request.descriptors]
        for claim in slots.acquire:
            statuses[claim.descriptor] = Status(Code.OVER_LIMIT, None, 0, 0.0, claim.pools[-1].rule)
        return Decision(Code.OK if self.shadow else Code.OVER_LIMIT, tuple(statuses))

    async def _rates(
        self,
        request: Request,
        now: float,
        plan: Plan | None = None,
        reserve: tuple[Reserve, ...] = (),
    ) -> Decision:
        """The rate-limit decision of ``request`` (no concurrency in it); ``plan``, its plan
        under the configuration in force when already made; ``reserve``, the reservations
        the store keeps if it admits."""
        if plan is None:
            plan = make_plan(request, self._active.matcher)
        if reserve:
            plan.reserve = reserve
        started = time.perf_counter()  # a latency, so real time: windows use self.clock
        tally = self.tally
        if tally.on and plan.shares:
            tally.add(request, plan)  # RLS demand at caps, for the RLQS division
        admitted = await self._admit(plan, now)
        if admitted is None:
            open_statuses = _open_statuses(len(plan.descriptors))
            return Decision(Code.OK, open_statuses, True, time.perf_counter() - started)
        outcome, decided = admitted  # decided: the plan itself, or as scaled when alone
        clock = now if outcome.now is None else outcome.now
        statuses = admission.statuses(decided, outcome, clock)
        code = admission.overall(statuses, self.quota_mode)
        if code is Code.OK and Code.OVER_LIMIT in [s.code for s in statuses]:
            code, statuses = await self._without_quotas_over(request, statuses, now, plan)
        self.telemetry.decided(request, statuses, now, plan)
        code = Code.OK if self.shadow else code
        return Decision(code, statuses, backend_seconds=time.perf_counter() - started)

    async def _admit(self, plan: Plan, now: float) -> tuple[Outcome, Plan] | None:
        """The store's outcome and the plan it decided; None when the store is down and the
        failure mode is open."""
        if not plan.counters:
            return Outcome(True, (), (), ()), plan
        local = self.local
        if local is not None:
            return await self._admit_local(local, plan, now)
        outcome = await self._store_call(self.store.admit(plan, now))
        return None if outcome is None else (outcome, plan)

    async def _admit_local(
        self, local: LocalLimits, plan: Plan, now: float
    ) -> tuple[Outcome, Plan]:
        """``_admit`` under ``--failure-mode local``: a store that is down leaves the
        decision to this process alone (the outcome of the plan scaled to its part); one
        that is back admits only what this process's part admits too, for RETURN_GRACE."""
        checked = False
        if local.returned_at is not None:
            self._end_if_due(local, now)
            if local.active:
                refused = await local.check(plan, now)
                if refused is not None:
                    self.telemetry.decided_locally()
                    return refused
                checked = True
        outcome = await self._store_call(self.store.admit(plan, now))
        # Decided here at the time it is decided, not when the call came: one that waited
        # for the store into the next window counts in that window's part (never twice in
        # a window: the parts add up to the limit exactly, docs/failure-modes.md).
        at = self.clock.now()
        if outcome is None:
            self.telemetry.decided_locally()
            return await self._alone().admit(plan, at)
        local.saw(plan, outcome, now)
        if local.active and not checked and outcome.admitted:
            # The answer that brought the store back: nothing is written back yet. Refused
            # by the part, it stays charged in the store (once per return).
            refused = await local.check(plan, at)
            if refused is not None:
                self.telemetry.decided_locally()
                return refused
        return outcome, plan

    def _alone(self) -> LocalLimits:
        """The local limits, begun (and logged) when this process was not yet alone."""
        local = self.local
        assert local is not None
        if not local.active:
            local.begin(self.clock.now())
            self.telemetry.degraded(True)
            processes, index = local.place
            log.warning(
                "limiting locally until the backend is back (--failure-mode local): this "
                "process admits its part of every limit, about 1/%d (place %d of %d; %d "
                "processes last seen, --replicas x --workers %d); e.g. 100 a window -> %d",
                processes, index + 1, processes, len(local.replicas.seen),
                local.replicas.configured, local.part_of(100),
            )  # fmt: skip
        return local

    def _back(self, local: LocalLimits) -> None:
        """The store answers again: the grace starts (once), and what was decided alone is
        written back (in the background, one write-back at a time)."""
        if local.returned_at is None:
            local.returned_at = self.clock.now()
        if self._paying is None or self._paying.done():
            self._paying = asyncio.get_running_loop().create_task(self._pay(local))

    async def _pay(self, local: LocalLimits) -> None:
        for _ in range(PAY_ROUNDS):
            try:
                failed = await local.pay(self.store, self.clock.now())
            except Exception:  # a write-back must never take the server down
                log.exception("writing back what was decided locally failed")
                return
            if failed is not None:
                self._backend_state(failed)  # still away: alone still, owed kept
                return
            local.paid_at = self.clock.now()
            if not local.owes:
                return
        # decided alone again meanwhile: the next answer pays the rest

    def _end_if_due(self, local: LocalLimits, now: float) -> None:
        """Drop the local state once the store has answered for RETURN_GRACE, everything
        decided alone is written back, and no write-back is out."""
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
        self.telemetry.degraded(False)

    async def watch_backend(self) -> None:
        """While this process limits alone: ping the store (so that it comes back as soon as
        the store does, traffic or not), and drop the local state when that is due. The
        serve loop calls it every BREAK_SECONDS."""
        local = self.local
        if local is None or not local.active:
            return
        if local.returned_at is None:
            await self.ping()
        else:
            self._end_if_due(local, self.clock.now())

    async def close(self) -> None:
        """Let a write-back that is out finish (for at most a second)."""
        paying = self._paying
        if paying is not None and not paying.done():
            try:
                await asyncio.wait_for(asyncio.shield(paying), 1.0)
            except TimeoutError:
                log.warning("what was decided locally was not all written back in time")

    async def _store_call(self, call: Awaitable[_T]) -> _T | None:
        """A store call's answer; None when the store is down and the failure mode is open.

        StoreUnavailable (GivenUp included) is counted and, under ``--failure-mode closed``,
        raised; a deadline error is raised as it is. While the breaker is open the store is
        not called: the answer is the failure mode's at once (``_skip``).
        """
        now = self.clock.now()
        skip = self._skip(now)
        if skip is not None:
            if hasattr(call, "close"):
                call.close()  # never awaited: the store is not asked
            self._failed(StoreUnavailable(f"backend unavailable ({skip})"), False)
            return None
        try:
            answer = await self.waits.wait(call, now)
        except DeadlineExceeded:
            raise  # a StoreUnavailable too, but shed by decide(), not a backend failure
        except StoreUnavailable as exc:
            self._failed(exc, True)
            return None
        self._answered_at = self.clock.now()
        if self._failures or self._tripped or not self.backend_healthy:
            self._backend_state(None)
        return answer

    def _skip(self, now: float) -> str | None:
        """Why the store is not to be asked now (the breaker is open), or None: open for
        BREAK_SECONDS once tripped, then while one call tries the store; tripped here when
        a call has waited BREAK_QUIET with no answer from the store since it began."""
        if now < self._broken_until <= now + BREAK_SECONDS:
            return "breaker open"
        if self._tripped and self.waits.busy:
            return "breaker open, a call is trying the backend"
        oldest = self.waits.oldest()
        if oldest is not None and now - oldest >= STALLED and self._answered_at < oldest:
            self._broken_until, self._tripped = now + BREAK_SECONDS, True
            self.waits.give_up_all()  # each would wait for its timeout, holding its place
            return f"no answer for {now - oldest:.2f} s: breaker open"
        return None

    def _failed(self, exc: StoreUnavailable, asked: bool) -> None:
        """A store call that failed (``asked``) or was not made: counted; raised when
        closed."""
        self._backend_state(exc, asked)
        if self.failure_mode is FailureMode.CLOSED:
            raise exc

    async def _without_quotas_over(
        self, request: Request, statuses: tuple[Status, ...], now: float, first: Plan
    ) -> tuple[Code, tuple[Status, ...]]:
        """Charge a request whose only overs are some (not all) of its quota descriptors.

        The store admits all or nothing, so the request is charged again without the quota
        descriptors that were over; they keep their OVER_LIMIT status. Should something
        else go over in between, the request is refused (and nothing is charged). A
        descriptor with a forced level (charge_when_over_limit) was charged by the refusal
        already: it keeps its status too, and is not charged twice.
        """
        keep = [
            i
            for i, s in enumerate(statuses)
            if s.code is not Code.OVER_LIMIT and not admission.forced(first, i)
        ]
        if not keep:
            return admission.overall(statuses, self.quota_mode), statuses
        rest = Request(request.domain, tuple(request.descriptors[i] for i in keep), request.hits)
        plan = make_plan(rest, self._active.matcher)
        admitted = await self._admit(plan, now)
        if admitted is None:
            return Code.OK, statuses  # failure-open, as for any request
        outcome, decided = admitted
        clock = now if outcome.now is None else outcome.now
        merged = list(statuses)
        for index, status in zip(keep, admission.statuses(decided, outcome, clock), strict=True):
            merged[index] = status
        code = admission.overall(merged, self.quota_mode) if outcome.admitted else Code.OVER_LIMIT
        return code, tuple(merged)

    async def ping(self) -> bool:
        """Whether the backend answers now (readiness)."""
        try:
            await self.store.ping()
        except StoreUnavailable as exc:
            self._backend_state(exc)
            return False
        self._backend_state(None)
        return True

    async def refresh_fairness(self) -> tuple[CapRow, ...]:
        """Read the caps' fairness figures from the store into the gauges; returns the rows."""
        try:
            reports = list((await self.store.caps()).values())
        except StoreUnavailable as exc:
            self._backend_state(exc)
            reports = []
        return self.telemetry.refresh(self.loaded, reports, self.clock.now())

    async def tokens(self, domain: str, entries: tuple[tuple[str, str], ...]
                     ) -> TokenReport | None:  # fmt: skip
        """The token budget of the client ``entries`` name (without a request id) now, at
        the rule with a reservation they match; None when they match none. Charges
        nothing; raises StoreUnavailable when the store cannot answer."""
        matcher = self._active.matcher
        match = matcher.match(domain, entries)
        limit = None if match is None else match.rule.rate_limit
        if match is None or match.rule.reservation is None or limit is None:
            return None
        plan = make_plan(Request(domain, (Descriptor(entries, None, 0),)), matcher)
        usage = await self.store.usage(plan, self.clock.now())
        return TokenReport(match.rule.path, limit.requests_per_unit, limit.window,
                           usage.charged, usage.reserved)  # fmt: skip

    def top_clients(self, n: int) -> tuple[TopRow, ...]:
        """Each cap's top ``n`` clients by demand and by rejections, as recorded here."""
        return self.telemetry.top(n, self.clock.now())

    @property
    def top_capacity(self) -> int:
        """The most clients ``top_clients`` can rank per cap (0: not recorded)."""
        return self.telemetry.top_capacity

    def _backend_state(self, error: StoreUnavailable | None, asked: bool = True) -> None:
        """Count a failed store call; log each healthy <-> unavailable transition once.

        Every answer the store gives (calls, readiness pings, the fairness refresh) moves
        the breaker: BREAK_AFTER failures in a row with no answer for BREAK_QUIET open it
        for BREAK_SECONDS, a success closes it. A call the open breaker answered (not
        ``asked``) counts as an error but does not hold it open."""
        if error is None:
            self._failures, self._broken_until, self._tripped = 0, -math.inf, False
            self._answered_at = self.clock.now()
            if self.local is not None and self.local.active:
                self._back(self.local)
        else:
            self.telemetry.backend_error()
            if self.local is not None:
                self.local.returned_at = None  # away again: alone, without the store
            if asked:
                self._failures += 1
                now = self.clock.now()
                if self._failures >= BREAK_AFTER and now - self._answered_at >= BREAK_QUIET:
                    self._broken_until, self._tripped = now + BREAK_SECONDS, True
        if (error is None) == self.backend_healthy:
            return
        self.backend_healthy = error is None
        if error is None:
            log.info("backend healthy again")
        else:
            log.error("backend unavailable: %s", error or type(error).__name__)
            if self.local is not None:
                self._alone()


def _active(loaded: Loaded) -> _Active:
    config = loaded.config
    anonymous = any(
        rule.concurrency is not None and rule.concurrency.released_by == "negative_hits"
        for domain in config.domains.values()
        for rule, _ in walk(domain.rules)
    )
    return _Active(loaded, Matcher(config), declared(config), anonymous, reserves(config))


def _moved(reserve: Reserve, descriptor: int) -> Reserve:
    """``reserve`` at another index of the descriptors decided."""
    return Reserve(reserve.request_id, descriptor, reserve.hits, reserve.ttl, reserve.rule)


def _placed(request: Request, slots: Slots, rates: Decision | None) -> Decision:
    """The rates' decision with a status at every descriptor of ``request`` as received:
    release descriptors answer OK (Envoy ignores the stream-done answer anyway)."""
    statuses = [Status(Code.OK, None, 0, 0.0) for _ in request.descriptors]
    if rates is None:
        return Decision(Code.OK, tuple(statuses))
    for position, status in zip(slots.positions, rates.statuses, strict=True):
        statuses[position] = status
    return Decision(rates.code, tuple(statuses), rates.backend_failed, rates.backend_seconds)
