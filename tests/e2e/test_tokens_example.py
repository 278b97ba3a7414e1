"""examples/envoy/tokens.yaml: token budgets charged after the response, through a real Envoy.

`envoy --mode validate` of the file is tests/deploy/test_examples.py's (every examples/envoy
bootstrap); here: the two-phase flow on the wire, then end to end through fairlimit.
"""

import json
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from envoy_proxy import EnvoyProcess, envoy_in_front, http_get
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from servers import fairlimit_server

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
TOKENS = ROOT / "examples" / "envoy" / "tokens.yaml"
DESCRIPTORS = ROOT / "examples" / "envoy" / "tokens-descriptors.yaml"
ACTIONS = [
    {"generic_key": {"descriptor_key": "provider", "descriptor_value": "llm"}},
    {"request_headers": {"header_name": "x-tenant", "descriptor_key": "tenant"}},
]

Call = tuple[list[tuple[str, str]], int | None]  # a descriptor's entries, its hits_addend


def _ratelimit_filter() -> dict[str, Any]:
    listener = yaml.safe_load(TOKENS.read_text())["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ratelimit: dict[str, Any] = hcm["http_filters"][0]
    assert ratelimit["name"] == "envoy.filters.http.ratelimit"
    return ratelimit


class TestTwoPhaseConfig:
    def test_a_free_check_then_the_responses_cost(self) -> None:
        """Entry 1 checks with hits_addend 0; entry 2 charges x-tokens-used at stream end."""
        config = _ratelimit_filter()["typed_config"]
        check, charge = config["rate_limits"]
        assert config["domain"] == "edge"
        assert check == {"actions": ACTIONS, "hits_addend": {"number": 0}}
        assert charge == {
            "actions": ACTIONS,
            "apply_on_stream_done": True,
            "hits_addend": {"format": "%RESP(x-tokens-used)%"},
        }

    def test_the_descriptors_charge_when_over_limit_under_a_fair_share(self) -> None:
        """(provider=llm),(tenant) is a tenant rule that records charges past its limit."""
        (cap,) = yaml.safe_load(DESCRIPTORS.read_text())["descriptors"]
        (tenant,) = cap["descriptors"]
        assert (cap["key"], cap["value"], "fair_share" in cap) == ("provider", "llm", True)
        assert tenant["key"] == "tenant" and "value" not in tenant
        assert tenant["rate_limit"]["unit"] == "minute"
        assert tenant["rate_limit"]["charge_when_over_limit"] is True


class RecordingService(rls_pb2_grpc.RateLimitServiceServicer):
    """Records each call's descriptors and hits; tenant "over" is over its limit."""

    def __init__(self) -> None:
        self.calls: list[list[Call]] = []

    def ShouldRateLimit(
        self, request: rls_pb2.RateLimitRequest, context: grpc.ServicerContext
    ) -> rls_pb2.RateLimitResponse:
        self.calls.append(
            [
                (
                    [(e.key, e.value) for e in d.entries],
                    d.hits_addend.value if d.HasField("hits_addend") else None,
                )
                for d in request.descriptors
            ]
        )
        over = any(e.value == "over" for d in request.descriptors for e in d.entries)
        code = rls_pb2.RateLimitResponse.OVER_LIMIT if over else rls_pb2.RateLimitResponse.OK
        return rls_pb2.RateLimitResponse(overall_code=code)


@pytest.fixture
def recording_rls() -> Iterator[tuple[RecordingService, int]]:
    service = RecordingService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield service, port
    server.stop(grace=None)


def _rls_calls(proxy: EnvoyProcess) -> int:
    """Rate-limit calls Envoy has completed (its fairlimit cluster's finished requests)."""
    _, _, body = http_get(f"http://127.0.0.1:{proxy.admin}/stats?format=json&filter=^cluster")
    stats = {s["name"]: s.get("value", 0) for s in json.loads(body)["stats"] if "name" in s}
    return int(stats.get("cluster.fairlimit.upstream_rq_completed", 0))


def _wait_calls(proxy: EnvoyProcess, count: int) -> None:
    """Until Envoy has completed ``count`` calls: the charge goes after the response."""
    deadline = time.monotonic() + 30  # a loaded machine; ends as soon as they are done
    while _rls_calls(proxy) < count:
        assert time.monotonic() < deadline, f"fewer than {count} rate-limit calls"
        time.sleep(0.02)  # polls Envoy's counter; asserts no duration


def _ask(proxy: EnvoyProcess, tenant: str, tokens: int) -> tuple[int, dict[str, str], bytes]:
    return http_get(proxy.url, {"x-tenant": tenant, "x-simulated-tokens": str(tokens)})


class TestTwoPhaseOnTheWire:
    def test_the_check_carries_zero_hits_and_the_charge_the_tokens(
        self, recording_rls: tuple[RecordingService, int], tmp_path: Path
    ) -> None:
        """One call: a check with hits_addend 0, then the response's 5000 tokens as hits."""
        service, port = recording_rls
        with envoy_in_front(port, tmp_path, example=TOKENS) as proxy:
            answer = _ask(proxy, "big", 5000)
            _wait_calls(proxy, 2)
        assert (answer[0], answer[1]["x-tokens-used"]) == (200, "5000")
        entries = [("provider", "llm"), ("tenant", "big")]
        assert service.calls == [[(entries, 0)], [(entries, 5000)]]

    def test_a_refused_check_never_reaches_the_provider(
        self, recording_rls: tuple[RecordingService, int], tmp_path: Path
    ) -> None:
        """OVER_LIMIT on the check is a 429 with no tokens used, so nothing is charged."""
        service, port = recording_rls
        with envoy_in_front(port, tmp_path, example=TOKENS) as proxy:
            refused = _ask(proxy, "over", 5000)
            _wait_calls(proxy, 1)
            missing = http_get(proxy.url, {"x-simulated-tokens": "5"})
            accepted = _ask(proxy, "small", 7)  # its charge is the last call: after the 429
            _wait_calls(proxy, 3)
        assert refused[0] == 429 and "x-tokens-used" not in refused[1]
        assert (missing[0], missing[2]) == (400, b"x-tenant required\n")
        assert accepted[0] == 200
        tenants = [call[0][0][1][1] for call in service.calls]
        assert tenants == ["over", "small", "small"]


class TestTokenBudgetEndToEnd:
    """HTTP -> a real Envoy (tokens.yaml) -> a real fairlimit (tokens-descriptors.yaml)."""

    def test_a_tenant_with_large_responses_is_stopped_a_small_one_passes(
        self, tmp_path: Path
    ) -> None:
        """20 000 tokens a minute each: a tenant spending 15 000 a call passes twice (the second
        charge is recorded past its limit), then gets 429; a tenant at 10 a call still passes."""
        with (
            fairlimit_server("--config", str(DESCRIPTORS)) as server,
            envoy_in_front(server.grpc_port, tmp_path, example=TOKENS) as proxy,
        ):
            for attempt in range(3):  # a minute boundary mid-test spoils an attempt
                minute = int(time.time() // 60)
                calls, codes = _rls_calls(proxy), []
                for _ in range(3):
                    codes.append(_ask(proxy, f"big-{attempt}", 15000)[0])
                    calls += 2 if codes[-1] == 200 else 1  # a 429 has no charge
                    _wait_calls(proxy, calls)
                small = _ask(proxy, f"small-{attempt}", 10)
                if int(time.time() // 60) != minute:
                    continue
                assert codes == [200, 200, 429]
                assert (small[0], small[1]["x-tokens-used"]) == (200, "10")
                return
            raise AssertionError("three attempts straddled minute boundaries")
