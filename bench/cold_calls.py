"""fairlimit's own work per call with the CPU's caches warm, and cooled between calls.

In-process (bench/inproc.py's servicer path: request bytes -> servicer -> limiter -> memory
store -> response bytes, telemetry on) a call costs 10-35 µs; in the running server the
same work adds several times that to a request's CPU (bench/ladder.py, `guards` ->
`handler`). In the server, gRPC and the event loop run between two calls and take the
caches from the call's code and objects. Here each call is timed alone, back to back
("warm"), and after a walk over many Python objects spread over memory ("cooled"): a call
costs what it touches, not only what it executes.

    python bench/cold_calls.py                 # routes plain and public, 5,000 calls each way
    python bench/cold_calls.py --objects 3000  # a lighter cooling between calls
    python bench/cold_calls.py --pieces        # also parts of a call, each timed alone
"""

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))
sys.path.insert(0, str(ROOT / "bench"))

from inproc import CONFIG, _Context  # noqa: E402
from wire import message  # noqa: E402

from fairlimit.config.loader import load  # noqa: E402
from fairlimit.grpc_api.convert import response_to_proto  # noqa: E402
from fairlimit.grpc_api.servicer import RateLimitServicer  # noqa: E402
from fairlimit.limiter import Limiter  # noqa: E402
from fairlimit.store.memory import MemoryStore  # noqa: E402
from fairlimit.telemetry import Telemetry  # noqa: E402
from fairlimit.telemetry import sdk as otel_sdk  # noqa: E402

WARMUP = 2000


def _cooler(objects: int) -> Callable[[], int]:
    """A walk over ``objects`` dicts picked from 7 times as many made at start (so they lie
    apart in memory): it reads one value of each."""
    made = [{"n": i} for i in range(objects * 7)]
    picked = made[::7]

    def cool() -> int:
        total = 0
        for each in picked:
            total += each["n"]
        return total

    return cool


def measure(routes: list[str], calls: int, objects: int, pieces: bool
            ) -> list[dict[str, object]]:  # fmt: skip
    """Per route, and per piece with ``pieces``: the median µs warm and cooled."""
    sdk = otel_sdk.install({})
    telemetry = Telemetry(rpc_latency=sdk.latency)  # as `serve` makes it
    limiter = Limiter(load([CONFIG]), MemoryStore(), telemetry=telemetry)
    servicer, context = RateLimitServicer(limiter, telemetry), _Context()
    cool = _cooler(objects)
    rows: list[dict[str, object]] = []

    async def timed(step: Callable[[], Awaitable[object] | None], between: bool) -> float:
        """The median µs of ``calls`` steps, each timed alone (awaited if it is a coroutine)."""
        each = []
        for _ in range(calls):
            if between:
                cool()
            started = time.perf_counter()
            result = step()
            if result is not None:
                await result
            each.append(time.perf_counter() - started)
        return statistics.median(each) * 1e6

    async def call() -> None:
        await servicer.ShouldRateLimit(None, context)  # the response's bytes

    async def parts() -> dict[str, Callable[[], Awaitable[object] | None]]:
        """The steps of the call on ``context.body``: the call, and its pieces if asked."""
        steps: dict[str, Callable[[], Awaitable[object] | None]] = {"the call": call}
        if pieces:
            prepared = servicer._prepared[context.body][1]
            decision = await limiter.decide(prepared, 0.02)

            def build() -> None:
                response_to_proto(decision).SerializeToString()

            steps["limiter.decide"] = lambda: limiter.decide(prepared, 0.02)
            steps["response built, serialized"] = build
            steps["latency recorded"] = lambda: telemetry.rpc_finished(0.0001, "OK")
        return steps

    async def run() -> None:
        for route in routes:
            context.body = message(route, "hot")
            for _ in range(WARMUP):
                await call()
            for name, step in (await parts()).items():
                rows.append({"route": route, "what": name,
                             "warm_us": round(await timed(step, False), 1),
                             "cooled_us": round(await timed(step, True), 1)})  # fmt: skip

    asyncio.run(run())
    sdk.shutdown()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routes", default="plain,public", help="bench.yaml's routes")
    parser.add_argument("--calls", type=int, default=5000, help="timed calls each way")
    parser.add_argument("--objects", type=int, default=30000,
                        help="dicts read before each cooled call")  # fmt: skip
    parser.add_argument("--pieces", action="store_true", help="also parts of the call alone")
    args = parser.parse_args()
    rows = measure(args.routes.split(","), args.calls, args.objects, args.pieces)
    print(f"fairlimit's own work per call, median µs of {args.calls} calls timed alone "
          f"(memory://, telemetry on; cooled: {args.objects} dicts read before each)")
    print(f"{'route':<8}{'what':<28}{'warm':>8}{'cooled':>9}{'cooled/warm':>13}")
    for row in rows:
        warm, cooled = float(row["warm_us"]), float(row["cooled_us"])  # type: ignore[arg-type]
        print(f"{row['route']!s:<8}{row['what']!s:<28}{warm:>8.1f}{cooled:>9.1f}"
              f"{cooled / warm:>12.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
