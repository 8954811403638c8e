"""Graceful shutdown: on SIGTERM stop admitting (503), let running requests finish for up to
the shutdown timeout, abort the rest (finish_reason "abort"), then stop the HTTP server.

uvicorn on its own would close the listener at once and re-raise the signal on exit; this
server keeps answering 503 while it drains and exits with status 0.

When the engine loop dies (`ctx.engine_failed`) the server stops at once, with nothing left to
drain; `aieng serve` then exits non-zero so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn

from aieng.server.admission import ServerState
from aieng.server.context import ServerContext
from aieng.server.errors import ApiError

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 5.0  # after the aborts, time for the last chunks to reach the clients


async def drain(ctx: ServerContext, timeout: float) -> None:
    ctx.admission.state = ServerState.DRAINING
    logger.info("draining: %d requests in flight", ctx.admission.num_in_flight)
    if not await _until_idle(ctx, timeout) and ctx.engine is not None:
        logger.info("shutdown timeout: aborting %d requests", ctx.admission.num_in_flight)
        ctx.engine.abort_all()
        ctx.admission.abort_waiting(  # those still waiting for their turn to go to the engine
            ApiError(503, "the server shut down before this request started", code="draining")
        )
        await _until_idle(ctx, FLUSH_TIMEOUT_S)


async def _until_idle(ctx: ServerContext, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while ctx.admission.num_in_flight:
        if time.monotonic() >= end:
            return False
        await asyncio.sleep(0.05)
    return True


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ctx: ServerContext, shutdown_timeout: float):
        super().__init__(config)
        self.ctx, self.shutdown_timeout = ctx, shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def on_tick(self, counter: int) -> bool:
        if self.ctx.engine_failed and not self.should_exit:
            logger.error("the engine loop died: stopping the server")
            self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self._drain is not None:  # a second signal: stop now
            if sig == signal.SIGINT and self.should_exit:
                self.force_exit = True
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self.ctx, self.shutdown_timeout)
        finally:
            self.should_exit = True
