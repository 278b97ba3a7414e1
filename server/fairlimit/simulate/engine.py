"""Traffic scenarios run through the real limiter on a simulated clock, config by config.

The model (ticks, the order of attempts, costs, retries, the coalescing of a refused client's
attempts in a tick, what is measured) is docs/fair-sharing.md's "How a run is simulated":
every figure can be checked by hand against it. A config's run is ``run.Run``; with an
``rlqs`` key each config runs again behind simulated RLQS Envoys (``rlqs``). The scenario
file is read by ``scenario``; the report is ``report`` (and ``plot``).
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
