"""Bursts of seconds at caps of a minute or an hour (docs/fairness.md, point 4): a client that
arrives during a long window and asks for a few seconds gets its max-min share of the window,
not a share paced over the whole window as if it kept its rate. (A burst from the window's
start is paced as a client that keeps its rate: a known limit, quoted from the bundled
scenario below.)

Scenarios are drawn at random (seeded): sparse clients asking all along, and one to three
clients each asking at a steady rate for a few seconds, once, starting during the second
window (the first is the cold rule's) at least twice their length after its start, one
after another or at once; the cap sometimes contended, sometimes not, over per-client limits
it does not fit (so it is paced). Each runs through ``fairlimit simulate``'s engine (on
memory, and two on Redis, which must admit the same) for two whole windows and is measured
against the exact weighted max-min solver (tests/support/maxmin.py via fairness_figures.py).
Paced by their history (before this rule), 21 of the 24 drawn runs failed.
"""

import contextlib
import io
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from fairlimit.cli import main
from fairlimit.store.base import Store
from fairness_cases import flat_config
from fairness_figures import UNITS, Figures, late_one_shot_at, phased, scenario_text, simulated
from helpers import once

pytestmark = pytest.mark.behaviour

ERROR = 0.10  # within 10% of its max-min share, one request of rounding allowed
SEEDS = range(12)
# More draws of bursts at once: of 172 such draws none is past ERROR, and 8 were before a
# burst gone quiet was predicted nothing (sharing._quiet); 4 of these 40 among them.
TOGETHER = range(100, 140)
# Bursts one after another: a known limit (docs/fairness.md, "Known limits"). Online, the
# cap cannot know a burst will come later in the window: the bursts before it, and the
# sparse clients, take what max-min would have left it. Measured over 172 draws, 16 past
# ERROR (14 before sharing._quiet); this one of the 24 here: 78, 78 and 65 admitted where
# max-min gives each 73.7 (78, 73 and 70 before).
KNOWN = {(3, "apart")}
BUNDLED = Path(__file__).resolve().parents[2] / "descriptors/scenarios/bursts-long-window.yaml"


@dataclass(frozen=True)
class Drawn:
    scenario: str
    config: str
    bursts: tuple[str, ...]


def draw(seed: int, start: str = "apart") -> Drawn:
    """Two windows of a minute or an hour; 1-3 sparse clients all along; in the second
    window (the first is the cold rule's, point 8) 1-3 bursts of one length (2 s up to a
    sixth of a window over the bursts, at most 30 s) and rate (5-100 requests a second),
    starting at least twice their length into the window: one after another (``apart``)
    or at once (``together``). The cap holds what
    the sparse clients ask in a window and 0.5-1.3 times what the bursts ask; each client's
    own limit is the cap (as in the shared cases: never sized, so paced)."""
    rng = random.Random(seed)
    unit = rng.choice(["minute", "hour"])
    window = UNITS[unit]
    sparse = rng.randint(1, 3)
    rates = [round(rng.uniform(0.02, 0.3), 3) for _ in range(sparse)]
    clients = [
        f"{{name: sparse{i}, phases: [{{start: 0.0, stop: {2 * window}.0, rate: {rate}}}]}}"
        for i, rate in enumerate(rates)
    ]
    count = rng.randint(1, 3)
    length = rng.randint(2, min(30, window // (count + 2) // 2))
    rate = rng.randint(5, 100)
    # the bursts' starts: each in its own slot of [2 length, window - length - 1)
    slot = (window - 3 * length - 1) / count
    offsets = [2 * length + k * slot + rng.uniform(0, slot - length - 1) for k in range(count)]
    if start == "together":
        offsets = [offsets[0]] * count
    bursts = tuple(f"burst{i}" for i in range(count))
    for name, offset in zip(bursts, offsets, strict=True):
        begin = round(window + offset, 2)
        phase = f"{{start: {begin}, stop: {begin + length}, rate: {rate}}}"
        clients.append(f"{{name: {name}, phases: [{phase}]}}")
    asked = sum(r * window for r in rates), rate * length * count
    capacity = round(asked[0] + asked[1] * rng.uniform(0.5, 1.3))
    return Drawn(
        scenario_text(f"long bursts {seed}", 2 * window, 0.05, clients),
        flat_config(capacity, unit, capacity, active=len(clients)),
        bursts,
    )


async def _run(drawn: Drawn, where: Path, store: Callable[[], Store] | None = None) -> Figures:
    return await simulated(drawn.scenario, drawn.config, where, store)


def _drawn(seeds: range, starts: tuple[str, ...]) -> list[object]:
    known = pytest.mark.xfail(strict=True, reason="known limit: a burst later in the window")
    return [
        pytest.param(seed, start, marks=[known] if (seed, start) in KNOWN else [])
        for seed in seeds
        for start in starts
    ]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("seed", "start"),
    [*_drawn(SEEDS, ("apart", "together")), *_drawn(TOGETHER, ("together",))],
)
async def test_a_burst_arriving_during_a_long_window_gets_its_maxmin_share(
    seed: int, start: str, tmp_path: Path
) -> None:
    """Every client, the bursts and the sparse ones, within ERROR of its max-min share of
    each window; the cap never passed."""
    drawn = draw(seed, start)
    got = await _run(drawn, tmp_path)
    worst = got.worst()
    assert worst.error <= ERROR, f"{worst}\n{drawn.scenario}{drawn.config}"
    assert max(w.over for w in got.windows) <= 1.0


@pytest.mark.asyncio
@pytest.mark.parametrize(("seed", "start"), [(1, "apart"), (3, "together"), (115, "together")])
@pytest.mark.parametrize("backend", ["redis"])
async def test_redis_admits_as_memory_does(
    seed: int, start: str, store: Store, tmp_path: Path
) -> None:
    """On Redis (its script runs the same rule) every window admits what memory admits
    (115: bursts gone quiet in an hour beside a sparse client, ``_quiet``: the division,
    made from the rows read from Redis, must read when each client first asked)."""
    drawn = draw(seed, start)
    on_redis = await _run(drawn, tmp_path, once(store))
    on_memory = await _run(drawn, tmp_path)
    assert on_redis.admitted() == on_memory.admitted()


def test_the_bundled_scenario_admits_what_docs_fairness_quotes() -> None:
    """descriptors/scenarios/bursts-long-window.yaml: the clients arriving 70 s into the
    hour get all their 30 at the hourly and the per-minute cap; those at a window's start
    are paced as clients that keep their rate (a known limit): 1 at the hour, 24 at the
    minute; the global bucket admits all."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["simulate", str(BUNDLED), "--format", "json"])
    assert (code, err.getvalue()) == (0, "")
    admitted = {
        config["label"]: {c["name"]: c["admitted"] for c in config["clients"]}
        for config in json.loads(out.getvalue())["configs"]
    }
    for label, start in (("fair-per-hour", 1), ("fair-per-minute", 24)):
        got = admitted[label]
        assert [got[f"during-{i}"] for i in (1, 2)] == [30, 30], label
        assert [got[f"start-{i}"] for i in (1, 2)] == [start, start], label
    assert set(admitted["global-bucket"].values()) == {30}


# The shared late-one-shot case with its one-shot in the cap's first second, where nobody
# has history (docs/fairness.md, point 8 and "Known limits"): six clients asking once every
# 4 s from 0 s at a cap of 900 a minute (active_clients 7), 1,500 asked in 0.1 s from 0.5 s.
FIRST_SECOND = late_one_shot_at(0.5)


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_one_shot_in_a_new_caps_first_second_gets_its_cold_split(
    store: Store, tmp_path: Path
) -> None:
    """It arrived during the window: not paced by the elapsed minute (0.9% of it, 9 hits),
    it takes its equal split among the clients (900 / 8, with itself) at once; the sparse
    clients still get all they ask."""
    got = await simulated(FIRST_SECOND, flat_config(900, "minute", 900, 7), tmp_path, once(store))
    minute = got.windows[0]
    admitted = dict(zip(got.names, minute.admitted, strict=True))
    assert admitted.pop("late") == 900 // 8
    assert all(a == 15 for a in admitted.values()), admitted


# --- a burst across a long window's edge ---------------------------------------------------
# The shared burst-at-minute-start case with its burst begun just before the minute's edge
# (docs/fairness.md, point 4): its one period of history is the last of the minute before,
# so in the new minute it is served as a client that arrived during it, not paced by that
# period. Paced so, the part after the edge got 1 of the 533 max-min gives it (the shared
# case from 119.9 s), and every one of 100 draws below left it more than 10% short (none
# now). Its part before the edge gets what the steady clients' pace has left of that
# minute's last moments (a known limit: docs/fairness.md, "A burst in a second's last
# tenth", at a minute's scale), so that window is not judged here.


def draw_across(seed: int) -> tuple[Drawn, int]:
    """(drawn, the window the burst runs on into): a cap of 600-6,000 a minute, 3-12 steady
    clients asking 0.5-1.6 times the cap together; one burst of 0.5-2 times the cap over
    0.2, 0.5 or 1 s, begun up to its length before the edge of minute 1 or 2."""
    rng = random.Random(seed * 31 + 7)
    capacity = rng.randint(600, 6000)
    count = rng.randint(3, 12)
    rate = round(capacity * rng.uniform(0.5, 1.6) / 60 / count, 3)
    edge = rng.choice([1, 2])
    length = rng.choice([0.2, 0.5, 1.0])
    begin = round(60 * edge - rng.uniform(0.02, length - 0.02), 3)
    asked = int(capacity * rng.uniform(0.5, 2))
    burst = phased("burst", begin, round(begin + length, 3), round(asked / length, 2))
    clients = [f"{{name: steady, count: {count}, rate: {rate}}}", burst]
    drawn = Drawn(
        scenario_text(f"a burst across a minute's edge {seed}", 240, 0.05, clients),
        flat_config(capacity, "minute", capacity, active=count + 1),
        ("burst",),
    )
    return drawn, edge


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(16))
async def test_a_burst_across_a_long_windows_edge_gets_its_share_after_it(
    seed: int, tmp_path: Path
) -> None:
    """In the minute the burst runs on into, every client within ERROR of its max-min
    share, the burst too, and 0.98 of the minute used at least; every other minute but the
    one before the edge within ERROR; the cap never passed."""
    drawn, edge = draw_across(seed)
    got = await _run(drawn, tmp_path)
    worst = got.worst([w for w in got.windows if w.index != edge - 1])
    assert worst.error <= ERROR, f"{worst}\n{drawn.scenario}{drawn.config}"
    assert got.windows[edge].utilisation >= 0.98
    assert max(w.over for w in got.windows) <= 1.0


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [7, 15])
@pytest.mark.parametrize("backend", ["redis"])
async def test_redis_admits_a_burst_across_an_edge_as_memory_does(
    seed: int, store: Store, tmp_path: Path
) -> None:
    """The script's ``arrived`` (admit/verdict.lua) holds the same rule."""
    drawn, _ = draw_across(seed)
    on_redis = await _run(drawn, tmp_path, once(store))
    on_memory = await _run(drawn, tmp_path)
    assert on_redis.admitted() == on_memory.admitted()


# The shared burst-at-minute-start case with its burst at 0 s, the first instant of a new
# cap (docs/fairness.md, point 8): nobody has history, and a burst that asks more than its
# whole split within a period is not paced by the elapsed minute.
AT_ZERO = scenario_text(
    "a burst at a new cap's first instant",
    120,
    0.05,
    [
        "{name: steady, count: 8, rate: 12}",
        phased("burst", 0.0, 0.2, 25000),
    ],
)


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_burst_at_a_new_caps_first_instant_takes_its_split(
    store: Store, tmp_path: Path
) -> None:
    """Its split, 4,800 / 10 (the nine clients seen, and itself counted again: the cap's
    rule for clients seen), within 10% of the 533 max-min gives it, and 0.98 of the minute
    used (paced by the minute it got 71, its split held for it: 0.90 used); every steady
    client within 10% of its own."""
    got = await simulated(AT_ZERO, flat_config(4800, "minute", 4800, 9), tmp_path, once(store))
    minute = got.windows[0]
    admitted = dict(zip(got.names, minute.admitted, strict=True))
    assert admitted["burst"] == 480
    assert got.worst([minute]).error <= ERROR
    assert minute.utilisation >= 0.98
