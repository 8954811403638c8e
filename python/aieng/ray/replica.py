"""`EngineReplica`: one engine as a Ray Serve replica, reached by the ingress's router.

It holds an `AsyncLLMEngine` (the engine loop in its own thread) and streams each request's
deltas back. Ray restarts a replica whose health check fails (its engine loop died) or whose
actor died; a replica that scales down stops taking requests and ends only once its streams
have finished (`graceful_shutdown_timeout_s`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aieng.async_engine import AsyncLLMEngine
from aieng.engine import EngineDeadError, LLMEngine
from aieng.engine_args import EngineArgs
from aieng.engine_client import ModelInfo
from aieng.outputs import RequestOutput
from aieng.ray.board import STATS_KEY
from aieng.sampling import SamplingParams


class EngineReplica:
    async def __init__(self, engine_args: EngineArgs):
        engine = await asyncio.to_thread(LLMEngine, engine_args)
        self.engine = AsyncLLMEngine(engine)
        self.engine.start()

    def model_info(self) -> ModelInfo:
        return self.engine.model_info

    async def generate(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's deltas; `timeout_s` from now it is aborted (a deadline in seconds
        rather than a time: the replica's clock is not the ingress's)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        async for out in self.engine.generate(request_id, prompt, params, priority, deadline):
            yield out

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve asks for this every `stats_period_s`; the routers keep it."""
        return {STATS_KEY: dataclasses.asdict(self.engine.stats)}

    def check_health(self) -> None:
        """Ray Serve restarts the replica when this raises."""
        if not self.engine.alive:
            raise EngineDeadError(self.engine.not_running())

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()
            engine.engine.shutdown()
