"""Late arrivals (issue 40): light clients get their max-min share at every phase of a window.

Random scenarios (tests/support/late_arrivals.py draws them: caps of 50 to 5,000 per second
and per minute, 5 to 200 light clients each with its own phase, page size and period, one to
three steady clients that retry, with weights) run through ``fairlimit simulate``'s engine on
a simulated clock and are measured against the exact weighted max-min solver
(tests/support/maxmin.py), from the window in which every light client has come back once:

- every light client (its own phase, 0 to 0.97 of the window) gets >= 0.95 of its max-min
  hits, summed over the measured windows;
- every measured window admits >= 0.98 of the max-min total.

The scenarios are drawn from fixed seeds (an engine run costs seconds, so a handful, each the
same every run); the issue's own traffic is checked at each phase it names, and on Redis,
which must admit exactly what memory admits. The issue's pages take 10 ms: at a phase of
0.985 the last of them comes 5 ms before the window's end, and still finds its reserve.
"""

import dataclasses
import random

import pytest

from bursty_cases import PAGE_LOADS
from fairlimit.store.base import Store
from helpers import once
from late_arrivals import Figures, Spec, draw, issue_case, run, run_async

pytestmark = [pytest.mark.behaviour]

SHARE = 0.95
UTILISATION = 0.98
# Ten draws, and two of 160 more (seeds 100-259) that missed before a held client keeping
# its whole part of the reserve also left the open clients' requests still to come: a page
# at 0.968 and one at 0.970 of the second lost a request to a held client
SEEDS = [*range(10), 100, 225]
PHASES = (0.0, 0.05, 0.37, 0.6, 0.85, 0.93, 0.96, 0.97, 0.98, 0.985)


def check(spec: Spec, got: Figures) -> None:
    name, share = got.worst_light()
    phase = next(lc.phase for lc in spec.light if lc.name == name)
    assert share >= SHARE, f"{spec.describe()}: {name} at phase {phase} got {share:.3f}"
    low = min(got.utilisation)
    assert low >= UTILISATION, f"{spec.describe()}: a window's utilisation {low:.3f}"


@pytest.mark.parametrize("seed", SEEDS)
def test_light_clients_get_their_share_at_every_phase(seed: int) -> None:
    """Every light client gets >= 0.95 of its max-min share, whatever its phase up to 0.97,
    and every window admits >= 0.98 of the max-min total."""
    spec = draw(random.Random(seed))
    check(spec, run(spec, PAGE_LOADS.scenario)[0])


@pytest.mark.parametrize("phase", PHASES)
def test_the_issue_case_at_every_phase(phase: float) -> None:
    """Cap 100/s, a batch job at 500/s retrying every 429, 30 users loading 5-request pages
    every 6 s, five a second at ``phase``: the users get their pages (25/s), the batch job
    the other 75/s."""
    spec = issue_case(phase)
    got = run(spec, PAGE_LOADS.scenario)[0]
    check(spec, got)
    assert got.steady_rate == pytest.approx(75, abs=1)


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["redis"])
@pytest.mark.parametrize("phase", [0.5, 0.96])
async def test_redis_admits_as_memory_does(store: Store, phase: float) -> None:
    """On Redis (the caller's clock) the issue case admits exactly what memory admits,
    window by window, and meets the same targets."""
    spec = issue_case(phase, windows=20)
    made: list[Store] = []

    def fresh() -> Store:  # the fixture's store is fresh and empty once: one run only
        assert not made, "the engine asked for a second store"
        made.append(store)
        return store

    got, on_redis = await run_async(spec, PAGE_LOADS.scenario, fresh)
    on_memory = (await run_async(spec, PAGE_LOADS.scenario))[1]
    admitted = [w.admitted_by_client for w in on_redis.windows]
    assert admitted == [w.admitted_by_client for w in on_memory.windows]
    check(spec, got)


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["redis"])
async def test_redis_admits_as_memory_does_on_a_drawn_scenario(store: Store) -> None:
    """Seed 225 (82 light clients, a page at 0.970 of the second held in reserve beside the
    open clients' requests still to come): Redis admits what memory admits, window by
    window, and meets the targets."""
    drawn = draw(random.Random(225))  # its page lost a request in window 21 (warm: 20)
    spec = dataclasses.replace(drawn, windows=drawn.warm + 3)
    got, on_redis = await run_async(spec, PAGE_LOADS.scenario, once(store))
    on_memory = (await run_async(spec, PAGE_LOADS.scenario))[1]
    admitted = [w.admitted_by_client for w in on_redis.windows]
    assert admitted == [w.admitted_by_client for w in on_memory.windows]
    check(spec, got)
