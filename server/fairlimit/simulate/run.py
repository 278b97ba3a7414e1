"""One config's run of a scenario: the simulated clock, the limiter and what each client got.

``engine`` runs one per config (and ``rlqs.RlqsRun``, built on it, per config with an
``rlqs`` key); the model they follow is ``engine``'s docstring.
"""

import dataclasses
import math
from collections import defaultdict

from fairlimit.core.admission import Code
from fairlimit.core.concurrency import declared as slots_declared
from fairlimit.core.request import Descriptor, Request
from fairlimit.core.reserve import declared as reserves
from fairlimit.core.rules import Loaded
from fairlimit.limiter import Limiter
from fairlimit.simulate import levels
from fairlimit.simulate.measure import Meter, Tally, client_result
from fairlimit.simulate.report import ConfigResult, shared_limit
from fairlimit.simulate.retries import RetryPool
from fairlimit.simulate.scenario import Scenario
from fairlimit.store.base import Store
from fairlimit.store.memory import MemoryStore

EPOCH = 1_699_920_000  # a day boundary (19675 x 86400): scenario time 0


class SimClock:
    """The injected clock: moved by the run, tick by tick."""

    def __init__(self) -> None:
        self.t = float(EPOCH)

    def now(self) -> float:
        return self.t


def requests_for(scenario: Scenario) -> list[Request]:
    """Each client's request: the descriptor template with its name and tenant filled in."""

    def fill(value: str, name: str, tenant: str) -> str:
        return value.replace("{client}", name).replace("{tenant}", tenant)

    return [
        Request(
            scenario.domain,
            tuple(
                Descriptor(tuple((k, fill(v, c.name, c.tenant)) for k, v in template))
                for template in scenario.descriptors
            ),
        )
        for c in scenario.clients
    ]


def _with_hits(request: Request, hits: int) -> Request:
    """``request`` with every descriptor's own ``hits_addend`` set (0: a check only)."""
    descriptors = tuple(dataclasses.replace(d, hits=hits) for d in request.descriptors)
    return Request(request.domain, descriptors)


Event = tuple[int, RetryPool | None, int]  # (client, retry pool or None: an original, cost)


class Run:
    """One config's run: the limiter, the pending retries and what each client got."""

    def __init__(
        self, scenario: Scenario, loaded: Loaded, coalesce: bool, store: Store | None = None
    ) -> None:
        self.scenario = scenario
        self.clock = SimClock()
        self.store: Store = MemoryStore() if store is None else store
        self.limiter = Limiter(loaded, self.store, self.clock)
        self.requests = requests_for(scenario)
        self.shared = shared_limit(loaded, self.requests)
        self.tree = levels.tree(loaded, self.requests, self.shared.key if self.shared else None)
        self.meter = Meter(scenario, self.tree)
        self.coalesce = coalesce and not any(c.request_duration for c in scenario.clients)
        self.releases: dict[int, list[Request]] = defaultdict(list)  # tick -> stream-done calls
        self.ids = 0
        domain = loaded.config.domains.get(scenario.domain)
        self.id_keys = (domain.acquire_key, domain.release_key) if domain else ("", "")
        self.reserving = reserves(loaded.config)  # charge: response clients reserve, settle
        self.slotted = slots_declared(loaded.config)
        clients = scenario.clients
        self.batchable = [c.cost.fixed is not None and not c.charge_after for c in clients]
        self.per_second = round(1 / scenario.tick)
        self.backoff = [  # in ticks; a retry never goes in the tick that was refused
            max(1, math.ceil(c.retries.backoff * self.per_second - 1e-9)) for c in clients
        ]
        self.tallies = [Tally() for _ in clients]
        self.pending: dict[int, dict[int, RetryPool]] = defaultdict(dict)  # tick -> client
        self.calls = 0
        self.tick = 0
        self.steady = False

    async def run(self, by_tick: dict[int, list[tuple[float, int, int]]]) -> None:
        ticks = math.ceil(self.scenario.duration * self.per_second - 1e-9)
        low, high = (round(x * self.per_second) for x in self.scenario.steady)
        fixed = [c.cost.fixed or 1 for c in self.scenario.clients]
        for self.tick in range(ticks):
            if self.tick and self.tick % self.per_second == 0:
                await self._second_ends()
            self.clock.t = EPOCH + self.tick / self.per_second
            self.steady = low <= self.tick < high
            for done in self.releases.pop(self.tick, ()):
                await self.limiter.should_rate_limit(done)
            await self._before_tick()
            due = sorted(self.pending.pop(self.tick, {}).items())
            events: list[Event] = [(c, pool, fixed[c]) for c, pool in due]
            for at, client, cost in by_tick.get(self.tick, ()):
                self.tallies[client].offer(cost)
                self.meter.offer(at, client, cost)
                events.append((client, None, cost))
            await self._tick(events)
        await self._second_ends()

    async def _before_tick(self) -> None:
        """What happens at a tick's start besides requests (nothing for RLS)."""

    async def _decide(self, client: int, request: Request) -> bool:
        """Whether ``request`` of ``client`` is admitted: the limiter's answer."""
        return (await self.limiter.should_rate_limit(request)).code is Code.OK

    async def _second_ends(self) -> None:
        """λ at the root cap as the store reports it, at the end of each second."""
        report = (await self.store.caps()).get(self.tree.root or "")
        self.meter.level(None if report is None else report.level)

    async def _tick(self, events: list[Event]) -> None:
        refused: dict[int, tuple[int, RetryPool]] = {}  # client -> (refused alone, to send)
        for client, pool, cost in events:
            if not (self.coalesce and self.batchable[client]):
                await self._alone(client, pool, cost)
            elif client in refused:  # only originals follow a client's retries
                refused[client][1].add(self._expiry(client), 1)
            elif pool is None:
                expiry = self._expiry(client)
                if not await self._ask(client, 1, cost):
                    refused[client] = (expiry, RetryPool())
            else:
                while pool.total:
                    expiry = pool.take()
                    if not await self._ask(client, 1, cost):
                        refused[client] = (expiry, pool)
                        break
        for client, (first, rest) in refused.items():
            await self._send_refused(client, first, rest)

    async def _alone(self, client: int, pool: RetryPool | None, cost: int) -> None:
        if pool is None:
            await self._send(client, self._expiry(client), cost)
        while pool is not None and pool.total:
            await self._send(client, pool.take(), cost)

    def _expiry(self, client: int) -> int:
        """The last tick a request first sent now may be retried in."""
        return self.tick + self.scenario.clients[client].retries.max * self.backoff[client]

    async def _send(self, client: int, expiry: int, cost: int) -> None:
        """One attempt; if refused, its retry is due ``backoff`` later unless that is too late."""
        if not await self._ask(client, 1, cost):
            due = self.tick + self.backoff[client]
            if due <= expiry:
                self.pending[due].setdefault(client, RetryPool()).add(expiry, 1)

    async def _ask(self, client: int, count: int, cost: int) -> bool:
        """``count`` identical attempts as one request through the limiter; True if admitted."""
        request = self.requests[client]
        spec = self.scenario.clients[client]
        after = spec.charge_after
        reserve = after and self.reserving
        if reserve:
            request = _with_hits(request, spec.estimate)  # reserved by the id added below
        elif after:
            request = _with_hits(request, 0)
        elif count * cost != 1:
            request = Request(request.domain, request.descriptors, count * cost)
        held = spec.request_duration
        # the id pairs slots or a reservation; a check-then-charge client under a config
        # without concurrency sends none (its Envoy would not: matched whole, it is checked)
        paired = reserve or (held and (not after or self.slotted))
        if paired:
            self.ids += 1
            request = with_id(request, self.id_keys[0], str(self.ids))
        ok = await self._decide(client, request)
        self.calls += 1
        ends = self.tick + max(1, math.ceil(held * self.per_second - 1e-9))
        if (paired or (held and after)) and ok:
            await self._stream_done(client, cost, ends if held else None)
        self.tallies[client].attempt(count, cost, ok, self.steady, self.tick // self.per_second)
        if ok and after and not reserve and not held:  # the response came back: its real
            # cost is charged, answer or not
            await self.limiter.should_rate_limit(_with_hits(self.requests[client], cost))
            self.calls += 1
        if ok:
            self.meter.admit(self.clock.t - EPOCH, client, count * cost)
        return ok

    async def _stream_done(self, client: int, cost: int, ends: int | None) -> None:
        """The stream-done calls of an admitted request, at tick ``ends`` (None: now): the
        settlement of its reservation, or its slots' release and its charge."""
        request, spec = self.requests[client], self.scenario.clients[client]
        done = with_id(request, self.id_keys[1], str(self.ids))
        calls: list[Request] = []
        if spec.charge_after and self.reserving:
            calls.append(_with_hits(done, cost))
        else:
            if not spec.charge_after or self.slotted:
                calls.append(done)  # gives back its slots
            if spec.charge_after:
                calls.append(_with_hits(request, cost))  # the tokens, when the stream ends
        if ends is not None:
            self.releases[ends].extend(calls)
            return
        for call in calls:
            await self.limiter.should_rate_limit(call)
            self.calls += 1

    async def _send_refused(self, client: int, first: int, rest: RetryPool) -> None:
        """A refused client's other attempts this tick as one request, then all their retries."""
        cost = self.scenario.clients[client].cost.fixed or 1
        if rest.total and await self._ask(client, rest.total, cost):
            # admitted after all: a cap's division remade within the tick (a request that
            # found it newly contended) may raise a bound; the rest is spent, not retried
            rest = RetryPool()
        rest.push_front(first)
        due = self.tick + self.backoff[client]
        rest.drop_expired(due)
        if rest.total:
            self.pending[due][client] = rest  # nothing else of this client is due then

    def result(self, label: str, path: str) -> ConfigResult:
        seconds = math.ceil(self.scenario.duration - 1e-9)
        clients = tuple(
            client_result(c, t, seconds)
            for c, t in zip(self.scenario.clients, self.tallies, strict=True)
        )
        modes = {(c.path, c.limit): c.mode.value for c in self.limiter.loaded.classifications}
        checks = self.meter.checks(self.tree.root, modes)
        cap = checks[0] if self.shared is not None else None
        figures = None
        if self.shared is not None and not checks[0].smooth:  # measured in fixed windows
            span = self.scenario.steady[1] - self.scenario.steady[0]
            figures = self.shared.figures(
                [t.steady_attempted / span for t in self.tallies],
                [t.steady_admitted / span for t in self.tallies],
                EPOCH + self.scenario.steady[0],
                EPOCH + self.scenario.steady[1],
            )
        return ConfigResult(
            label,
            path,
            clients,
            cap,
            figures,
            self.calls,
            checks,
            self.meter.windows(),
            self.meter.levels,
        )


def with_id(request: Request, key: str, request_id: str) -> Request:
    """``request`` with ``(key, request_id)`` ending each descriptor, as Envoy adds it."""
    return Request(
        request.domain,
        tuple(
            Descriptor((*d.entries, (key, request_id)), d.limit, d.hits)
            for d in request.descriptors
        ),
        request.hits,
    )
