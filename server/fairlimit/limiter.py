"""The RLS use case: a request, prepared under the configuration in force, handed to one flow.

``prepare`` validates a request and sorts it: one that settles or reserves tokens goes to the
tokens flow (flows/tokens.py), one that takes or gives back slots to the slots flow
(flows/slots.py), the rest to the rates flow (flows/rates.py) with its plan made. Every flow
calls the store through one failure policy (policy/guarded.py: the breaker, shedding past a
deadline and ``--failure-mode local``), so each gets the same failure behaviour.
"""

import time
from dataclasses import dataclass, field, replace
from typing import Protocol

from fairlimit.core.admission import Code, Said
from fairlimit.core.concurrency import Slots
from fairlimit.core.plan import Plan
from fairlimit.core.plan import plan as make_plan
from fairlimit.core.request import Request, validate
from fairlimit.core.reserve import TokenReport, Tokens
from fairlimit.core.rules import Loaded
from fairlimit.core.tally import Tally
from fairlimit.errors import DeadlineExceeded, StoreUnavailable
from fairlimit.flows.decision import Decision, active
from fairlimit.flows.fast import FastLeased, FastMemory, FastRates, fast, leased
from fairlimit.flows.rates import RatesFlow
from fairlimit.flows.slots import SlotsFlow
from fairlimit.flows.tokens import TokensFlow
from fairlimit.policy.alone import PAY_ROUNDS, RETURN_GRACE
from fairlimit.policy.answers import open_statuses
from fairlimit.policy.breaker import BREAK_AFTER, BREAK_QUIET, BREAK_SECONDS, STALLED
from fairlimit.policy.guarded import FailurePolicy
from fairlimit.policy.local import LocalLimits
from fairlimit.settings import FailureMode
from fairlimit.store.base import BlockStore, Store
from fairlimit.store.deadline import DEADLINE
from fairlimit.store.memory import MemoryStore
from fairlimit.store.replicas import Replicas
from fairlimit.store.waits import Waits
from fairlimit.telemetry import Telemetry
from fairlimit.telemetry.fairness import CapRow
from fairlimit.telemetry.top import TopRow

__all__ = [  # the policy's timings, named here as before they moved (tests read them)
    "BREAK_AFTER", "BREAK_QUIET", "BREAK_SECONDS", "PAY_ROUNDS", "RETURN_GRACE", "STALLED",
    "Clock", "Decision", "Limiter", "Prepared", "SystemClock",
]  # fmt: skip


class Clock(Protocol):
    """Where the limiter reads the time: once per request."""

    def now(self) -> float: ...


class SystemClock:
    """Wall-clock Unix time."""

    def now(self) -> float:
        return time.time()


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated request and its plan under one configuration: pure of time, so a caller
    that sees the same request again may decide it again without rebuilding the plan
    (``Limiter.current`` says whether the configuration is still the one in force), unless
    it is not ``reusable``."""

    request: Request
    plan: Plan | None  # None when the request takes or gives back slots or tokens
    slots: Slots | None
    active: object  # the configuration it was planned under
    tokens: Tokens | None = None  # its reservations and settlements, when it has any
    # its decision in one step, when it qualifies (a servicer's)
    fast: FastRates | FastMemory | FastLeased | None = None
    # its plan's last statuses worked out whole (the next ones may move from them)
    said: Said = field(default_factory=Said)

    @property
    def reusable(self) -> bool:
        """Whether the same request may be decided with it again: not when it takes a slot
        under an id made up for it (released by negative hits), one per request."""
        return self.slots is None or not self.slots.anonymous


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
        self._active = active(loaded)
        self.store = store  # the store itself (quota/ shares it); the flows call the policy
        self.clock = clock or SystemClock()
        self.telemetry = telemetry or Telemetry.off()
        self.telemetry.use(loaded)
        self.policy = FailurePolicy(store, failure_mode, self.clock.now, self.telemetry,
                                    replicas)  # fmt: skip
        self.tally = Tally()  # RLS demand at caps, while an RLQS division wants it
        self._rates = RatesFlow(self.policy, self.telemetry, self.tally, shadow, quota_mode,
                                self.policy.admits_now)  # fmt: skip
        # plans decided in one step need this process's memory, every answer as decided
        memory = store if isinstance(store, MemoryStore) and not (shadow or quota_mode) else None
        self._fast_store = memory if self.policy.admits_now is not None else None
        # plans a lease block serves, admitted from it in one step (not alone, not quota mode)
        blocks = store.blocks() if isinstance(store, BlockStore) else None
        self._from_block = None if quota_mode or self.policy.alone is not None else blocks
        self._shadow = shadow
        self._slots = SlotsFlow(self.policy, self.telemetry, self._rates, shadow)
        self._tokens = TokensFlow(self.policy, self.telemetry, self._rates, self._slots, shadow)

    @property
    def loaded(self) -> Loaded:
        return self._active.loaded

    @property
    def backend_healthy(self) -> bool:
        return self.policy.healthy

    @property
    def waits(self) -> Waits:
        """The calls waiting on the store (a full call budget gives one up)."""
        return self.policy.waits

    @property
    def local(self) -> LocalLimits | None:
        """``--failure-mode local``: the last counts seen, and this process's own limits."""
        return self.policy.local

    def swap(self, loaded: Loaded) -> None:
        """Serve ``loaded`` from the next request on (one reference swap, so atomic)."""
        self._active = active(loaded)
        self.telemetry.use(loaded)

    async def should_rate_limit(self, request: Request) -> Decision:
        """Decide ``request``; RequestError for a malformed one, StoreUnavailable if closed."""
        return await self.decide(self.prepare(request))

    def prepare(self, request: Request, quick: bool = True) -> Prepared:
        """Validate ``request`` (RequestError) and plan it under the configuration in force:
        its tokens or its slots, when it has any, else the plan of its rates, with its
        decision in one step where it qualifies (flows/fast.py) unless not ``quick``
        (``quicken`` adds it later: a request seen once would not use it)."""
        validate(request)
        active = self._active
        if active.tokens or any([d.negative for d in request.descriptors]):
            tokens = self._tokens.split(request, active.matcher)
            if tokens is not None:
                return Prepared(request, None, None, active, tokens)
        if active.slots:
            slots = self._slots.split(request, active)
            if slots is not None and (slots.acquire or slots.release):
                return Prepared(request, None, slots, active)
        plan = make_plan(request, active.matcher)
        said = Said()  # one per kept plan: the generic path's and the one step's alike
        one = self._one_step(plan, request, said) if quick else None
        return Prepared(request, plan, None, active, fast=one, said=said)

    def quicken(self, prepared: Prepared) -> Prepared:
        """``prepared`` with its decision in one step, where it qualifies (else as it is)."""
        plan = prepared.plan
        if plan is None or prepared.fast is not None:
            return prepared
        one = self._one_step(plan, prepared.request, prepared.said)
        return prepared if one is None else replace(prepared, fast=one)

    def _one_step(
        self, plan: Plan, request: Request, said: Said
    ) -> FastRates | FastMemory | FastLeased | None:
        store, from_block = self._fast_store, self._from_block
        if store is not None:
            return fast(plan, request, store, self.policy, self.telemetry, self.tally, said)
        if from_block is not None:
            policy, telemetry, shadow = self.policy, self.telemetry, self._shadow
            return leased(plan, request, from_block, policy, telemetry, self.tally, shadow, said)
        return None

    def current(self, prepared: Prepared) -> bool:
        """Whether ``prepared`` was planned under the configuration in force now."""
        return prepared.active is self._active

    async def decide(self, prepared: Prepared, remaining: float | None = None) -> Decision:
        """Decide a prepared request now; StoreUnavailable if the store fails and closed.

        ``remaining``: seconds until the caller's deadline (None: no deadline). A call whose
        deadline has passed, or leaves the store no time, is shed by the failure policy.
        """
        request = prepared.request
        if remaining is not None and remaining <= 0:
            return self._shed(request)
        now = self.clock.now()
        active = self._active
        token = None if remaining is None else DEADLINE.set(time.monotonic() + remaining)
        try:
            if prepared.tokens is not None:
                decision = await self._tokens.decide(request, prepared.tokens, now, active)
            elif prepared.slots is not None:
                slots = prepared.slots
                decision = await self._slots.decide(request, slots, now, active.matcher)
            else:
                plan, said = prepared.plan, prepared.said
                decision = await self._rates.decide(request, now, active.matcher, plan, (), said)
        except DeadlineExceeded:
            return self._shed(request)
        finally:
            if token is not None:
                DEADLINE.reset(token)
        if decision.backend_failed:
            self.telemetry.failed_open()
        return decision

    def _shed(self, request: Request) -> Decision:
        self.policy.shed()  # counted; raised under --failure-mode closed
        return Decision(Code.OK, open_statuses(len(request.descriptors)), shed=True)

    async def watch_backend(self) -> None:
        """While this process limits alone: ping the store and end the local state when due
        (the serve loop calls it every BREAK_SECONDS)."""
        await self.policy.watch()

    async def close(self) -> None:
        """Let a write-back that is out finish (for at most a second)."""
        await self.policy.close()

    async def ping(self) -> bool:
        """Whether the backend answers now (readiness)."""
        try:
            await self.policy.ping()
        except StoreUnavailable:
            return False
        return True

    async def refresh_fairness(self) -> tuple[CapRow, ...]:
        """Read the caps' fairness figures from the store into the gauges; returns the rows."""
        try:
            reports = list((await self.policy.caps()).values())
        except StoreUnavailable:
            reports = []
        return self.telemetry.refresh(self.loaded, reports, self.clock.now())

    async def tokens(self, domain: str, entries: tuple[tuple[str, str], ...]
                     ) -> TokenReport | None:  # fmt: skip
        """The token budget of the client ``entries`` name (without a request id) now, at
        the rule with a reservation they match; None when they match none. Charges
        nothing; raises StoreUnavailable when the store cannot answer."""
        matcher = self._active.matcher
        return await self._tokens.report(domain, entries, matcher, self.clock.now())

    def top_clients(self, n: int) -> tuple[TopRow, ...]:
        """Each cap's top ``n`` clients by demand and by rejections, as recorded here."""
        return self.telemetry.top(n, self.clock.now())

    @property
    def top_capacity(self) -> int:
        """The most clients ``top_clients`` can rank per cap (0: not recorded)."""
        return self.telemetry.top_capacity
