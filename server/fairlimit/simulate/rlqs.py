"""RLQS in the simulator: clients behind simulated Envoys enforcing fairlimit's token buckets.

The model follows Envoy 1.40's rate_limit_quota filter as docs/rlqs.md describes it:

- A client's n-th request goes to Envoy ``n mod envoys``; its bucket id is, as a map, the
  scenario's descriptor that names the client (``{client}``), else the first. The real
  quota service (``quota/``) assigns on the simulated clock.
- A bucket's first request on an Envoy passes (``no_assignment_behavior: ALLOW_ALL``) and is
  reported at once (the subscription); the assignment comes back with no delay.
- Each Envoy reports every bucket's allowed and denied requests every ``interval`` seconds
  from its first bucket, at the start of the tick that reaches it.
- A token bucket fills continuously at its rate up to ``max_tokens`` and starts full; an
  assignment with unchanged parameters keeps it as it is. Assignments never expire (the
  reports never stop). The usage drip into the counters runs every tick.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from fairlimit.core.bucket import BucketKey, bucket_key
from fairlimit.core.quota import Blanket, Strategy, TokenBucket
from fairlimit.core.request import Request
from fairlimit.core.rules import Loaded
from fairlimit.quota import Abandon, Action, QuotaService, Usage
from fairlimit.simulate.report import ConfigResult
from fairlimit.simulate.run import Run
from fairlimit.simulate.scenario import RlqsModel, Scenario
from fairlimit.store.base import Store


class _Local:
    """One bucket in one Envoy: its assignment, tokens and usage since the last report."""

    def __init__(self, bucket: Mapping[str, str]) -> None:
        self.bucket = dict(bucket)
        self.strategy: Strategy | None = None
        self.tokens = 0.0
        self.at = 0.0
        self.allowed = self.denied = 0

    def assign(self, strategy: Strategy, now: float) -> None:
        if strategy == self.strategy:
            return
        self.strategy = strategy
        if isinstance(strategy, TokenBucket):
            self.tokens, self.at = float(strategy.max_tokens), now

    def take(self, now: float) -> bool:
        strategy = self.strategy
        if isinstance(strategy, TokenBucket):
            self.tokens = min(strategy.max_tokens, self.tokens + strategy.rate * (now - self.at))
            self.at = now
            passed = self.tokens >= 1
            if passed:
                self.tokens -= 1
        else:
            passed = strategy is not Blanket.DENY_ALL
        if passed:
            self.allowed += 1
        else:
            self.denied += 1
        return passed


class SimEnvoy:
    """One Envoy's rate_limit_quota filter on one RLQS stream."""

    def __init__(
        self, quota: QuotaService, domain: str, interval: float, now: Callable[[], float]
    ) -> None:
        self.domain, self.interval, self.now = domain, interval, now
        self.buckets: dict[BucketKey, _Local] = {}
        self.next_report: float | None = None
        self.reports = 0
        self.quota = quota
        self.stream = quota.open(self._apply)

    def _apply(self, actions: Sequence[Action]) -> None:
        for action in actions:
            key = bucket_key(action.bucket)
            if key not in self.buckets:
                continue
            if isinstance(action, Abandon):
                del self.buckets[key]
            else:
                self.buckets[key].assign(action.strategy, self.now())

    async def admit(self, bucket: Mapping[str, str], now: float) -> bool:
        """One request in ``bucket``: the local verdict (a new bucket subscribes first)."""
        key = bucket_key(bucket)
        local = self.buckets.get(key)
        if local is not None:
            return local.take(now)
        self.buckets[key] = _Local(bucket)
        if self.next_report is None:
            self.next_report = now + self.interval
        self.reports += 1
        await self.quota.report(self.stream, self.domain, [Usage(bucket, 1, 0)])
        return True

    async def tick(self, now: float) -> None:
        """Report every bucket's usage when the reporting interval has come round."""
        if self.next_report is None or now < self.next_report - 1e-9:
            return
        self.next_report += self.interval
        usages = []
        for local in self.buckets.values():
            usages.append(Usage(local.bucket, local.allowed, local.denied))
            local.allowed = local.denied = 0
        self.reports += 1
        await self.quota.report(self.stream, self.domain, usages)


class RlqsRun(Run):
    """One config's run with every client behind ``model.envoys`` RLQS Envoys."""

    def __init__(
        self, scenario: Scenario, loaded: Loaded, model: RlqsModel, store: Store | None = None
    ) -> None:
        super().__init__(scenario, loaded, False, store)  # no coalescing: attempts alternate Envoys
        self.quota = QuotaService(lambda: loaded, self.limiter.store, self.clock.now)
        self.envoys = [
            SimEnvoy(self.quota, scenario.domain, model.interval, self.clock.now)
            for _ in range(model.envoys)
        ]
        # The bucket is the descriptor that names the client ({client}), else the first.
        names = [any("{client}" in v for _, v in t) for t in scenario.descriptors]
        which = names.index(True) if True in names else 0
        self.bucket_of = [dict(r.descriptors[which].entries) for r in self.requests]
        self.sent = [0] * len(scenario.clients)

    async def _before_tick(self) -> None:
        now = self.clock.now()
        for envoy in self.envoys:
            await envoy.tick(now)
        await self.quota.drip()

    async def _decide(self, client: int, request: Request) -> bool:
        envoy = self.envoys[self.sent[client] % len(self.envoys)]
        self.sent[client] += 1
        return await envoy.admit(self.bucket_of[client], self.clock.now())

    def result(self, label: str, path: str) -> ConfigResult:
        """As for RLS; ``calls`` counts usage reports (no call per request)."""
        reports = sum(e.reports for e in self.envoys)
        return dataclasses.replace(super().result(label, path), limiter_calls=reports)
