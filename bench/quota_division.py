"""CPU time of an RLQS division after a report, for N clients under one contended cap.

    python bench/quota_division.py [--server DIR] [N ...]     # default: 10000 50000

Two Envoys (streams) each hold every client's bucket, as the end-to-end test spreads clients
over both; each reports every 5 s on an injected clock. After three rounds (every demand
measured), one Envoy's periodic report (all N of its buckets) is timed: measuring each
bucket, the division of the cap over all 2N holders and the assignments that changed.
Then the same N clients spread over 50 caps, and one new client subscribing under one of
them (Envoy reports a new bucket at once): a division re-divides only the caps a report
touched. CPU time (process_time), the median of 5 reports; on a shared machine wall time
measures the others. The division's part of the report is printed beside it (the rest is
taking the report's lines: measuring each bucket). Then five such reports each listing the
buckets in another order than the last (every line keyed: see quota/reports.py).

The timed Envoy's reports are encoded as Envoy sends them and parsed as the RLQS servicer
parses them (``grpc_api/rlqs.py``), before the report's timer starts; a third figure times
the servicer's whole part of a report: parsing it, taking it, and encoding every response
its division sent (to both Envoys). ``--server DIR`` imports fairlimit from another
checkout's ``server`` directory (a baseline, side by side; one without ``Wire`` is driven
through its ``usages_from_proto`` and ``response_to_proto``).
"""

import asyncio
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

_SERVER = str(Path(__file__).resolve().parents[1] / "server")
if sys.argv[1:2] == ["--server"]:
    _SERVER = sys.argv[2]
    del sys.argv[1:3]
sys.path.insert(0, _SERVER)

from fairlimit._proto.envoy.service.rate_limit_quota.v3 import rlqs_pb2  # noqa: E402
from fairlimit.config.loader import load  # noqa: E402
from fairlimit.core.rules import Loaded  # noqa: E402
from fairlimit.grpc_api import rlqs  # noqa: E402
from fairlimit.quota import QuotaService, QuotaStream, Usage  # noqa: E402
from fairlimit.store.memory import MemoryStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = (ROOT / "descriptors" / "rlqs" / "many-clients.yaml").read_text()


class Clock:
    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def now(self) -> float:
        return self.t


CAPS = 50


def _route(i: int, caps: int) -> str:
    return "public" if caps == 1 else f"r{i % caps}"


def _config(caps: int) -> str:
    if caps == 1:
        return CONFIG
    rule = CONFIG.split("descriptors:\n", 1)[1]
    rules = "".join(rule.replace("value: public", f"value: r{i}") for i in range(caps))
    return "domain: edge\ndescriptors:\n" + rules


def _usage(n: int, round_: int, caps: int = 1) -> list[Usage]:
    """Every client's 5 s of usage on one Envoy: a spread of demands, some above the share,
    reported as denied (an allowed count past what its token bucket can let through would
    be cut, and logged)."""
    out = []
    for i in range(n):
        asked = 5 + (i * 7 + round_) % 120  # 1-25/s per Envoy
        out.append(Usage({"route": _route(i, caps), "client_id": f"c{i}"}, 0, asked))
    return out


def _payload(usages: list[Usage]) -> bytes:
    """The report as Envoy encodes it."""
    message = rlqs_pb2.RateLimitQuotaUsageReports(domain="edge")
    for u in usages:
        line = message.bucket_quota_usages.add()
        line.bucket_id.bucket.update(u.bucket)
        line.num_requests_allowed, line.num_requests_denied = u.allowed, u.denied
        line.time_elapsed.seconds = 5
    return message.SerializeToString()


class Served:
    """The RLQS servicer's side of one Envoy's stream: its reports parsed, its responses
    encoded (``grpc_api/rlqs.py``; a baseline without ``Wire`` through its functions)."""

    def __init__(self, service: QuotaService) -> None:
        self.service = service
        self.sent: list[Sequence[Any]] = []
        self.stream = service.open(self.sent.append)
        self.wire = rlqs.Wire(self.stream) if hasattr(rlqs, "Wire") else None

    def parse(self, payload: bytes) -> tuple[str, Sequence[Usage]]:
        if self.wire is not None:
            domain, lines = self.wire.usages(payload)
            return domain, lines
        message = rlqs_pb2.RateLimitQuotaUsageReports.FromString(payload)
        return message.domain, rlqs.usages_from_proto(message)

    def encode(self) -> int:
        """Encode what was sent since the last call; the bytes."""
        sent, self.sent[:] = list(self.sent), []
        if self.wire is not None:
            return sum(len(self.wire.response(actions)) for actions in sent)
        return sum(len(rlqs.response_to_proto(a).SerializeToString()) for a in sent)


def _loaded(caps: int) -> Loaded:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rlqs.yaml"
        path.write_text(_config(caps))
        return load([str(path)])


async def _measured(n: int, caps: int) -> tuple[Clock, QuotaService, list[QuotaStream]]:
    """Two Envoys holding the n clients spread over ``caps`` caps, each client's demand
    measured (three reports each)."""
    loaded = _loaded(caps)
    clock = Clock()
    # caps raised: this measures the division's cost, past the default caps
    room = 2 * n + 10
    service = QuotaService(lambda: loaded, MemoryStore(), clock.now,
                           max_buckets_per_stream=room, max_buckets=room)  # fmt: skip
    envoys = [service.open(lambda actions: None) for _ in range(2)]
    for round_ in range(3):
        clock.t += 5.0
        for envoy in envoys:
            await service.report(envoy, "edge", _usage(n, round_, caps))
    return clock, service, envoys


async def _timed(service: QuotaService, stream: QuotaStream, usage: list[Usage]) -> float:
    """CPU seconds of one report."""
    started = time.process_time()
    await service.report(stream, "edge", usage)
    return time.process_time() - started


async def subscribe(n: int) -> float:
    """CPU ms of the report of one new bucket, next to n clients under CAPS caps."""
    clock, service, envoys = await _measured(n, CAPS)
    times = []
    for k in range(5):
        clock.t += 1.0  # past the division gap
        usage = [Usage({"route": "r0", "client_id": f"new-{k}"}, 1, 0)]
        times.append(await _timed(service, envoys[0], usage))
    return statistics.median(times) * 1000


async def measure(n: int) -> tuple[float, float, float, tuple[float, float, float]]:
    """CPU ms of a periodic report of n clients under one cap, beside a second Envoy's, of
    the division in it (the rest: taking the report's lines), of such a report listing
    its buckets in another order than the last (Envoy lists them in the same order report
    after report, until a new bucket reshuffles its map), and of the servicer's whole part
    of the first (parsing, taking, encoding the responses; and its parsing and encoding)."""
    loaded = _loaded(1)
    clock = Clock()
    room = 2 * n + 10
    service = QuotaService(lambda: loaded, MemoryStore(), clock.now,
                           max_buckets_per_stream=room, max_buckets=room)  # fmt: skip
    envoys = [Served(service) for _ in range(2)]
    for round_ in range(3):
        clock.t += 5.0
        payload = _payload(_usage(n, round_))
        for envoy in envoys:
            await service.report(envoy.stream, *envoy.parse(payload))
            envoy.encode()
    division = service.divider._division
    spent: list[float] = []

    def timed_division(*args: Any) -> Iterator[None]:
        started = time.process_time()
        yield from division(*args)
        spent.append(time.process_time() - started)

    service.divider._division = timed_division  # type: ignore[method-assign,assignment]
    times, divisions, shuffled, served, parsing, encoding = [], [], [], [], [], []
    for round_ in range(3, 13):
        clock.t += 5.0
        usage = _usage(n, round_)
        await service.report(envoys[1].stream, *envoys[1].parse(_payload(usage)))
        if round_ >= 8:  # each in another order than the last: every line keyed
            random.Random(round_).shuffle(usage)
        payload = _payload(usage)
        for envoy in envoys:
            envoy.encode()
        started = time.process_time()
        domain, lines = envoys[0].parse(payload)
        parsed = time.process_time()
        await service.report(envoys[0].stream, domain, lines)
        taken = time.process_time()
        for envoy in envoys:
            envoy.encode()
        if round_ >= 8:
            shuffled.append(taken - parsed)
            continue
        times.append(taken - parsed)
        divisions.append(spent[-1])
        served.append(time.process_time() - started)
        parsing.append(parsed - started)
        encoding.append(served[-1] - (taken - started))
    ms = [statistics.median(x) * 1000
          for x in (times, divisions, shuffled, served, parsing, encoding)]  # fmt: skip
    return ms[0], ms[1], ms[2], (ms[3], ms[4], ms[5])


def main() -> None:
    sizes = [int(x) for x in sys.argv[1:]] or [10_000, 50_000]
    print(f"fairlimit from {_SERVER}")
    for n in sizes:
        ms, division, shuffled, served = asyncio.run(measure(n))
        print(f"RLQS division after a report, {n} clients x 2 Envoys: {ms:.0f} ms CPU "
              f"(median of 5; the division {division:.0f} ms of it)")  # fmt: skip
        print(f"  the same report listing its buckets in another order: {shuffled:.0f} ms CPU")
        print(f"  the servicer's part (report parsed, taken, responses encoded): {served[0]:.0f}"
              f" ms CPU (parsing {served[1]:.0f} ms, encoding {served[2]:.0f} ms)")  # fmt: skip
        ms = asyncio.run(subscribe(n))
        print(f"  a new bucket's report beside them, spread over {CAPS} caps: {ms:.1f} ms CPU")


if __name__ == "__main__":
    main()
