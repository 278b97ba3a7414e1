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
from fairlimit.errors import DeadlineExceeded, StoreUnavailable
from fairlimit.settings import FailureMode
from fairlimit.store.base import Store
from fairlimit.store.deadline import DEADLINE
from fairlimit.telemetry import Telemetry
from fairlimit.telemetry.fairness import CapRow

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
    shed: bool = False  # the caller's deadline had passed or left the store no time


@dataclass(frozen=True, slots=True)
class _Active:
    loaded: Loaded
    matcher: Matcher


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated request and its plan under one configuration: pure of time, so a caller
    that sees the same request again may decide it again without rebuilding the plan
    (``Limiter.current`` says whether the configuration is still the one in force)."""

    request: Request
    plan: Plan
    active: object  # the configuration it was planned under


def _open_statuses(plan: Plan) -> tuple[Status, ...]:
    """What ``--failure-mode open`` answers: OK for every descriptor, no limit."""
    return tuple(Status(Code.OK, None, 0, 0.0) for _ in plan.descriptors)


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
    ) -> None:
        self._active = _Active(loaded, Matcher(loaded.config))
        self.store = store
        self.clock = clock or SystemClock()
        self.shadow = shadow
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
        return await self.decide(self.prepare(request))

    def prepare(self, request: Request) -> Prepared:
        """Validate ``request`` (RequestError) and plan it under the configuration in force."""
        validate(request)
        active = self._active
        return Prepared(request, make_plan(request, active.matcher), active)

    def current(self, prepared: Prepared) -> bool:
        """Whether ``prepared`` was planned under the configuration in force now."""
        return prepared.active is self._active

    async def decide(self, prepared: Prepared, remaining: float | None = None) -> Decision:
        """Decide a prepared request now; StoreUnavailable if the store fails and closed.

        ``remaining``: seconds until the caller's deadline (None: no deadline). A call whose
        deadline has passed, or leaves the store no time, is shed: answered at once by the
        failure mode and counted, since nobody waits for its answer.
        """
        request, plan = prepared.request, prepared.plan
        now = self.clock.now()
        backend = 0.0
        if not plan.counters:
            outcome = Outcome(True, (), (), ())
        elif remaining is not None and remaining <= 0:
            return self._shed(plan)
        else:
            started = time.perf_counter()  # a latency, so real time: windows use self.clock
            token = None if remaining is None else DEADLINE.set(time.monotonic() + remaining)
            try:
                outcome = await self.store.admit(plan, now)
            except DeadlineExceeded:
                return self._shed(plan)
            except StoreUnavailable as exc:
                self._backend_state(exc)
                if self.failure_mode is FailureMode.CLOSED:
                    raise
                backend = time.perf_counter() - started
                return Decision(Code.OK, _open_statuses(plan), True, backend)
            finally:
                if token is not None:
                    DEADLINE.reset(token)
            backend = time.perf_counter() - started
            if not self.backend_healthy:
                self._backend_state(None)
        clock = now if outcome.now is None else outcome.now
        statuses = admission.statuses(plan, outcome, clock)
        code = Code.OK if self.shadow else admission.overall(statuses)
        self.telemetry.decided(request, statuses, now)
        return Decision(code, statuses, backend_seconds=backend)

    def _shed(self, plan: Plan) -> Decision:
        """The failure mode's answer for a call past (or too near) its deadline, counted."""
        self.telemetry.shed()
        if self.failure_mode is FailureMode.CLOSED:
            raise DeadlineExceeded("the call's deadline passed before it could be decided")
        return Decision(Code.OK, _open_statuses(plan), shed=True)

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
