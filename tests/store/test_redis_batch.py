"""Redis-only: concurrent admissions share pipelines (store/redis/batch.py), and each call
keeps its own answer."""

import asyncio
from pathlib import Path

import pytest

from fairlimit.core.matching import Matcher
from fairlimit.core.plan import plan
from fairlimit.store.redis import RedisStore
from helpers import desc, load_text, req
from redis_servers import RedisProcess, StoreFactory

pytestmark = pytest.mark.behaviour

T0 = 1_700_000_000.0
CONFIG = """
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: minute, requests_per_unit: 10}
"""


@pytest.fixture
def matcher(tmp_path: Path) -> Matcher:
    return Matcher(load_text(tmp_path, CONFIG).config)


async def _admit_all(store: RedisStore, matcher: Matcher, clients: list[str]) -> list[bool]:
    plans = [plan(req("edge", desc(f"client_id={c}")), matcher) for c in clients]
    outcomes = await asyncio.gather(*(store.admit(p, T0) for p in plans))
    return [o.admitted for o in outcomes]


class TestCoalescing:
    async def test_concurrent_calls_share_round_trips_and_keep_their_answers(
        self, redis_store_factory: StoreFactory, matcher: Matcher
    ) -> None:
        """30 calls at once: fewer pipelines than calls; one client still gets exactly 10."""
        store = await redis_store_factory(local_cache=0)
        assert isinstance(store, RedisStore) and store._batch is not None
        try:
            answers = await _admit_all(store, matcher, ["a"] * 15 + [f"c{i}" for i in range(15)])
            assert store.round_trips == 30
            assert store._batch.pipelines < 30
        finally:
            await store.close()
        assert answers[:15].count(True) == 10 and answers[15:] == [True] * 15

    async def test_a_flushed_script_is_loaded_again_for_a_whole_batch(
        self, redis_store_factory: StoreFactory, redis_server: RedisProcess, matcher: Matcher
    ) -> None:
        """SCRIPT FLUSH between batches: every call of the next batch is still answered."""
        store = await redis_store_factory(local_cache=0)
        assert isinstance(store, RedisStore)
        try:
            assert await _admit_all(store, matcher, ["a", "b"]) == [True, True]
            with redis_server.client() as client:
                client.script_flush()
            assert await _admit_all(store, matcher, [f"c{i}" for i in range(8)]) == [True] * 8
        finally:
            await store.close()
