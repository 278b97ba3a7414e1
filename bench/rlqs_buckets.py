"""RLS latency while RLQS streams report many buckets, and RSS before and after they close.

    python bench/rlqs_buckets.py [--buckets 20000] [--streams 1] [--per-report 2000]
                                 [--rate 100] [--waves 2] [-- SERVE FLAGS...]

Starts ``fairlimit serve`` (memory backend unless the flags say otherwise; a config with a
fair-share cap over per-client RLQS buckets and an RLS rule), and a second process that
calls ShouldRateLimit at a steady ``--rate`` (open loop: each call is sent at its time
whether the last one was answered or not, with a 2 s deadline) until the end. Then, in
each of ``--waves`` waves, ``--streams`` RLQS streams (each on a connection of its own, as
Envoys are) send their part of ``--buckets`` new buckets at once, in reports of
``--per-report`` lines (a hostile or broken Envoy; a real one reports a bucket as it sees
it), wait for their assignments, report every bucket again (a periodic report) and close;
the next wave's buckets are new ones.

Prints, per wave, the RLS latencies (p50/p99/max over every call, a failed one counted to
its error; the calls that failed, by code; and those not answered OK within Envoy's default
20 ms RLS timeout) from the first report to the last assignment, the
buckets assigned and those never assigned (a bucket past the caps is assigned, not
tracked: the server's log line counts them), and the server's RSS before the
first wave, with the streams open, and ``--settle`` seconds after they closed; then the
latencies over the whole run and the server's log lines about refused buckets. With
``--steps``, the server also logs each step of its event loop that took more than 10 ms of
CPU (a ``sitecustomize`` hook the bench writes), and each wave's longest are printed: on a
shared machine, the latencies measure the neighbours too, the CPU time of a step does not.
Extra ``serve`` flags go after ``--`` (``--rlqs-max-buckets-per-stream 20000
--rlqs-max-buckets 20000`` lift the caps).
"""

import argparse
import asyncio
import contextlib
import multiprocessing
import multiprocessing.synchronize
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2  # noqa: E402
from fairlimit._proto.envoy.service.rate_limit_quota.v3 import rlqs_pb2  # noqa: E402
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2  # noqa: E402

RLS = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
RLQS = "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas"
# the RLQS clients' cap, and a rule of its own for the RLS calls measured meanwhile
RLS_RULE = """\
  - key: k
    rate_limit: {unit: second, requests_per_unit: 1000000}
"""
CONFIG = (ROOT / "descriptors" / "rlqs" / "many-clients.yaml").read_text() + RLS_RULE
Reports = rlqs_pb2.RateLimitQuotaUsageReports
DEADLINE = 2.0  # seconds an RLS call may take before it counts as failed
MAX_SECONDS = 300.0  # the pacer stops by itself after this long
QUIET = 2.0  # a wave's assignments are all in when none came for this long
Sample = tuple[float, float, str]  # (sent at, seconds to the answer, its status code)


def rss_mb(pid: int) -> float:
    pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return pages * 4096 / 2**20


STEPS_HOOK = """\
import asyncio, sys, time
_run = asyncio.events.Handle._run
def _timed(self):
    cpu, wall = time.thread_time(), time.monotonic()
    _run(self)
    took = time.thread_time() - cpu
    if took > 0.010:
        print(f"loop step {took * 1e3:.1f} ms CPU at {wall:.3f}", file=sys.stderr, flush=True)
asyncio.events.Handle._run = _timed
"""
_STEP = re.compile(r"loop step ([0-9.]+) ms CPU at ([0-9.]+)")


def start_server(
    workdir: Path, flags: list[str], steps: bool
) -> tuple[subprocess.Popen[str], str, list[str]]:
    config = workdir / "rlqs.yaml"
    config.write_text(CONFIG)
    command = [sys.executable, "-m", "fairlimit", "serve", "--config", str(config),
               "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", *flags]  # fmt: skip
    path = str(ROOT / "server")
    if steps:
        (workdir / "sitecustomize.py").write_text(STEPS_HOOK)
        path += f":{workdir}"
    env = {"PYTHONPATH": path, "PATH": "/usr/bin:/bin"}
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    stderr = server.stderr
    assert stderr is not None
    lines: list[str] = []
    for line in stderr:
        lines.append(line)
        if "serving gRPC on" in line:
            port = line.rsplit("(port ", 1)[1].rstrip(")\n")
            threading.Thread(target=lambda: lines.extend(stderr), daemon=True).start()
            return server, f"127.0.0.1:{port}", lines
    raise RuntimeError("the server did not start:\n" + "".join(lines))


def pace(
    target: str,
    rate: float,
    stop: multiprocessing.synchronize.Event,
    out: "multiprocessing.Queue[list[Sample]]",
) -> None:
    """In a process of its own: ShouldRateLimit every 1/rate s until ``stop`` is set (or
    MAX_SECONDS); puts the list of samples on ``out``."""
    entry = ratelimit_pb2.RateLimitDescriptor.Entry(key="k", value="v")
    request = rls_pb2.RateLimitRequest(
        domain="edge", descriptors=[ratelimit_pb2.RateLimitDescriptor(entries=[entry])]
    ).SerializeToString()
    samples: list[Sample] = []
    lock = threading.Lock()
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(RLS, request_serializer=None, response_deserializer=None)
        call(request, timeout=10)  # connected and warm
        futures = []
        start = time.monotonic()
        for n in range(int(rate * MAX_SECONDS)):
            if stop.is_set():
                break
            time.sleep(max(0.0, start + n / rate - time.monotonic()))
            sent = time.monotonic()
            future = call.future(request, timeout=DEADLINE)

            def done(f: grpc.Future, sent: float = sent) -> None:
                took = time.monotonic() - sent
                error = f.exception()
                with lock:
                    samples.append((sent, took, "OK" if error is None else error.code().name))

            future.add_done_callback(done)
            futures.append(future)
        for future in futures:
            with contextlib.suppress(grpc.RpcError):
                future.result()
        time.sleep(0.1)
    out.put(samples)


def report(stream: str, first: int, count: int) -> bytes:
    lines = [
        Reports.BucketQuotaUsage(
            bucket_id={"bucket": {"route": "public", "client_id": f"{stream}c{i}"}},
            num_requests_allowed=0,
            num_requests_denied=5,
        )
        for i in range(first, first + count)
    ]
    return Reports(domain="edge", bucket_quota_usages=lines).SerializeToString()


async def send_all(
    call: grpc.aio.StreamStreamCall, stream: str, count: int, per_report: int
) -> None:
    for first in range(0, count, per_report):
        await call.write(report(stream, first, min(per_report, count - first)))


async def open_stream(
    target: str, stream: str, count: int, per_report: int, assigned: set[str],
    arrived: list[float],
) -> tuple[grpc.aio.StreamStreamCall, "asyncio.Task[None]"]:  # fmt: skip
    """Open a stream and send ``count`` new buckets in reports of ``per_report``, as fast
    as it can; a task reads every assignment into ``assigned`` (the time of each response
    into ``arrived``)."""
    # a connection of its own, as each Envoy has (channels to one target share one by
    # default)
    channel = grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    parse = rlqs_pb2.RateLimitQuotaResponse.FromString
    call = channel.stream_stream(RLQS, request_serializer=None, response_deserializer=parse)()

    async def read() -> None:
        try:
            async for response in call:
                arrived.append(time.monotonic())
                for action in response.bucket_action:
                    if action.HasField("quota_assignment_action"):
                        assigned.add(action.bucket_id.bucket["client_id"])
        except grpc.aio.AioRpcError as error:
            print(f"  stream {stream} ended with {error.code().name}: {error.details()}")
        await channel.close()

    reader = asyncio.create_task(read())
    await send_all(call, stream, count, per_report)
    return call, reader


@dataclass
class Wave:
    started: float
    ended: float
    sent: int
    assigned: int
    rss_open: float


async def wave(target: str, name: str, streams: int, buckets: int, per_report: int,
               pid: int) -> Wave:  # fmt: skip
    assigned: set[str] = set()
    arrived: list[float] = []
    each = buckets // streams
    started = time.monotonic()
    calls = await asyncio.gather(
        *(open_stream(target, f"{name}s{s}", each, per_report, assigned, arrived)
          for s in range(streams))
    )  # fmt: skip
    for _ in range(60):  # every assignment in: none for QUIET seconds
        seen = len(arrived)
        await asyncio.sleep(QUIET)
        if len(arrived) == seen:
            break
    ended = arrived[-1] if arrived else time.monotonic()
    # as the arrival left them: once streams close, their room goes to buckets refused before
    took = len(assigned)
    rss_open = rss_mb(pid)
    await asyncio.gather(  # a periodic report: every bucket again
        *(send_all(call, f"{name}s{s}", each, per_report) for s, (call, _) in enumerate(calls))
    )
    await asyncio.sleep(1.5)
    for call, reader in calls:
        if not reader.done():
            await call.done_writing()
    for _, reader in calls:
        await reader
    return Wave(started, ended, each * streams, took, rss_open)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latencies(samples: list[Sample]) -> str:
    """Percentiles over every call, answered or failed (a failure's time is until its
    error came), the failures by code, and the calls not answered OK within 20 ms."""
    if not samples:
        return "no calls"
    took = [t for _, t, _ in samples]
    codes = Counter(code for _, _, code in samples if code != "OK")
    late = sum(1 for _, t, code in samples if t > 0.020 or code != "OK")
    failed = f"{sum(codes.values())} failed {dict(codes) or ''}".rstrip()
    return (f"{len(samples)} calls, p50 {statistics.median(took) * 1e3:.1f} ms, p99 "
            f"{percentile(took, 0.99) * 1e3:.1f} ms, max {max(took) * 1e3:.1f} ms; "
            f"{failed}; {late} not OK within 20 ms")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--buckets", type=int, default=20_000)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--per-report", type=int, default=2000,
                        help="bucket lines a report (2000: about 90 kB, under the 256 KiB "
                        "receive limit)")  # fmt: skip
    parser.add_argument("--rate", type=float, default=100.0, help="RLS calls a second")
    parser.add_argument("--waves", type=int, default=2)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds after a close")
    parser.add_argument("--steps", action="store_true", help="log the server's long loop steps")
    parser.add_argument("flags", nargs="*", help="extra serve flags (after --)")
    args = parser.parse_args()
    waves: list[tuple[Wave, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        server, target, log = start_server(Path(tmp), args.flags, args.steps)
        spawn = multiprocessing.get_context("spawn")
        stop = spawn.Event()
        queue: multiprocessing.Queue[list[Sample]] = spawn.Queue()
        pacer = spawn.Process(target=pace, args=(target, args.rate, stop, queue))
        try:
            pacer.start()
            time.sleep(2.0)  # the pacer connected and calling; the server warm
            before = rss_mb(server.pid)
            for n in range(args.waves):
                done = asyncio.run(wave(target, f"w{n}", args.streams, args.buckets,
                                        args.per_report, server.pid))  # fmt: skip
                time.sleep(args.settle)
                waves.append((done, rss_mb(server.pid)))
            stop.set()
            samples = queue.get(timeout=60)
            pacer.join(30)
        finally:
            stop.set()
            server.terminate()
            server.wait(30)
    flags = " ".join(args.flags) or "(defaults)"
    print(f"{args.buckets} buckets over {args.streams} stream(s) a wave, {args.per_report} a "
          f"report, {args.rate:.0f} RLS calls/s; serve {flags}")  # fmt: skip
    print(f"  RSS before: {before:.0f} MB")
    steps = [(float(m[1]), float(m[2])) for line in log if (m := _STEP.search(line))]
    for n, (done, after) in enumerate(waves, 1):
        during = [s for s in samples if done.started <= s[0] <= done.ended]
        print(f"  wave {n}: {done.ended - done.started:.2f} s from the first report to the "
              f"last assignment; {done.assigned} buckets assigned, "
              f"{done.sent - done.assigned} never (past the caps: assigned, not tracked; "
              f"the log below counts them)")  # fmt: skip
        print(f"    RLS meanwhile: {latencies(during)}")
        if args.steps:
            longest = sorted((ms for ms, at in steps if done.started <= at <= done.ended),
                             reverse=True)  # fmt: skip
            print(f"    loop steps over 10 ms CPU meanwhile: {len(longest)}, the longest "
                  f"{', '.join(f'{ms:.0f}' for ms in longest[:5]) or '-'} ms")  # fmt: skip
        print(f"    RSS {done.rss_open:.0f} MB with the streams open, {after:.0f} MB "
              f"{args.settle:.0f} s after they closed")  # fmt: skip
    print(f"  RLS over the whole run: {latencies(samples)}")
    if args.steps:
        longest = sorted((ms for ms, _ in steps), reverse=True)
        print(f"  loop steps over 10 ms CPU in the whole run: {len(longest)}, the longest "
              f"{', '.join(f'{ms:.0f}' for ms in longest[:5]) or '-'} ms")  # fmt: skip
    for line in log:
        if "RLQS" in line and "refused" in line:
            print("  log:", line.strip()[:240])


if __name__ == "__main__":
    main()
