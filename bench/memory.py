"""Memory store growth: RSS and the store's own count before, during and after client waves.

    python bench/memory.py [--clients 200000] [--units second,minute,...] [--waves 2]

For each window unit, in a fresh process (so one unit's heap does not flatter the next):
a config with a fair-share cap and a per-client limit of that unit, a warm-up wave of
1,000 clients that expires (the baseline: imports, config and code paths all in place),
then ``--waves`` waves of ``--clients`` new client ids, each followed by the clock moving
past the windows and the cap's idle time, and one request that sweeps. Prints, per unit,
the RSS and the entries the store holds at each step, and after/baseline (issue 13's
target: every unit back within 10% of its baseline). The clock is injected, so a year's
window expires on cue.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))

from inproc import Clock, drive  # noqa: E402

from fairlimit.config.loader import load  # noqa: E402
from fairlimit.core.request import Descriptor, Request  # noqa: E402
from fairlimit.core.sharing import STALE  # noqa: E402
from fairlimit.core.units import Unit  # noqa: E402
from fairlimit.limiter import Limiter  # noqa: E402
from fairlimit.store.memory import MemoryStore  # noqa: E402

CONFIG = """\
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
T0 = 1_700_000_000.0




def rss_mb() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20


def _wave(limiter: Limiter, prefix: str, clients: int) -> None:
    for i in range(clients):
        entries = (("route", "public"), ("client_id", f"{prefix}{i}"))
        request = Request("edge", (Descriptor(entries),))
        drive(limiter.should_rate_limit(request))


def one_unit(unit: str, clients: int, waves: int, workdir: Path) -> dict[str, object]:
    """The measurements for one unit, in this process."""
    path = workdir / f"memory-{unit}.yaml"
    path.write_text(CONFIG.format(unit=unit))
    clock, store = Clock(T0), MemoryStore()
    limiter = Limiter(load([path]), store, clock)
    window = Unit[unit.upper()].seconds
    clock.t = (T0 // window + 1) * window  # window-aligned

    def expire() -> None:
        clock.t += max(2 * window + 1, STALE) + 1  # past the windows and the caps' idle time
        _wave(limiter, "sweep-", 1)

    _wave(limiter, "warm-", 1_000)
    expire()
    steps: dict[str, object] = {"baseline": (round(rss_mb(), 1), len(store))}
    for wave in range(1, waves + 1):
        _wave(limiter, f"w{wave}-", clients)
        steps[f"wave {wave}"] = (round(rss_mb(), 1), len(store))
        expire()
        steps[f"after {wave}"] = (round(rss_mb(), 1), len(store))
    after = steps[f"after {waves}"]
    baseline = steps["baseline"]
    assert isinstance(after, tuple) and isinstance(baseline, tuple)
    steps["after/baseline"] = round(after[0] / baseline[0], 3)
    return {"unit": unit, **steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=200_000)
    parser.add_argument("--waves", type=int, default=2)
    parser.add_argument("--units", default=",".join(u.name.lower() for u in Unit))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child's unit
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_unit(args.one, args.clients, args.waves, args.workdir)))
        return
    worst = 0.0
    print(f"{args.clients} clients a wave, {args.waves} waves; RSS MB, store entries")
    for unit in args.units.split(","):
        command = [sys.executable, __file__, "--one", unit, "--clients", str(args.clients),
                   "--waves", str(args.waves), "--workdir", str(args.workdir)]  # fmt: skip
        row = json.loads(subprocess.run(command, check=True, capture_output=True,
                                        text=True).stdout)  # fmt: skip
        worst = max(worst, float(row["after/baseline"]))
        print("  ".join(f"{k}: {v}" for k, v in row.items()))
    verdict = "met" if worst <= 1.10 else "NOT met"
    print(f"worst after/baseline {worst:.3f}: target (within 10% of baseline) {verdict}")


if __name__ == "__main__":
    main()
