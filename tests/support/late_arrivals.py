"""Late arrivals (issue 40): light clients that arrive at any phase of a window, beside steady
clients that retry, run through ``fairlimit simulate``'s engine (a simulated clock) and
measured window by window against the exact weighted max-min solver (tests/support/maxmin.py).

A scenario (``Spec``) is a cap of C hits per second or per minute over ``client_id`` buckets
of C each (``fair_share: {active_clients: 5}``, the steady clients' weights), with

- one to three *steady* clients: each sends all the time, every 429 retried three times 50 ms
  later; together they offer 3 to 5 times C (originals), each in proportion to its weight
  times 1 to 2, so each asks at least three times its share; a request costs C/200 hits
  (at least 1);
- 5 to 200 *light* clients: each loads a page of 1 to 8 requests within 10 ms, every 2 to 8
  windows (per second; 1 or 2 per minute), at its own phase of the window (0 to 0.97) and
  its own window offset; a request's cost is set so that the light clients together offer
  5% to 30% of C per window on average, a page at most half of what max-min gives a
  client of weight 1 (the light clients are light: max-min admits their pages whole).

``figures`` gives per light client its admitted hits over its max-min hits, summed over the
measured windows (from the one in which every light client has come back once: the cap
knows how often each comes), and per measured window the utilisation (admitted over the
max-min total). ``draw`` makes a ``Spec`` from a ``random.Random``; ``issue_case`` is the
issue's own traffic with the pages' phase as a parameter. Run as a program it prints the
issue case's table (phase -> the users' share of max-min, the batch job's rate) and the
figures of the first ten drawn scenarios, for this code or another on the path:

    python tests/support/late_arrivals.py
    PYTHONPATH=OTHER/server python tests/support/late_arrivals.py
"""

import dataclasses
import math
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from fairlimit.simulate import engine
from fairlimit.simulate.clients import Client, Retries
from fairlimit.simulate.report import ConfigResult
from fairlimit.simulate.scenario import Scenario
from fairlimit.simulate.traffic import Cost, Phase
from fairlimit.store.base import Store
from maxmin import maxmin

PAGE = 0.01  # seconds a page load takes
RETRIES = Retries(3, 0.05)


@dataclass(frozen=True)
class Steady:
    name: str
    rate: float  # original requests per second
    cost: int  # hits per request
    weight: int


@dataclass(frozen=True)
class Light:
    name: str
    phase: float  # of the window, where its page starts
    period: int  # windows between its pages
    offset: int  # the window of its first page
    requests: int  # per page
    cost: int  # hits per request


@dataclass(frozen=True)
class Spec:
    unit: str  # second | minute
    capacity: int  # hits per window
    steady: tuple[Steady, ...]
    light: tuple[Light, ...]
    windows: int  # the run's length, in windows

    @property
    def window(self) -> int:
        return 1 if self.unit == "second" else 60

    @property
    def warm(self) -> int:
        """The first measured window: every light client has come back once (its second
        page), so the cap knows how often it comes."""
        return max(lc.offset + 2 * lc.period for lc in self.light)

    def describe(self) -> str:
        steady = ", ".join(f"{s.name} {s.rate:g}/s x{s.cost} w{s.weight}" for s in self.steady)
        light = sum(lc.requests * lc.cost / lc.period for lc in self.light)
        return (
            f"cap {self.capacity}/{self.unit}, steady: {steady}; {len(self.light)} light "
            f"clients offering {light:.0f} hits per window on average"
        )


def draw(rng: random.Random) -> Spec:
    """A random scenario of the kind the module docstring describes."""
    unit = rng.choice(("second", "minute"))
    window = 1 if unit == "second" else 60
    capacity = round(math.exp(rng.uniform(math.log(50), math.log(5000))))
    share = rng.uniform(0.05, 0.30)  # of C: the light clients' demand per window
    periods = (2, 8) if unit == "second" else (1, 2)
    count = rng.randint(5, min(200, max(5, int(share * capacity * periods[1] / 2))))
    weights = [rng.randint(1, 3) for _ in range(rng.randint(1, 3))]
    spread = [w * rng.uniform(1, 2) for w in weights]
    total = rng.uniform(3, 5) * capacity / window  # hits per second
    # a steady request is at most 1/200 of the cap: whole requests fill it to 0.5%
    cost = max(1, capacity // 200)
    steady = tuple(
        Steady(f"steady{i + 1}", round(total * part / sum(spread) / cost, 3), cost, w)
        for i, (w, part) in enumerate(zip(weights, spread, strict=True))
    )
    # a page is at most half of what max-min gives a client of weight 1, so the light
    # clients are light (their max-min share is their page)
    level = capacity * (1 - share) / (sum(weights) + 1)
    light = []
    for i in range(count):
        period = rng.randint(*periods)
        page = max(1.0, min(share * capacity * period / count, level / 2))
        requests = max(1, min(rng.randint(1, 8), int(page)))
        light.append(
            Light(
                f"user{i:03d}",
                round(rng.uniform(0, 0.97), 3),
                period,
                rng.randrange(period),
                requests,
                max(1, round(page / requests)),
            )
        )
    windows = max(lc.offset + 2 * lc.period for lc in light) + (10 if unit == "second" else 3)
    return Spec(unit, capacity, steady, tuple(light), windows)


def issue_case(phase: float, windows: int = 30) -> Spec:
    """Issue 40's traffic: cap 100/s; a batch job at 500/s retrying every 429 three times;
    30 users loading 5-request pages every 6 s, five of them each second, all at ``phase``."""
    light = tuple(Light(f"user{k:02d}", phase, 6, k // 5, 5, 1) for k in range(30))
    return Spec("second", 100, (Steady("batch", 500, 1, 1),), light, windows)


def config_text(spec: Spec) -> str:
    weights = {s.name: s.weight for s in spec.steady if s.weight != 1}
    shown = "{" + ", ".join(f"{k}: {v}" for k, v in weights.items()) + "}"
    fair = "{active_clients: 5" + (f", weights: {shown}" if weights else "") + "}"
    return f"""domain: edge
descriptors:
  - key: route
    value: api
    rate_limit: {{unit: {spec.unit}, requests_per_unit: {spec.capacity}}}
    fair_share: {fair}
    descriptors:
      - key: client_id
        rate_limit: {{unit: {spec.unit}, requests_per_unit: {spec.capacity}}}
"""


def scenario(spec: Spec, base: Scenario) -> Scenario:
    """``spec`` as a scenario, built on ``base`` (any scenario file: its name and source)."""
    w = spec.window
    duration = spec.windows * w
    clients = [
        Client(s.name, (Phase(0, duration, s.rate),), RETRIES, s.weight, Cost((s.cost,)))
        for s in spec.steady
    ]
    for lc in spec.light:
        start = round((lc.offset + lc.phase) * w, 6)
        phase = Phase(start, duration, lc.requests / PAGE, lc.period * w, PAGE)
        clients.append(Client(lc.name, (phase,), Retries(), 1.0, Cost((lc.cost,))))
    return dataclasses.replace(
        base,
        name=f"late arrivals: {spec.describe()}",
        duration=duration,
        tick=0.005 if spec.unit == "second" else 0.01,
        descriptors=((("route", "api"), ("client_id", "{client}")),),
        clients=tuple(clients),
        steady=(0.0, float(duration)),
    )


@dataclass(frozen=True)
class Figures:
    names: tuple[str, ...]
    light_share: dict[str, float]  # per light client: admitted / max-min, measured windows
    utilisation: tuple[float, ...]  # per measured window
    steady_rate: float  # the steady clients' admitted hits per window, measured windows
    light_total: float  # the light clients' admitted over max-min, measured windows

    def worst_light(self) -> tuple[str, float]:
        name = min(self.light_share, key=lambda n: self.light_share[n])
        return name, self.light_share[name]


def figures(spec: Spec, result: ConfigResult) -> Figures:
    names = tuple(c.name for c in result.clients)
    weights = {s.name: s.weight for s in spec.steady}
    wts = [weights.get(n, 1) for n in names]
    light = {lc.name for lc in spec.light}
    got = dict.fromkeys(light, 0)
    fair: dict[str, Fraction] = dict.fromkeys(light, Fraction(0))
    utilisation = []
    steady = 0
    measured = [w for w in result.windows if spec.warm <= w.index and w.complete]
    for w in measured:
        shares = maxmin(list(w.offered), [spec.capacity] * len(names), wts, spec.capacity)
        for name, a, f in zip(names, w.admitted_by_client, shares, strict=True):
            if name in light:
                got[name] += a
                fair[name] += Fraction(f)
            else:
                steady += a
        total = sum(Fraction(f) for f in shares)
        utilisation.append(float(sum(w.admitted_by_client) / total) if total else 1.0)
    share = {n: float(got[n] / fair[n]) if fair[n] else 1.0 for n in light}
    light_fair = sum(fair.values())
    return Figures(
        names,
        share,
        tuple(utilisation),
        steady / max(1, len(measured)),
        float(sum(got.values()) / light_fair) if light_fair else 1.0,
    )


def run(spec: Spec, base: Scenario) -> tuple[Figures, ConfigResult]:
    """``spec`` through the engine on memory: its figures and the engine's result."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "late-arrivals.yaml"
        config.write_text(config_text(spec))
        result = engine.run(scenario(spec, base), [str(config)])
    fair = result.configs[0]
    return figures(spec, fair), fair


async def run_async(
    spec: Spec, base: Scenario, store: Callable[[], Store] | None = None
) -> tuple[Figures, ConfigResult]:
    """``run`` in the caller's event loop, on the stores ``store`` makes (Redis), else on
    memory."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "late-arrivals.yaml"
        config.write_text(config_text(spec))
        result = await engine.run_async(scenario(spec, base), [str(config)], store=store)
    fair = result.configs[0]
    return figures(spec, fair), fair


PHASES = (0.05, 0.37, 0.6, 0.85, 0.93, 0.96, 0.97, 0.975, 0.98, 0.985, 0.99)


def main() -> None:
    from bursty_cases import PAGE_LOADS

    base = PAGE_LOADS.scenario
    print("| phase in the window | users' share of max-min | batch job |")
    print("|---|---|---|")
    for phase in PHASES:
        got = run(issue_case(phase), base)[0]
        print(f"| {phase:g} | {got.light_total:.2f} | {got.steady_rate:.1f}/s |")
    print()
    print("| seed | scenario | worst light client (phase) | lowest utilisation |")
    print("|---|---|---|---|")
    for seed in range(10):
        spec = draw(random.Random(seed))
        got = run(spec, base)[0]
        name, share = got.worst_light()
        phase = next(lc.phase for lc in spec.light if lc.name == name)
        print(
            f"| {seed} | {spec.describe()} | {share:.3f} ({phase:g}) | {min(got.utilisation):.3f} |"
        )


if __name__ == "__main__":
    main()
