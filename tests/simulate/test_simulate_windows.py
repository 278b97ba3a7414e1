"""`fairlimit simulate` over window edges (issue 28): descriptors/scenarios/window-edge.yaml
sends twice a client's limit across a minute's edge; `fixed` admits it all, `sliding` and
`gcra` never more than the limit (+ burst) in any span of one window, on every backend. The
busiest span is checked against a count of every span."""

import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from fairlimit.simulate import load_scenario
from fairlimit.simulate.engine import run_async
from fairlimit.simulate.measure import bucket_levels, busiest_span
from fairlimit.simulate.plot import bands
from fairlimit.simulate.report import ConfigResult, text
from fairlimit.store.base import Store
from fairlimit.store.memory import MemoryStore
from limit_configs import FOUR_LIMITS
from redis_servers import RedisClusterProcesses, RedisProcess, suite_url

SCENARIOS = Path(__file__).resolve().parents[2] / "descriptors" / "scenarios"
WINDOW_EDGE = SCENARIOS / "window-edge.yaml"

CONFIG = """# {algorithm}: {limit} per {window} s
domain: edge
descriptors:
  - key: client_id
    rate_limit: {{duration: {window}s, requests_per_unit: {limit}, algorithm: {algorithm}{burst}}}
"""
SCENARIO = """name: edge-{limit}-per-{window}
domain: edge
descriptor: [{{key: client_id, value: "{{client}}"}}]
configs:
  - {{label: fixed, path: fixed.yaml}}
  - {{label: sliding, path: sliding.yaml}}
  - {{label: gcra, path: gcra.yaml}}
duration: {duration}
tick: 0.05
clients:
  - {{name: edge, phases: [{{start: {start}, stop: {stop}, rate: {rate}}}]}}
"""


def _spans_by_count(hits: dict[int, int], ticks: int) -> int:
    """The busiest span of ``ticks`` ticks, by summing every span that starts at a tick."""
    last = max(hits, default=0)
    return max(
        (sum(hits.get(t, 0) for t in range(start, start + ticks)) for start in range(last + 1)),
        default=0,
    )


@pytest.mark.unit
def test_the_busiest_span_is_the_most_of_any_span() -> None:
    rng = random.Random(28)
    for _ in range(300):
        hits = {rng.randrange(200): rng.randrange(1, 9) for _ in range(rng.randrange(0, 40))}
        ticks = rng.randrange(1, 60)
        most, start = busiest_span(hits, ticks, 0.05)
        assert most == _spans_by_count(hits, ticks), (hits, ticks)
        first = round(start / 0.05)
        assert sum(hits.get(t, 0) for t in range(first, first + ticks)) == most


def _by_label(configs: tuple[ConfigResult, ...]) -> dict[str, ConfigResult]:
    return {c.label: c for c in configs}


def _fresh(backend: str, request: pytest.FixtureRequest) -> tuple[Callable[[], Store], list[Store]]:
    """A factory of empty stores of ``backend`` for the engine, and the stores it made."""
    made: list[Store] = []
    if backend == "memory":

        def memory() -> Store:
            made.append(MemoryStore())
            return made[-1]

        return memory, made
    from fairlimit.store.redis import open_redis

    if backend == "redis":
        server: RedisProcess = request.getfixturevalue("redis_server")

        def standalone() -> Store:
            with server.client() as client:
                client.flushall()
            made.append(open_redis(suite_url(server.url)))
            return made[-1]

        return standalone, made
    cluster: RedisClusterProcesses = request.getfixturevalue("redis_cluster")

    def clustered() -> Store:
        cluster.flush()
        made.append(open_redis(suite_url(cluster.url)))
        return made[-1]

    return clustered, made


async def _run(path: Path, backend: str, request: pytest.FixtureRequest) -> dict[str, ConfigResult]:
    fresh, made = _fresh(backend, request)
    try:
        return _by_label((await run_async(load_scenario(path), store=fresh)).configs)
    finally:
        for store in made:
            await store.close()


@pytest.mark.behaviour
@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["memory", "redis", "redis-cluster"])
async def test_the_bundled_window_edge(backend: str, request: pytest.FixtureRequest) -> None:
    """100 a minute; the client asks 20/s from 45 s to 75 s."""
    runs = await _run(WINDOW_EDGE, backend, request)
    fixed, sliding, gcra = (runs[k].levels[0] for k in ("fixed", "sliding", "gcra"))
    # fixed: the limit in each window, twice the limit within 20 s across the edge
    assert (fixed.max_admitted, fixed.max_in_span, fixed.span_start) == (100, 200, 45.0)
    assert not fixed.exceeded
    # sliding: the limit at 45 s, then nothing until 45 s have left the last minute
    assert (sliding.max_in_span, runs["sliding"].clients[0].admitted) == (100, 100)
    # gcra, burst 20: 21 at once, then one per 0.6 s (30 s from the start: 50 more)
    assert gcra.max_in_span <= 120 and gcra.burst == 20
    assert 69 <= runs["gcra"].clients[0].admitted <= 71
    assert not sliding.exceeded and not gcra.exceeded
    if backend != "memory":
        on_memory = await _run(WINDOW_EDGE, "memory", request)
        for label, result in runs.items():
            assert result.clients == on_memory[label].clients, label


@pytest.mark.unit
def test_the_report_says_it() -> None:
    import asyncio

    result = asyncio.run(run_async(load_scenario(WINDOW_EDGE)))
    lines = [line for line in text(result).splitlines() if line.startswith(("cap", "("))]
    assert lines == [
        "cap 100 per 1-min window: at most 100 (100%) admitted in one; across a window's edge "
        "200 (200%) in the 60 s from 45 s, never exceeded",
        "cap 100 per 1-min window (sliding): at most 100 (100%) admitted in one; "
        "in any 60 s at most 100 (100%), never exceeded",
        "(utilisation and fairness are measured in fixed windows: not for a sliding limit)",
        "cap 100 per 1-min window (gcra, burst 20): at most 45 (45%) admitted in one; "
        "in any 60 s at most 70 (70%), never exceeded",
        "(utilisation and fairness are measured in fixed windows: not for a gcra limit)",
    ]


# Other numbers of the same kind: (limit, window s, burst, start, stop, rate, duration).
VARIANTS = [
    (30, 10, 5, 7, 14, 25, 30),
    (50, 20, 0, 12.5, 27, 12, 60),
    (12, 4, 3, 2.5, 9, 10, 16),
]


@pytest.mark.behaviour
@pytest.mark.asyncio
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}-per-{v[1]}s")
@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_other_limits_and_windows(
    variant: tuple[int, int, int, float, float, int, int],
    backend: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    """The client starts inside a window and asks fast enough to fill it and the next one
    within one window's length: fixed admits twice the limit in a span, the others do not
    (gcra takes its burst at once, then paces)."""
    limit, window, burst, start, stop, rate, duration = variant
    for algorithm in ("fixed", "sliding", "gcra"):
        extra = f", burst: {burst}" if algorithm == "gcra" and burst else ""
        body = CONFIG.format(algorithm=algorithm, limit=limit, window=window, burst=extra)
        (tmp_path / f"{algorithm}.yaml").write_text(body)
    scenario = tmp_path / "edge.yaml"
    fields = {"limit": limit, "window": window, "duration": duration, "rate": rate}
    scenario.write_text(SCENARIO.format(start=start, stop=stop, **fields))
    runs = await _run(scenario, backend, request)
    fixed, sliding, gcra = (runs[k].levels[0] for k in ("fixed", "sliding", "gcra"))
    assert fixed.max_admitted == limit and fixed.max_in_span == 2 * limit
    assert 0 < sliding.max_in_span <= limit
    assert 0 < gcra.max_in_span <= limit + burst
    assert max(runs["gcra"].clients[0].per_second) >= burst + 1  # a full bucket at once
    assert not any(c.exceeded for c in (fixed, sliding, gcra))


@pytest.mark.unit
def test_the_plot_draws_the_last_window_for_a_smooth_limit() -> None:
    """With a smooth limit in the run every panel draws the last 60 s: fixed reaches 200."""
    import asyncio

    configs = _by_label(asyncio.run(run_async(load_scenario(WINDOW_EDGE))).configs)
    last = {k: max(bands(c, 60, trailing=True)["edge"]) for k, c in configs.items()}
    assert last == {"fixed": 200, "sliding": 100, "gcra": 70}
    assert max(bands(configs["fixed"], 60)["edge"]) == 100  # so far in the window


def _gcra_admits(hits_at: list[float], rate: float, size: int) -> list[bool]:
    """GCRA as a theoretical arrival time: a hit at t passes while tat - t <= (size - 1) / rate."""
    tat, out = 0.0, []
    for t in hits_at:
        ok = max(tat, t) - t <= (size - 1) / rate + 1e-9
        out.append(ok)
        if ok:
            tat = max(tat, t) + 1 / rate
    return out


@pytest.mark.unit
def test_a_replayed_bucket_holds_what_gcra_would_still_admit() -> None:
    """At each start, the bucket's whole tokens are the hits a GCRA of that rate and burst
    would admit at once then: checked by asking a GCRA for hits until it refuses."""
    rng = random.Random(7)
    for _ in range(200):
        rate, size, tick = rng.choice([0.5, 2, 10]), rng.randrange(1, 6), 0.05
        times = sorted(rng.sample(range(400), rng.randrange(0, 60)))
        admitted = _gcra_admits([t * tick for t in times], rate, size)
        hits = {t: 1 for t, ok in zip(times, admitted, strict=True) if ok}
        starts = [float(s) for s in range(0, 21, 2)]
        levels = bucket_levels(hits, tick, rate, size, starts)
        for start, level in zip(starts, levels, strict=True):
            before = [t * tick for t in hits if t * tick < start - 1e-9]
            extra = _gcra_admits([*before, *[start] * (size + 1)], rate, size)[len(before) :]
            assert math.floor(level + 1e-9) == sum(extra), (rate, size, hits, start)


MIXED = (
    """
domain: edge
descriptors:
  - key: client_id
"""
    + FOUR_LIMITS
)


@pytest.mark.unit
def test_longer_and_paced_limits_bound_each_window_by_what_they_have_left(
    tmp_path: Path,
) -> None:
    """A per-second rule with a sliding 5 minutes, a GCRA minute and a calendar month: a
    saturating client is held by whichever limit binds, and each second's achievable is
    exactly what it got (scaled to its average rate, the month would have made the first
    second's 20 an 'achievable' of 0.39)."""
    import asyncio

    (tmp_path / "mixed.yaml").write_text(MIXED)
    (tmp_path / "scenario.yaml").write_text(
        "name: mixed\ndomain: edge\ndescriptor: [{key: client_id, value: '{client}'}]\n"
        "configs: [{label: mixed, path: mixed.yaml}]\nduration: 130\ntick: 0.05\n"
        "clients:\n  - {name: c, phases: [{start: 0, stop: 40, rate: 30},"
        " {start: 70, stop: 71, burst: 50}, {start: 90, stop: 130, rate: 12}]}\n"
    )
    (config,) = asyncio.run(run_async(load_scenario(tmp_path / "scenario.yaml"))).configs
    busy = [w for w in config.windows if w.achievable]
    assert [w.admitted for w in busy] == [w.achievable for w in busy]
    assert [w.admitted for w in busy[:4]] == [20, 20, 20, 10]  # the burst of 31, then 10/s
