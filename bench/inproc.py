"""In-process measurements (no server, no network): per-request cost against the number of
live clients, memory per client and after expiry, and the λ recompute time.

The memory store never awaits, so a request is driven straight through the limiter's
coroutine; the clock is injected, so a million clients fit in one window and expire on cue.
"""

import asyncio
import gc
import random
import sys
import time
import tracemalloc
import types
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))

from fairlimit.config.loader import load  # noqa: E402
from fairlimit.core import fairshare  # noqa: E402
from fairlimit.core.admission import Code  # noqa: E402
from fairlimit.core.request import Descriptor, Request  # noqa: E402
from fairlimit.core.sharing import STALE  # noqa: E402
from fairlimit.limiter import Limiter  # noqa: E402
from fairlimit.store.memory import MemoryStore  # noqa: E402

CONFIG = ROOT / "bench" / "bench.yaml"
# Past every 1-second window and the STALE periods a cap keeps a quiet client's history
# (fairness v2): then the store holds what it held before the clients came.
QUIET = STALE + 6.0
T0 = 1_700_000_000.25


class Clock:
    """An injected clock the benches move by hand."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t


def drive(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never awaits (the memory store does not)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("the memory store awaited")


def _request(route: str, client: str) -> Request:
    return Request("edge", (Descriptor((("route", route), ("client_id", client))),))


def _limiter() -> tuple[Limiter, MemoryStore, Clock]:
    store, clock = MemoryStore(), Clock()
    return Limiter(load([CONFIG]), store, clock), store, clock


def _per_request_us(limiter: Limiter, requests: list[Request], repeat: int) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        for request in requests:
            drive(limiter.should_rate_limit(request))
    return (time.perf_counter() - started) / (repeat * len(requests)) * 1e6


def _fill(limiter: Limiter, start: int, stop: int) -> float:
    """Requests for new clients ``start..stop-1``; µs per request."""
    started = time.perf_counter()
    for i in range(start, stop):
        decision = drive(limiter.should_rate_limit(_request("public", f"c{i:07d}")))
        assert decision.code is Code.OK
    return (time.perf_counter() - started) / max(1, stop - start) * 1e6


def deep_size(root: object) -> int:
    """Bytes held by ``root`` and everything it reaches (each object once; types, modules
    and functions, which are shared, left out): the store's own accounting of its memory."""
    seen: set[int] = set()
    stack, total = [root], 0
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def _known_us(limiter: Limiter, live: int) -> float:
    known = [_request("public", f"c{i:07d}") for i in range(0, live, max(1, live // 1000))]
    return round(_per_request_us(limiter, known, 10), 2)


def clients_run(steps: tuple[int, ...] = (10_000, 100_000, 1_000_000)) -> dict[str, Any]:
    """Clients added step by step to one memory store, all live in one 1-second window.

    Per step: µs per request for new clients and for known ones (10 passes over 1000 of
    them), and the store's size; then every window ends and the store's size is read again.
    """
    limiter, store, clock = _limiter()
    drive(limiter.should_rate_limit(_request("contended", "warm")))  # structures exist
    base = deep_size(store)
    hot = [_request("public", "hot")] * 1000
    rows = [{"live_clients": 0, "known_client_us": round(_per_request_us(limiter, hot, 10), 2),
             "new_client_us": None, "store_bytes": base}]  # fmt: skip
    live = 0
    for target in steps:
        new_us = round(_fill(limiter, live, target), 2)
        live = target
        rows.append({"live_clients": live, "known_client_us": _known_us(limiter, live),
                     "new_client_us": new_us, "store_bytes": deep_size(store)})  # fmt: skip
    full, entries = rows[-1]["store_bytes"], len(store)
    clock.t += QUIET
    drive(limiter.should_rate_limit(_request("contended", "warm")))  # expiry runs on admit
    after = deep_size(store)
    return {
        "rows": rows,
        "clients": live,
        "bytes_per_client": round((full - base) / live, 1),
        "base_bytes": base,
        "after_expiry_bytes": after,
        "after_vs_base": round(after / base, 3),
        "store_entries_full": entries,
        "store_entries_after": len(store),
        "tracemalloc_check": tracemalloc_check(),
    }


def tracemalloc_check(clients: int = 20_000) -> dict[str, Any]:
    """The same fill under tracemalloc (slow, so fewer clients): bytes per client and the
    memory left after expiry, to cross-check deep_size."""
    gc.collect()
    tracemalloc.start()
    limiter, _, clock = _limiter()
    drive(limiter.should_rate_limit(_request("contended", "warm")))
    gc.collect()
    base = tracemalloc.get_traced_memory()[0]
    _fill(limiter, 0, clients)
    gc.collect()
    full = tracemalloc.get_traced_memory()[0]
    clock.t += QUIET
    drive(limiter.should_rate_limit(_request("contended", "warm")))
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"clients": clients, "bytes_per_client": round((full - base) / clients, 1),
            "base_bytes": base, "after_expiry_bytes": after,
            "after_minus_base_bytes": after - base}  # fmt: skip


class _Context:
    """A call's context as the servicer reads it: the request bytes come from ``read``."""

    def __init__(self) -> None:
        self.body = b""

    async def read(self) -> bytes:
        return self.body

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("user-agent", "h2load"), ("te", "trailers"))

    def time_remaining(self) -> float | None:
        return 0.02  # Envoy's default rate-limit timeout


def servicer_cost() -> dict[str, Any]:
    """µs per request of everything fairlimit does for one call, without gRPC itself:
    request bytes -> servicer -> limiter -> memory store -> response bytes, telemetry on
    (the SDK as `serve` installs it). Best of 7 passes over 1000 hot + 1000 distinct."""
    from fairlimit.grpc_api.servicer import RateLimitServicer
    from fairlimit.telemetry import Telemetry
    from fairlimit.telemetry import sdk as otel_sdk

    sys.path.insert(0, str(ROOT / "bench"))
    from wire import message

    sdk = otel_sdk.install({})
    telemetry = Telemetry(rpc_latency=sdk.latency)  # as `serve` makes it
    limiter = Limiter(load([CONFIG]), MemoryStore(), telemetry=telemetry)
    servicer, context = RateLimitServicer(limiter, telemetry), _Context()
    bodies = [message("public", "hot")] * 1000 + [message("public", f"c{i}") for i in range(1000)]

    async def passes() -> float:  # on a task, as grpc.aio runs each call
        best = float("inf")
        for _ in range(7):
            started = time.perf_counter()
            for body in bodies:
                context.body = body
                await servicer.ShouldRateLimit(None, context)  # the response's bytes
            best = min(best, (time.perf_counter() - started) / len(bodies) * 1e6)
        return best

    best = asyncio.run(passes())
    sdk.shutdown()
    return {"us_per_request": round(best, 1)}


def _timed(fn: Any, *args: Any, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - started)
    return best * 1000


def lambda_recompute(sizes: tuple[int, ...] = (10_000, 100_000)) -> dict[str, Any]:
    """ms for water_level alone and with the period's fairness figures, per cap of n clients."""
    rng = random.Random(7)
    rows = []
    for n in sizes:
        demands = [rng.uniform(0, 200) for _ in range(n)]
        admitted = [min(d, 90.0) for d in demands]
        limits, weights = [100.0] * n, [rng.choice((1.0, 1.0, 3.0)) for _ in range(n)]
        capacity = 50.0 * n  # contended: λ is finite

        def both(d: list[float] = demands, a: list[float] = admitted, lim: list[float] = limits,
                 w: list[float] = weights, c: float = capacity) -> None:  # fmt: skip
            fairshare.water_level(d, lim, w, c)
            fairshare.fairness_figures(d, a, lim, w, c)

        rows.append({
            "clients": n,
            "water_level_ms": round(_timed(fairshare.water_level, demands, limits, weights,
                                           capacity), 2),
            "with_figures_ms": round(_timed(both), 2),
        })  # fmt: skip
    return {"rows": rows}


if __name__ == "__main__":
    import json

    print(json.dumps(lambda_recompute(), indent=1))
    print(json.dumps(clients_run((10_000, 100_000)), indent=1))
