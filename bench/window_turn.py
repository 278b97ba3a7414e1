"""Latency at a window's turn: one hot client paced under a fair cap on Redis (issue 41).

    python bench/window_turn.py                        # this checkout
    python bench/window_turn.py --baseline ../base     # and another checkout's server/, in turns
    python bench/window_turn.py --memory               # and this checkout on memory://

bench/bench.yaml's ``route=public`` (a client limit under a fair_share cap) counts per
second. With lease blocks (Redis's defaults) a block ends a margin before its window does,
so the requests at each second's turn go to Redis together. Targets, on 127.0.0.1 and one
redis-server, take turns for ``--rounds`` rounds: `fairlimit serve --backend redis://...`
(no query: the defaults) of this checkout (and of ``--baseline``'s), and on ``memory://``
with ``--memory``. h2load paces the hot client at ``--rate`` req/s (4 connections x 8
streams, ``grpc-timeout: 20m`` as Envoy sends), and its log of every request gives, per
run: p50, p99, p99.9 and the slowest, the requests slower than ``--slow`` ms, and how many
of those started in the last or the first tenth of a second (at the turn). Then the median
of each figure over the rounds, one JSON line per target.
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


def figures(log: Path, slow_ms: float) -> dict[str, float]:
    """One run's figures from h2load's per-request log (start µs, status, duration µs)."""
    rows = [line.split("\t") for line in log.read_text().splitlines() if line]
    took = sorted(int(r[2]) / 1000 for r in rows)
    n = len(took)
    slow = [int(r[0]) % 1_000_000 for r in rows if int(r[2]) / 1000 > slow_ms]  # µs in its second
    turn = [t for t in slow if not 100_000 <= t < 900_000]
    return {"requests": n, "p50_ms": took[n // 2], "p99_ms": took[int(n * 0.99)],
            "p999_ms": took[int(n * 0.999)], "max_ms": took[-1], "slow": len(slow),
            "slow_at_turn": len(turn)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1500.0, help="req/s in all")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slow", type=float, default=15.0, help="ms")
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                        help="also `fairlimit serve` from that checkout's server/, in turns")
    parser.add_argument("--memory", action="store_true", help="also this checkout on memory://")
    args = parser.parse_args()
    redis_binary = procs.ensure_debian_package("redis-server", "redis-server")
    if redis_binary is None or h2load.binary() is None:
        print("window_turn: redis-server or h2load not found", file=sys.stderr)
        return 2
    # (label, server/, backend): None for the run's Redis with the defaults
    targets: list[tuple[str, Path, str | None]] = [
        (label, server, None) for label, server in procs.servers(args.baseline)
    ]
    if args.memory:
        targets.append(("memory", procs.ROOT / "server", "memory://"))
    load = Load(clients=4, streams=8, seconds=args.seconds, warmup=1.0,
                rps_per_client=args.rate / 4)  # fmt: skip
    headers = (*h2load.GRPC_HEADERS, "grpc-timeout: 20m")
    runs: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="fairlimit-window-turn-") as tmp:
        workdir = Path(tmp)
        redis = procs.Redis(redis_binary, workdir)
        body = wire.write_body(workdir / "body.bin", "public", "hot")
        try:
            for turn in range(args.rounds):
                for label, server, backend in targets:
                    url = backend or f"{redis.url}?key_prefix={label}{turn}:"
                    proc, port = procs.fairlimit(workdir, label, url, server=server)
                    try:
                        h2load.run(h2load.grpc_url(port), load, workdir, body=body,
                                   headers=headers, label=label, keep=True)  # fmt: skip
                    finally:
                        proc.stop()
                    log = h2load.log_path(workdir, label)
                    runs.setdefault(label, []).append(figures(log, args.slow))
                    log.unlink()
        finally:
            redis.stop()
    for label, figured in runs.items():
        row: dict[str, Any] = {"target": label, "rate": args.rate}
        for key in figured[0]:
            row[key] = round(statistics.median(f[key] for f in figured), 2)
        row["slow_by_round"] = [f["slow"] for f in figured]
        row["at_turn_by_round"] = [f["slow_at_turn"] for f in figured]
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
