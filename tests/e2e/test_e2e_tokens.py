"""End to end: HTTP -> a real Envoy (examples/envoy/llm-tokens.yaml) -> a real fairlimit
(llm-tokens-descriptors.yaml), with a small fake LLM on 127.0.0.1 that holds each stream
until released and reports its usage in x-tokens-used (and x-tokens-unused).

Ten parallel streams from one tenant, each reserving x-max-tokens = 4000 of its 20 000 an
hour: five fit, five are refused while the five run; once they end, the tenant's counter is
exactly the tokens the five really used (settled: unused given back, excess charged). The
Envoy-native style (is_negative_hits with x-tokens-unused) gives back the unused part only.

Then the shipped example against the shipped stand-in LLM (examples/llm/stand-in-llm.py, run
as a user runs it): every x-max-tokens a client can send either reserves (and is settled at
its real cost) or is refused; an upstream that fails in each way gives its whole
reservation back; a stream reports its usage in its last event or a trailer. Envoy's own
ratelimit.error and ratelimit.failure_mode_allowed stay 0 and its log never says
"Invalid hits_addend"; fairlimit's /tokens shows each tenant's counter at exactly the tokens
served and nothing left reserved.

Waits are events or bounded polls of Envoy's counters; no duration is asserted.
"""

import http.client
import http.server
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from envoy_proxy import EnvoyProcess, bootstrap, envoy_on, http_get
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from servers import ROOT, fairlimit_server, free_port

pytestmark = pytest.mark.process

EXAMPLE = ROOT / "examples" / "envoy" / "llm-tokens.yaml"
DESCRIPTORS = ROOT / "examples" / "envoy" / "llm-tokens-descriptors.yaml"
BUDGET = 20_000  # the tenant's tokens an hour (llm-tokens-descriptors.yaml)
DEFAULT = 1000  # its reservation.default
ESTIMATE = 4000  # x-max-tokens of every stream: five fit in the budget
# The real cost of each stream: some under the estimate, two above it (debt); any five sum
# to at most 18 500, under the budget, so the counter shows them all.
COSTS = (1000, 1500, 2000, 2500, 3000, 3500, 4500, 5000, 1200, 800)
DEADLINE = 30.0
NEGATIVE = {
    'hits_addend: {format: "%DYNAMIC_METADATA(fairlimit:used)%"}':
        'hits_addend: {format: "%RESP(x-tokens-unused)%", is_negative_hits: true}',
}  # fmt: skip


class FakeLLM(http.server.ThreadingHTTPServer):
    """Answers each request once released, with x-tokens-used = x-simulated-tokens and
    x-tokens-unused = x-max-tokens minus that (at least 0)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.release = threading.Event()
        self.arrived = 0
        self.lock = threading.Lock()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeLLM

    def do_GET(self) -> None:
        with self.server.lock:
            self.server.arrived += 1
        self.server.release.wait(DEADLINE)
        used = int(self.headers.get("x-simulated-tokens", "0"))
        unused = max(0, int(self.headers.get("x-max-tokens", "0")) - used)
        body = b"completion\n"
        self.send_response(200)
        self.send_header("x-tokens-used", str(used))
        self.send_header("x-tokens-unused", str(unused))
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def fake_llm() -> Iterator[FakeLLM]:
    server = FakeLLM()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()


def _rls_calls(proxy: EnvoyProcess) -> int:
    return proxy.stat("cluster.fairlimit.upstream_rq_completed")


def _wait(condition: object, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)  # a poll interval, not a wait for an outcome


def _remaining(grpc_port: int, tenant: str) -> int:
    """The tenant's tokens left this hour, by a check that charges nothing."""
    entries = [{"key": "provider", "value": "llm"}, {"key": "tenant", "value": tenant}]
    descriptor = rls_pb2.RateLimitRequest(domain="edge", descriptors=[{"entries": entries}])
    descriptor.descriptors[0].hits_addend.value = 0
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        answer = rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(descriptor, timeout=5)
    return int(answer.statuses[0].limit_remaining)


def _streams(proxy: EnvoyProcess, llm: FakeLLM, tenant: str, grpc_port: int,
             negative: bool = False) -> tuple[list[tuple[int, int]], int]:  # fmt: skip
    """The ten streams at once: (status, real cost) each, and the tenant's tokens left
    while the admitted ones were still running."""
    out: list[tuple[int, int]] = []
    lock = threading.Lock()

    def one(cost: int) -> None:
        headers = {"x-tenant": tenant, "x-max-tokens": str(ESTIMATE),
                   "x-simulated-tokens": str(cost)}  # fmt: skip
        status = http_get(proxy.url, headers)[0]
        with lock:
            out.append((status, cost))

    threads = [threading.Thread(target=one, args=(cost,)) for cost in COSTS]
    for thread in threads:
        thread.start()
    _wait(lambda: llm.arrived + len(out) == len(COSTS), "the streams did not all arrive")
    during = _remaining(grpc_port, tenant)
    llm.release.set()
    for thread in threads:
        thread.join(DEADLINE)
    # the stream-done calls: one per admitted stream, and one per refused one too (the Lua
    # filter reports 0 used for a 429; fairlimit finds no reservation to settle), except
    # with negative hits, where a 429 has no x-tokens-unused and so no call
    admitted = sum(1 for status, _ in out if status == 200)
    calls = len(COSTS) + admitted + (0 if negative else len(COSTS) - admitted)
    _wait(lambda: _rls_calls(proxy) >= calls, "stream-done calls missing")
    return out, during


@contextmanager
def _stack(tmp_path: Path, edits: dict[str, str] | None = None
           ) -> Iterator[tuple[EnvoyProcess, FakeLLM, int]]:  # fmt: skip
    with fake_llm() as llm, fairlimit_server("--config", str(DESCRIPTORS)) as server:
        text = bootstrap(EXAMPLE, {"port_value: 8000": f"port_value: {llm.server_port}",
                                   **(edits or {})})  # fmt: skip
        with envoy_on(text, server.grpc_port, tmp_path) as proxy:
            yield proxy, llm, server.grpc_port


class TestTenParallelStreams:
    def test_without_x_max_tokens_the_default_is_reserved(self, tmp_path: Path) -> None:
        """No x-max-tokens: the Lua filter sends 0, and fairlimit reserves
        reservation.default (1000) for each of three held streams; settled, the counter is
        what they used (100 each)."""
        with _stack(tmp_path) as (proxy, llm, grpc_port):
            out: list[int] = []
            lock = threading.Lock()

            def one() -> None:
                status = http_get(proxy.url, {"x-tenant": "t3", "x-simulated-tokens": "100"})[0]
                with lock:
                    out.append(status)

            threads = [threading.Thread(target=one) for _ in range(3)]
            for thread in threads:
                thread.start()
            _wait(lambda: llm.arrived == len(threads), "the requests did not arrive")
            during = _remaining(grpc_port, "t3")
            llm.release.set()
            for thread in threads:
                thread.join(DEADLINE)
            _wait(lambda: _rls_calls(proxy) >= 2 * len(threads), "stream-done calls missing")
            after = _remaining(grpc_port, "t3")
        assert out == [200] * len(threads)
        assert BUDGET - during == DEFAULT * len(threads)  # the default, reserved
        assert BUDGET - after == 100 * len(threads)

    def test_reserved_while_running_and_exact_once_settled(self, tmp_path: Path) -> None:
        """Five of ten fit (4000 each of 20 000); while they run the counter holds their
        reservations; settled, it holds what they really used (two used more than their
        estimate: that is charged too). The overspend is no more than real minus reserved."""
        with _stack(tmp_path) as (proxy, llm, grpc_port):
            assert _remaining(grpc_port, "t1") == BUDGET
            results, during = _streams(proxy, llm, "t1", grpc_port)
            after = _remaining(grpc_port, "t1")
        admitted = [cost for status, cost in results if status == 200]
        refused = [cost for status, cost in results if status == 429]
        assert (len(admitted), len(refused)) == (BUDGET // ESTIMATE, len(COSTS) - 5)
        assert during == BUDGET - len(admitted) * ESTIMATE  # the reservations, all visible
        assert BUDGET - after == sum(admitted)  # settled: exactly the tokens really used
        overspend = max(0, sum(admitted) - BUDGET)
        assert overspend <= max(0, sum(admitted) - len(admitted) * ESTIMATE)
        print(f"\nreserve/settle: {len(admitted)} of {len(COSTS)} admitted, reserved "
              f"{len(admitted) * ESTIMATE}, really used {sum(admitted)}, counter "
              f"{BUDGET - after} of {BUDGET}")  # fmt: skip

    def test_envoy_native_refunds_give_back_the_unused_part(self, tmp_path: Path) -> None:
        """is_negative_hits with x-tokens-unused: each admitted stream keeps min(real,
        estimate) charged; a refund never gives back more than was reserved."""
        with _stack(tmp_path, NEGATIVE) as (proxy, llm, grpc_port):
            results, during = _streams(proxy, llm, "t2", grpc_port, negative=True)
            after = _remaining(grpc_port, "t2")
        admitted = [cost for status, cost in results if status == 200]
        assert len(admitted) == BUDGET // ESTIMATE
        assert during == BUDGET - len(admitted) * ESTIMATE
        assert BUDGET - after == sum(min(cost, ESTIMATE) for cost in admitted)


# --- The shipped example against the shipped stand-in LLM (examples/llm/stand-in-llm.py) ---

STAND_IN = ROOT / "examples" / "llm" / "stand-in-llm.py"
REFUSED_BY_ENVOY = 400  # the Lua filter's answer to an x-max-tokens it cannot pass on
ROUTE_TIMEOUT = {"timeout: 600s": "timeout: 5s"}  # so that a slow LLM meets Envoy's 504
# The example gives a rate-limit call 0.25 s; on a loaded test machine the first calls (a
# cold gRPC channel) can take longer, and Envoy would let the request through (counted in
# ratelimit.error): the budget is what is under test here, not that latency.
CALL_TIMEOUT = {"timeout: 0.25s": "timeout: 5s"}


@contextmanager
def stand_in_llm() -> Iterator[int]:
    """The stand-in LLM as a user runs it, on a free port; yields the port."""
    process = subprocess.Popen([sys.executable, str(STAND_IN), "--port", "0"],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("stand-in LLM on 127.0.0.1:"), line
        yield int(line.rsplit(":", 1)[1])
    finally:
        process.terminate()
        process.wait(10)
        assert process.stdout is not None
        process.stdout.close()


class Shipped:
    """A real Envoy from llm-tokens.yaml (route timeout 5 s), a real fairlimit from
    llm-tokens-descriptors.yaml, the stand-in LLM; counts the rate-limit calls it expects."""

    def __init__(self, proxy: EnvoyProcess, admin_port: int, grpc_port: int) -> None:
        self.proxy, self.admin_port, self.grpc_port, self.calls = proxy, admin_port, grpc_port, 0
        self.lock = threading.Lock()  # requests from several threads count their calls

    def ask(self, tenant: str, headers: dict[str, str] | list[tuple[str, str]],
            body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
        """One request (``headers`` as pairs may repeat a name); waits for the rate-limit
        calls it makes (a request refused by the Lua filter makes none; any other two: the
        reservation and the settlement)."""
        pairs = list(headers.items()) if isinstance(headers, dict) else headers
        connection = http.client.HTTPConnection("127.0.0.1", self.proxy.port, timeout=10)
        try:
            connection.putrequest("POST" if body else "GET", "/")
            for name, value in [("x-tenant", tenant), *pairs]:
                connection.putheader(name, value)
            if body:
                connection.putheader("content-length", str(len(body)))
            connection.endheaders(body)
            response = connection.getresponse()
            answer = (response.status, {k.lower(): v for k, v in response.getheaders()},
                      response.read())  # fmt: skip
        finally:
            connection.close()
        with self.lock:
            self.calls += 0 if answer[0] == REFUSED_BY_ENVOY else 2
        self.settled()
        return answer

    def settled(self) -> None:
        """Until Envoy has completed every rate-limit call counted so far."""
        _wait(lambda: _rls_calls(self.proxy) >= self.calls, "rate-limit calls missing")

    def tokens(self, tenant: str) -> dict[str, object]:
        """fairlimit's /tokens for the tenant: its counter, not its fair share at the cap
        (the status Envoy sees is the share once many tenants are active)."""
        url = (f"http://127.0.0.1:{self.admin_port}/tokens?domain=edge"
               f"&entry=provider=llm&entry=tenant={tenant}")  # fmt: skip
        status, _, body = http_get(url)
        assert status == 200, body
        report: dict[str, object] = json.loads(body)
        return report

    def used(self, tenant: str) -> int:
        """The tenant's tokens charged this hour, once every call made so far is answered;
        asserts none is still reserved (every request has been settled: no budget left
        burned)."""
        self.settled()
        report = self.tokens(tenant)
        assert report["reserved"] == 0, report
        charged = report["charged"]
        assert isinstance(charged, int)
        return charged

    def assert_envoy_clean(self) -> None:
        """Envoy's own counters: every rate-limit call answered, none failed open, none
        more than expected; and its log never says it dropped an entry."""
        assert self.proxy.stat("cluster.llm.ratelimit.error") == 0
        assert self.proxy.stat("cluster.llm.ratelimit.failure_mode_allowed") == 0
        assert _rls_calls(self.proxy) == self.calls
        assert "Invalid hits_addend" not in self.proxy.log.read_text()


# One stack per class: the cap above the tenants (60,000 an hour, fair_share) divides by
# what each tenant asked this hour, so a stack shared by the whole module gave the later
# classes' tenants a share below what they ask (the header cases reserve up to 19,999
# each), depending on test order and the minute of the hour.
@pytest.fixture(scope="class")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shipped]:
    tmp_path = tmp_path_factory.mktemp("shipped")
    with stand_in_llm() as port, fairlimit_server("--config", str(DESCRIPTORS)) as server:
        text = bootstrap(EXAMPLE, {"port_value: 8000": f"port_value: {port}", **ROUTE_TIMEOUT,
                                   **CALL_TIMEOUT})  # fmt: skip
        with envoy_on(text, server.grpc_port, tmp_path) as proxy:
            yield Shipped(proxy, server.admin_port, server.grpc_port)


HEADER_CASES = [  # (x-max-tokens or None for absent, status, what the tenant is charged)
    (None, 200, 37),  # reservation.default reserved, settled at the real 37
    ("", 200, 37),
    ("0", 200, 37),  # 0: the default too
    ("4000", 200, 37),
    ("19999", 200, 37),
    ("999999999", 429, 0),  # a whole number, over the budget: fairlimit refuses it
    ("abc", 400, 0),
    ("+42", 400, 0),  # Envoy alone would read 42
    ("-1", 400, 0),
    ("1e3", 400, 0),  # Envoy alone would read 1000
    ("042", 400, 0),  # Envoy alone would read 42
    ("1.5", 400, 0),  # Envoy alone would read 1
    ("1000000000", 400, 0),  # 10^9
    ("99999999999", 400, 0),  # above 10^9: Envoy alone would drop the entry
    ("4000, 5000", 400, 0),  # two values
]


class TestEveryRequestReservesOrIsRefused:
    @pytest.mark.parametrize(("max_tokens", "status", "charged"), HEADER_CASES)
    def test_each_x_max_tokens(self, shipped: Shipped, max_tokens: str | None, status: int,
                               charged: int) -> None:  # fmt: skip
        """A request either reserves (then is settled at its real cost) or is refused: none
        reaches the LLM unbudgeted, none leaves a reservation open."""
        tenant = f"h-{HEADER_CASES.index((max_tokens, status, charged))}"
        headers = {"x-simulated-tokens": "37"}
        if max_tokens is not None:
            headers["x-max-tokens"] = max_tokens
        answer = shipped.ask(tenant, headers)
        assert answer[0] == status, answer
        assert shipped.used(tenant) == charged
        shipped.assert_envoy_clean()

    def test_two_x_max_tokens_headers_are_refused(self, shipped: Shipped) -> None:
        """Two x-max-tokens headers, each a number or not, in either order: 400."""
        for values in (("4000", "5"), ("abc", "5"), ("5", "abc")):
            pairs = [("x-max-tokens", v) for v in values]
            assert shipped.ask("two-headers", pairs)[0] == REFUSED_BY_ENVOY
        assert shipped.used("two-headers") == 0
        shipped.assert_envoy_clean()


FAILURES = [  # (x-simulated-failure, the status the client sees)
    ("500", 500),  # the provider's error, no usage reported
    ("503", 503),
    ("429", 429),  # the provider's own rate limit
    ("reset", 503),  # the connection closed before any answer: Envoy's local reply
    ("slow", 504),  # no answer before the route's timeout: Envoy's local reply
]


class TestAFailedUpstreamGivesItsReservationBack:
    @pytest.mark.parametrize(("failure", "status"), FAILURES)
    def test_nothing_generated_nothing_charged(self, shipped: Shipped, failure: str,
                                               status: int) -> None:  # fmt: skip
        """Reserved 4000, the upstream failed without reporting usage: all 4000 go back
        at once (the budget is not burned for the window), and the tenant's next requests
        pass and are charged their real cost."""
        tenant = f"fail-{failure}"
        headers = {"x-max-tokens": "4000", "x-simulated-failure": failure,
                   "x-simulated-delay": "8"}  # fmt: skip
        for _ in range(BUDGET // 4000 + 1):  # more than the budget holds if any stuck
            assert shipped.ask(tenant, headers)[0] == status
        assert shipped.used(tenant) == 0
        served = shipped.ask(tenant, {"x-max-tokens": str(BUDGET), "x-simulated-tokens": "55"})
        assert served[0] == 200
        assert shipped.used(tenant) == 55
        shipped.assert_envoy_clean()


    def test_no_llm_listening(self, shipped: Shipped, tmp_path: Path) -> None:
        """The quick start without an LLM on :8000: Envoy answers 503 (connection refused)
        to every request, and each gives its reservation back (was: five 503s burned the
        tenant's budget for the hour, then 429s)."""
        text = bootstrap(EXAMPLE, {"port_value: 8000": f"port_value: {free_port()}",
                                   **CALL_TIMEOUT})  # fmt: skip
        with envoy_on(text, shipped.grpc_port, tmp_path) as proxy:
            alone = Shipped(proxy, shipped.admin_port, shipped.grpc_port)
            for _ in range(7):
                assert alone.ask("nobody-home", {"x-max-tokens": "5000"})[0] == 503
            assert alone.used("nobody-home") == 0
            alone.assert_envoy_clean()


STREAMS = [  # (headers, body): each an OpenAI-style way of reporting usage at the end
    ({"x-simulated-stream": "sse"}, None),  # usage in the last server-sent event
    ({"content-type": "application/json"}, b'{"stream": true}'),  # the same, asked in JSON
    ({"x-simulated-stream": "trailer"}, None),  # usage in an x-tokens-used trailer
    ({"content-type": "application/json"}, b'{"stream": false}'),  # a JSON answer
]


class TestStreamsReportTheirUsageAtTheEnd:
    @pytest.mark.parametrize(("headers", "body"), STREAMS)
    def test_settled_at_the_streams_usage(self, shipped: Shipped, headers: dict[str, str],
                                          body: bytes | None) -> None:  # fmt: skip
        """The LLM's answer carries no x-tokens-used header; the Lua filter reads the usage
        at the end of the body or from the trailer, and the reservation settles at it."""
        tenant = f"stream-{STREAMS.index((headers, body))}"
        for cost in (4321, 17, 9000):
            answer = shipped.ask(tenant, {"x-max-tokens": "5000",
                                          "x-simulated-tokens": str(cost), **headers}, body)
            assert answer[0] == 200 and "x-tokens-used" not in answer[1]
            assert b'"total_tokens"' in answer[2] or headers.get("x-simulated-stream")
        assert shipped.used(tenant) == 4321 + 17 + 9000  # 9000 past its 5000: debt
        shipped.assert_envoy_clean()
