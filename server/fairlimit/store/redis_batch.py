"""Coalescing: the admission calls made while one pipeline is out go together in the next.

Every request is one EVALSHA, but sending each on its own costs the event loop a connection
checkout, a write, a read and a wake-up per call: at a few thousand requests per second
that, not Redis, is the server's limit. The batcher keeps at most one pipeline in flight;
calls arriving meanwhile queue and leave together when it returns (or on the next loop turn
when none is out), so a busy server sends few, full pipelines and an idle one adds at most
one loop turn. Each call is still its own atomic script run: only the round trip is shared.
A pipeline has no transaction: one call's error (NOSCRIPT after a Redis restart, a script
error) is that call's alone; NOSCRIPT is retried on its own through the script object,
which loads the script again. Redis Cluster calls are not batched (one slot per call).
"""

import asyncio
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

_Call = tuple[Sequence[str], Sequence[str | int], "asyncio.Future[Any]"]


class ScriptBatcher:
    """Runs one script for many callers, a pipeline per batch."""

    def __init__(self, client: "aioredis.Redis", script: AsyncScript, timeout: float) -> None:
        self._client = client
        self._script = script
        self._timeout = timeout
        self._queue: list[_Call] = []
        self._busy = False  # a pipeline is out, or a flush is scheduled
        self._tasks: set[asyncio.Task[None]] = set()
        self.pipelines = 0  # round trips made (the benchmark reports calls per round trip)

    async def call(self, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        """The script's reply for ``keys`` and ``args`` (its error raised, if it failed)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append((keys, args, future))
        if not self._busy:
            self._busy = True
            loop.call_soon(self._flush)  # after the calls this loop turn still brings
        return await future

    def _flush(self) -> None:
        batch, self._queue = self._queue, []
        batch = [call for call in batch if not call[2].done()]  # callers that gave up
        if not batch:
            self._busy = False
            return
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._tasks.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: "asyncio.Task[None]") -> None:
        self._tasks.discard(task)
        if self._queue:
            self._flush()
        else:
            self._busy = False

    async def _send(self, batch: list[_Call]) -> None:
        self.pipelines += 1
        try:
            # The callers' deadline, here too: a pipeline outliving them would be resent by
            # the client's retry once Redis answers again, and charge its calls twice.
            async with asyncio.timeout(self._timeout):
                async with self._client.pipeline(transaction=False) as pipe:
                    for keys, args, _ in batch:
                        pipe.evalsha(self._script.sha, len(keys), *keys, *args)
                    replies = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # the round trip failed: every caller sees why
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (keys, args, future), reply in zip(batch, replies, strict=True):
            if future.done():
                continue
            if isinstance(reply, NoScriptError):
                self._alone(keys, args, future)
            elif isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    def _alone(self, keys: Sequence[str], args: Sequence[str | int], future: "asyncio.Future[Any]"
               ) -> None:  # fmt: skip
        """One call through the script object, which loads the script first (NOSCRIPT)."""

        async def run() -> None:
            try:
                reply = await self._script(keys=keys, args=args)
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
        for _, _, future in self._queue:
            future.cancel()
        self._queue.clear()
