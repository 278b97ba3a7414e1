"""CPU time of a cap's division for N clients: core.sharing.divide (fairness v3: λ and the
sums every request then updates in O(1)) next to v1's bare λ (``level_of``: the water level
of the period's demand) on the same machine. python bench/fairness_level.py [N]

CPU time (process_time), not wall time: on a shared machine wall time measures the others.
"""

import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from fairlimit.core.fairshare import PeriodDemand, water_level
from fairlimit.core.sharing import Clock, Row, divide


def level_of(period: PeriodDemand) -> float:
    """v1's λ: the water level of the period's demand, in the cap's window."""
    demands = [d * period.scale for d in period.demands]
    return water_level(demands, period.limits, period.weights, period.capacity)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    rnd = random.Random(1)
    clock = Clock(60, 1.0, 1_699_920_030.0)
    rows = []
    for i in range(n):
        row = Row(rnd.choice([100.0, 600.0, float("inf")]), rnd.choice([1.0, 1.0, 3.0]))
        row.window, row.period = clock.start, clock.period - 1
        row.period_asked = row.asked = float(rnd.randint(0, 20))
        row.previous, row.previous_last = float(rnd.randint(0, 40)), clock.start - 1.0
        row.history, row.mass = rnd.random() * 10, 1.0
        rows.append((f"client-{i}", row))
    capacity = 6000.0 * n / 100
    v3 = _median(lambda: divide(rows, capacity, clock))
    carried = _median(lambda: divide(rows, capacity, clock, closing=1.0))
    demand = [row.period_asked for _, row in rows]
    period = PeriodDemand(capacity, 60.0, demand, demand, [r.limit for _, r in rows],
                          [r.weight for _, r in rows])  # fmt: skip
    v1 = _median(lambda: level_of(period))
    print(
        f"{n} clients, CPU ms (median of 7): v3 divide {v3:.0f} (the first of a window), "
        f"{carried:.0f} (the others), v1 level_of {v1:.0f}"
    )


def _median(run: Callable[[], object]) -> float:
    times = []
    for _ in range(7):
        started = time.process_time()
        run()
        times.append(time.process_time() - started)
    return statistics.median(times) * 1000


if __name__ == "__main__":
    main()
