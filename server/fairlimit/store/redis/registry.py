"""The caps a Redis is known to divide, and the demand reports replicas exchange.

A cap is added to the registry (a set of meta keys, ``{prefix}caps``) in the background when
its division is written; caps() reads each listed cap's meta hash and drops the ones gone.
The demand reports (RLQS) sit in one hash, ``{prefix}rlqs-demand``, written and read by
demand.lua.
"""

import asyncio
import logging
from collections.abc import Mapping, Sequence

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from fairlimit.core.fairshare import CapReport, FairnessFigures
from fairlimit.core.sharing import DIVISION_FIELDS
from fairlimit.errors import StoreUnavailable
from fairlimit.store.redis import script
from fairlimit.store.redis.client import bounded, unavailable

log = logging.getLogger(__name__)

_REGISTRY_TTL = 86400


class CapRegistry:
    """The cap registry and the demand exchange of one store: its keys and its writes out."""

    def __init__(
        self, client: "aioredis.Redis | RedisCluster", key_prefix: str, timeout: float
    ) -> None:
        self._client = client
        self._timeout = timeout  # the store's ``?timeout=``
        self._registry = f"{key_prefix}caps"
        self.tasks: set[asyncio.Task[None]] = set()  # the registry writes out
        self._demand = client.register_script(script.source("demand"))
        self._demand_key = f"{key_prefix}rlqs-demand"

    def register(self, metas: Sequence[str]) -> None:
        """Add caps to the registry that caps() reads (in the background, when a cap's
        division is written)."""

        async def register() -> None:
            try:
                with unavailable():
                    async with self._client.pipeline(transaction=False) as pipe:
                        pipe.sadd(self._registry, *metas)
                        pipe.expire(self._registry, _REGISTRY_TTL)
                        await pipe.execute()
            except StoreUnavailable as exc:
                log.debug("cap registry not updated: %s", exc)

        task = asyncio.get_running_loop().create_task(register())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def exchange_demand(
        self, consumer: str, report: str, at: str, ttl: float
    ) -> Mapping[str, str]:
        """demand.lua: ``report`` written for ``consumer``, the others' read (``at``: the
        caller's clock, or "" for Redis TIME)."""
        async with bounded(max(self._timeout, 1.0)):
            flat = await self._demand(keys=[self._demand_key],
                                      args=[at, consumer, repr(ttl), report])  # fmt: skip
        return {str(k): str(v) for k, v in zip(flat[::2], flat[1::2], strict=True)}

    async def caps(self) -> Mapping[str, CapReport]:
        async with bounded(max(self._timeout, 1.0)):
            metas = sorted(await self._client.smembers(self._registry))
            async with self._client.pipeline(transaction=False) as pipe:
                for meta in metas:
                    pipe.hgetall(meta)
                states = await pipe.execute() if metas else []
            gone = [m for m, state in zip(metas, states, strict=True) if not state]
            if gone:
                await self._client.srem(self._registry, *gone)
        reports = (_report(state) for state in states if state)
        return {report.cap: report for report in reports}

    async def close(self) -> None:
        """Cancel the registry writes out, and wait for them: a cancelled write hands its
        connection back before the pool closes."""
        pending = list(self.tasks)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def _report(state: Mapping[str, str]) -> CapReport:
    cold = state.get(DIVISION_FIELDS["cold"], "1") != "0"
    level = None if cold else float(state[DIVISION_FIELDS["level"]])
    figures = None
    if "f_u" in state:
        u, a, lv, j, t, s = (float(state[f]) for f in script.FIGURES)
        figures = FairnessFigures(u, int(a), lv, j, t, int(s))
    return CapReport(state.get("cap", ""), level, int(state.get("declared", 0)), figures)
