"""What a window's expiry costs the calls around it, and the memory it leaves (issue 38).

    python bench/expiry.py [--clients 200000] [--unit minute] [--cap] [--reservations]

In one process, on a real event loop, as the server runs the memory store (the limiter,
MemoryStore, the clock injected so that the window ends on cue; everything made before the
wave frozen out of the collector's sight, as the server does at start): ``--clients``
distinct client ids in one window of ``--unit`` (``--cap``: under a fair-share cap too;
``--reservations``: instead, one client's reservations under as many request ids, an hour's
limit, never settled: they expire after their max_duration of 60 s). Then the clock
moves past the window (and the reservations' max_duration), and for two seconds a probe
asks every millisecond (a new client each time), as steady traffic would. Printed: the
longest any probe waited (for the loop to come back to it, plus its own call), the CPU
time this process used meanwhile (a wait far above it is the machine's, not the store's),
the first call's time, then RSS before the wave, with it held, and once everything has
expired, per 100k keys.
"""

import argparse
import asyncio
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))

from inproc import Clock  # noqa: E402

from fairlimit.config.loader import load  # noqa: E402
from fairlimit.core.request import Descriptor, Request  # noqa: E402
from fairlimit.core.sharing import STALE  # noqa: E402
from fairlimit.core.units import Unit  # noqa: E402
from fairlimit.limiter import Limiter  # noqa: E402
from fairlimit.store.memory import MemoryStore  # noqa: E402

PLAIN = """\
domain: edge
descriptors:
  - key: client_id
    rate_limit: {{unit: {unit}, requests_per_unit: 10}}
"""
CAPPED = """\
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {{unit: {unit}, requests_per_unit: 1000000000}}
    fair_share: {{active_clients: 1000}}
    descriptors:
      - key: client_id
        rate_limit: {{unit: {unit}, requests_per_unit: 10}}
"""
TOKENS = """\
domain: edge
descriptors:
  - key: client_id
    rate_limit: {{unit: hour, requests_per_unit: 1000000000}}
    reservation: {{default: 30, max_duration: 60}}
"""
PROBE_SECONDS, PROBE_EVERY = 2.0, 0.001


def rss_mb() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20


def _request(client: str, cap: bool, reserve: bool) -> Request:
    """One client's call; ``reserve``: one client's reservation under the id ``client``."""
    entries: tuple[tuple[str, str], ...] = (("client_id", client),)
    if cap:
        entries = (("route", "public"), *entries)
    if reserve:
        entries = (("client_id", "tenant"), ("request_id", client))
    return Request("edge", (Descriptor(entries),))


async def _probe(limiter: Limiter, cap: bool, reserve: bool) -> tuple[float, float, float]:
    """(the longest wait of a probe, this process's CPU time in it, the first call's own
    time), in ms. On a shared machine a wait far above its CPU time is the machine's."""
    worst, cpu, first = 0.0, 0.0, -1.0
    end = time.perf_counter() + PROBE_SECONDS
    i = 0
    while time.perf_counter() < end:  # bounded: two seconds
        due, used = time.perf_counter() + PROBE_EVERY, time.process_time()
        await asyncio.sleep(PROBE_EVERY)
        woke = time.perf_counter()
        await limiter.should_rate_limit(_request(f"probe-{i}", cap, reserve))
        done = time.perf_counter()
        if first < 0:
            first = (done - woke) * 1000
        if (done - due) * 1000 > worst:
            worst = (done - due) * 1000
            cpu = max(0.0, (time.process_time() - used) * 1000 - PROBE_EVERY * 1000)
        i += 1
    return worst, cpu, first


async def measure(clients: int, unit: str, cap: bool, reserve: bool, workdir: Path
                  ) -> dict[str, object]:  # fmt: skip
    text = TOKENS if reserve else CAPPED if cap else PLAIN
    path = workdir / "expiry.yaml"
    path.write_text(text.format(unit=unit))
    window = Unit[unit.upper()].seconds
    clock, store = Clock(), MemoryStore()
    clock.t = (clock.t // window + 1) * window
    limiter = Limiter(load([path]), store, clock)
    for i in range(1000):  # warm-up: every path in place
        await limiter.should_rate_limit(_request(f"warm-{i}", cap, reserve))
    clock.t += max(2 * window + 1, STALE, 61) + 1
    await _probe(limiter, cap, reserve)
    gc.collect()
    gc.freeze()  # as the server does once started (app/__init__.py)
    baseline = rss_mb()
    for i in range(clients):
        await limiter.should_rate_limit(_request(f"c{i}", cap, reserve))
    held = rss_mb()
    clock.t += max(2 * window + 1, STALE, 61) + 1  # past the window, idle caps, max_duration
    worst, cpu, first = await _probe(limiter, cap, reserve)
    await asyncio.sleep(0.5)
    after = rss_mb()
    per = 100_000 / clients
    return {"clients": clients, "unit": unit, "cap": cap, "reservations": reserve,
            "longest wait ms": round(worst, 1), "cpu in it ms": round(cpu, 1),
            "first call ms": round(first, 1),
            "rss baseline MB": round(baseline, 1), "rss held MB": round(held, 1),
            "rss after MB": round(after, 1),
            "MB per 100k held": round((held - baseline) * per, 1),
            "MB per 100k kept after expiry": round((after - baseline) * per, 1),
            "entries after": len(store) + len(store.reservations)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=200_000)
    parser.add_argument("--unit", default="minute")
    parser.add_argument("--cap", action="store_true")
    parser.add_argument("--reservations", action="store_true")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    row = asyncio.run(measure(args.clients, args.unit, args.cap, args.reservations,
                              args.workdir))  # fmt: skip
    print(json.dumps(row))


if __name__ == "__main__":
    main()
