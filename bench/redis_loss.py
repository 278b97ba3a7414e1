"""Redis lost under load, by failure mode: two fairlimit servers (``--failure-mode open``,
``closed`` or ``local``, ``--replicas 2``, default ``?timeout=``) on one local redis-server;
CLIENTS callers, each asking every 20 ms with a 20 ms deadline (as Envoy does), each call to
the two servers in turn. Redis is SIGKILLed (then started again, empty: no persistence) or
SIGSTOPped (then SIGCONT) for OUTAGE seconds between BEFORE and AFTER seconds of health.

Half of the callers are clients of a limit of 20 a second, half of one of 200 a minute (a
window the outage cuts in two: the run is started so that the minute holds it all). Per
mode and fault it prints: the answers during the outage by code; the most any client was
admitted by both servers together in a window of each limit, against the limit (in the
second windows wholly inside the outage, and in the minute); and how long after Redis was
back each server logged ``backend healthy again`` (and, under ``local``, the end of its
local limiting: what it admitted alone written back).

    python bench/redis_loss.py [MODE ...]    # open closed local by default

docs/failure-modes.md quotes it (degraded mode).
"""

import asyncio
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import grpc
import procs
import wire

CLIENTS, EVERY = 8, 0.02
BEFORE, OUTAGE, AFTER = 2.0, 4.0, 3.0
PER_SECOND, PER_MINUTE = 20, 200
CONFIG = f"""\
domain: edge
descriptors:
  - key: route
    value: second
    descriptors:
      - key: client_id
        rate_limit: {{unit: second, requests_per_unit: {PER_SECOND}}}
  - key: route
    value: minute
    descriptors:
      - key: client_id
        rate_limit: {{unit: minute, requests_per_unit: {PER_MINUTE}}}
"""
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?(backend healthy again|"
                    r"limiting locally ended)", re.MULTILINE)  # fmt: skip
_AFTER = {"backend healthy again": "healthy", "limiting locally ended": "local state dropped"}


@dataclass
class Run:
    """The answers of one run: (sent, received, route, client, code) each."""

    answers: list[tuple[float, float, str, str, str]] = field(default_factory=list)
    lost: float = 0.0  # when Redis was killed or stopped (time.time())
    back: float = 0.0  # when it answered again


async def _caller(channels: list[grpc.aio.Channel], route: str, client: str, end: float,
                  run: Run) -> None:  # fmt: skip
    body = wire.message(route, client)
    calls = [channel.unary_unary(wire.METHOD) for channel in channels]
    turn = 0
    while time.time() < end:
        started, sent = time.monotonic(), time.time()
        call = calls[turn % len(calls)]
        turn += 1
        try:
            reply = await call(body, timeout=EVERY)
            code = wire.overall_code(reply)
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
        run.answers.append((sent, time.time(), route, client, code))
        await asyncio.sleep(max(0.0, EVERY - (time.monotonic() - started)))


async def _fault(redis: procs.Redis, fault: str, run: Run) -> None:
    await asyncio.sleep(BEFORE)
    run.lost = time.time()
    if fault == "kill":
        redis.kill()
    else:
        os.kill(redis.proc.pid, signal.SIGSTOP)
    await asyncio.sleep(OUTAGE)
    if fault == "kill":
        await asyncio.to_thread(redis.start)
    else:
        os.kill(redis.proc.pid, signal.SIGCONT)
        await asyncio.to_thread(redis.client.ping)
    run.back = time.time()


def _wait_for_room() -> None:
    """Start where the rest of the minute holds the whole run (the minute limit's window)."""
    need = BEFORE + OUTAGE + AFTER + 6  # and the servers' start
    while time.time() % 60 > 60 - need:
        time.sleep(0.5)


async def _one(redis: procs.Redis, workdir: Path, config: Path, mode: str, fault: str
               ) -> tuple[Run, list[procs.Proc]]:  # fmt: skip
    redis.flush()
    servers = [procs.fairlimit(workdir, f"{mode}-{fault}-{i}", redis.url, 1, "--failure-mode",
                               mode, "--replicas", "2", config=config)
               for i in (0, 1)]  # fmt: skip
    run = Run()
    try:
        await asyncio.sleep(1.5)  # each server's demand exchange has seen the other
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _, port in servers]
        prefix = uuid.uuid4().hex[:6]
        end = time.time() + BEFORE + OUTAGE + AFTER
        callers = [_caller(channels, "second" if i % 2 else "minute", f"{prefix}-{i}", end, run)
                   for i in range(CLIENTS)]  # fmt: skip
        await asyncio.gather(_fault(redis, fault, run), *callers)
        await asyncio.sleep(0.5)  # a write-back still out
        for channel in channels:
            await channel.close()
    finally:
        for proc, _ in servers:
            proc.stop()
    return run, [proc for proc, _ in servers]


def _report(mode: str, fault: str, run: Run, servers: list[procs.Proc]) -> None:
    during = Counter(code for t, _, _, _, code in run.answers if run.lost <= t < run.back)
    total = sum(during.values()) or 1
    shares = ", ".join(f"{c} {n / total:.1%}" for c, n in during.most_common())
    # Admissions per client window, both servers together. A call is decided between its
    # sending and its answer: certainly in a window when both are in it, maybe when they
    # straddle its edge; the true count lies between the two.
    certain: dict[tuple[str, str, int], int] = defaultdict(int)
    maybe: dict[tuple[str, str, int], int] = defaultdict(int)
    for sent, received, route, client, code in run.answers:
        if code != "OK":
            continue
        size = 1 if route == "second" else 60
        first, last = int(sent // size), int(received // size)
        if first == last:
            certain[(route, client, first)] += 1
        for window in range(first, last + 1):
            maybe[(route, client, window)] += 1
    # second windows wholly inside the outage, and those it begins in or ends in
    inside: list[tuple[int, int]] = []
    lost: list[tuple[int, int]] = []
    back_in: list[tuple[int, int]] = []
    for key in maybe:
        route, _, w = key
        pair = (certain.get(key, 0), maybe[key])
        if route != "second":
            continue
        if run.lost + 0.1 <= w and w + 1 <= run.back - 0.1:
            inside.append(pair)
        if w - 0.1 < run.lost < w + 1.1:
            lost.append(pair)
        if w - 0.1 < run.back < w + 1.1:
            back_in.append(pair)
    minutes = [(certain.get(k, 0), n) for k, n in maybe.items() if k[0] == "minute"]
    back = []
    for proc in servers:
        seen = []
        for stamp, what in _STAMP.findall(proc.text()):
            at = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if at >= run.back - 0.5:
                seen.append((_AFTER[what], at - run.back))
        firsts = {label: t for label, t in reversed(seen)}
        flaps = sum(label == "healthy" for label, _ in seen) - 1
        ordered = sorted(firsts.items(), key=lambda item: item[1])
        text = ", ".join(f"{label} {t:+.2f} s" for label, t in ordered)
        back.append(text + (f" ({flaps} more unavailable/healthy flaps)" if flaps > 0 else ""))
    print(f"{mode:6} {fault:4} | outage ({total} answers): {shares}")
    print(f"{'':11} | per-second limit {PER_SECOND}, admitted by both per client window: "
          f"inside the outage {_most(inside, PER_SECOND)}; Redis lost in it "
          f"{_most(lost, PER_SECOND)}; Redis back in it {_most(back_in, PER_SECOND)}; "
          f"per-minute limit {PER_MINUTE}: "
          f"{_most(minutes, PER_MINUTE)}")  # fmt: skip
    print(f"{'':11} | after Redis is back: {'; '.join(back) or 'nothing logged'}")


def _most(windows: list[tuple[int, int]], limit: int) -> str:
    """The most admitted in a window (certainly-maybe), and how many windows were over."""
    low, high = max((c for c, _ in windows), default=0), max((m for _, m in windows), default=0)
    over = sum(c > limit for c, _ in windows)
    most = str(low) if low == high else f"{low}-{high}"
    return f"at most {most} ({over} of {len(windows)} over)"


async def main() -> None:
    binary = procs.ensure_debian_package("redis-server", "redis-server")
    if binary is None:
        raise SystemExit("redis-server is needed (Debian package redis-server)")
    workdir = Path(tempfile.mkdtemp())
    config = workdir / "loss.yaml"
    config.write_text(CONFIG)
    redis = procs.Redis(binary, workdir)
    try:
        modes = sys.argv[1:] or ["open", "closed", "local"]
        for fault in ("kill", "stop"):
            for mode in modes:
                _wait_for_room()
                run, servers = await _one(redis, workdir, config, mode, fault)
                _report(mode, fault, run, servers)
    finally:
        redis.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
