"""The use case: a request -> the core's plan -> the store's atomic admission -> statuses."""

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from fairlimit.core import admission
from fairlimit.core.admission import Code, Outcome, Status
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import Plan
from fairlimit.core.plan import plan as make_plan
from fairlimit.core.request import Request, validate
from fairlimit.core.rules import Loaded
from fairlimit.errors import StoreUnavailable
from fairlimit.settings import FailureMode
from fairlimit.store.base import Store
from fairlimit.telemetry import Telemetry
from fairlimit.telemetry.fairness import CapRow
from fairlimit.telemetry.top import TopRow

log = logging.getLogger(__name__)


class Clock(Protocol):
    """Where the limiter reads the time: once per request."""

    def now(self) -> float: ...


class SystemClock:
    """Wall-clock Unix time."""

    def now(self) -> float:
        return time.time()


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer to one request."""

    code: Code
    statuses: tuple[Status, ...]
    backend_failed: bool = False
    backend_seconds: float = 0.0  # time spent waiting for the store, for the trace


@dataclass(frozen=True, slots=True)
class _Active:
    loaded: Loaded
    matcher: Matcher


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
    ) -> None:
        self._active = _Active(loaded, Matcher(loaded.config))
        self.store = store
        self.clock = clock or SystemClock()
        self.shadow = shadow
        self.quota_mode = quota_mode  # upstream's QUOTA_MODE: every rule a quota
        self.failure_mode = failure_mode
        self.backend_healthy = True
        self.telemetry = telemetry or Telemetry.off()
        self.telemetry.use(loaded)

    @property
    def loaded(self) -> Loaded:
        return self._active.loaded

    def swap(self, loaded: Loaded) -> None:
        """Serve ``loaded`` from the next request on (one reference swap, so atomic)."""
        self._active = _Active(loaded, Matcher(loaded.config))
        self.telemetry.use(loaded)

    async def should_rate_limit(self, request: Request) -> Decision:
        """Decide ``request``; RequestError for a malformed one, StoreUnavailable if closed."""
        validate(request)
        plan = make_plan(request, self._active.matcher)
        now = self.clock.now()
        started = time.perf_counter()  # a latency, so real time: windows use self.clock
        outcome = await self._admit(plan, now)
        if outcome is None:
            open_statuses = tuple(Status(Code.OK, None, 0, 0.0) for _ in plan.descriptors)
            return Decision(Code.OK, open_statuses, True, time.perf_counter() - started)
        statuses = admission.statuses(plan, outcome, now if outcome.now is None else outcome.now)
        code = admission.overall(statuses, self.quota_mode)
        if code is Code.OK and any(s.code is Code.OVER_LIMIT for s in statuses):
            code, statuses = await self._without_quotas_over(request, statuses, now)
        self.telemetry.decided(request, statuses, now, plan)
        code = Code.OK if self.shadow else code
        return Decision(code, statuses, backend_seconds=time.perf_counter() - started)

    async def _admit(self, plan: Plan, now: float) -> Outcome | None:
        """The store's outcome; None when it is down and the failure mode is open."""
        if not plan.counters:
            return Outcome(True, (), (), ())
        try:
            outcome = await self.store.admit(plan, now)
        except StoreUnavailable as exc:
            self._backend_state(exc)
            if self.failure_mode is FailureMode.CLOSED:
                raise
            return None
        if not self.backend_healthy:
            self._backend_state(None)
        return outcome

    async def _without_quotas_over(
        self, request: Request, statuses: tuple[Status, ...], now: float
    ) -> tuple[Code, tuple[Status, ...]]:
        """Charge a request whose only overs are some (not all) of its quota descriptors.

        The store admits all or nothing, so the request is charged again without the quota
        descriptors that were over; they keep their OVER_LIMIT status. Should something
        else go over in between, the request is refused (and nothing is charged).
        """
        keep = [i for i, s in enumerate(statuses) if s.code is not Code.OVER_LIMIT]
        rest = Request(request.domain, tuple(request.descriptors[i] for i in keep), request.hits)
        plan = make_plan(rest, self._active.matcher)
        outcome = await self._admit(plan, now)
        if outcome is None:
            return Code.OK, statuses  # failure-open, as for any request
        clock = now if outcome.now is None else outcome.now
        merged = list(statuses)
        for index, status in zip(keep, admission.statuses(plan, outcome, clock), strict=True):
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

    def top_clients(self, n: int) -> tuple[TopRow, ...]:
        """Each cap's top ``n`` clients by demand and by rejections, as recorded here."""
        return self.telemetry.top(n, self.clock.now())

    @property
    def top_capacity(self) -> int:
        """The most clients ``top_clients`` can rank per cap (0: not recorded)."""
        return self.telemetry.top_capacity

    def _backend_state(self, error: StoreUnavailable | None) -> None:
        """Count a failed store call; log each healthy <-> unavailable transition once."""
        if error is not None:
            self.telemetry.backend_error()
        if (error is None) == self.backend_healthy:
            return
        self.backend_healthy = error is None
        if error is None:
            log.info("backend healthy again")
        else:
            log.error("backend unavailable: %s", error or type(error).__name__)
