"""Traffic scenarios run through the real limiter on a simulated clock, config by config.

The model, so that every figure can be checked by hand:

- Time advances in ticks of ``tick`` seconds (a divisor of 1 s, so no tick straddles a
  limiter window); the clock the ``Limiter`` reads is the tick's start, and scenario time 0
  is a day boundary, so scenario seconds are the limiter's epoch-aligned windows.
- A client at ``rate`` sends request n at ``start + n / rate`` while that is before ``stop``:
  evenly spread, no randomness. Within a tick, attempts go in order of those exact times;
  retries due in a tick go first (at its start); ties go in scenario order.
- A rejected attempt with retries left is sent again ``backoff`` seconds later, and never in
  the same tick (``backoff: 0`` means the next tick). Retries past the end are not sent.
- Every config runs against the same traffic, with its own fresh ``MemoryStore``.
- A client with ``request_duration`` models concurrency: each attempt carries a request id
  (the domain's acquire key, as Envoy's request path sends it), and an admitted one is
  released ``request_duration`` later, at the start of that tick (the stream-done call).
  Such runs send every attempt alone: each has its own id, so none can be coalesced.

One economy, exact by construction: once a client is rejected in a tick, the rest of its
attempts in that tick (identical requests at the same instant) cannot be admitted, because
within one window and λ period counters and fair-share bounds only move against it. They are
still sent through the limiter, but as one request whose ``hits_addend`` is their number:
rejected, it moves no counter and records the same demand at each cap as they would have
one by one. A retry storm then costs two limiter calls per client and tick, not thousands.
The run checks the limiter agrees (RuntimeError otherwise), and the tests compare it with
sending every attempt alone.

The scenario file is read by ``scenario``; the report is ``report`` (and ``plot``).
"""

import asyncio
import dataclasses
import math
from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
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
from fairlimit.simulate.report import ClientResult, ConfigResult, Result, Summary, shared_limit
from fairlimit.simulate.scenario import Client, Scenario
from fairlimit.store.memory import MemoryStore

EPOCH = 1_699_920_000  # a day boundary (19675 x 86400): scenario time 0


class SimClock:
    """The injected clock: moved by the run, tick by tick."""

    def __init__(self) -> None:
        self.t = float(EPOCH)

    def now(self) -> float:
        return self.t


def requests_for(scenario: Scenario) -> list[Request]:
    """Each client's request: the descriptor template with its name filled in."""
    return [
        Request(
            scenario.domain,
            tuple(
                Descriptor(tuple((k, v.replace("{client}", c.name)) for k, v in template))
                for template in scenario.descriptors
            ),
        )
        for c in scenario.clients
    ]


def _arrivals(scenario: Scenario) -> dict[int, list[tuple[float, int]]]:
    """Original requests by tick: (exact time, client index), in time order."""
    by_tick: dict[int, list[tuple[float, int]]] = defaultdict(list)
    per_second = round(1 / scenario.tick)
    for index, client in enumerate(scenario.clients):
        n = 0
        while (at := client.start + n / client.rate) < client.stop - 1e-9:
            by_tick[math.floor(at * per_second + 1e-9)].append((at, index))
            n += 1
    for events in by_tick.values():
        events.sort()
    return by_tick


@dataclass
class _Tally:
    offered: int = 0
    attempted: int = 0
    admitted: int = 0
    steady_attempted: int = 0
    steady_admitted: int = 0
    per_second: Counter[int] = field(default_factory=Counter)


class _Pool:
    """One client's retries due in one tick, as runs of [last tick they may go, count].

    A client's retries all wait the same ``backoff``, so the pool due at tick t + b is filled
    only while tick t runs, in order of expiry; it moves on whole when the client is refused.
    """

    __slots__ = ("runs", "total")

    def __init__(self) -> None:
        self.runs: deque[list[int]] = deque()
        self.total = 0

    def add(self, expiry: int, count: int) -> None:
        if self.runs and self.runs[-1][0] == expiry:
            self.runs[-1][1] += count
        else:
            self.runs.append([expiry, count])
        self.total += count

    def push_front(self, expiry: int) -> None:
        """Put back one retry expiring no later than any in the pool."""
        if self.runs and self.runs[0][0] == expiry:
            self.runs[0][1] += 1
        else:
            self.runs.appendleft([expiry, 1])
        self.total += 1

    def take(self) -> int:
        """Remove one retry (the soonest to expire); its expiry."""
        run = self.runs[0]
        run[1] -= 1
        self.total -= 1
        if not run[1]:
            self.runs.popleft()
        return run[0]

    def drop_expired(self, tick: int) -> None:
        while self.runs and self.runs[0][0] < tick:
            self.total -= self.runs.popleft()[1]


Event = tuple[int, _Pool | None]  # (client, its retry pool) or (client, None): an original


class _Run:
    """One config's run: the limiter, the pending retries and what each client got."""

    def __init__(self, scenario: Scenario, loaded: Loaded, coalesce: bool) -> None:
        self.scenario = scenario
        self.clock = SimClock()
        self.limiter = Limiter(loaded, MemoryStore(), self.clock)
        self.requests = requests_for(scenario)
        self.shared = shared_limit(loaded, self.requests)
        self.coalesce = coalesce and not any(c.request_duration for c in scenario.clients)
        self.releases: dict[int, list[Request]] = defaultdict(list)  # tick -> stream-done calls
        self.ids = 0
        domain = loaded.config.domains.get(scenario.domain)
        self.id_keys = (domain.acquire_key, domain.release_key) if domain else ("", "")
        self.per_second = round(1 / scenario.tick)
        self.backoff = [  # in ticks; a retry never goes in the tick that was refused
            max(1, math.ceil(c.retries.backoff * self.per_second - 1e-9)) for c in scenario.clients
        ]
        self.tallies = [_Tally() for _ in scenario.clients]
        self.pending: dict[int, dict[int, _Pool]] = defaultdict(dict)  # tick -> client -> pool
        self.windows: Counter[int] = Counter()
        self.calls = 0
        self.tick = 0
        self.steady = False

    async def run(self, arrivals: dict[int, list[tuple[float, int]]]) -> None:
        ticks = math.ceil(self.scenario.duration * self.per_second - 1e-9)
        low, high = (round(x * self.per_second) for x in self.scenario.steady)
        for self.tick in range(ticks):
            self.clock.t = EPOCH + self.tick / self.per_second
            self.steady = low <= self.tick < high
            for done in self.releases.pop(self.tick, ()):
                await self.limiter.should_rate_limit(done)
            events: list[Event] = sorted(self.pending.pop(self.tick, {}).items())
            for _, client in arrivals.get(self.tick, ()):
                self.tallies[client].offered += 1
                events.append((client, None))
            await self._tick(events)

    async def _tick(self, events: list[Event]) -> None:
        if not self.coalesce:
            for client, pool in events:
                if pool is None:
                    await self._send(client, self._expiry(client))
                while pool is not None and pool.total:
                    await self._send(client, pool.take())
            return
        refused: dict[int, tuple[int, _Pool]] = {}  # client -> (refused alone, still to send)
        for client, pool in events:
            if client in refused:  # only originals follow a client's retries
                refused[client][1].add(self._expiry(client), 1)
            elif pool is None:
                expiry = self._expiry(client)
                if not await self._ask(client, 1):
                    refused[client] = (expiry, _Pool())
            else:
                while pool.total:
                    expiry = pool.take()
                    if not await self._ask(client, 1):
                        refused[client] = (expiry, pool)
                        break
        for client, (first, rest) in refused.items():
            await self._send_refused(client, first, rest)

    def _expiry(self, client: int) -> int:
        """The last tick a request first sent now may be retried in."""
        return self.tick + self.scenario.clients[client].retries.max * self.backoff[client]

    async def _send(self, client: int, expiry: int) -> None:
        """One attempt; if refused, its retry is due ``backoff`` later unless that is too late."""
        if not await self._ask(client, 1):
            due = self.tick + self.backoff[client]
            if due <= expiry:
                self.pending[due].setdefault(client, _Pool()).add(expiry, 1)

    async def _ask(self, client: int, hits: int) -> bool:
        """``hits`` identical attempts as one request through the limiter; True if admitted."""
        request = self.requests[client]
        if hits != 1:
            request = Request(request.domain, request.descriptors, hits)
        held = self.scenario.clients[client].request_duration
        if held:
            self.ids += 1
            request = with_id(request, self.id_keys[0], str(self.ids))
        decision = await self.limiter.should_rate_limit(request)
        if held and decision.code is Code.OK:
            ends = self.tick + max(1, math.ceil(held * self.per_second - 1e-9))
            self.releases[ends].append(
                with_id(self.requests[client], self.id_keys[1], str(self.ids))
            )
        self.calls += 1
        tally = self.tallies[client]
        tally.attempted += hits
        tally.steady_attempted += hits if self.steady else 0
        if decision.code is not Code.OK:
            return False
        tally.admitted += hits
        tally.steady_admitted += hits if self.steady else 0
        tally.per_second[self.tick // self.per_second] += hits
        if self.shared is not None:
            window = math.floor(self.clock.t / self.shared.check.window)
            self.windows[window] += self.shared.hits[client] * hits
        return True

    async def _send_refused(self, client: int, first: int, rest: _Pool) -> None:
        """A refused client's other attempts this tick as one request, then all their retries."""
        if rest.total and await self._ask(client, rest.total):
            raise RuntimeError(
                f"the limiter admitted {self.scenario.clients[client].name} after refusing "
                "the same request earlier in the tick: counters moved backwards"
            )
        rest.push_front(first)
        due = self.tick + self.backoff[client]
        rest.drop_expired(due)
        if rest.total:
            self.pending[due][client] = rest  # nothing else of this client is due then

    def result(self, label: str, path: str) -> ConfigResult:
        seconds = math.ceil(self.scenario.duration - 1e-9)
        clients = tuple(
            _client_result(c, t, seconds)
            for c, t in zip(self.scenario.clients, self.tallies, strict=True)
        )
        cap, figures = None, None
        if self.shared is not None:
            top = max(self.windows.values(), default=0)
            cap = dataclasses.replace(self.shared.check, max_admitted=top)
            span = self.scenario.steady[1] - self.scenario.steady[0]
            figures = self.shared.figures(
                [t.steady_attempted / span for t in self.tallies],
                [t.steady_admitted / span for t in self.tallies],
            )
        return ConfigResult(label, path, clients, cap, figures, self.calls)


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


def _client_result(client: Client, tally: _Tally, seconds: int) -> ClientResult:
    active = client.stop - client.start
    return ClientResult(
        client.name,
        tally.offered,
        tally.attempted,
        tally.admitted,
        tally.attempted - tally.admitted,
        tally.admitted / tally.offered if tally.offered else 1.0,
        tally.admitted / active,
        tuple(tally.per_second[s] for s in range(seconds)),
    )


async def _run_all(
    scenario: Scenario, configs: Sequence[tuple[str, str, Loaded]], coalesce: bool
) -> Result:
    arrivals = _arrivals(scenario)
    results = []
    for label, path, loaded in configs:
        sim = _Run(scenario, loaded, coalesce)
        await sim.run(arrivals)
        results.append(sim.result(label, path))
    summary = Summary(
        scenario.name,
        scenario.source,
        scenario.duration,
        scenario.tick,
        scenario.steady,
        len(scenario.clients),
    )
    return Result(summary, tuple(results))


def run(scenario: Scenario, override: Sequence[str] = (), *, coalesce: bool = True) -> Result:
    """Run ``scenario`` against its configs (or ``override`` paths), side by side.

    Raises ConfigError (every line ``FILE: PATH: message``) when a config is unusable, its
    subclass ScenarioError when the scenario and its configs do not fit together.
    """
    configs = load_configs(scenario, override)
    return asyncio.run(_run_all(scenario, configs, coalesce))


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
