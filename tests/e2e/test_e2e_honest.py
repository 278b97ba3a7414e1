"""What a 429 says, through a real Envoy (enable_x_ratelimit_headers: DRAFT_VERSION_03) and a
real fairlimit process with its response headers and metadata on: the headers name the rule
and the limit that refused the request, a client at a contended cap sees its share, and a
route reads which quota still has budget from the dynamic metadata."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from envoy_proxy import EnvoyProcess, bootstrap, envoy_on, http_get
from servers import fairlimit_server

pytestmark = pytest.mark.process

CONFIG = Path(__file__).parents[1] / "fixtures" / "e2e" / "honest"
ENV = {"FAIRLIMIT_RESPONSE_HEADERS": "true", "FAIRLIMIT_RESPONSE_METADATA": "true"}

# The example's route limits give way to the filter's (each descriptor from headers: Envoy
# drops an entry whose header is missing), and the route copies pt's budget for the upstream.
EXAMPLE_LIMITS = """                      rate_limits:
                        - actions:
                            - generic_key: {descriptor_key: route, descriptor_value: public}
                            - request_headers: {header_name: x-client-id, descriptor_key: client_id}
                        - actions:
                            - generic_key: {descriptor_key: route, descriptor_value: public}
                            # No x-client-id: one shared client, "anonymous".
                            - header_value_match:
                                descriptor_key: client_id
                                descriptor_value: anonymous
                                expect_match: false
                                headers: [{name: x-client-id, present_match: true}]
"""
PT_LEFT = "%DYNAMIC_METADATA(envoy.filters.http.ratelimit:fairlimit:withQuota:backend=pt)%"
ROUTE = f"""                      request_headers_to_add:
                        - header: {{key: x-pt-left, value: "{PT_LEFT}"}}
"""
# In the filter's own rate_limits: Envoy 1.40 sends hits_addend only for these.
FILTER = """                      domain: edge
                      rate_limits:
                        - actions:
                            - request_headers: {header_name: x-route, descriptor_key: route}
                            - request_headers: {header_name: x-client-id, descriptor_key: client_id}
                          hits_addend: {format: "%REQ(x-hits)%"}
                        - actions:
                            - request_headers: {header_name: x-tokens, descriptor_key: tokens}
                            - request_headers: {header_name: x-client-id, descriptor_key: client_id}
                          hits_addend: {format: "%REQ(x-cost)%"}
                        - actions:
                            - header_value_match:
                                descriptor_key: backend
                                descriptor_value: pt
                                headers: [{name: x-backends, present_match: true}]
                        - actions:
                            - header_value_match:
                                descriptor_key: backend
                                descriptor_value: ondemand
                                headers: [{name: x-backends, present_match: true}]
"""
# The "upstream" answers which backend the route picked: pt while the edge route found pt's
# quota with budget (x-pt-left set from the metadata), else ondemand.
EXAMPLE_OK = """                      routes:
                        - match: {prefix: "/"}
                          direct_response:
                            status: 200
                            body: {inline_string: "ok\\n"}
"""
OK = """                      routes:
                        - match: {prefix: "/", headers: [{name: x-pt-left, present_match: true}]}
                          direct_response:
                            status: 200
                            body: {inline_string: "pt\\n"}
                        - match: {prefix: "/"}
                          direct_response:
                            status: 200
                            body: {inline_string: "ondemand\\n"}
"""


@contextmanager
def _proxied(tmp_path: Path) -> Iterator[EnvoyProcess]:
    filter_domain = "                      domain: edge\n"
    edits = {EXAMPLE_LIMITS: ROUTE, filter_domain: FILTER, EXAMPLE_OK: OK}
    text = bootstrap(edits=edits)
    with (
        fairlimit_server("--config", str(CONFIG), env=ENV) as server,
        envoy_on(text, server.grpc_port, tmp_path) as envoy,
    ):
        yield envoy


def _get(envoy: EnvoyProcess, **headers: str) -> tuple[int, dict[str, str], bytes]:
    return http_get(envoy.url, {k.replace("_", "-"): v for k, v in headers.items()})


def _in_one_window(answers: list[tuple[int, dict[str, str], bytes]]) -> bool:
    """No hour boundary between the answers (the reset never goes up)."""
    resets = [int(h["x-ratelimit-reset"]) for _, h, _ in answers if "x-ratelimit-reset" in h]
    return resets == sorted(resets, reverse=True)


class TestHonest429s:
    def test_the_descriptor_that_refused_though_another_has_less_left(self, tmp_path: Path) -> None:
        """A client's 3 requests an hour and its 12 tokens: two calls of 5 tokens leave 1
        request and 2 tokens; the third call (5 tokens) is refused by the tokens, while the
        requests have less left (1). Envoy's X-RateLimit-* and fairlimit's RateLimit-*
        describe the tokens: 12 an hour, 0 left, named edge/tokens/client_id (the least
        left would have said 3 requests, 1 left)."""
        with _proxied(tmp_path) as envoy:
            for attempt in range(3):  # an hour boundary mid-test spoils an attempt
                client = f"c{attempt}"
                call = {"x_route": "public", "x_client_id": client, "x_hits": "1",
                        "x_tokens": "t", "x_cost": "5"}  # fmt: skip
                answers = [_get(envoy, **call) for _ in range(3)]
                if not _in_one_window(answers):
                    continue
                assert [code for code, _, _ in answers] == [200, 200, 429]
                ok, refused = answers[1][1], answers[2][1]
                # a 200: the requests, 1 left, are the closest to their limit
                assert ok["x-ratelimit-remaining"] == "1"
                assert ok["ratelimit-policy"] == '"edge/route=public/client_id";q=3;w=3600'
                assert refused["x-ratelimit-limit"] == (
                    '12, 3;w=3600;name="edge/route=public/client_id", '
                    '12;w=3600;name="edge/tokens/client_id"'
                )
                assert refused["x-ratelimit-remaining"] == "0"
                assert refused["ratelimit-limit"] == "12"
                assert refused["ratelimit-remaining"] == "0"
                assert refused["ratelimit-policy"] == '"edge/tokens/client_id";q=12;w=3600'
                reset = refused["x-ratelimit-reset"]
                assert refused["ratelimit"] == f'"edge/tokens/client_id";r=0;t={reset}'
                assert refused["ratelimit-reset"] == reset
                return
            raise AssertionError("three attempts straddled hour boundaries")

    def test_a_client_at_a_contended_cap_is_told_its_share(self, tmp_path: Path) -> None:
        """A cap of 10 an hour, clients of 8; bob takes his 8, then alice (weight 0.25) asks
        for 8: her max-min share beside bob is 2, so the 429 says 2 an hour (not her 8),
        named by her rule; she then gets her 2, one at a time, and is refused the third."""
        for _ in range(3):  # an hour boundary mid-test spoils an attempt
            with _proxied(tmp_path) as envoy:
                bob = _get(envoy, x_route="shared", x_client_id="bob", x_hits="8")
                asks = [("8", 429), ("1", 200), ("1", 200), ("1", 429)]
                alice = [_get(envoy, x_route="shared", x_client_id="alice", x_hits=h)
                         for h, _ in asks]  # fmt: skip
            if not _in_one_window([bob, *alice]):
                continue
            assert bob[0] == 200 and bob[1]["x-ratelimit-limit"].startswith("8, 8;w=3600")
            assert [code for code, _, _ in alice] == [code for _, code in asks]
            policy = '"edge/route=shared/client_id";q=2;w=3600'
            for (code, headers, _), left in zip(alice, ["0", "1", "0", "0"], strict=True):
                assert headers["x-ratelimit-limit"] == (
                    '2, 2;w=3600;name="edge/route=shared/client_id"'
                ), code
                assert (headers["x-ratelimit-remaining"], headers["ratelimit-policy"]) == (
                    left,
                    policy,
                )
            return
        raise AssertionError("three attempts straddled hour boundaries")


class TestQuotaMetadata:
    def test_a_route_picks_the_backend_whose_quota_has_budget(self, tmp_path: Path) -> None:
        """pt (2 an hour) and ondemand (100) in one quota group: the route reads pt's budget
        from the metadata (withQuota) into x-pt-left, and the upstream answers by it: pt
        while pt has a request left after this one, then ondemand; every request passes
        while either quota does."""
        with _proxied(tmp_path) as envoy:
            for _ in range(3):  # an hour boundary mid-test spoils an attempt
                answers = [_get(envoy, x_backends="pt,ondemand") for _ in range(3)]
                if not _in_one_window(answers):
                    continue
                assert [(code, body) for code, _, body in answers] == [
                    (200, b"pt\n"),
                    (200, b"ondemand\n"),
                    (200, b"ondemand\n"),
                ]
                return
            raise AssertionError("three attempts straddled hour boundaries")
