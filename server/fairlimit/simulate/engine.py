"""Traffic scenarios run through the real limiter on a simulated clock, config by config.

The model, so that every figure can be checked by hand:

- Time advances in ticks of ``tick`` seconds (a divisor of 1 s, so no tick straddles a
  limiter window); the clock the ``Limiter`` reads is the tick's start, and scenario time 0
  is a day boundary, so scenario seconds are the limiter's epoch-aligned windows.
- A client at ``rate`` sends request n at ``start + n / rate`` while that is before ``stop``,
  in each of its phases (``traffic``): evenly spread. Within a tick, attempts go in order of
  those exact times; retries due in a tick go first (at its start); ties go in scenario order.
- A request costs its client's ``cost`` in hits (request-level ``hits_addend``). A client with
  ``charge: response`` sends a check with ``hits_addend: 0`` and, when it passes, the cost as
  a second request, as Envoy's ``apply_on_stream_done`` does; its hits count as admitted when
  the check passes, whatever the limiter says of the charge (the tokens were spent).
- A rejected attempt with retries left is sent again ``backoff`` seconds later, and never in
  the same tick (``backoff: 0`` means the next tick). Retries past the end are not sent.
- Every config runs against the same traffic, with its own fresh ``MemoryStore`` (or a
  fresh store from the caller's factory, ``run(..., store=...)``: Redis in the tests).
- A client with ``request_duration`` models concurrency: each attempt carries a request id
  (the domain's acquire key, as Envoy's request path sends it), and an admitted one is
  released ``request_duration`` later, at the start of that tick (the stream-done call).
  Such runs send every attempt alone: each has its own id, so none can be coalesced.

One economy: once a client is rejected in a tick, the rest of its attempts in that tick
(identical requests at the same instant) are sent through the limiter as one request whose
``hits_addend`` is their number, at the tick's end: rejected, it moves no counter and
records the same demand at each cap as they would have one by one, only later in the tick
(fairness v3 counts demand at once, so the other clients of that tick see it after, not
before, their own requests). Within an instant counters only grow and a fair-share bound
mostly falls, but a cap's division remade in the tick (a request that finds the cap newly
contended) may raise one: then the coalesced request is admitted whole and its attempts
are not retried. A retry storm costs two limiter calls per client and tick, not thousands;
the tests compare it with sending every attempt alone (within 1% of each client's hits).
Clients whose cost varies or who charge after the response are always sent one request at
a time.

What is measured: per client and second the hits admitted; per window of every counter
charged, the hits admitted there (``levels``: the cap checked at every level); per window
of the root limit, demand, achievable and admitted; λ at the root cap each second.

With an ``rlqs`` key each config runs a second time with the clients behind simulated RLQS
Envoys (``rlqs``), under the same ticks.

The scenario file is read by ``scenario``; the report is ``report`` (and ``plot``).
"""

import asyncio
import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from fairlimit.config.loader import load
from fairlimit.core.admission import Code
from fairlimit.core.concurrency import split
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import plan
from fairlimit.core.request import Descriptor, Request
from fairlimit.core.rules import Loaded
from fairlimit.errors import ScenarioError
from fairlimit.limiter import Limiter
from fairlimit.simulate import levels
from fairlimit.simulate.measure import Meter, Tally, client_result
from fairlimit.simulate.report import ConfigResult, Result, Summary, shared_limit
from fairlimit.simulate.retries import RetryPool
from fairlimit.simulate.scenario import Scenario
from fairlimit.simulate.traffic import arrivals
from fairlimit.store.base import Store
from fairlimit.store.memory import MemoryStore

EPOCH = 1_699_920_000  # a day boundary (19675 x 86400): scenario time 0
# Makes the store of one run: called once per config (and once more for its RLQS run).
StoreFactory = Callable[[], Store]


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


class _Run:
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
        after = self.scenario.clients[client].charge_after
        if after:
            request = _with_hits(request, 0)
        elif count * cost != 1:
            request = Request(request.domain, request.descriptors, count * cost)
        held = self.scenario.clients[client].request_duration
        if held:
            self.ids += 1
            request = with_id(request, self.id_keys[0], str(self.ids))
        ok = await self._decide(client, request)
        self.calls += 1
        if held and ok:
            ends = self.tick + max(1, math.ceil(held * self.per_second - 1e-9))
            self.releases[ends].append(
                with_id(self.requests[client], self.id_keys[1], str(self.ids))
            )
        self.tallies[client].attempt(count, cost, ok, self.steady, self.tick // self.per_second)
        if ok and after:  # the response came back: its real cost is charged, answer or not
            await self.limiter.should_rate_limit(_with_hits(self.requests[client], cost))
            self.calls += 1
        if ok:
            self.meter.admit(self.clock.t - EPOCH, client, count * cost)
        return ok

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
        modes = {c.path: c.mode.value for c in self.limiter.loaded.classifications}
        checks = self.meter.checks(self.tree.root, modes)
        cap, figures = None, None
        if self.shared is not None:
            cap = checks[0]
            span = self.scenario.steady[1] - self.scenario.steady[0]
            figures = self.shared.figures(
                [t.steady_attempted / span for t in self.tallies],
                [t.steady_admitted / span for t in self.tallies],
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


async def _run_all(
    scenario: Scenario,
    configs: Sequence[tuple[str, str, Loaded]],
    coalesce: bool,
    store: StoreFactory | None = None,
) -> Result:
    from fairlimit.simulate.rlqs import RlqsRun  # it builds on _Run, defined here

    clients = scenario.clients
    by_tick = arrivals(
        [c.phases for c in clients],
        [c.cost for c in clients],
        [c.name for c in clients],
        scenario.seed,
        round(1 / scenario.tick),
    )
    fresh: StoreFactory = MemoryStore if store is None else store
    results = []
    for label, path, loaded in configs:
        sim = _Run(scenario, loaded, coalesce, fresh())
        await sim.run(by_tick)
        results.append(sim.result(label, path))
        if scenario.rlqs is not None:
            over = RlqsRun(scenario, loaded, scenario.rlqs, fresh())
            await over.run(by_tick)
            results.append(over.result(f"{label} over RLQS", path))
    summary = Summary(
        scenario.name,
        scenario.source,
        scenario.duration,
        scenario.tick,
        scenario.steady,
        len(scenario.clients),
    )
    return Result(summary, tuple(results))


def run(
    scenario: Scenario,
    override: Sequence[str] = (),
    *,
    coalesce: bool = True,
    store: StoreFactory | None = None,
) -> Result:
    """Run ``scenario`` against its configs (or ``override`` paths), side by side.

    ``store`` makes each run's store (see ``run_async``); by default a fresh MemoryStore.
    Raises ConfigError (every line ``FILE: PATH: message``) when a config is unusable, its
    subclass ScenarioError when the scenario and its configs do not fit together.
    """
    return asyncio.run(run_async(scenario, override, coalesce=coalesce, store=store))


async def run_async(
    scenario: Scenario,
    override: Sequence[str] = (),
    *,
    coalesce: bool = True,
    store: StoreFactory | None = None,
) -> Result:
    """``run`` in the caller's event loop (a store bound to that loop, such as Redis).

    ``store`` is called once per config, and once more for its RLQS run, inside this loop;
    each call must return a fresh, empty store, which stays the caller's to close. The
    store must take the limiter's time (Redis: ``?clock=caller``): the clock is simulated.
    """
    configs = load_configs(scenario, override)
    return await _run_all(scenario, configs, coalesce, store)


def _check_config(
    scenario: Scenario, where: str, path: str, loaded: Loaded, requests: Sequence[Request]
) -> None:
    """ScenarioError unless ``loaded`` limits the scenario's requests at all."""
    domains = sorted(loaded.config.domains)
    if scenario.domain not in domains:
        found = ", ".join(domains) or "none"
        message = f"{path} has no domain '{scenario.domain}' (it has: {found})"
        raise ScenarioError([f"{scenario.source}: {where}: {message}"])
    matcher = Matcher(loaded.config)
    domain = loaded.config.domains[scenario.domain]
    if not any(
        plan(r, matcher).counters or split(with_id(r, domain.acquire_key, "0"), matcher).acquire
        for r in requests
    ):
        message = f"no rule in {path} limits the scenario's descriptors"
        raise ScenarioError([f"{scenario.source}: {where}: {message}"])


def load_configs(scenario: Scenario, override: Sequence[str]) -> list[tuple[str, str, Loaded]]:
    """(label, path, loaded) per config; ConfigError if one is unusable, ScenarioError if unfit."""
    refs = [(Path(p).stem, str(p), f"--config[{i}]") for i, p in enumerate(override)] or [
        (r.label, str(r.path), f"configs[{i}].path") for i, r in enumerate(scenario.configs)
    ]
    if not refs:
        message = "no configs to run: name them under 'configs' or pass --config"
        raise ScenarioError([f"{scenario.source}: configs: {message}"])
    requests = requests_for(scenario)
    out = []
    for label, path, where in refs:
        loaded = load([path])
        _check_config(scenario, where, path, loaded, requests)
        out.append((label, path, loaded))
    return out
