"""Coalescing: the admission calls made while one is out go together in the next pipeline.

Every request is one EVALSHA, but sending each on its own costs the event loop a connection
checkout, a write, a read and a wake-up per call: at a few thousand requests per second
that, not Redis, is the server's limit. A call that finds nothing in flight is sent at once
(an idle server pays nothing); calls made while a call or pipeline is out queue, and leave
together in one pipeline when it returns, so a busy server sends few, full pipelines. Each
call is still its own atomic script run: only the round trip is shared. A pipeline has no
transaction: one call's error (NOSCRIPT after a Redis restart, a script error) is that
call's alone; NOSCRIPT is retried on its own through the script object, which loads the
script again. Redis Cluster calls are not batched (one slot per call).
"""

import asyncio
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from fairlimit.store.patience import Heard

_Call = tuple[AsyncScript, Sequence[str], Sequence[str | int], "asyncio.Future[Any]"]


class ScriptBatcher:
    """Runs scripts for many callers, a pipeline per batch."""

    def __init__(self, client: "aioredis.Redis", timeout: float, heard: Heard) -> None:
        self._client = client
        self._timeout = timeout
        self._heard = heard  # a pipeline's replies are Redis answering, callers gone or not
        self._queue: list[_Call] = []
        self._busy = False  # a call or a pipeline is out
        self._tasks: set[asyncio.Task[None]] = set()
        self.pipelines = 0  # round trips made (the benchmark reports calls per round trip)

    async def call(
        self, script: AsyncScript, keys: Sequence[str], args: Sequence[str | int]
    ) -> Any:
        """``script``'s reply for ``keys`` and ``args`` (its error raised, if it failed).

        A call that finds nothing in flight goes at once, on its own, as an unbatched call
        would; calls made while it (or a pipeline) is out queue for the next pipeline.
        """
        if self._busy:
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._queue.append((script, keys, args, future))
            return await future
        self._busy = True
        try:
            return await script(keys=keys, args=args)
        finally:
            self._next()

    def _next(self) -> None:
        """Hand what queued meanwhile to a pipeline task, or go idle."""
        if not self._queue:
            self._busy = False
            return
        task = asyncio.get_running_loop().create_task(self._pump())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _pump(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                batch = [call for call in batch if not call[3].done()]  # callers gone
                if batch:
                    await self._send(batch)
        finally:
            self._busy = False

    async def _send(self, batch: list[_Call]) -> None:
        self.pipelines += 1
        try:
            # The callers' deadline, here too: a pipeline outliving them would be resent by
            # the client's retry once Redis answers again, and charge its calls twice.
            async with asyncio.timeout(self._timeout):
                async with self._client.pipeline(transaction=False) as pipe:
                    for script, keys, args, _ in batch:
                        pipe.evalsha(script.sha, len(keys), *keys, *args)
                    replies = await pipe.execute(raise_on_error=False)
            self._heard.at = asyncio.get_running_loop().time()
        except Exception as exc:  # the round trip failed: every caller sees why
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (script, keys, args, future), reply in zip(batch, replies, strict=True):
            if future.done():
                continue
            if isinstance(reply, NoScriptError):
                self._alone(script, keys, args, future)
            elif isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    def _alone(self, script: AsyncScript, keys: Sequence[str], args: Sequence[str | int],
               future: "asyncio.Future[Any]") -> None:  # fmt: skip
        """One call through the script object, which loads the script first (NOSCRIPT)."""

        async def run() -> None:
            try:
                reply = await script(keys=keys, args=args)
            except Exception as exc:
                if not future.done():
                    future.set_exception(exc)
                return
            if not future.done():
                future.set_result(reply)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for *_, future in self._queue:
            future.cancel()
        self._queue.clear()
