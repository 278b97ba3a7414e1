"""Fair share in tokens against the size of the estimates: the four tenants of
tests/limiter/test_tokens_fairness.py (weights 2, 1, 1, 1 at a cap of 12 000 tokens a
minute; its clock, traffic and the exact weighted max-min solver, tests/support/maxmin.py),
with every estimate and real cost multiplied by SCALE and every rate divided by it: the same
demand in tokens, in larger requests. Memory store, injected clock: the same figures on
every run.

python bench/tokens_fairness.py [SCALE ...]     (default: 1 2 4 8 16)
"""

import asyncio
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / p) for p in ("server", "tests/support", "tests/limiter")]

import test_tokens_fairness as mix  # noqa: E402

from fairlimit.limiter import Limiter  # noqa: E402
from fairlimit.store.memory import MemoryStore  # noqa: E402
from helpers import FakeClock, load_text  # noqa: E402
from maxmin import maxmin  # noqa: E402


async def measure(scale: float) -> str:
    base = mix.TENANTS
    mix.TENANTS = tuple(
        mix.Tenant(t.name, t.rate / scale, round(t.estimate * scale), round(t.real * scale),
                   t.weight)
        for t in base
    )
    try:
        clock = FakeClock()
        limiter = Limiter(load_text(Path(tempfile.mkdtemp()), mix.CONFIG), MemoryStore(), clock)
        got = await mix._run(limiter, clock)
        fair = maxmin([t.demand for t in mix.TENANTS], [mix.LIMIT] * len(mix.TENANTS),
                      [t.weight for t in mix.TENANTS], mix.CAPACITY)
        errors, used = [], []
        for window in range(1, mix.WINDOWS):  # the first window is the warm-up
            for t, share in zip(mix.TENANTS, fair, strict=True):
                errors.append(abs(got[window][t.name] - share) / share)
            used.append(sum(got[window].values()) / mix.CAPACITY)
        ratio = max(t.estimate / s for t, s in zip(mix.TENANTS, fair, strict=True))
        estimates = ", ".join(str(t.estimate) for t in mix.TENANTS)
        return (f"{scale:>5g}  {estimates:<24} {ratio:>8.1%} {max(errors):>10.1%}"
                f"   {min(used):.1%}-{max(used):.1%}")
    finally:
        mix.TENANTS = base


def main() -> None:
    scales = [float(a) for a in sys.argv[1:]] or [1, 2, 4, 8, 16]
    print("scale  estimates                estimate   worst off   cap used")
    print("                                / share    its share   (settled windows)")
    for scale in scales:
        print(asyncio.run(measure(scale)))


if __name__ == "__main__":
    main()
