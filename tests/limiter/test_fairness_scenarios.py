"""The targets of issues 11 and 23 (fairness v3), measured by tests/support/fairness_scenarios.py
against the exact max-min solver: every scenario of tests/support/fairness_cases.py on memory, the
short per-second ones on Redis too (where they must also give exactly memory's admissions)."""

import dataclasses

import pytest

import fairness_cases as cases
from fairlimit.store.base import Store
from fairlimit.store.memory import MemoryStore
from fairness_scenarios import Figures, Record, Scenario, figures, run

pytestmark = [pytest.mark.behaviour, pytest.mark.asyncio]

# Long caps (a minute): a steady client is paced by its history, so it runs ahead of its
# share of the elapsed window by at most what the bound column prints (hits). A client that
# bursts or has no history takes its share of the window at once (fairness v3), so where one
# does the bound is its window share, which the error figure already holds it to.
LONG = {
    cases.LATE_GREEDY.name: 20,
    cases.STEADY_MINUTE.name: 20,
}
LATE = {cases.LATE_GREEDY.name}  # utilisation >= 0.95 in a late-arrival minute
# Refused while below its share of the elapsed window for longer than P = 1 s: a token
# budget whose requests of 300-600 tokens wait for the paced share to grow past a whole
# request; sparse clients (one request every 5 s) whose request due in a window's last tick
# was not foreseen (a fraction of a request is no request), refused once, their next request
# 5 s later (docs/fairness.md, known limits).
SLOW = {cases.TOKENS.name: 2.0, cases.BURST_AFTER_IDLE.name: 5.0}
SHORT = {  # the Redis runs: per-second caps, a few seconds each
    "steady": dataclasses.replace(cases.STEADY_SECOND, duration=3),
    "on/off": dataclasses.replace(cases.ON_OFF, duration=4),
    "fractional": dataclasses.replace(cases.FRACTIONAL, duration=2),
}


def check(scenario: Scenario, got: Figures) -> None:
    """The issue's targets, as the docstring of fairness_scenarios.py defines each figure."""
    assert got.over <= 1.0, "a cap was exceeded"
    assert got.error <= 0.02, got
    if scenario.cap.window > 1:
        assert got.error_change <= 0.15, got  # inside the first window of a long cap
        if scenario.name in LONG:
            assert got.bound is not None and got.bound <= LONG[scenario.name], got
    assert got.jain >= 0.99, got
    assert got.utilisation >= (0.95 if scenario.name in LATE else 0.99), got
    assert got.starved <= SLOW.get(scenario.name, 1.0) + 1e-9, got


@pytest.mark.parametrize("scenario", cases.SCENARIOS, ids=lambda s: s.name)
async def test_memory_meets_the_targets(scenario: Scenario) -> None:
    """Every scenario on the memory store: error, Jain, utilisation, starvation, caps."""
    check(scenario, figures(scenario, await run(scenario, MemoryStore())))


@pytest.mark.parametrize("scenario", SHORT.values(), ids=list(SHORT))
@pytest.mark.parametrize("backend", ["redis"])
async def test_redis_admits_as_memory_does(scenario: Scenario, store: Store) -> None:
    """Redis meets the targets with exactly memory's admissions, window by window."""
    on_redis = await run(scenario, store)
    check(scenario, figures(scenario, on_redis))
    assert _admitted(on_redis) == _admitted(await run(scenario, MemoryStore()))


def _admitted(record: Record) -> dict[int, dict[str, float]]:
    return {w: dict(per) for w, per in record.admitted.items()}
