"""`EngineReplica`: one engine as a Ray Serve replica, reached by the ingress's router.

It holds an `AsyncLLMEngine` (the engine loop in its own thread) and streams each request's
deltas back. Ray restarts a replica whose health check fails (its engine loop died) or whose
actor died; a replica that scales down stops taking requests and ends only once its streams
have finished (`graceful_shutdown_timeout_s`).

A rolling upgrade (`aieng.ray.upgrade`) calls `reload` on one replica at a time, once the router
has stopped sending it requests: the replica holds back any request that still arrives, waits
for its own in-flight requests to finish, stops its engine, loads the new version's checkpoint
into a new one and lets the held requests in. A version that fails to load leaves the replica
on the old version (loaded again), and the upgrade stops there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from aieng.config.engine_args import EngineArgs
from aieng.config.model_manifest import MANIFEST, ModelManifest
from aieng.engine.async_engine import AsyncLLMEngine
from aieng.engine.engine_client import ModelInfo
from aieng.engine.llm_engine import EngineDeadError
from aieng.outputs import RequestOutput
from aieng.ray.board import STATS_KEY, VERSION_KEY
from aieng.sampling import SamplingParams

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05


def manifest_version(model: str | None) -> str:
    """The version in the checkpoint folder's aieng-model.json ("" without one)."""
    if model is None or not (Path(model) / MANIFEST).is_file():
        return ""
    return str(ModelManifest.load(model).version)


class EngineReplica:
    async def __init__(self, engine_args: EngineArgs):
        self.engine_args = engine_args
        self.engine = await self._start(engine_args)
        self.version = manifest_version(engine_args.model)
        self._admitting = asyncio.Event()  # cleared while the replica reloads
        self._admitting.set()
        self._in_flight = 0  # generate calls admitted to the engine and not yet done
        self._reloading = False

    @staticmethod
    async def _start(engine_args: EngineArgs) -> AsyncLLMEngine:
        engine = await asyncio.to_thread(AsyncLLMEngine.from_engine_args, engine_args)
        engine.start()
        return engine

    def model_info(self) -> ModelInfo:
        return self.engine.model_info

    async def generate(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        timeout_s: float | None = None,
        client: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's deltas; `timeout_s` from now it is aborted (a deadline in seconds
        rather than a time: the replica's clock is not the ingress's)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        await self._admitting.wait()  # while reloading: held, then served by the new version
        self._in_flight += 1
        try:
            stream = self.engine.generate(request_id, prompt, params, priority, deadline, client)
            async for out in stream:
                yield out
        finally:
            self._in_flight -= 1

    async def reload(self, model: str, replica: str, drain_timeout_s: float) -> str:
        """Drains this replica, then serves the checkpoint folder `model`; its version.
        `replica`: this replica's id, which the router sent the call to (checked)."""
        from ray import serve

        own = serve.get_replica_context().replica_id.unique_id
        if replica != own:
            raise ValueError(f"reload for replica {replica} reached replica {own}")
        if self._reloading:
            raise RuntimeError(f"replica {own} is already reloading")
        self._reloading = True
        self._admitting.clear()
        try:
            deadline = time.monotonic() + drain_timeout_s
            while self._in_flight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
            if self._in_flight > 0:
                raise TimeoutError(
                    f"replica {own}: {self._in_flight} requests still running after "
                    f"{drain_timeout_s:g} s of draining; not reloaded"
                )
            new_args = dataclasses.replace(self.engine_args, model=model)
            await asyncio.to_thread(self._stop_engine)
            try:
                self.engine = await self._start(new_args)
            except BaseException:
                logger.exception(
                    "replica %s: loading %s failed; back to %s", own, model, self.version
                )
                self.engine = await self._start(self.engine_args)
                raise
            old = self.version
            self.engine_args, self.version = new_args, manifest_version(model)
            logger.info("replica %s: version %s -> %s (%s)", own, old, self.version, model)
            return self.version
        finally:
            self._reloading = False
            self._admitting.set()

    def _stop_engine(self) -> None:
        self.engine.shutdown()

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve asks for this every `stats_period_s`; the routers keep it."""
        return {STATS_KEY: dataclasses.asdict(self.engine.stats), VERSION_KEY: self.version}

    def check_health(self) -> None:
        """Ray Serve restarts the replica when this raises (not while it reloads)."""
        if not self._reloading and not self.engine.alive:
            raise EngineDeadError(self.engine.not_running())

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
