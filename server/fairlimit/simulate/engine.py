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
from collections.abc import Callable, Sequence
from pathlib import Path

from fairlimit.config.loader import load
from fairlimit.core.concurrency import split
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import plan
from fairlimit.core.request import Request
from fairlimit.core.rules import Loaded
from fairlimit.errors import ScenarioError
from fairlimit.simulate.report import Result, Summary
from fairlimit.simulate.rlqs import RlqsRun
from fairlimit.simulate.run import Run, requests_for, with_id
from fairlimit.simulate.scenario import Scenario
from fairlimit.simulate.traffic import arrivals
from fairlimit.store.base import Store
from fairlimit.store.memory import MemoryStore

# Makes the store of one run: called once per config (and once more for its RLQS run).
StoreFactory = Callable[[], Store]


async def _run_all(
    scenario: Scenario,
    configs: Sequence[tuple[str, str, Loaded]],
    coalesce: bool,
    store: StoreFactory | None = None,
) -> Result:
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
        sim = Run(scenario, loaded, coalesce, fresh())
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
