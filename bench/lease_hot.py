"""One hot client on Redis with the default options, beside the no-op, in turns (issue 41).

    python bench/lease_hot.py                          # this checkout
    python bench/lease_hot.py --baseline ../base       # and another checkout's server/, in turns

Targets, all on 127.0.0.1 and started here on one redis-server: the no-op RLS (the ceiling);
``cap``, `fairlimit serve --backend redis://...` (no query: the defaults) with its hot client
on ``route=public`` (a client limit under a fair_share cap); ``upstream``, the same with
``--charge-when-over-limit true`` (upstream's semantics: every level counts a refused hit, as
under upstream's layout, xDS and Envoy Gateway) on ``route=plain`` (a client limit, no cap).
h2load drives the hot client at full speed (16 connections x 2 streams), the targets taking
turns for ``--rounds`` rounds; prints each target's median req/s, its ratio to the no-op's
(of the medians, and the median of each round's ratio),
and Redis script calls (EVALSHA + EVAL, the server stopped first so a block given back
counts) per request the server answered (its /metrics, the warm-up's included).
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import h2load
import procs
import wire
from h2load import Load

TARGETS = {"cap": ("public", ()), "upstream": ("plain", ("--charge-when-over-limit", "true"))}


def _start(workdir: Path, label: str, server: Path, redis: procs.Redis, target: str
           ) -> tuple[procs.Proc, int]:  # fmt: skip
    extra = TARGETS[target][1]
    url = "memory://" if label == "memory" else f"{redis.url}?key_prefix={label}-{target}:"
    return procs.fairlimit(workdir, f"{label}-{target}", url, 1, *extra, server=server)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                        help="also `fairlimit serve` from that checkout's server/, in turns")
    parser.add_argument("--memory", action="store_true",
                        help="also this checkout on memory:// (what Redis with leases nears)")
    args = parser.parse_args()
    redis_binary = procs.ensure_debian_package("redis-server", "redis-server")
    if redis_binary is None or h2load.binary() is None:
        print("lease_hot: redis-server or h2load not found", file=sys.stderr)
        return 2
    servers = procs.servers(args.baseline)
    if args.memory:
        servers.append(("memory", procs.ROOT / "server"))
    load = Load(clients=16, streams=2, seconds=args.seconds, warmup=1.0)
    rps: dict[str, list[float]] = {}
    calls: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="fairlimit-lease-hot-") as tmp:
        workdir = Path(tmp)
        redis = procs.Redis(redis_binary, workdir)
        try:
            for _ in range(args.rounds):
                noop, port = procs.noop(workdir)
                try:
                    body = wire.write_body(workdir / "body-public.bin", "public", "hot")
                    run = h2load.run(h2load.grpc_url(port), load, workdir, body=body,
                                     headers=h2load.GRPC_HEADERS, label="noop")  # fmt: skip
                    rps.setdefault("noop", []).append(run.rps)
                finally:
                    noop.stop()
                for label, server in servers:
                    for target, (route, _) in TARGETS.items():
                        name = f"{label} {target}"
                        proc, port = _start(workdir, label, server, redis, target)
                        before = redis.script_calls()
                        try:
                            body = wire.write_body(workdir / f"body-{route}.bin", route, "hot")
                            run = h2load.run(h2load.grpc_url(port), load, workdir, body=body,
                                             headers=h2load.GRPC_HEADERS, label=name)  # fmt: skip
                            answered = proc.metrics().get("rpc_calls", 0.0)  # warm-up's too
                        finally:
                            proc.stop()
                        rps.setdefault(name, []).append(run.rps)
                        made = max(1.0, answered)
                        calls.setdefault(name, []).append((redis.script_calls() - before) / made)
        finally:
            redis.stop()
    ceiling = statistics.median(rps["noop"])
    for name, values in rps.items():
        # each round's ratio to the no-op's run of that round, then their median: load
        # that comes and goes on a shared machine weighs on both runs of a round alike
        rounds = [v / n for v, n in zip(values, rps["noop"], strict=True)]
        row: dict[str, Any] = {"target": name, "rps": round(statistics.median(values), 1),
                               "runs": [round(v) for v in values],
                               "vs_noop": round(statistics.median(values) / ceiling, 3),
                               "vs_noop_by_round": round(statistics.median(rounds), 3)}
        if name in calls:
            row["script_calls_per_request"] = round(statistics.median(calls[name]), 4)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
