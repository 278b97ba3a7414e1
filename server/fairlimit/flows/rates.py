"""The rates flow: a request's plan -> one atomic admit -> each descriptor's status.

The store admits all of a plan or none of it. A request whose only overs are quota
descriptors (``quota_mode``) is charged again without them (``_without_quotas_over``).
"""

import time
from collections.abc import Callable

from fairlimit.core import admission
from fairlimit.core.admission import Code, Outcome, Said, Status
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import Plan
from fairlimit.core.plan import plan as make_plan
from fairlimit.core.request import Request
from fairlimit.core.reserve import Reserve
from fairlimit.core.tally import Tally
from fairlimit.flows.decision import Decision
from fairlimit.policy.answers import Unanswered, open_statuses
from fairlimit.policy.answers import statuses as statuses_of
from fairlimit.store.base import Store
from fairlimit.telemetry import Telemetry


class RatesFlow:
    """Decides requests by their rate limits alone (no slots, no reservations kept)."""

    def __init__(
        self,
        store: Store,
        telemetry: Telemetry,
        tally: Tally,
        shadow: bool,
        quota_mode: bool,
        admit_now: Callable[[Plan, float], Outcome] | None = None,
    ) -> None:
        self._store = store  # the failure policy's: its answers are the failure mode's too
        self._admit_now = admit_now  # the same as a plain function, when it never waits
        self._telemetry = telemetry
        self._tally = tally  # RLS demand at caps, while an RLQS division wants it
        self._shadow = shadow
        self._quota_mode = quota_mode  # upstream's QUOTA_MODE: every rule a quota

    async def decide(
        self,
        request: Request,
        now: float,
        matcher: Matcher,
        plan: Plan | None = None,
        reserve: tuple[Reserve, ...] = (),
        said: Said | None = None,
    ) -> Decision:
        """The rate-limit decision of ``request`` (no concurrency in it); ``plan``, its plan
        under the configuration in force when already made; ``reserve``, the reservations
        the store keeps if it admits; ``said``, the plan's last statuses when it is kept
        (policy/answers.py)."""
        if plan is None:
            plan = make_plan(request, matcher)
        if reserve:
            plan.reserve = reserve
        started = time.perf_counter()  # a latency, so real time: windows use the clock
        tally = self._tally
        if tally.on and plan.shares:
            tally.add(request, plan)  # RLS demand at caps, for the RLQS division
        # a plan with no counters charges nothing: admitted without asking the store
        admit_now = self._admit_now
        if not plan.counters:
            outcome = Outcome(True, (), (), ())
        elif admit_now is not None:  # an in-process store: no coroutine to await
            outcome = admit_now(plan, now)
        else:
            outcome = await self._store.admit(plan, now)
        if isinstance(outcome, Unanswered):  # let through: nothing decided to record
            statuses = open_statuses(len(plan.descriptors))
            return Decision(Code.OK, statuses, True, time.perf_counter() - started)
        statuses = statuses_of(plan, outcome, now, said)
        code = admission.overall(statuses, self._quota_mode)
        if code is Code.OK and Code.OVER_LIMIT in [s.code for s in statuses]:
            code, statuses = await self._without_quotas_over(request, statuses, now, plan, matcher)
        self._telemetry.decided(request, statuses, now, plan)
        code = Code.OK if self._shadow else code
        return Decision(code, statuses, backend_seconds=time.perf_counter() - started)

    async def _without_quotas_over(
        self,
        request: Request,
        statuses: tuple[Status, ...],
        now: float,
        first: Plan,
        matcher: Matcher,
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
            return admission.overall(statuses, self._quota_mode), statuses
        rest = Request(request.domain, tuple(request.descriptors[i] for i in keep), request.hits)
        plan = make_plan(rest, matcher)
        outcome = await self._store.admit(plan, now) if plan.counters else Outcome(True, (), (), ())
        if isinstance(outcome, Unanswered):
            return Code.OK, statuses  # failure-open, as for any request
        merged = list(statuses)
        for index, status in zip(keep, statuses_of(plan, outcome, now), strict=True):
            merged[index] = status
        quota_mode = self._quota_mode
        code = admission.overall(merged, quota_mode) if outcome.admitted else Code.OVER_LIMIT
        return code, tuple(merged)
