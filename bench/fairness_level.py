"""CPU time of λ for N clients: core.sharing.period_level (fairness v2: λ and R of a period)
next to core.fairshare.level_of (v1) on the same machine. python bench/fairness_level.py [N]

CPU time (process_time), not wall time: on a shared machine wall time measures the others.
"""

import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from fairlimit.core.fairshare import PeriodDemand, level_of
from fairlimit.core.sharing import Clock, Row, period_level


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    rnd = random.Random(1)
    clock = Clock(60, 1.0, 1_699_920_030.0)
    rows = []
    for _ in range(n):
        row = Row(rnd.choice([100.0, 600.0, float("inf")]), rnd.choice([1.0, 1.0, 3.0]))
        row.ws, row.pk = clock.start, clock.period - 1
        row.pd = row.d = float(rnd.randint(0, 20))
        row.r = rnd.random() * 10
        rows.append(row)
    capacity = 6000.0 * n / 100
    v2 = _median(lambda: period_level(rows, capacity, clock))
    demand = [row.pd for row in rows]
    period = PeriodDemand(capacity, 60.0, demand, demand, [r.limit for r in rows],
                          [r.weight for r in rows])  # fmt: skip
    v1 = _median(lambda: level_of(period))
    print(f"{n} clients, CPU ms (median of 7): v2 period_level {v2:.0f}, v1 level_of {v1:.0f}")


def _median(run: Callable[[], object]) -> float:
    times = []
    for _ in range(7):
        started = time.process_time()
        run()
        times.append(time.process_time() - started)
    return statistics.median(times) * 1000


if __name__ == "__main__":
    main()
