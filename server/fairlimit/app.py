"""Composition root: settings -> config -> store -> limiter -> servers, and the serve loop."""

import asyncio
import logging
import signal
from collections.abc import Callable

from fairlimit.config.loader import load
from fairlimit.grpc_api.servicer import GrpcServer
from fairlimit.limiter import Limiter
from fairlimit.settings import Settings
from fairlimit.store import open_store

log = logging.getLogger("fairlimit")

DRAIN_SECONDS = 5.0


class App:
    """A running fairlimit: the limiter and the servers around it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        loaded = load(settings.config, strict=settings.strict)
        for line in loaded.warnings:
            log.warning("%s", line)
        self.store = open_store(settings.backend)
        self.limiter = Limiter(
            loaded, self.store, shadow=settings.shadow, failure_mode=settings.failure_mode
        )
        self.grpc = GrpcServer(self.limiter, settings.grpc_addr)
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        await self.grpc.start()
        files = ", ".join(str(p) for p in self.limiter.loaded.files)
        log.info(
            "config loaded: %d domains from %s",
            len(self.limiter.loaded.config.domains),
            files or "(no files)",
        )
        log.info("serving gRPC on %s (port %d)", self.settings.grpc_addr, self.grpc.port)

    def stop(self) -> None:
        """Ask the serve loop to drain and exit."""
        self._stopping.set()

    async def run(self, on_ready: Callable[["App"], None] | None = None) -> None:
        """Serve until SIGTERM/SIGINT or ``stop()``: then NOT_SERVING, drain, exit."""
        await self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        if on_ready is not None:
            on_ready(self)
        await self._stopping.wait()
        log.info("draining: health NOT_SERVING, finishing in-flight calls")
        await self.grpc.drain(DRAIN_SECONDS)
        await self.store.close()
        log.info("stopped")
