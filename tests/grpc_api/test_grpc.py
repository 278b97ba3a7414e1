"""The gRPC surface through real channels: RLS answers, error statuses, health, reflection, fuzz."""

import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from fairlimit._proto.envoy.type.v3 import ratelimit_unit_pb2
from fairlimit.core.values import MAX_TEXT, STAND_IN_EDGE
from servers import ROOT, ServerProcess

pytestmark = pytest.mark.process

RLS = rls_pb2.RateLimitResponse
D = ratelimit_pb2.RateLimitDescriptor
RLS_SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"


def _request(
    *pairs: tuple[str, str], domain: str = "edge", **fields: object
) -> rls_pb2.RateLimitRequest:
    entries = [D.Entry(key=k, value=v) for k, v in pairs]
    return rls_pb2.RateLimitRequest(domain=domain, descriptors=[D(entries=entries, **fields)])


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    process = ServerProcess(["--config", str(ROOT / "descriptors")])
    yield process  # type: ignore[misc]
    assert process.stop() == 0


@pytest.fixture(scope="module")
def channel(server: ServerProcess) -> grpc.Channel:
    with grpc.insecure_channel(server.target) as ch:
        yield ch  # type: ignore[misc]


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> rls_pb2_grpc.RateLimitServiceStub:
    return rls_pb2_grpc.RateLimitServiceStub(channel)


class TestShouldRateLimit:
    def test_limit_then_over_limit_with_headers_filled(
        self, stub: rls_pb2_grpc.RateLimitServiceStub
    ) -> None:
        """100 per second per client: OK with limit, remaining and reset, then OVER_LIMIT."""
        for attempt in range(5):  # a window boundary between the calls spoils an attempt
            client = ("client_id", f"grpc-test-{attempt}")
            time.sleep(1.01 - time.time() % 1)  # start a second's window (the server's clock)
            second = int(time.time())
            first = stub.ShouldRateLimit(_request(("route", "public"), client), timeout=5)
            rest = stub.ShouldRateLimit(
                _request(("route", "public"), client, hits_addend={"value": 99}), timeout=5
            )
            over = stub.ShouldRateLimit(_request(("route", "public"), client), timeout=5)
            resets = [r.statuses[0].duration_until_reset.ToTimedelta() for r in (first, rest, over)]
            if int(time.time()) != second or not resets[0] >= resets[1] >= resets[2]:
                continue  # the resets are whole seconds: they may not show a boundary crossed
            assert first.overall_code == RLS.OK
            status = first.statuses[0]
            limit = (status.current_limit.requests_per_unit, status.current_limit.unit)
            assert limit == (100, RLS.RateLimit.SECOND)
            assert status.limit_remaining == 99
            assert 0 < resets[0].total_seconds() <= 1
            assert (rest.overall_code, rest.statuses[0].limit_remaining) == (RLS.OK, 0)
            assert (over.overall_code, over.statuses[0].code) == (RLS.OVER_LIMIT, RLS.OVER_LIMIT)
            return
        pytest.fail("five attempts straddled window boundaries")

    def test_unknown_domain_is_ok(self, stub: rls_pb2_grpc.RateLimitServiceStub) -> None:
        """A domain no config names: OK, no limits."""
        out = stub.ShouldRateLimit(_request(("a", "b"), domain="nobody"), timeout=5)
        assert out.overall_code == RLS.OK and not out.statuses[0].HasField("current_limit")

    def test_unlimited_reports_max_remaining(self, stub: rls_pb2_grpc.RateLimitServiceStub) -> None:
        """An unlimited rule answers remaining 4294967295."""
        out = stub.ShouldRateLimit(_request(("health", "x")), timeout=5)
        assert out.statuses[0].limit_remaining == 4294967295

    @pytest.mark.parametrize(
        "request_",
        [
            rls_pb2.RateLimitRequest(
                domain="", descriptors=[D(entries=[D.Entry(key="a", value="b")])]
            ),
            rls_pb2.RateLimitRequest(domain="edge"),
            _request(("client_id", "a"), limit=D.RateLimitOverride(requests_per_unit=5, unit=0)),
            _request(*[(f"k{i}", "v") for i in range(100)]),
        ],
        ids=["empty-domain", "no-descriptors", "override-unit-unknown", "oversized"],
    )
    def test_bad_requests_get_invalid_argument(
        self, stub: rls_pb2_grpc.RateLimitServiceStub, request_: rls_pb2.RateLimitRequest
    ) -> None:
        """Malformed requests get INVALID_ARGUMENT with a reason, never a crash."""
        with pytest.raises(grpc.RpcError) as caught:
            stub.ShouldRateLimit(request_, timeout=5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details()

    def test_override_is_honoured(self, stub: rls_pb2_grpc.RateLimitServiceStub) -> None:
        """A request-supplied limit replaces the configured one."""
        override = D.RateLimitOverride(requests_per_unit=2, unit=2)  # MINUTE
        request = _request(("client_id", "override-test"), limit=override)
        codes = [stub.ShouldRateLimit(request, timeout=5).overall_code for _ in range(3)]
        assert codes == [RLS.OK, RLS.OK, RLS.OVER_LIMIT]


def _with_bytes(value: bytes, domain: bytes = b"edge") -> bytes:
    """A request of (remote_address=``value``) with a yearly override of 2, its domain and
    value given as raw bytes (protobuf would not build one that is no UTF-8). A rule under
    no cap: clients added at the admin cap would change the share the fuzz's last test
    expects of a new client there."""
    override = D.RateLimitOverride(requests_per_unit=2, unit=ratelimit_unit_pb2.YEAR)
    mark_domain, mark_value = "D" * len(domain), "V" * len(value)
    request = _request(("remote_address", mark_value), limit=override)
    request.domain = mark_domain
    payload = request.SerializeToString()
    assert payload.count(mark_value.encode()) == 1 and payload.count(mark_domain.encode()) == 1
    return payload.replace(mark_value.encode(), value).replace(mark_domain.encode(), domain)


class TestHostileValues:
    """A descriptor value is what a client sent (Envoy copies a header's bytes as they
    came): one too long or no UTF-8 is limited like any other, never refused, because
    Envoy lets the request of a refused call through."""

    def _codes(self, channel: grpc.Channel, payload: bytes, times: int = 3) -> list[str]:
        call = channel.unary_unary(METHOD)
        codes = []
        for _ in range(times):
            reply = rls_pb2.RateLimitResponse.FromString(call(payload, timeout=5))
            codes.append(RLS.Code.Name(reply.overall_code))
        return codes

    @pytest.mark.parametrize(
        "value",
        [b"\xff", b"hostile-\xc3(", b"\xed\xa0\x80", b"x" * (MAX_TEXT + 1), b"y" * 200_000],
        ids=["byte-ff", "broken-sequence", "surrogate", "one-too-long", "200kB"],
    )
    def test_each_value_is_limited_on_its_own(self, channel: grpc.Channel, value: bytes) -> None:
        """Two a year: OK, OK, OVER_LIMIT; the same value with one byte more has its own."""
        assert self._codes(channel, _with_bytes(value)) == ["OK", "OK", "OVER_LIMIT"]
        assert self._codes(channel, _with_bytes(value + b"\xfe"), 1) == ["OK"]

    def test_long_values_apart_only_in_the_middle_are_apart(self, channel: grpc.Channel) -> None:
        head, tail = b"h" * MAX_TEXT, b"t" * MAX_TEXT  # a stand-in keeps STAND_IN_EDGE of each
        assert STAND_IN_EDGE < MAX_TEXT
        first, second = head + b"middle-1" + tail, head + b"middle-2" + tail
        assert self._codes(channel, _with_bytes(first)) == ["OK", "OK", "OVER_LIMIT"]
        assert self._codes(channel, _with_bytes(second), 1) == ["OK"]

    def test_a_hits_addend_past_uint32_is_over_the_limit(self, channel: grpc.Channel) -> None:
        """A descriptor's hits_addend is a uint64, which Envoy may take from a request header
        (``hits_addend: {format: "%REQ(x-cost)%"}``): one past 2^32 - 1 was refused, and
        Envoy let the request through. Now it counts as 2^32 - 1: over a limit of 2."""
        call = channel.unary_unary(METHOD)
        for hits in (2**32, 2**64 - 1):
            request = rls_pb2.RateLimitRequest.FromString(_with_bytes(f"costly-{hits}".encode()))
            request.descriptors[0].hits_addend.value = hits
            reply = call(request.SerializeToString(), timeout=5)
            assert rls_pb2.RateLimitResponse.FromString(reply).overall_code == RLS.OVER_LIMIT

    def test_a_domain_that_is_no_utf8_is_still_refused(self, channel: grpc.Channel) -> None:
        """The domain and keys are Envoy's configuration: bytes there are a broken message."""
        call = channel.unary_unary(METHOD)
        with pytest.raises(grpc.RpcError) as caught:
            call(_with_bytes(b"alice", domain=b"ed\xffe"), timeout=5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "RateLimitRequest" in (caught.value.details() or "")


class TestHealthAndReflection:
    def test_health_serving_for_both_names(self, channel: grpc.Channel) -> None:
        """The overall and the RLS service health both say SERVING."""
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "envoy.service.ratelimit.v3.RateLimitService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

    def test_reflection_lists_the_rls_service(self, channel: grpc.Channel) -> None:
        """Server reflection names the RateLimitService."""
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert "envoy.service.ratelimit.v3.RateLimitService" in names


def _get_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code


texts = st.text(max_size=40) | st.sampled_from(
    ["", "route", "public", "client_id", "\x00", "é" * 2000]
)
entries = st.lists(st.tuples(texts, texts), max_size=20)
descriptors = st.lists(
    st.builds(
        lambda es, hits, rpu, unit: D(
            entries=[D.Entry(key=k, value=v) for k, v in es],
            **({"hits_addend": {"value": hits}} if hits is not None else {}),
            **(
                {"limit": D.RateLimitOverride(requests_per_unit=rpu, unit=unit)}
                if unit is not None
                else {}
            ),
        ),
        entries,
        st.none() | st.integers(0, 2**64 - 1),
        st.integers(0, 2**32 - 1),
        st.none() | st.integers(0, 9),
    ),
    max_size=70,
)
requests = st.builds(
    lambda domain, ds, hits: rls_pb2.RateLimitRequest(
        domain=domain, descriptors=ds, hits_addend=hits
    ),
    st.sampled_from(["edge", "", "other"]) | texts,
    descriptors,
    st.integers(0, 2**32 - 1),
)


class TestFuzz:
    @settings(
        max_examples=150,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        payload=st.one_of(requests.map(lambda r: r.SerializeToString()), st.binary(max_size=300))
    )
    def test_every_payload_gets_an_answer_not_unknown(
        self, channel: grpc.Channel, payload: bytes
    ) -> None:
        """Random, malformed, huge and odd-unicode payloads: a response or a definite status."""
        call = channel.unary_unary(METHOD)
        try:
            reply = call(payload, timeout=5)
            rls_pb2.RateLimitResponse.FromString(reply)
        except grpc.RpcError as exc:
            assert exc.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED), (
                exc
            )

    def test_server_still_answers_correctly_after_the_fuzz(
        self, stub: rls_pb2_grpc.RateLimitServiceStub
    ) -> None:
        """After the fuzz a fresh client is limited exactly as before, up to its edge."""
        request = _request(("route", "admin"), ("client_id", "after-fuzz"))
        first = stub.ShouldRateLimit(request, timeout=5).statuses[0]
        assert (first.current_limit.requests_per_unit, first.limit_remaining) == (120, 119)
        # A yearly override of 2 reaches the edge without racing a window boundary.
        override = D.RateLimitOverride(requests_per_unit=2, unit=ratelimit_unit_pb2.YEAR)
        edge = _request(("route", "admin"), ("client_id", "after-fuzz-edge"), limit=override)
        replies = [stub.ShouldRateLimit(edge, timeout=5) for _ in range(3)]
        assert [r.overall_code for r in replies] == [RLS.OK, RLS.OK, RLS.OVER_LIMIT]
        assert [r.statuses[0].limit_remaining for r in replies] == [1, 0, 0]


def _watch(channel: grpc.Channel, service: str) -> Iterator[health_pb2.HealthCheckResponse]:
    """A health Watch stream; it is an in-flight call, so it also holds a drain open."""
    stub = health_pb2_grpc.HealthStub(channel)
    stream: Iterator[health_pb2.HealthCheckResponse] = stub.Watch(
        health_pb2.HealthCheckRequest(service=service), timeout=30
    )
    return stream


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class TestShutdown:
    def test_sigterm_turns_grpc_health_not_serving_on_the_wire(self) -> None:
        """SIGTERM: health watchers of every name (upstream's "ratelimit" too) see SERVING turn
        NOT_SERVING; then exit 0."""
        process = ServerProcess(["--config", str(ROOT / "descriptors")])
        try:
            with grpc.insecure_channel(process.target) as ch:
                watches = [_watch(ch, name) for name in ("", RLS_SERVICE, "ratelimit")]
                assert [next(w).status for w in watches] == [SERVING] * 3
                process.terminate()
                assert [next(w).status for w in watches] == [NOT_SERVING] * 3
                for w in watches:
                    w.cancel()  # type: ignore[attr-defined]  # a grpc call is also a future
        finally:
            assert process.stop() == 0

    def test_sigterm_makes_readyz_answer_503_while_draining(self) -> None:
        """SIGTERM: while in-flight calls drain, /readyz answers 503 so balancers stop sending."""
        process = ServerProcess(["--config", str(ROOT / "descriptors")])
        try:
            url = f"http://127.0.0.1:{process.admin_port}/readyz"
            assert _get_status(url) == 200
            with grpc.insecure_channel(process.target) as ch:
                watch = _watch(ch, "")
                assert next(watch).status == SERVING
                process.terminate()
                # The server is draining once the watch stream says so (it says so before
                # the drain waits for this very call, which keeps the admin server up).
                next(watch)
                assert _get_status(url) == 503
                watch.cancel()  # type: ignore[attr-defined]  # a grpc call is also a future
        finally:
            assert process.stop() == 0

    def test_sigterm_drains_and_exits_cleanly(self) -> None:
        """SIGTERM: the server answers NOT_SERVING or closes, then exits 0."""
        process = ServerProcess(["--config", str(ROOT / "descriptors")])
        with grpc.insecure_channel(process.target) as ch:
            assert rls_pb2_grpc.RateLimitServiceStub(ch).ShouldRateLimit(
                _request(("a", "b")), timeout=5
            )
        assert process.stop() == 0
        assert any("draining" in line for line in process.lines)
