"""/rlconfig shows every limit of a rule (issue: views that showed only the first): upstream's
text line, one per limit, and the JSON report's ``rate_limits`` with each cap limit's verdict.
Through real HTTP listeners over a real limiter."""

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fairlimit.admin import AdminServer, JsonCodec, SideListener
from fairlimit.grpc_api.proto_json import request_from_json, response_to_json
from fairlimit.limiter import Limiter
from fairlimit.store.memory import MemoryStore
from helpers import FakeClock, load_text
from limit_configs import CAP_OF_TWO, FOUR_LIMITS

pytestmark = pytest.mark.behaviour

# A bucket with a burst per second, a sliding 5 minutes, a gcra with a burst and a calendar
# month in a zone; a cap whose second limit (10/s over 5 minutes) is contended; plain rules.
CONFIG = (
    """
domain: api
descriptors:
  - key: generic_key
    value: search
"""
    + FOUR_LIMITS
    + CAP_OF_TWO
    + """  - key: route
    value: public
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 7}
"""
)
FLAGS = ", shadow_mode: false, quota_mode: false\n"
TEXT = (
    "api/generic_key=search: rate_limits[0]: unit=SECOND requests_per_unit=20" + FLAGS
    + "api/generic_key=search: rate_limits[1]: unit=MINUTE requests_per_unit=3000 window=5m "
    "algorithm=sliding" + FLAGS
    + "api/generic_key=search: rate_limits[2]: unit=MINUTE requests_per_unit=600 "
    "algorithm=gcra burst=30" + FLAGS
    + "api/generic_key=search: rate_limits[3]: unit=MONTH requests_per_unit=1000000 "
    "calendar=Europe/Berlin" + FLAGS
    + "api/tenant: rate_limits[0]: unit=SECOND requests_per_unit=100" + FLAGS
    + "api/tenant: rate_limits[1]: unit=MINUTE requests_per_unit=3000 window=5m" + FLAGS
    + "api/tenant/user: unit=SECOND requests_per_unit=15" + FLAGS
    + "api/route=public: unit=SECOND requests_per_unit=7, shadow_mode: true, quota_mode: false\n"
)  # fmt: skip
# envoyproxy/ratelimit's line, unchanged for rules with one plain fixed limit
UPSTREAM_ONLY = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 100}
    descriptors:
      - key: client_id
        rate_limit: {unit: day, requests_per_unit: 3}
  - key: generic_key
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: open
    rate_limit: {unlimited: true}
"""
UPSTREAM_TEXT = (
    "edge/route=public: unit=SECOND requests_per_unit=100, shadow_mode: false, quota_mode: false\n"
    "edge/route=public/client_id: unit=DAY requests_per_unit=3, shadow_mode: false, "
    "quota_mode: false\n"
    "edge/generic_key: unit=MINUTE requests_per_unit=10, shadow_mode: false, quota_mode: true\n"
    "edge/open: unlimited, shadow_mode: false, quota_mode: false\n"
)


@pytest.fixture
async def listeners(tmp_path: Path) -> AsyncIterator[Any]:
    """``await listeners(text)``: (admin URL, debug URL) over a limiter of ``text``."""
    started: list[AdminServer | SideListener] = []

    async def start(text: str) -> tuple[str, str]:
        limiter = Limiter(load_text(tmp_path, text), MemoryStore(), FakeClock())
        admin = AdminServer(limiter, "127.0.0.1", 0, JsonCodec(request_from_json, response_to_json))
        debug = SideListener("127.0.0.1", 0, {"/rlconfig": admin.rlconfig_text})
        for server in (admin, debug):
            await server.start()
            started.append(server)
        return f"http://127.0.0.1:{admin.port}", f"http://127.0.0.1:{debug.port}"

    yield start
    for server in started:
        await server.stop()


async def _get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        return response.status, await response.text()


class TestText:
    async def test_one_line_per_limit_with_what_upstream_cannot_say(self, listeners: Any) -> None:
        _, debug = await listeners(CONFIG)
        assert await _get(debug + "/rlconfig") == (200, TEXT)

    async def test_upstreams_own_rules_are_written_exactly_as_upstream(
        self, listeners: Any
    ) -> None:
        _, debug = await listeners(UPSTREAM_ONLY)
        assert await _get(debug + "/rlconfig") == (200, UPSTREAM_TEXT)


class TestJson:
    async def test_rate_limits_lists_every_limit(self, listeners: Any) -> None:
        """Window, algorithm, burst and zone of each; ``rate_limit`` is still the first."""
        admin, _ = await listeners(CONFIG)
        async with aiohttp.ClientSession() as http, http.get(admin + "/rlconfig") as response:
            bucket, _, plain = (await response.json())["domains"][0]["descriptors"]
        named = {"name": None, "replaces": []}
        assert bucket["rate_limits"] == [
            {"unit": "second", "requests_per_unit": 20, "window_seconds": 1,
             "algorithm": "fixed", **named},
            {"unit": "minute", "requests_per_unit": 3000, "window_seconds": 300,
             "algorithm": "sliding", **named},
            {"unit": "minute", "requests_per_unit": 600, "window_seconds": 60,
             "algorithm": "gcra", "burst": 30, **named},
            {"unit": "month", "requests_per_unit": 1000000, "window_seconds": 2592000,
             "algorithm": "fixed", "calendar": "Europe/Berlin", **named},
        ]  # fmt: skip
        assert bucket["rate_limit"] == bucket["rate_limits"][0]
        assert bucket["classification"]["mode"] == "global-bucket-only"
        assert plain["rate_limits"] == [plain["rate_limit"]]
        assert plain["rate_limit"] == {
            "unit": "second", "requests_per_unit": 7, "window_seconds": 1, "algorithm": "fixed",
            **named,
        }  # fmt: skip

    async def test_each_limit_of_a_cap_carries_its_own_verdict(self, listeners: Any) -> None:
        """The rule's classification is the most severe one: one contended limit shares."""
        admin, _ = await listeners(CONFIG)
        async with aiohttp.ClientSession() as http, http.get(admin + "/rlconfig") as response:
            cap = (await response.json())["domains"][0]["descriptors"][1]
        first, second = cap["rate_limits"]
        assert (first["window_seconds"], first["classification"]["mode"]) == (
            1, "per-client-buckets")  # fmt: skip
        assert (second["window_seconds"], second["classification"]["mode"]) == (
            300, "weighted-fair-queue")  # fmt: skip
        assert second["classification"]["message"].startswith("rate_limits[1]: global cap 10/s")
        assert cap["classification"] == second["classification"]
        assert "classification" not in cap["descriptors"][0]["rate_limits"][0]  # not a cap
