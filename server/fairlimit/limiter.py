"""The use case: a request -> the core's plan -> the store's atomic admission -> statuses."""

import enum
import time
from dataclasses import dataclass
from typing import Protocol

from fairlimit.config.loader import Loaded
from fairlimit.core import admission
from fairlimit.core.admission import Code, Request, Status
from fairlimit.core.matching import Matcher
from fairlimit.errors import StoreUnavailable
from fairlimit.store.base import Store


class Clock(Protocol):
    """Where the limiter reads the time: once per request."""

    def now(self) -> float: ...


class SystemClock:
    """Wall-clock Unix time."""

    def now(self) -> float:
        return time.time()


class FailureMode(enum.Enum):
    OPEN = "open"  # answer OK when the backend is down, and count it
    CLOSED = "closed"  # answer UNAVAILABLE so Envoy's failure_mode_deny decides


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer to one request."""

    code: Code
    statuses: tuple[Status, ...]
    backend_failed: bool = False


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
    ) -> None:
        self._active = _Active(loaded, Matcher(loaded.config))
        self.store = store
        self.clock = clock or SystemClock()
        self.shadow = shadow
        self.failure_mode = failure_mode
        self.backend_failures = 0

    @property
    def loaded(self) -> Loaded:
        return self._active.loaded

    def swap(self, loaded: Loaded) -> None:
        """Serve ``loaded`` from the next request on (one reference swap, so atomic)."""
        self._active = _Active(loaded, Matcher(loaded.config))

    async def should_rate_limit(self, request: Request) -> Decision:
        """Decide ``request``; RequestError for a malformed one, StoreUnavailable if closed."""
        admission.validate(request)
        plan = admission.plan(request, self._active.matcher)
        now = self.clock.now()
        if not plan.counters:
            outcome = admission.Outcome(True, (), (), ())
        else:
            try:
                outcome = await self.store.admit(plan, now)
            except StoreUnavailable:
                self.backend_failures += 1
                if self.failure_mode is FailureMode.CLOSED:
                    raise
                open_statuses = tuple(Status(Code.OK, None, 0, 0.0) for _ in plan.descriptors)
                return Decision(Code.OK, open_statuses, backend_failed=True)
        statuses = admission.statuses(plan, outcome, now)
        code = Code.OK if self.shadow else admission.overall(statuses)
        return Decision(code, statuses)
