"""The divisions the admit script hands back, for the store: made inline before a request is
decided (a small cap), or left to the background (division.Background, a large cap), and
handed in with an admit-script call; the stale rows a division finds dropped by prune.lua.
division.py holds the computing; this module, the calls."""

from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from fairlimit.core.plan import Plan
from fairlimit.store import deadline
from fairlimit.store.redis import division, script
from fairlimit.store.redis.client import Options
from fairlimit.store.redis.keys import SlotGroup
from fairlimit.store.redis.script import ADMIT, GivenDivision, Scripts
from fairlimit.store.redis.slots import Call


class Divisions:
    """A store's divisions: the inline ones, and the background that makes the others."""

    def __init__(
        self,
        client: "aioredis.Redis | RedisCluster",
        options: Options,
        scripts: Scripts,
        call: Call,
    ) -> None:
        self._client = client
        self._options = options
        self._scripts = scripts
        self._call = call  # the store's script call (batched, counted in round_trips)
        self.background = division.Background(
            client, self._hand_in, self._prune, max(options.timeout, 1.0)
        )

    async def given(
        self, plan: Plan, g: SlotGroup, reply: Sequence[Any]
    ) -> dict[str, GivenDivision]:
        """The divisions a hand-back asks for that are made inline; those of large caps are
        left to the background (the next call finds their lock held: the division in force
        decides)."""
        now, backs = division.hand_backs(reply)
        given: dict[str, GivenDivision] = {}
        for back in backs:
            share = plan.shares[g.cap_share[back.index]]
            if not division.inline(back, self._options.inline_rows,
                                   self._options.clock != "caller"):  # fmt: skip
                self.background.want(plan, g, now, back)
                continue
            keys = g.cap_keys[back.index]
            timeout = deadline.timeout(self._options.timeout)
            given[g.caps[back.index]] = await division.made(self._client, keys, share, now,
                                                            back, timeout)  # fmt: skip
            self.background.drop(keys, share, now, back)
        return given

    async def _prune(self, keys: list[str], args: list[str | int]) -> int:
        """prune.lua (not a request's call: not batched, not counted in round_trips): the
        number of clients it dropped."""
        return int(await self._scripts.prune(keys=keys, args=args))

    async def _hand_in(self, plan: Plan, g: SlotGroup, given: dict[str, GivenDivision]) -> None:
        """A division made in the background handed in: the admit script with the cap alone."""
        lock = (False, self._options.lock_ms)
        await self._call(self._scripts.admit, script.keys(ADMIT, g),
                         script.admit_args(plan, g, "", lock, given))  # fmt: skip

    async def close(self) -> None:
        await self.background.close()
