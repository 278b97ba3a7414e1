"""The figures of the shared fairness cases and their variants, as a Markdown table.

    python tests/support/fairness_cases_report.py
    python tests/support/fairness_cases_report.py --backend 'redis://127.0.0.1:6379/?clock=caller&leases=on'

Each case of tests/simulate/test_fairness_cases.py (the four bundled scenarios of
descriptors/scenarios/ and the variants with other numbers) runs through ``fairlimit
simulate``'s engine on its fair-share config, on memory, and is measured per window against
the exact max-min solver (tests/support/fairness_figures.py defines each figure). With another
server's code first on the path (``PYTHONPATH=OTHER/server``) it measures that code. With
``--backend`` each run is on a fresh store of that Redis URL (flushed first: use a scratch
server; ``clock=caller`` is required, the runs are simulated), e.g. with leases on.
"""

import argparse
import asyncio
import math
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import fairlimit  # noqa: F401
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(HERE.parents[1] / "server"))

from bursty_cases import BUNDLED, VARIANTS, Case, _config_path, _fair  # noqa: E402
from fairlimit.simulate import engine  # noqa: E402
from fairlimit.simulate.report import Result  # noqa: E402
from fairness_figures import Figures, figures, read_cap  # noqa: E402

HEADER = ("case", "worst error (window, client)", "lowest utilisation", "Jain", "max/cap",
          "bursting clients' share")  # fmt: skip


def measure(case: Case, where: Path, backend: str | None = None) -> Figures:
    config = _config_path(case, where)
    if backend is None:
        result = engine.run(case.scenario, [str(config)])
    else:
        result = asyncio.run(_on_redis(case, config, backend))
    return figures(case.scenario, read_cap(config), _fair(result, config))


async def _on_redis(case: Case, config: Path, backend: str) -> Result:
    """``case`` run on fresh stores of the Redis URL ``backend``."""
    import redis

    from fairlimit.store.base import Store
    from fairlimit.store.redis import open_redis

    stores: list[Store] = []

    def fresh() -> Store:
        with redis.Redis.from_url(backend.partition("?")[0]) as client:
            client.flushdb()
        stores.append(open_redis(backend))
        return stores[-1]

    try:
        return await engine.run_async(case.scenario, [str(config)], store=fresh)
    finally:
        for store in stores:
            await store.close()


def row(case: Case, f: Figures) -> tuple[str, ...]:
    worst = None
    for w in f.windows:
        for name, error in zip(f.names, w.error, strict=True):
            if error is not None and (worst is None or error > worst[0]):
                worst = (error, w.index, name)
    low = min(f.windows, key=lambda w: w.utilisation)
    settled = [w.jain for w in f.windows if not w.changed]
    error = "-" if worst is None else f"{worst[0]:.1%} (w{worst[1]}, {worst[2]})"
    return (
        case.name,
        error,
        f"{low.utilisation:.3f} (w{low.index})",
        f"{min(settled, default=math.nan):.3f}",
        f"{max(w.over for w in f.windows):.3f}",
        f"{f.share(case.bursty):.3f}",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", help="a Redis URL with clock=caller (default: memory)")
    args = parser.parse_args()
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    with tempfile.TemporaryDirectory() as tmp:
        for case in (*BUNDLED, *VARIANTS):
            got = measure(case, Path(tmp), args.backend)
            lines.append("| " + " | ".join(row(case, got)) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
