"""Instructions per rate-limit call, in-process, counted by valgrind (callgrind): a figure
that other load on the machine does not move, where CPU time and req/s do (issue 41).

    python bench/instructions.py                       # plain and public, about 3 minutes
    python bench/instructions.py --baseline ../main    # and another checkout's server/
    python bench/instructions.py --served --baseline ../main   # in the running server
    python bench/instructions.py --redis --baseline ../main    # in redis-server, a request

The call is bench/inproc.py's servicer path (request bytes -> servicer -> limiter -> memory
store -> response bytes, telemetry on as `serve` installs it) for one hot client, on
route=plain (a client limit) and route=public (a client limit under a fair_share cap).
Each count is two runs under callgrind, of FEW and FEW + CALLS calls after the same start:
their difference over CALLS is what one more call costs, start-up and imports left out.
Needs valgrind (Debian valgrind, installed here where missing).

``--store`` counts only the memory store's admit and the statuses (``admit_now`` and
``core.admission.statuses`` on the route's prepared plan) on a simulated clock, 10 µs a
call: no timer, no period rolled mid-run (in-process, a call under callgrind takes wall
time enough that the cap's per-second work lands in the counted calls, and those counts
move by tens of thousands between runs), so the same code gives the same count.

``--redis`` counts what redis-server does a request (its main thread, where scripts run):
the limiter on a RedisStore with leases off (each request one admit script call) and the
caller's clock (``clock=caller``: 200 µs a request, so every run makes the same calls with
the same arguments), requests one at a time from REDIS_CLIENTS clients in turn, on
route=plain and route=public; REDIS_WARM requests, the counts zeroed, REDIS_COUNT more.
At 10,000 clients nearly every request is a client's first in its window (a new row at the
cap); at 100 each client comes back within the window.

``--served`` counts them in the server itself: the no-op (bench/noop.py) and `fairlimit
serve` (telemetry on, memory://) run under callgrind, one thread per count
(--separate-threads), driven by h2load (4 connections x 2 streams): WARMUP requests,
a dump, SERVED requests, another dump; the second dump's counts over the requests are
per request. The main thread's (the event loop and all the Python, the thread that bounds
req/s: bench/ladder.py) is shown, then every thread's. The server's own path is in it:
gRPC's C core, the event loop, the stream of one, the call budgets and the read deadline.
"""

import argparse
import asyncio
import glob
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import procs

# h2load and wire are imported where --served needs them: wire puts this checkout's
# server/ first on sys.path and imports fairlimit, so a child importing it at the top
# would count this checkout's code for --baseline's too.

FEW, CALLS, WARMUP = 200, 1000, 300
SERVED = 1000  # requests counted in the server (--served)
REDIS_CLIENTS = (100, 10_000)  # --redis
REDIS_WARM, REDIS_COUNT = 400, 1500
REDIS_STEP = 0.0002  # the caller's clock moves this much a request (--redis)
_COLLECTED = re.compile(r"Collected : (\d+)")
_HEADER = re.compile(r"^(part|thread|summary|totals): (\d+)", re.M)
_SUCCEEDED = re.compile(r"(\d+) succeeded")


class _Context:
    """A call's context as the servicer reads it (bench/inproc.py's, which imports this
    checkout's server: here the server is the one asked for)."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    async def read(self) -> bytes:
        return self.body

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("user-agent", "h2load"), ("te", "trailers"))

    def time_remaining(self) -> float | None:
        return 0.02  # Envoy's default rate-limit timeout


def calls(server: str, route: str, count: int) -> None:
    """``count`` hot calls on ``route`` through the servicer of ``server`` (a checkout's
    server/), after WARMUP: the child."""
    sys.path.insert(0, server)
    from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
    from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
    from fairlimit.config.loader import load
    from fairlimit.grpc_api.servicer import RateLimitServicer
    from fairlimit.limiter import Limiter
    from fairlimit.store.memory import MemoryStore
    from fairlimit.telemetry import Telemetry
    from fairlimit.telemetry import sdk as otel_sdk

    entry = ratelimit_pb2.RateLimitDescriptor.Entry
    descriptor = ratelimit_pb2.RateLimitDescriptor(
        entries=[entry(key="route", value=route), entry(key="client_id", value="hot")]
    )
    body = rls_pb2.RateLimitRequest(domain="edge", descriptors=[descriptor]).SerializeToString()
    sdk = otel_sdk.install({})
    telemetry = Telemetry(rpc_latency=sdk.latency)
    limiter = Limiter(load([procs.BENCH / "bench.yaml"]), MemoryStore(), telemetry=telemetry)
    servicer, context = RateLimitServicer(limiter, telemetry), _Context(body)

    async def run() -> None:
        for _ in range(WARMUP + count):
            await servicer.ShouldRateLimit(None, context)  # the response's bytes

    asyncio.run(run())
    sdk.shutdown()


def store_calls(server: str, route: str, count: int) -> None:
    """``count`` calls of the memory store's admit and the statuses on ``route``'s plan,
    on a simulated clock, after WARMUP: the child of ``--store``."""
    sys.path.insert(0, server)
    from fairlimit.config.loader import load
    from fairlimit.core.admission import statuses
    from fairlimit.core.matching import Matcher
    from fairlimit.core.plan import plan
    from fairlimit.core.request import Descriptor, Request
    from fairlimit.store.memory import MemoryStore

    matcher = Matcher(load([procs.BENCH / "bench.yaml"]).config)
    entries = (("route", route), ("client_id", "hot"))
    prepared = plan(Request("edge", (Descriptor(entries, None, None),), 0), matcher)
    store, start = MemoryStore(), 1_700_000_000.0
    for i in range(WARMUP + count):
        now = start + i * 1e-5
        statuses(prepared, store.admit_now(prepared, now), now)


def redis_requests(server: str, url: str, pid: int, route: str, clients: int) -> None:
    """The requests of ``--redis`` (the child): REDIS_WARM, callgrind's counts of
    redis-server (``pid``) zeroed, REDIS_COUNT more, one at a time on the caller's clock."""
    sys.path.insert(0, server)
    from fairlimit.config.loader import load
    from fairlimit.core.request import Descriptor, Request
    from fairlimit.limiter import Limiter
    from fairlimit.simulate.run import SimClock
    from fairlimit.store import open_store

    clock = SimClock()  # the simulations' injected clock, moved by hand here
    clock.t = 1_700_000_000.0
    store = open_store(f"{url}?clock=caller&leases=off&timeout=60")
    limiter = Limiter(load([procs.BENCH / "bench.yaml"]), store, clock)
    prepared = [
        limiter.prepare(Request("edge", (Descriptor((("route", route), ("client_id", f"c{i}")),
                                                    None, None),), 0))
        for i in range(clients)
    ]  # fmt: skip

    async def run() -> None:
        for n in range(REDIS_WARM + REDIS_COUNT):
            if n == REDIS_WARM:
                subprocess.run(["callgrind_control", "--zero", str(pid)], capture_output=True,
                               check=True)  # fmt: skip
            await limiter.decide(prepared[n % clients], None)
            clock.t += REDIS_STEP
        await store.close()

    asyncio.run(run())


def in_redis(label: str, server: Path, route: str, clients: int, workdir: Path) -> int:
    """Instructions of redis-server's main thread a request (``--redis``), ``server``'s
    scripts and limiter."""
    out = workdir / f"callgrind-redis-{label}-{route}-{clients}"
    wrapper = ("valgrind", "--tool=callgrind", "--separate-threads=yes",
               f"--callgrind-out-file={out}")  # fmt: skip
    redis = procs.Redis("redis-server", workdir, wrapper, timeout=120)
    try:
        child = [sys.executable, __file__, "--redis-child", str(server), redis.url,
                 str(redis.proc.pid), route, str(clients)]  # fmt: skip
        subprocess.run(child, check=True, timeout=1800)
        counts = _dump(redis.proc.pid, out, 1)
    finally:
        redis.proc.stop(60)
    return round(counts[1] / REDIS_COUNT)


def main_redis(baseline: Path | None, routes: list[str]) -> int:
    """``--redis``: each server's requests on each route and number of clients."""
    print(f"instructions of redis-server's main thread a request (callgrind, {REDIS_COUNT} "
          f"requests after {REDIS_WARM}, one at a time, the caller's clock; leases off: each "
          "request one admit script call)")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="fairlimit-redis-") as tmp:
        for clients in REDIS_CLIENTS:
            for route in routes:
                line = f"route={route:<8} {clients:>6} clients"
                counts = {}
                for name, server in procs.servers(baseline):
                    counts[name] = in_redis(name, server, route, clients, Path(tmp))
                line += f"   this checkout {counts['this']:>10,}"
                if "baseline" in counts:
                    base = counts["baseline"]
                    change = (counts["this"] - base) / base
                    line += f"   {baseline}: {base:>10,}   {change:+.1%}"
                print(line, flush=True)
    return 0


def _collected(server: Path, route: str, count: int, store: bool = False) -> int:
    command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
               __file__, "--child", str(server), route, str(count)]  # fmt: skip
    if store:
        command.append("--store")
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    found = _COLLECTED.search(out.stderr)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"callgrind failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return int(found.group(1))


def per_call(server: Path, route: str, pool: ThreadPoolExecutor, store: bool = False) -> int:
    few, more = pool.map(lambda n: _collected(server, route, n, store), (FEW, FEW + CALLS))
    return round((more - few) / CALLS)


def _h2load(port: int, body: Path, requests: int) -> int:
    """``requests`` calls by h2load (4 connections x 2 streams); the number answered."""
    import h2load
    command = [h2load.binary() or "h2load", "-t", "1", "-c", "4", "-m", "2", "-n",
               str(requests), "-d", str(body)]  # fmt: skip
    for header in h2load.GRPC_HEADERS:
        command += ["-H", header]
    out = subprocess.run([*command, h2load.grpc_url(port)], capture_output=True, text=True,
                         timeout=600, check=False)  # fmt: skip
    found = _SUCCEEDED.search(out.stdout)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"h2load failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return int(found.group(1))


def _dump(pid: int, out: Path, part: int) -> dict[int, int]:
    """Have callgrind dump its counts (part ``part``); instructions by thread number."""
    subprocess.run(["callgrind_control", "--dump", str(pid)], capture_output=True, check=False)
    deadline = time.monotonic() + 120
    while not glob.glob(f"{out}.{part}-*"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"callgrind wrote no dump {part} of {pid}")
        time.sleep(0.5)
    time.sleep(2)  # every thread's file written
    counts = {}
    for name in glob.glob(f"{out}.{part}-*"):
        fields = {k: int(v) for k, v in _HEADER.findall(Path(name).read_text())}
        counts[fields["thread"]] = fields.get("summary", fields.get("totals", 0))
    return counts


def served(label: str, command: list[str], route: str, workdir: Path,
           server: Path | None) -> dict[int, int]:  # fmt: skip
    """Instructions per request by thread (1: the main thread) in ``command``'s server
    under callgrind, on ``route``."""
    out = workdir / f"callgrind-{label}-{route}"
    env = None if server is None else {"PYTHONPATH": str(server)}
    proc = procs.Proc(f"served-{label}-{route}", ["valgrind", "--tool=callgrind",
                      "--separate-threads=yes", f"--callgrind-out-file={out}", *command],
                      workdir, env)  # fmt: skip
    try:
        port = proc.wait_for(procs._PORT, timeout=900)[0]  # valgrind starts slowly
        import wire

        body = wire.write_body(workdir / f"served-{route}.bin", route, "hot")
        _h2load(int(port), body, WARMUP)
        _dump(proc.pid, out, 1)
        done = _h2load(int(port), body, SERVED)
        counts = _dump(proc.pid, out, 2)
    finally:
        proc.stop(60)
    return {thread: round(n / done) for thread, n in sorted(counts.items())}


def main_served(baseline: Path | None, routes: list[str]) -> int:
    """``--served``: the no-op, then each server on each route, one at a time."""
    flags = ["serve", "--config", str(procs.BENCH / "bench.yaml"), "--backend", "memory://",
             "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"]  # fmt: skip
    runs: list[tuple[str, list[str], str, Path | None]] = [
        ("noop", [sys.executable, str(procs.BENCH / "noop.py"), "--addr", "127.0.0.1:0"],
         "public", None)]  # fmt: skip
    for name, server in procs.servers(baseline):
        label = "this checkout" if name == "this" else str(baseline)
        runs += [(label, [sys.executable, "-m", "fairlimit", *flags], route, server)
                 for route in routes]  # fmt: skip
    print(f"instructions per request in the server (callgrind, {SERVED} requests by h2load "
          f"after {WARMUP}; one hot client, memory://, telemetry on; main: the event loop's "
          "thread)")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="fairlimit-served-") as tmp:
        for label, command, route, server in runs:
            counts = served(label.replace("/", "_").replace(" ", "-"), command, route,
                            Path(tmp), server)  # fmt: skip
            main, total = counts.get(1, 0), sum(counts.values())
            shown = "noop (bench/noop.py)" if label == "noop" else f"route={route:<8}{label}"
            print(f"{shown:<40} main {main:>9,}   all threads {total:>9,}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                        help="also another checkout's server/ (e.g. a worktree of main)")
    parser.add_argument("--routes", default="plain,public", help="comma-separated")
    parser.add_argument("--served", action="store_true",
                        help="count in the running server under h2load (and the no-op's)")
    parser.add_argument("--store", action="store_true",
                        help="only the memory store's admit and the statuses, simulated clock")
    parser.add_argument("--redis", action="store_true",
                        help="count what redis-server does a request (the admit script)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--redis-child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.redis_child:
        server, url, pid, route, clients = args.redis_child
        redis_requests(server, url, int(pid), route, int(clients))
        return 0
    if args.child:
        child = store_calls if args.store else calls
        child(args.child[0], args.child[1], int(args.child[2]))
        return 0
    if procs.ensure_debian_package("valgrind", "valgrind") is None:
        print("instructions: valgrind not found and not installable", file=sys.stderr)
        return 2
    # the modes that need one more program: it, its Debian package, and the mode's run
    modes = ((args.redis, "redis-server", "redis-server", main_redis),
             (args.served, "h2load", "nghttp2-client", main_served))  # fmt: skip
    for on, command, package, run in modes:
        if not on:
            continue
        if procs.ensure_debian_package(command, package) is None:
            print(f"instructions: {command} not found and not installable", file=sys.stderr)
            return 2
        return run(args.baseline.resolve() if args.baseline else None, args.routes.split(","))
    servers = {"this": procs.ROOT / "server"}
    if args.baseline is not None:
        servers["base"] = args.baseline.resolve() / "server"
    jobs = [(name, route) for route in args.routes.split(",") for name in servers]
    with ThreadPoolExecutor(4) as pool, ThreadPoolExecutor(len(jobs)) as outer:
        counts = dict(zip(jobs, outer.map(
            lambda job: per_call(servers[job[0]], job[1], pool, args.store), jobs),
            strict=True))  # fmt: skip
    what = ("the memory store's admit and the statuses, simulated clock" if args.store
            else "memory://, telemetry on")  # fmt: skip
    print(f"instructions per call, in-process (callgrind, {FEW} and {FEW + CALLS} calls after "
          f"{WARMUP} warm-up ones; one hot client, {what})")  # fmt: skip
    for route in args.routes.split(","):
        this = counts["this", route]
        line = f"route={route:<8} this checkout {this:>9,}"
        if "base" in servers:
            base = counts["base", route]
            line += f"   {args.baseline}: {base:>9,}   {(this - base) / base:+.1%}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
