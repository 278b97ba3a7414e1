"""A flood of oversized requests against a real server: its peak RSS, and a small call's wait.

    python bench/flood.py [--concurrent 64] [--megabytes 3.9] [-- SERVE FLAGS...]

Starts ``fairlimit serve`` (memory backend, a small config), sends ``--concurrent`` calls of
a ``--megabytes`` RateLimitRequest at once, each on its own connection (as many clients
would), then reports the answers by status code, the server's peak RSS (VmHWM) and how long
a small call took in the middle of the flood. Issue 13: 16 such calls took the server to
164 MB and 128 to 732 MB before the receive limit and the cap on concurrent calls.
"""

import argparse
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2  # noqa: E402
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2  # noqa: E402

METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
CONFIG = """\
domain: edge
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 10}
"""
D = ratelimit_pb2.RateLimitDescriptor


def big_request(megabytes: float) -> bytes:
    """A RateLimitRequest of about ``megabytes`` MB (64 descriptors of 16 long entries)."""
    text = max(1, int(megabytes * 1e6 / (64 * 16 * 2)))
    entry = D.Entry(key="k" * text, value="v" * text)
    descriptor = D(entries=[entry] * 16)
    message = rls_pb2.RateLimitRequest(domain="edge", descriptors=[descriptor] * 64)
    return message.SerializeToString()


def small_request() -> bytes:
    entry = D.Entry(key="k", value="v")
    message = rls_pb2.RateLimitRequest(domain="edge", descriptors=[D(entries=[entry])])
    return message.SerializeToString()


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def call(target: str, payload: bytes, codes: Counter[str]) -> float:
    """One call on a fresh connection; its seconds. Counts its status code."""
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(target, options) as channel:
        send = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
        started = time.perf_counter()
        try:
            send(payload, timeout=60)
            codes["OK"] += 1
        except grpc.RpcError as error:
            codes[error.code().name] += 1
        return time.perf_counter() - started


def start_server(workdir: Path, flags: list[str]) -> tuple[subprocess.Popen[str], str]:
    config = workdir / "flood.yaml"
    config.write_text(CONFIG)
    command = [sys.executable, "-m", "fairlimit", "serve", "--config", str(config),
               "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", *flags]  # fmt: skip
    env = {"PYTHONPATH": str(ROOT / "server"), "PATH": "/usr/bin:/bin"}
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    assert server.stderr is not None
    for line in server.stderr:
        if "serving gRPC on" in line:
            port = line.rsplit("(port ", 1)[1].rstrip(")\n")
            threading.Thread(target=server.stderr.read, daemon=True).start()
            return server, f"127.0.0.1:{port}"
    raise RuntimeError("the server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrent", type=int, default=64)
    parser.add_argument("--megabytes", type=float, default=3.9)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp"))
    parser.add_argument("flags", nargs="*", help="extra serve flags (after --)")
    args = parser.parse_args()
    server, target = start_server(args.workdir, args.flags)
    try:
        codes: Counter[str] = Counter()
        call(target, small_request(), Counter())  # warm: imports and first connection done
        baseline = peak_rss_mb(server.pid)
        payload = big_request(args.megabytes)
        flood = [threading.Thread(target=call, args=(target, payload, codes))
                 for _ in range(args.concurrent)]  # fmt: skip
        for thread in flood:
            thread.start()
        small = call(target, small_request(), Counter())
        for thread in flood:
            thread.join()
        peak = peak_rss_mb(server.pid)
    finally:
        server.terminate()
        server.wait(30)
    print(f"{args.concurrent} x {len(payload) / 1e6:.2f} MB: answers {dict(codes)}; "
          f"peak RSS {peak:.0f} MB (baseline {baseline:.0f} MB); "
          f"a small call meanwhile took {small:.3f} s")  # fmt: skip


if __name__ == "__main__":
    main()
