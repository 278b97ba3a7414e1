"""The gRPC receive limit and the cap on concurrent calls, on a real server process.

Before them, grpc's default 4 MB limit let a ~3.9 MB request in, parsed whole before the
request bounds rejected it: 64 of them at once took the server from 61 to ~400 MB.
"""

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit.core.request import MAX_DESCRIPTORS, MAX_ENTRIES, MAX_TEXT
from helpers import skip_or_fail
from redis_servers import RedisProcess
from servers import ServerProcess

pytestmark = pytest.mark.process

METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
D = ratelimit_pb2.RateLimitDescriptor
CONFIG = """\
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: minute, requests_per_unit: 10}
"""


def _request(text: int, domain: str = "edge") -> bytes:
    """A request of MAX_DESCRIPTORS descriptors of MAX_ENTRIES entries of ``text`` chars."""
    entry = D.Entry(key="k" * text, value="v" * text)
    descriptors = [D(entries=[entry] * MAX_ENTRIES)] * MAX_DESCRIPTORS
    message = rls_pb2.RateLimitRequest(domain=domain, descriptors=descriptors)
    return message.SerializeToString()


def _send(target: str, payload: bytes, timeout: float = 30) -> str:
    """One call on its own connection; the status code's name."""
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(target, options) as channel:
        call = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
        try:
            call(payload, timeout=timeout)
        except grpc.RpcError as error:
            return str(error.code().name)
    return "OK"


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc status")


def _serve(tmp_path: Path, *args: str) -> ServerProcess:
    config = tmp_path / "edge.yaml"
    config.write_text(CONFIG)
    return ServerProcess(["--config", str(config), *args])


class TestReceiveLimit:
    def test_the_largest_request_the_bounds_admit_is_answered_when_asked_for(
        self, tmp_path: Path
    ) -> None:
        """Every descriptor, entry and text at its bound (~2.1 MB): served with
        --grpc-max-receive-bytes 0, refused unread by the default 256 KiB."""
        largest = _request(MAX_TEXT, domain="d" * MAX_TEXT)
        codes = []
        for flags in (["--grpc-max-receive-bytes", "0"], []):
            server = _serve(tmp_path, *flags)
            try:
                codes.append(_send(server.target, largest))
            finally:
                server.stop()
        assert codes == ["OK", "RESOURCE_EXHAUSTED"]  # an unknown domain: no limits apply

    def test_a_request_under_the_default_limit_is_answered(self, tmp_path: Path) -> None:
        """A request of ~250 kB (64 descriptors of 16 entries of 120 characters) is served:
        the default fits requests far larger than Envoy's."""
        payload = _request(120)
        assert 200_000 < len(payload) < 256 * 1024
        server = _serve(tmp_path)
        try:
            code = _send(server.target, payload)
        finally:
            server.stop()
        assert code == "OK"

    def test_a_larger_request_is_refused_unread(self, tmp_path: Path) -> None:
        """A ~3.9 MB request is past any valid one: RESOURCE_EXHAUSTED, not parsed first."""
        server = _serve(tmp_path)
        try:
            code = _send(server.target, _request(1900))
        finally:
            server.stop()
        assert code == "RESOURCE_EXHAUSTED"

    def test_a_flood_of_oversized_requests_keeps_memory_bounded(self, tmp_path: Path) -> None:
        """64 concurrent ~3.9 MB requests: the server grows by well under 100 MB (it grew by
        ~340 MB when they were parsed)."""
        if not Path("/proc/self/status").exists():
            skip_or_fail("reads the server's peak RSS from Linux /proc")
        server = _serve(tmp_path)
        codes: list[str] = []
        try:
            _send(server.target, _request(1))  # imports and the first call done
            baseline = _peak_rss_mb(server.process.pid)
            payload = _request(1900)
            flood = [
                threading.Thread(target=lambda: codes.append(_send(server.target, payload)))
                for _ in range(64)
            ]
            for thread in flood:
                thread.start()
            for thread in flood:
                thread.join()
            growth = _peak_rss_mb(server.process.pid) - baseline
        finally:
            server.stop()
        assert codes == ["RESOURCE_EXHAUSTED"] * 64
        assert growth < 100, growth


class TestConcurrencyCap:
    def test_calls_waiting_on_a_stopped_redis_give_their_place_to_new_calls(
        self, redis_process: RedisProcess, tmp_path: Path
    ) -> None:
        """--grpc-max-concurrent 1: while a call waits on a stopped Redis (?timeout=3), a
        new call takes its place and the one waiting is answered by the failure mode (open:
        OK) at once; so each of 8 calls, sent 0.15 s apart, is answered OK. Before, most
        of them were RESOURCE_EXHAUSTED: calls waiting on the store filled the budget (issue
        38).

        The calls are 0.15 s apart, not sent together: a call whose message is not read yet
        gives its place to a new one by design (guards.Pool.admit), and on a loaded machine
        6 calls sent at once found some there (2 were RESOURCE_EXHAUSTED in CI). Not much
        more than 0.15 s: the server's watch of the store (every BREAK_SECONDS, 0.25 s) gives up
        a wait of STALLED (0.05 s) by itself, and each call would find the one before it
        ended (a call ends by itself 0.05-0.3 s after it began). Without the budget's relief,
        each of the 7 later calls is refused unless the one before has ended (0.4 each)."""
        # leases off: each call asks Redis (a lease would answer them without it)
        url = redis_process.url + "?timeout=3&leases=off"
        server = _serve(tmp_path, "--backend", url, "--grpc-max-concurrent", "1")
        small = rls_pb2.RateLimitRequest(
            domain="edge", descriptors=[D(entries=[D.Entry(key="client_id", value="a")])]
        ).SerializeToString()
        codes: list[str] = []
        assert redis_process.proc is not None
        try:
            assert _send(server.target, small) == "OK"
            os.kill(redis_process.proc.pid, signal.SIGSTOP)
            try:
                calls = [
                    threading.Thread(target=lambda: codes.append(_send(server.target, small)))
                    for _ in range(8)
                ]
                for thread in calls:
                    thread.start()
                    time.sleep(0.15)  # this call waits on the store when the next comes
                for thread in calls:
                    thread.join()
            finally:
                os.kill(redis_process.proc.pid, signal.SIGCONT)
            after = _send(server.target, small)
        finally:
            server.stop()
        assert codes == ["OK"] * 8
        assert after == "OK"


class TestPreparedCache:
    def test_distinct_large_valid_requests_are_not_kept(self, tmp_path: Path) -> None:
        """40 different maximal valid requests, one after another: the server does not keep
        them (the cache of prepared requests takes small payloads only; it grew by ~6 MB a
        request before)."""
        if not Path("/proc/self/status").exists():
            skip_or_fail("reads the server's peak RSS from Linux /proc")
        server = _serve(tmp_path, "--grpc-max-receive-bytes", "0")
        try:
            _send(server.target, _request(1))
            baseline = _peak_rss_mb(server.process.pid)
            codes = {_send(server.target, _request(MAX_TEXT, domain=f"d{i}")) for i in range(40)}
            growth = _peak_rss_mb(server.process.pid) - baseline
        finally:
            server.stop()
        assert codes == {"OK"}
        assert growth < 60, growth


def _details(target: str, payload: bytes) -> tuple[str, str]:
    """One call on its own connection: the status code's name and details."""
    with grpc.insecure_channel(target, [("grpc.use_local_subchannel_pool", 1)]) as channel:
        call = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
        try:
            call(payload, timeout=30)
        except grpc.RpcError as error:
            return str(error.code().name), str(error.details())
    return "OK", ""


class TestDescriptorCount:
    def test_too_many_descriptors_are_refused_before_any_is_converted(
        self, tmp_path: Path
    ) -> None:
        """10,000 descriptors (200 kB, under the receive limit), the 100th with an override
        whose unit is UNKNOWN: refused for the count, which is checked first, not for the
        100th descriptor, which converting them all would find (the server spent 30-40 ms of its
        event loop per request on it, holding every other call)."""
        small = [D(entries=[D.Entry(key="client_id", value=f"c{i}")]) for i in range(10_000)]
        small[99].limit.requests_per_unit = 5  # unit left UNKNOWN
        payload = rls_pb2.RateLimitRequest(domain="edge", descriptors=small).SerializeToString()
        server = _serve(tmp_path)
        try:
            answer = _details(server.target, payload)
            unknown = _details(server.target, rls_pb2.RateLimitRequest(
                domain="edge", descriptors=small[100 - MAX_DESCRIPTORS:100]
            ).SerializeToString())  # fmt: skip
        finally:
            server.stop()
        assert answer == ("INVALID_ARGUMENT", f"at most {MAX_DESCRIPTORS} descriptors per request")
        # the same descriptor in a request of 64 is refused for its unit
        unit = f"descriptor {MAX_DESCRIPTORS - 1}: limit override has unit UNKNOWN"
        assert unknown == ("INVALID_ARGUMENT", unit)
