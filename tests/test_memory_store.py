"""Memory-store specifics: bounded state. (Redis bounds its keys with TTLs, in test_redis.)"""

import pytest

from fairlimit.limiter import Limiter
from fairlimit.store.memory import MemoryStore
from helpers import FakeClock, desc, load_text, req

pytestmark = pytest.mark.behaviour

CONFIG = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 100000}
    fair_share: {active_clients: 10000}
    descriptors:
      - key: client_id
        rate_limit: {unit: minute, requests_per_unit: 10}
"""


class TestExpiry:
    async def test_idle_clients_expire(
        self, tmp_path: pytest.TempPathFactory, clock: FakeClock
    ) -> None:
        """After 5k clients go idle past their windows, the store holds only what is live."""
        store = MemoryStore()
        limiter = Limiter(load_text(tmp_path, CONFIG), store, clock)  # type: ignore[arg-type]
        for i in range(5_000):
            await limiter.should_rate_limit(req("edge", desc("route=public", f"client_id=c{i}")))
        assert len(store) > 5_000
        clock.advance(200)
        await limiter.should_rate_limit(req("edge", desc("route=public", "client_id=new")))
        assert len(store) <= 3  # the new client's counter, the cap counter, the cap state

    async def test_live_counters_survive_expiry_sweeps(
        self, tmp_path: pytest.TempPathFactory, clock: FakeClock
    ) -> None:
        """A sweep never drops a counter whose window is still running."""
        store = MemoryStore()
        limiter = Limiter(load_text(tmp_path, CONFIG), store, clock)  # type: ignore[arg-type]
        clock.t = 60 * 28_333_334  # the start of a minute
        for _ in range(10):
            await limiter.should_rate_limit(req("edge", desc("route=public", "client_id=a")))
        clock.advance(30)
        out = await limiter.should_rate_limit(req("edge", desc("route=public", "client_id=a")))
        assert out.statuses[0].limit_remaining == 0 and out.code.name == "OVER_LIMIT"
