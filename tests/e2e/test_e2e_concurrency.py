"""End to end (issue 16): HTTP -> a real Envoy (examples/envoy/concurrency.yaml) with a slow
upstream (Envoy's fault filter, a fixed delay) -> a real fairlimit process serving
examples/envoy/concurrency-descriptors.yaml: 5 in flight per client, slots released by the
stream-done call, leaked slots back after max_duration.

Waits are events (a barrier, thread joins) or bounded polls of fairlimit's /metrics; no
duration is asserted except as the measured figure the report prints.
"""

import http.client
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from envoy_proxy import EnvoyProcess, bootstrap, envoy_in_front
from servers import ROOT, ServerProcess, fairlimit_server

pytestmark = pytest.mark.process

EXAMPLES = ROOT / "examples" / "envoy"
DELAY = "2s"  # the upstream's fixed delay: long enough for 15 requests to overlap
MAX_DURATION = 6  # seconds; the test's short expiry (the example says 300)
ROUTER = """                http_filters:
                  - name: envoy.filters.http.router
"""
SLOW_UPSTREAM = {
    ROUTER: f"""                http_filters:
                  - name: envoy.filters.http.fault
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault
                      delay:
                        fixed_delay: {DELAY}
                        percentage: {{numerator: 100, denominator: HUNDRED}}
                  - name: envoy.filters.http.router
"""
}
CLIENT_RULE = "edge/route=public/client_id"
# Released by negative hits (docs/concurrency.md): the same rule without request ids; the
# stream-done call gives one slot back, its hits from a header only the upstream sets.
NEGATIVE_DESCRIPTORS = f"""
domain: edge
descriptors:
  - key: route
    value: public
    descriptors:
      - key: client_id
        concurrency: {{max_in_flight: 5, max_duration: {MAX_DURATION}, released_by: negative_hits}}
"""
_EXAMPLE = (EXAMPLES / "concurrency.yaml").read_text()
_ROUTE = _EXAMPLE.index("                      rate_limits:\n")
# the route's rate_limits of the example (pairing by request id), up to the filters
ROUTE_RATE_LIMITS = _EXAMPLE[_ROUTE : _EXAMPLE.index("                http_filters:\n", _ROUTE)]
# docs/concurrency.md's Envoy side: the filter's own rate_limits (Envoy sends hits_addend
# only for those), the stream-done entry's hits from a header only the upstream sets
FILTER_RATE_LIMITS = """                      domain: edge
                      rate_limits:
                        - actions:
                            - generic_key: {descriptor_key: route, descriptor_value: public}
                            - request_headers: {header_name: x-client-id, descriptor_key: client_id}
                        - apply_on_stream_done: true
                          hits_addend: {format: "%RESP(x-upstream-done)%", is_negative_hits: true}
                          actions:
                            - generic_key: {descriptor_key: route, descriptor_value: public}
                            - request_headers: {header_name: x-client-id, descriptor_key: client_id}
"""
NEGATIVE_HITS = {
    **SLOW_UPSTREAM,
    ROUTE_RATE_LIMITS: "",
    "                      domain: edge\n": FILTER_RATE_LIMITS,
    "                          direct_response:\n": (
        "                          response_headers_to_add:\n"
        '                            - header: {key: x-upstream-done, value: "1"}\n'
        "                          direct_response:\n"
    ),
}  # fmt: skip
DEADLINE = 30.0  # every poll gives up after this (seconds)


def _descriptors(tmp_path: Path) -> Path:
    text = (EXAMPLES / "concurrency-descriptors.yaml").read_text()
    path = tmp_path / "edge.yaml"
    path.write_text(text.replace("max_duration: 300", f"max_duration: {MAX_DURATION}"))
    return path


def _in_flight(server: ServerProcess, rule: str) -> float:
    """fairlimit's fairlimit.concurrency.in_flight for ``rule``, from its /metrics."""
    url = f"http://127.0.0.1:{server.admin_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name.startswith("fairlimit_concurrency_in_flight")
                and sample.labels.get("rule") == rule
            ):
                return sample.value
    return 0.0


def _wait_in_flight(server: ServerProcess, rule: str, value: float) -> None:
    deadline = time.monotonic() + DEADLINE
    while _in_flight(server, rule) != value:
        assert time.monotonic() < deadline, (rule, _in_flight(server, rule), value)
        time.sleep(0.05)  # a poll interval, not a wait for an outcome


def _burst(
    port: int, clients: list[str], headers: dict[str, str] | None = None
) -> list[tuple[str, int]]:
    """One request per entry of ``clients``, all sent at once (a barrier), each with
    ``headers`` too; (client, status), status 0 when the connection broke."""
    barrier = threading.Barrier(len(clients))
    out: list[tuple[str, int]] = []
    lock = threading.Lock()

    def send(client: str) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE)
        status = 0
        try:
            barrier.wait(DEADLINE)
            conn.request("GET", "/", headers={**(headers or {}), "x-client-id": client})
            response = conn.getresponse()
            response.read()
            status = response.status
        except (OSError, http.client.HTTPException):
            status = 0
        finally:
            conn.close()
        with lock:
            out.append((client, status))

    threads = [threading.Thread(target=send, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
    return out


def _statuses(answers: list[tuple[str, int]], client: str) -> list[int]:
    return sorted(status for who, status in answers if who == client)


def _five_each_then_back(server: ServerProcess, envoy: EnvoyProcess) -> None:
    """12 at once from one client: 5 pass, 7 get 429, while 3 from another all pass; once
    the streams end (every stream-done call given its slot back), the first client gets 5
    again. Envoy's every rate-limit call was answered."""
    answers = _burst(envoy.port, ["heavy"] * 12 + ["light"] * 3)
    assert _statuses(answers, "heavy") == [200] * 5 + [429] * 7
    assert _statuses(answers, "light") == [200] * 3
    _wait_in_flight(server, CLIENT_RULE, 0)  # every stream-done release arrived
    again = _burst(envoy.port, ["heavy"] * 12)
    assert _statuses(again, "heavy") == [200] * 5 + [429] * 7
    assert envoy.failed_calls() == {}


class TestConcurrencyThroughEnvoy:
    def test_five_in_flight_per_client_released_at_stream_end(self, tmp_path: Path) -> None:
        """12 at once from one client: 5 pass, 7 get 429, while 3 from another all pass;
        once the streams end, the first client gets 5 again."""
        with (
            fairlimit_server("--config", str(_descriptors(tmp_path))) as server,
            envoy_in_front(server.grpc_port, tmp_path, SLOW_UPSTREAM,
                           EXAMPLES / "concurrency.yaml") as envoy,
        ):  # fmt: skip
            _five_each_then_back(server, envoy)

    def test_a_forged_request_id_takes_a_slot_each_time(self, tmp_path: Path) -> None:
        """12 at once from one client, all sending one x-request-id of its own making (a
        slot is keyed by the request id): still 5 pass and 7 get 429, since the example's
        Envoy gives each edge request an id of its own. Were the client's kept
        (use_remote_address: false), one would pass: fairlimit refuses an id already in
        flight rather than let two requests share a slot."""
        with (
            fairlimit_server("--config", str(_descriptors(tmp_path))) as server,
            envoy_in_front(server.grpc_port, tmp_path, SLOW_UPSTREAM,
                           EXAMPLES / "concurrency.yaml") as envoy,
        ):  # fmt: skip
            answers = _burst(envoy.port, ["forger"] * 12, {"x-request-id": "forged-1"})
            assert _statuses(answers, "forger") == [200] * 5 + [429] * 7
            _wait_in_flight(server, CLIENT_RULE, 0)  # every stream-done release arrived

    def test_released_by_negative_hits_five_in_flight_per_client(self, tmp_path: Path) -> None:
        """Without request ids Envoy sends the same descriptor for every request of a
        client: 12 at once from one client, 5 pass and 7 get 429 (each takes a slot of its
        own: the server once kept the id made up for the first and refused the rest as
        duplicates), 3 from another all pass; the stream-done calls give every slot back
        (docs/concurrency.md's Envoy side), and the first client gets 5 again."""
        descriptors = tmp_path / "negative.yaml"
        descriptors.write_text(NEGATIVE_DESCRIPTORS)
        with (
            fairlimit_server("--config", str(descriptors)) as server,
            envoy_in_front(server.grpc_port, tmp_path, NEGATIVE_HITS,
                           EXAMPLES / "concurrency.yaml") as envoy,
        ):  # fmt: skip
            _five_each_then_back(server, envoy)

    def test_slots_of_a_killed_envoy_come_back_after_max_duration(self, tmp_path: Path) -> None:
        """Envoy killed with 5 requests in flight sends no stream-done call: the client is
        refused through another Envoy until the slots expire, then served again."""
        example = EXAMPLES / "concurrency.yaml"
        with (
            fairlimit_server("--config", str(_descriptors(tmp_path))) as server,
            envoy_in_front(server.grpc_port, tmp_path, SLOW_UPSTREAM, example) as survivor,
        ):
            doomed = EnvoyProcess(bootstrap(example, SLOW_UPSTREAM), server.grpc_port, tmp_path)
            try:
                burst = threading.Thread(target=_burst, args=(doomed.port, ["heavy"] * 5))
                burst.start()
                _wait_in_flight(server, CLIENT_RULE, 5)
                assert doomed.failed_calls() == {}  # its 5 calls were answered
                doomed.process.kill()
                killed_at = time.monotonic()
                burst.join(DEADLINE)
            finally:
                doomed.stop()
            assert _burst(survivor.port, ["heavy"]) == [("heavy", 429)]
            deadline = time.monotonic() + MAX_DURATION + DEADLINE
            while True:
                sent = time.monotonic()
                if _burst(survivor.port, ["heavy"]) == [("heavy", 200)]:
                    break
                assert sent < deadline, "the leaked slots never came back"
                time.sleep(0.1)  # a poll interval between attempts
            # the figure for the report: when the first admitted request was sent
            print(
                f"slots back {sent - killed_at:.1f}s after the kill (max_duration {MAX_DURATION}s)"
            )
