"""RLQS end to end: two real Envoys (rate_limit_quota filter) sharing one real fairlimit, and
two Envoys each on its own fairlimit process (two workers each) sharing one Redis.

examples/envoy/rlqs.yaml and rlqs-descriptors.yaml as shipped (ports substituted): a cap of
100/s with fair_share over per-client limits of 50/s. A greedy client offers 150/s and four
modest clients 15/s each, every client spread evenly over both Envoys. Max-min: the modest
clients get all they ask (15/s), the greedy one the rest, 40/s.

Envoy 1.40 reports usage every 5 s (I), so the run lasts four intervals: assignments follow
the measured demand after the first, and shares are measured from the end of the second.
"""

import asyncio
import json
import math
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest

from envoy_proxy import envoy_binary, envoy_in_front, http_get
from fairlimit.core.quota import HEADROOM, HEADROOM_FLOOR, MAX_DEPTH_SECONDS, depth_of
from redis_servers import RedisProcess
from servers import ROOT, fairlimit_server, free_port

pytestmark = pytest.mark.process

EXAMPLES = ROOT / "examples" / "envoy"
CAP, LIMIT, INTERVAL = 100.0, 50.0, 5.0
GREEDY, MODEST = 150.0, 15.0
MODEST_CLIENTS = [f"modest-{i}" for i in range(4)]
ENVOYS = 2
RUN, STEADY_FROM = 20.5, 2 * INTERVAL
Result = tuple[float, str, int]  # (sent, seconds from the start; client; HTTP status)


def stated_bound() -> float:
    """The most one 1 s window may admit once assignments follow demand, per docs/rlqs.md:
    C + H + the buckets' depth.

    H is the headroom of the clients below their share (d_e·HEADROOM + HEADROOM_FLOOR per
    Envoy); the depth is what every token bucket can hold when it is (re)filled.
    """
    per_envoy = MODEST / ENVOYS
    modest_rate = per_envoy * (1 + HEADROOM) + HEADROOM_FLOOR
    headroom = len(MODEST_CLIENTS) * ENVOYS * (modest_rate - per_envoy)
    greedy_rate = (CAP - MODEST * len(MODEST_CLIENTS)) / ENVOYS
    depth = len(MODEST_CLIENTS) * ENVOYS * depth_of(modest_rate, False, INTERVAL)
    depth += ENVOYS * depth_of(greedy_rate, True, INTERVAL)
    return CAP + headroom + depth


async def drive(urls: list[str], rates: dict[str, float], seconds: float) -> list[Result]:
    """Every client sends at its rate on a fixed schedule, alternating Envoys, for ``seconds``."""
    loop = asyncio.get_running_loop()
    results: list[Result] = []
    connector = aiohttp.TCPConnector(limit=400)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = loop.time()

        async def one(client: str, url: str) -> None:
            sent = loop.time() - start  # when it really went out, late if the loop lagged
            try:
                async with session.get(url, headers={"x-client-id": client}) as response:
                    await response.read()
                    results.append((sent, client, response.status))
            except aiohttp.ClientError:
                results.append((sent, client, 0))

        async def client(name: str, rate: float) -> None:
            calls = []
            for k in range(math.floor(seconds * rate)):
                # A load generator's schedule, not a wait for a condition: request k goes
                # out at k/rate. A client within its limit skips it once half an interval
                # late: a loaded machine held the loop for up to a second, and the requests
                # due meanwhile went out at once after it, a burst no steady client sends,
                # which emptied a modest client's token bucket, so that its next requests,
                # on time, were refused (9 of 132). One over its limit is refused past its
                # share whatever its pace: it catches up.
                due = start + k / rate
                await asyncio.sleep(max(0.0, due - loop.time()))
                if rate <= LIMIT and loop.time() - due > 0.5 / rate:
                    continue
                calls.append(asyncio.create_task(one(name, urls[k % len(urls)])))
            await asyncio.gather(*calls)

        await asyncio.gather(*(client(n, r) for n, r in rates.items()))
    return results


def admitted_per_window(results: list[Result]) -> Counter[int]:
    return Counter(math.floor(sent) for sent, _, status in results if status == 200)


class TestExample:
    def test_envoy_accepts_the_rlqs_example(self, tmp_path: Path) -> None:
        """envoy --mode validate loads examples/envoy/rlqs.yaml (rate_limit_quota filter)."""
        command = [envoy_binary(), "--mode", "validate", "--disable-hot-restart",
                   "--log-level", "error", "-c", str(EXAMPLES / "rlqs.yaml")]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "OK" in proc.stdout


RATES = {"greedy": GREEDY, **dict.fromkeys(MODEST_CLIENTS, MODEST)}
CONFIG = str(EXAMPLES / "rlqs-descriptors.yaml")


def unbunched(results: list[Result]) -> list[Result]:
    """The requests that went out at least half their client's interval after its one
    before: not in a bunch that a loaded machine's lag made of requests the test's loop held
    back (a burst no client at a steady rate sends, which its token bucket may refuse: 5 of a
    modest client's 307 in one run, all sent at once 3.45 s in)."""
    last: dict[str, float] = {}
    out = []
    for result in sorted(results):
        sent, client, _ = result
        if sent - last.get(client, -math.inf) >= 0.5 / RATES[client]:
            out.append(result)
        last[client] = sent
    return out


def check_shares(results: list[Result]) -> None:
    """Modest clients >= 99% success (of the requests not sent in a bunch); every 1 s window
    within the stated bound; from two intervals on, each modest client within 5% of what it
    sent, the greedy one at least 95% of its max-min share, and the cap held within 5%."""
    rates = RATES
    spaced = unbunched(results)
    sent = Counter(client for _, client, _ in spaced)
    ok = Counter(client for _, client, status in spaced if status == 200)
    assert {status for _, _, status in results} <= {200, 429}
    for name in MODEST_CLIENTS:
        # a third at least spaced (115 of 307 in a run of the e2e folder under -n 2 and load)
        assert sent[name] >= MODEST * RUN / 3, (name, sent[name])
        denied = [round(t, 2) for t, c, st in spaced if c == name and st != 200]
        assert ok[name] / sent[name] >= 0.99, (name, ok[name], sent[name], denied[:40])

    windows = admitted_per_window(results)
    bound = stated_bound()
    # The first second: every bucket is new and starts full, with up to 1 s of its
    # (provisional) bound, so newcomers may pass the cap by one second of their bounds.
    first = CAP + ENVOYS * len(rates) * LIMIT * MAX_DEPTH_SECONDS
    assert windows[0] <= first, (sorted(windows.items()), first)
    later = max(n for w, n in windows.items() if w > 0)
    assert later <= bound, (sorted(windows.items()), bound)

    # Max-min of what was sent: a loaded machine sends fewer requests than the schedule's
    # (drive skips those it is late for). The modest clients get all they sent; the greedy
    # one at least its share at the schedule's demand (40/s; 39.4/s in a run whose modest
    # clients sent 11.5/s each), and the rest of the cap, at most: the sum's bound. Not 5%
    # over its share: the division follows the demand reported an interval before, so an
    # interval a loaded machine's lag thinned the modest clients' requests in gives the
    # greedy one more in the next, as they come back (43.3/s and 44.4/s in two such runs,
    # the cap held within 5%).
    steady = [(s, c, st) for s, c, st in results if STEADY_FROM <= s < RUN - 0.5]
    span = RUN - 0.5 - STEADY_FROM
    got = Counter(c for _, c, st in steady if st == 200)
    asked = Counter(c for _, c, _ in steady)
    figures = {name: got[name] / span for name in rates}
    offered = {name: asked[name] / span for name in rates}
    for name in MODEST_CLIENTS:
        assert figures[name] == pytest.approx(offered[name], rel=0.05), (figures, offered)
        assert offered[name] >= MODEST / 3, offered  # as check_shares asks of what was sent
    rest = CAP - sum(figures[name] for name in MODEST_CLIENTS)
    assert offered["greedy"] > 1.5 * rest, offered  # it asks for more than is left
    share = CAP - MODEST * len(MODEST_CLIENTS)
    assert figures["greedy"] >= 0.95 * share, (figures, offered)
    assert sum(figures.values()) <= CAP * 1.05, figures


class TestTwoEnvoys:
    def test_greedy_and_modest_clients_share_the_cap_max_min(self, tmp_path: Path) -> None:
        """Both Envoys on one fairlimit: the shares of check_shares."""
        with (
            fairlimit_server("--config", CONFIG) as server,
            envoy_in_front(server.grpc_port, tmp_path, example=EXAMPLES / "rlqs.yaml") as one,
            envoy_in_front(server.grpc_port, tmp_path, example=EXAMPLES / "rlqs.yaml") as two,
        ):
            results = asyncio.run(drive([one.url, two.url], RATES, RUN))
        check_shares(results)


class TestReplicas:
    def test_two_replicas_on_one_redis_share_the_cap_as_one(
        self, tmp_path: Path, redis_server: RedisProcess
    ) -> None:
        """Two fairlimit processes with two workers each on one Redis, each Envoy's stream
        on its own process: every process divides the cap over both Envoys' demand
        (quota/peers.py), so the shares are check_shares', not twice the cap."""
        with redis_server.client() as client:
            client.flushall()
        backend = ("--backend", redis_server.url + "?timeout=1", "--workers", "2")
        with (
            fairlimit_server("--config", CONFIG, *backend) as a,
            fairlimit_server("--config", CONFIG, *backend) as b,
            envoy_in_front(a.grpc_port, tmp_path, example=EXAMPLES / "rlqs.yaml") as one,
            envoy_in_front(b.grpc_port, tmp_path, example=EXAMPLES / "rlqs.yaml") as two,
        ):
            results = asyncio.run(drive([one.url, two.url], RATES, RUN))
        check_shares(results)


class TestStreamDrop:
    def test_envoy_keeps_its_assignment_while_fairlimit_is_away_and_resubscribes(
        self, tmp_path: Path
    ) -> None:
        """fairlimit stops: Envoy's stream ends, and it goes on enforcing the greedy client's
        50/s (its TTL of 15 s has not run out; then reuse_last_assignment would). fairlimit
        starts again on the same port: Envoy reopens the stream at its next report."""
        port = free_port()
        config = ("--config", str(EXAMPLES / "rlqs-descriptors.yaml"), "--grpc-addr",
                  f"127.0.0.1:{port}")  # fmt: skip
        with envoy_in_front(port, tmp_path, example=EXAMPLES / "rlqs.yaml") as envoy:
            with fairlimit_server(*config):
                before = asyncio.run(drive([envoy.url], {"greedy": GREEDY}, 2.0))
            away = asyncio.run(drive([envoy.url], {"greedy": GREEDY}, 3.0))
            with fairlimit_server(*config) as server:
                streams = self._wait_for_stream(server.admin_port, envoy.url)
        # Before: limited, but by how much depends on how long the first assignment took
        # (ALLOW_ALL until it lands), so only the outage is measured. Away: 50/s plus what
        # the bucket held (at most 1 s of it), and a few answered as fairlimit stopped.
        assert any(st == 429 for _, _, st in before)
        slack = LIMIT * MAX_DEPTH_SECONDS + 10
        passed = sum(st == 200 for _, _, st in away)
        assert 0.8 * 3 * LIMIT <= passed <= 3 * LIMIT + slack, passed
        (stream,) = streams
        assert [b["bucket"]["client_id"] for b in stream["buckets"]] == ["greedy"]

    @staticmethod
    def _wait_for_stream(admin_port: int, url: str) -> list[dict[str, object]]:
        """Poll /rlconfig (sending a request now and then) until Envoy's stream is back."""
        deadline = time.monotonic() + 20  # Envoy 1.40 reports every 5 s
        while time.monotonic() < deadline:
            http_get(url, {"x-client-id": "greedy"})
            _, _, body = http_get(f"http://127.0.0.1:{admin_port}/rlconfig")
            streams: list[dict[str, object]] = json.loads(body)["rlqs"]["streams"]
            if streams and streams[0]["buckets"]:
                return streams
            time.sleep(0.2)  # a poll of the admin endpoint, not a wait for time to pass
        raise AssertionError("Envoy did not reopen its RLQS stream within 20 s")


class TestHostileBucketId:
    def test_a_client_id_that_is_no_utf8_keeps_the_stream(self, tmp_path: Path) -> None:
        """A client sends x-client-id with a byte 0xFF; Envoy puts it in the bucket id as it
        came. fairlimit ended the stream on that report (INVALID_ARGUMENT), and Envoy's next
        stream likewise: every bucket of that Envoy was left to its expired and then its
        no_assignment_behavior (ALLOW_ALL in the example). Now the stream stays open, the
        other clients stay assigned, and Envoy resets nothing."""
        with (
            fairlimit_server("--config", CONFIG) as server,
            envoy_in_front(server.grpc_port, tmp_path, example=EXAMPLES / "rlqs.yaml") as envoy,
        ):
            rlconfig = f"http://127.0.0.1:{server.admin_port}/rlconfig"
            hostile = "hostile-\xff"  # urllib sends U+00FF as the byte 0xFF
            held: list[dict[str, str]] = []
            deadline = time.monotonic() + 20  # Envoy reports a new bucket at once, or at 5 s
            while time.monotonic() < deadline and len(held) < 2:
                for client in ("greedy", hostile):
                    http_get(envoy.url, {"x-client-id": client})
                streams = json.loads(http_get(rlconfig)[2])["rlqs"]["streams"]
                held = [b["bucket"] for s in streams for b in s["buckets"]]
                time.sleep(0.2)  # polls the server's state; asserts no duration
            assert len(held) == 2, f"the stream holds {held}"
            time.sleep(1.0)  # Envoy read the response to that report meanwhile (or reset)
            streams = json.loads(http_get(rlconfig)[2])["rlqs"]["streams"]
            url = f"http://127.0.0.1:{envoy.admin}/stats?format=json&filter=fairlimit.upstream_rq"
            stats = {s["name"]: s.get("value") for s in json.loads(http_get(url)[2])["stats"]
                     if "name" in s}  # fmt: skip
        assert len(streams) == 1
        assert stats["cluster.fairlimit.upstream_rq_tx_reset"] == 0
        assert stats["cluster.fairlimit.upstream_rq_total"] == 1
        clients = sorted(b["bucket"]["client_id"] for b in streams[0]["buckets"])
        assert clients[0] == "greedy" and "sha256:" in clients[1]


class TestBucketsPastTheCaps:
    def test_a_new_client_past_the_bucket_cap_is_held_to_its_limit(self, tmp_path: Path) -> None:
        """--rlqs-max-buckets-per-stream 3, and three made-up ids fill the stream's room: a
        new client's bucket is refused (not tracked). It was sent no assignment, so the
        example's no_assignment_behavior (ALLOW_ALL) let all its requests through (150 of
        150 in 0.15 s, docs/rlqs.md). Now it is sent a new bucket's assignment, its own
        50/s (a token bucket a second deep, full): of 300 requests sent as fast as one
        connection goes, at most 50 and 50/s more pass."""
        with (
            fairlimit_server("--config", CONFIG, "--rlqs-max-buckets-per-stream", "3") as server,
            envoy_in_front(server.grpc_port, tmp_path, example=EXAMPLES / "rlqs.yaml") as envoy,
        ):
            rlconfig = f"http://127.0.0.1:{server.admin_port}/rlconfig"

            deadline = time.monotonic() + 20  # Envoy reports a new bucket at once, or at 5 s
            refused = 0
            while time.monotonic() < deadline and not refused:
                for client in ("made-0", "made-1", "made-2", "late"):
                    http_get(envoy.url, {"x-client-id": client})
                found: list[dict[str, Any]] = json.loads(http_get(rlconfig)[2])["rlqs"]["streams"]
                refused = sum(cast(int, s["buckets_refused_in_last_report"]) for s in found)
                time.sleep(0.2)  # polls the server's state; asserts no duration
            assert refused, f"no bucket was refused: {found}"
            held = sorted(b["bucket"]["client_id"] for s in found for b in s["buckets"])
            assert held == ["made-0", "made-1", "made-2"]
            time.sleep(0.5)  # the assignment left with that report's response; Envoy applies it
            start = time.monotonic()
            statuses = Counter(http_get(envoy.url, {"x-client-id": "late"})[0] for _ in range(300))
            elapsed = time.monotonic() - start
        bound = LIMIT * MAX_DEPTH_SECONDS + LIMIT * elapsed + 2
        assert bound < 300, f"300 requests took {elapsed:.1f} s: too slow to tell"
        assert statuses[200] <= bound, (statuses, elapsed)
        assert statuses[200] + statuses[429] == 300, statuses
