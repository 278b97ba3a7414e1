"""What Envoy shows for a window its unit enum cannot say: `duration: 10s` through a real
Envoy answers `w=1` (the longest unit within the window), never a longer window (issue 37)."""

from pathlib import Path

import pytest

from envoy_proxy import envoy_in_front, http_get
from servers import fairlimit_server

pytestmark = pytest.mark.process

TEN_SECONDS = """\
domain: edge
descriptors:
  - key: route
    value: e2e-ten
    descriptors:
      - key: client_id
        rate_limit: {duration: 10s, requests_per_unit: 5}
"""
ROUTE = {"descriptor_value: public": "descriptor_value: e2e-ten"}


def test_ten_seconds_say_w1_and_the_real_reset(tmp_path: Path) -> None:
    """5 per 10 s: five 200s and a 429; Envoy's header says `5, 5;w=1` (it said w=60), its
    reset at most the 10 s, and no call failed (Envoy's own counters)."""
    (tmp_path / "edge.yaml").write_text(TEN_SECONDS)
    with (
        fairlimit_server("--config", str(tmp_path / "edge.yaml")) as server,
        envoy_in_front(server.grpc_port, tmp_path, ROUTE) as envoy,
    ):
        for attempt in range(3):  # a 10 s boundary mid-test spoils an attempt
            answers = [http_get(envoy.url, {"x-client-id": f"ten-{attempt}"}) for _ in range(6)]
            resets = [int(h.get("x-ratelimit-reset", "0")) for _, h, _ in answers]
            if resets == sorted(resets, reverse=True):
                break
        else:
            raise AssertionError("three attempts straddled 10 s boundaries")
        assert [code for code, _, _ in answers] == [200] * 5 + [429]
        assert answers[0][1]["x-ratelimit-limit"].startswith("5, 5;w=1")
        assert all(0 < reset <= 10 for reset in resets)
        assert envoy.stat("cluster.ok.ratelimit.error") == 0
        assert envoy.stat("cluster.ok.ratelimit.failure_mode_allowed") == 0
        assert envoy.stat("cluster.ok.ratelimit.over_limit") >= 1
