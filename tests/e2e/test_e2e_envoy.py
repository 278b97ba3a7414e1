"""End to end: HTTP -> a real Envoy -> a real fairlimit process -> 200 or 429 with headers."""

import http.client
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from envoy_proxy import envoy_in_front, http_get
from servers import fairlimit_server, free_port

pytestmark = pytest.mark.process

FIXTURES = Path(__file__).parents[1] / "fixtures" / "e2e"
MINUTE_ROUTE = {"descriptor_value: public": "descriptor_value: e2e-minute"}
GLOBAL_ONLY = {"- request_headers: {header_name: x-client-id, descriptor_key: client_id}": ""}


class TestThroughEnvoy:
    def test_an_unanswered_call_is_counted_and_let_through(self, tmp_path: Path) -> None:
        """Nothing listens where fairlimit should: Envoy fails open, each request is a plain
        200, and only Envoy's counters tell (the ones every other test asserts are 0)."""
        with envoy_in_front(free_port(), tmp_path, failed_calls=True) as envoy:
            codes = [http_get(envoy.url, {"x-client-id": "alice"})[0] for _ in range(3)]
            failed = envoy.failed_calls()
        assert codes == [200] * 3
        assert failed == {
            "cluster.ok.ratelimit.error": 3,
            "cluster.ok.ratelimit.failure_mode_allowed": 3,
        }

    def test_under_limit_200_over_limit_429_with_headers(self, tmp_path: Path) -> None:
        """5 per minute per client: five 200s, then 429, X-RateLimit-* headers on both."""
        with (
            fairlimit_server("--config", str(FIXTURES / "fair")) as server,
            envoy_in_front(server.grpc_port, tmp_path, MINUTE_ROUTE) as envoy,
        ):
            for attempt in range(3):  # a minute boundary mid-test spoils an attempt
                headers = {"x-client-id": f"e2e-{attempt}"}
                answers = [http_get(envoy.url, headers) for _ in range(6)]
                resets = [int(h.get("x-ratelimit-reset", "0")) for _, h, _ in answers]
                if resets != sorted(resets, reverse=True):
                    continue
                assert [code for code, _, _ in answers] == [200] * 5 + [429]
                first, last = answers[0][1], answers[-1][1]
                assert first["x-ratelimit-limit"].startswith("5, 5;w=60")
                assert first["x-ratelimit-remaining"] == "4"
                assert last["x-ratelimit-remaining"] == "0"
                assert 0 < int(last["x-ratelimit-reset"]) <= 60
                # the 429 names the rule that refused it and its limit
                assert (
                    last["x-ratelimit-limit"] == '5, 5;w=60;name="edge/route=e2e-minute/client_id"'
                )
                return
            raise AssertionError("three attempts straddled minute boundaries")

    @pytest.mark.parametrize("backend", ["memory", "redis"])
    def test_a_hostile_client_id_is_limited_not_let_through(
        self, tmp_path: Path, backend: str, request: pytest.FixtureRequest
    ) -> None:
        """x-client-id as a hostile client sends it: 20,000 characters, a byte 0xFF, a broken
        UTF-8 sequence. Each was refused by fairlimit (too long, or no UTF-8 for protobuf)
        and Envoy let every such request through; now each is a client of its own, held to
        5 a minute, on either backend, and no call fails (the fixture asserts Envoy's
        ratelimit.error and failure_mode_allowed are 0)."""
        run = uuid.uuid4().hex[:8]  # the session's Redis outlives a test
        values = {"long": "L" * 20_000 + run, "byte-ff": f"\xff{run}",
                  "broken": f"hostile-\xc3({run}"}  # fmt: skip
        flags = ["--config", str(FIXTURES / "fair")]
        if backend == "redis":
            flags += ["--backend", request.getfixturevalue("redis_server").url]
        with (
            fairlimit_server(*flags) as server,
            envoy_in_front(server.grpc_port, tmp_path, MINUTE_ROUTE) as envoy,
        ):
            for attempt in range(3):  # a minute boundary mid-test spoils an attempt
                seen = {}
                for name, value in values.items():
                    # urllib sends a header's characters up to U+00FF as single bytes
                    answers = [http_get(envoy.url, {"x-client-id": f"{value}{attempt}"})
                               for _ in range(6)]  # fmt: skip
                    seen[name] = [code for code, _, _ in answers]
                    resets = [int(h.get("x-ratelimit-reset", "0")) for _, h, _ in answers]
                    if resets != sorted(resets, reverse=True):
                        break
                else:
                    assert seen == {name: [200] * 5 + [429] for name in values}
                    return
            raise AssertionError("three attempts straddled minute boundaries")

    def test_a_long_exact_client_id_in_the_config_limits_that_client(self, tmp_path: Path) -> None:
        """A config naming a client by a value past 1,024 characters (an API key, say): its
        rule matched no request, silently, and that client got the value-less rule's 5 a
        minute. Now its own 2 a minute, through Envoy; a client whose id differs in the
        middle still gets 5."""
        run = uuid.uuid4().hex[:8]
        keys = [f"key-{run}-{attempt}-" + "k" * 1100 for attempt in range(3)]
        rules = "".join(f"""
      - key: client_id
        value: "{key}"
        rate_limit: {{unit: minute, requests_per_unit: 2}}""" for key in keys)
        config = tmp_path / "long.yaml"
        config.write_text(f"""
domain: edge
descriptors:
  - key: route
    value: e2e-minute
    descriptors:{rules}
      - key: client_id
        rate_limit: {{unit: minute, requests_per_unit: 5}}
""")
        with (
            fairlimit_server("--config", str(config)) as server,
            envoy_in_front(server.grpc_port, tmp_path, MINUTE_ROUTE) as envoy,
        ):
            for key in keys:  # a minute boundary mid-test spoils an attempt
                other = key[:600] + "x" + key[601:]
                answers = [http_get(envoy.url, {"x-client-id": key}) for _ in range(3)]
                answers += [http_get(envoy.url, {"x-client-id": other}) for _ in range(6)]
                resets = [int(h.get("x-ratelimit-reset", "0")) for _, h, _ in answers]
                if resets != sorted(resets, reverse=True):
                    continue
                assert [code for code, _, _ in answers] == [200, 200, 429] + [200] * 5 + [429]
                assert answers[0][1]["x-ratelimit-limit"].startswith("2, 2;w=60")
                return
            raise AssertionError("three attempts straddled minute boundaries")

    def test_requests_without_a_client_id_are_one_anonymous_client(self, tmp_path: Path) -> None:
        """No x-client-id: Envoy sends client_id=anonymous, so they share one 5/min bucket."""
        for _ in range(3):  # a minute boundary mid-test spoils an attempt
            with (
                fairlimit_server("--config", str(FIXTURES / "fair")) as server,
                envoy_in_front(server.grpc_port, tmp_path, MINUTE_ROUTE) as envoy,
            ):
                answers = [http_get(envoy.url) for _ in range(6)]
            resets = [int(h.get("x-ratelimit-reset", "0")) for _, h, _ in answers]
            if resets != sorted(resets, reverse=True):
                continue
            assert [code for code, _, _ in answers] == [200] * 5 + [429]
            assert answers[0][1]["x-ratelimit-limit"].startswith("5, 5;w=60")
            return
        raise AssertionError("three attempts straddled minute boundaries")


def _storm(url_port: int, seconds: float) -> tuple[Counter[str], Counter[str]]:
    """A batch client retrying every 429 as fast as it can, four interactive at 4 rps each."""
    sent: Counter[str] = Counter()
    ok: Counter[str] = Counter()
    stop_at = time.monotonic() + seconds
    lock = threading.Lock()

    def client(name: str, pause: float, limit: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", url_port, timeout=5)
        for _ in range(limit):
            if time.monotonic() >= stop_at:
                break
            conn.request("GET", "/", headers={"x-client-id": name})
            response = conn.getresponse()
            response.read()
            with lock:
                sent[name] += 1
                ok[name] += response.status == 200
            time.sleep(pause)
        conn.close()

    threads = [threading.Thread(target=client, args=("batch", 0.0, 5000)) for _ in range(3)]
    threads += [threading.Thread(target=client, args=(f"web-{i}", 0.25, 100)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sent, ok


class TestRetryStorm:
    def test_global_bucket_starves_and_fairlimit_does_not(self, tmp_path: Path) -> None:
        """Same storm twice: one shared bucket starves the interactive clients, fair share
        serves them all (>= 99%) while the batch client is held to its own limit."""
        with (
            fairlimit_server("--config", str(FIXTURES / "global")) as server,
            envoy_in_front(server.grpc_port, tmp_path, GLOBAL_ONLY) as envoy,
        ):
            sent, ok = _storm(envoy.port, 3.0)
        web_global = sum(ok[f"web-{i}"] for i in range(4)) / sum(sent[f"web-{i}"] for i in range(4))
        with (
            fairlimit_server("--config", str(FIXTURES / "fair")) as server,
            envoy_in_front(server.grpc_port, tmp_path) as envoy,
        ):
            sent, ok = _storm(envoy.port, 3.0)
        assert sent["batch"] > 200, "the storm was too weak to prove anything"
        for i in range(4):
            assert ok[f"web-{i}"] >= 0.99 * sent[f"web-{i}"], (i, ok, sent)
        assert ok["batch"] <= 8 * 4 + 8  # 8/s over at most 4 windows, plus one window's slack
        assert web_global < 0.5, web_global
