"""End to end: a burst on an Envoy that has just started, as the quick start runs it.

A fresh Envoy opens its rate-limit streams to fairlimit before it has read fairlimit's HTTP/2
SETTINGS. With SETTINGS_MAX_CONCURRENT_STREAMS at 16 (the old default), each stream past 16
was reset (REFUSED_STREAM); Envoy does not retry it, counts ratelimit.error and, failing open,
lets the request through: 200 requests at once from a client allowed 10 a minute got 140-195
200s (issue 37).

A larger burst failed twice over: Envoy's default circuit breaker failed every call past 1,024
in flight on the fairlimit cluster, and grpc, in front of fairlimit's own queue, cancelled
calls at random once 1,000 waited to be taken up; fairlimit counted neither. The first burst
of 2,000 requests at once let 840 through unlimited with the breaker's default, and 9-124 in
three runs with grpc's.
"""

import asyncio
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from envoy_proxy import EXAMPLE, EnvoyProcess, burst, envoy_in_front
from servers import ServerProcess, fairlimit_server

pytestmark = pytest.mark.process

QUICKSTART = EXAMPLE.parent / "descriptors" / "quickstart.yaml"  # alice: 10 a minute
BURST = 200
LARGE_BURST = 2000  # past Envoy's default circuit breaker (1,024) and grpc's pending calls (1,000)
# A burst that large takes a loaded 2-core machine longer than the example's 0.25 s: a call
# timed out is slowness, not the refusal this test looks for.
PATIENT = {"timeout: 0.25s": "timeout: 30s"}


def _answered(envoy: EnvoyProcess) -> tuple[int, int]:
    """Envoy's rate-limit calls answered OK and OVER_LIMIT (the route's cluster is "ok")."""
    return envoy.stat("cluster.ok.ratelimit.ok"), envoy.stat("cluster.ok.ratelimit.over_limit")


def _all_answered(envoy: EnvoyProcess, server: ServerProcess) -> None:
    """Envoy counted no failed rate-limit call; else say why, as Envoy and fairlimit saw it
    (a CI run once counted 7: fairlimit had ended calls of a burst, issue 41's stop)."""
    try:
        envoy.assert_no_failed_calls()
    except AssertionError as failed:
        refused = {
            (labels["kind"], labels["reason"]): value
            for labels, value in server.samples("fairlimit_rpc_refused_total")
            if value
        }
        raise AssertionError(f"{failed}\nfairlimit refused {refused}") from None


# The large burst's sockets: the client's 2,000 and Envoy's as many plus its upstream ones
# (Envoy inherits the limit from this process).
OPEN_FILES = 8192


@pytest.fixture
def open_files() -> Iterator[None]:
    """A soft limit of open files that holds a 2,000-connection burst (often 1,024); root
    may raise the hard limit too. Put back afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max(soft, OPEN_FILES)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, max(hard, wanted)))
    except (ValueError, OSError) as exc:
        limit = f"{soft}/{hard}"
        raise AssertionError(f"cannot open {OPEN_FILES} files (limit {limit}): {exc}") from exc
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, max(hard, wanted)))


class TestFreshEnvoy:
    def test_a_burst_at_start_and_one_a_second_later_are_all_limited(self, tmp_path: Path) -> None:
        """200 requests at once on a just-started Envoy, then 200 more 1 s later: every
        rate-limit call is answered (Envoy's ratelimit.error and failure_mode_allowed stay
        0), and alice gets exactly her 10 200s."""
        _two_bursts_limited(tmp_path, BURST)

    @pytest.mark.usefixtures("open_files")
    def test_a_burst_of_two_thousand_is_limited(self, tmp_path: Path) -> None:
        """The same with 2,000 requests at once (Envoy's timeout raised, see PATIENT)."""
        _two_bursts_limited(tmp_path, LARGE_BURST, PATIENT)


def _two_bursts_limited(tmp_path: Path, n: int, edits: dict[str, str] | None = None) -> None:
    """``n`` requests from alice at once on a just-started Envoy, ``n`` more 1 s later:
    every call answered, alice's 10 a minute and no more let through."""
    for _ in range(3):  # a minute boundary between the bursts spoils an attempt
        with (
            fairlimit_server("--config", str(QUICKSTART)) as server,
            envoy_in_front(server.grpc_port, tmp_path, edits) as envoy,
        ):
            minute = time.time() // 60
            first = asyncio.run(burst(envoy.url, n, seconds=60))
            _all_answered(envoy, server)
            time.sleep(1)  # the second burst, on connections Envoy has open
            second = asyncio.run(burst(envoy.url, n, seconds=60))
            _all_answered(envoy, server)
            answered = _answered(envoy)
            straddled = time.time() // 60 != minute
        assert sum(answered) == 2 * n  # every call answered OK or OVER_LIMIT
        if straddled:
            continue
        assert answered == (10, 2 * n - 10)
        assert first == {200: 10, 429: n - 10}
        assert second == {429: n}
        return
    raise AssertionError("three attempts straddled minute boundaries")
