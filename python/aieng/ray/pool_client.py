"""`ReplicaPoolClient`: the `EngineClient` the ingress's server talks to, over the engine
replicas of a Ray Serve deployment.

A request goes to the replica the router picks. If that replica fails before the request has
produced any output (its actor died, its engine loop died), the request is sent again and the
router picks among the replicas left, up to `max_retries` times: the client sees nothing of it.
Once output has been streamed the request cannot be replayed: it ends with `ReplicaLostError`
(the server's error event). No other request is touched. An aborted request (its client went
away) ends its replica call, and its stream just stops.

The tokenizer and the grammar compiler are the ingress's own, loaded from the checkpoint the
replicas serve; the stats are the sum over the replicas that run (`pooled_stats`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError, WorkerCrashedError
from ray.serve.context import _get_serve_request_context, _serve_request_context
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from aieng._core import Grammar, GrammarCompiler, Tokenizer
from aieng.engine.engine_client import EngineStats, ModelInfo
from aieng.engine.llm_engine import EngineDeadError
from aieng.outputs import RequestOutput
from aieng.ray.board import ReplicaBoard
from aieng.sampling import SamplingParams

logger = logging.getLogger(__name__)

# What a replica that can no longer serve raises (its process, or its engine loop, is gone).
REPLICA_FAILURES = (RayActorError, ActorUnavailableError, WorkerCrashedError, EngineDeadError)


class ReplicaLostError(EngineDeadError):
    """The replica serving a request failed: after the request had streamed output, or on
    every replica it was retried on."""


class ReplicaPoolClient:
    def __init__(self, replicas: DeploymentHandle, board: ReplicaBoard, max_retries: int):
        """Blocks until a replica answers (call it off the event loop)."""
        self.replicas = replicas
        self.board = board
        self.max_retries = max_retries
        self.failure: str | None = None  # never set: Ray restarts a failed replica
        self._model_info: ModelInfo = replicas.model_info.remote().result()
        self._tokenizer = Tokenizer.from_dir(self._model_info.model_path)
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._tag = uuid.uuid4().hex[:8]  # request ids unique across ingress replicas
        self._streams: dict[str, DeploymentResponseGenerator] = {}
        self._running = False

    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    async def refresh_model_info(self) -> ModelInfo:
        """The replicas' model info asked again (after a rolling upgrade: the new version's)."""
        self._model_info = await self.replicas.model_info.remote()
        return self._model_info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def stats(self) -> EngineStats:
        return pooled_stats(self.board.snapshot().values())

    @property
    def alive(self) -> bool:
        return self._running

    def not_running(self) -> str:
        return "the replica pool is stopped"

    def start(self) -> None:
        self._running = True

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops sending work to the pool (the replicas are Ray Serve's to release)."""
        self._running = False
        self.abort_all()

    def gpu_memory(self) -> Any:
        return None  # each replica's own; the ingress holds no device

    def compile_grammar(self, params: SamplingParams) -> Grammar | None:
        """Checks the constraint here, before a replica compiles it again for its requests."""
        constraint = params.structured_outputs
        if constraint is None:
            return None
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer, self._model_info.vocab_size)
            compiler = self._compiler
        return compiler.compile(constraint.kind, constraint.source())

    async def generate(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        deadline: float | None = None,
        client: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if not self._running:
            raise EngineDeadError(self.not_running())
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        replica_request_id = f"{self._tag}-{request_id}"
        for attempt in range(self.max_retries + 1):
            timeout_s = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            own_routing_id()
            stream = self.replicas.options(stream=True, method_name="generate").remote(
                request_id=replica_request_id,
                prompt=list(prompt),
                params=params,
                priority=priority,
                timeout_s=timeout_s,
                client=client,
            )
            self._streams[request_id] = stream
            streamed = finished = False
            try:
                async for out in stream:
                    streamed = True
                    finished = out.finished
                    out.request_id = request_id
                    yield out
                return
            except Exception as error:
                if stream.cancelled():  # aborted here (`abort`): the request ends, quietly
                    return
                cause = _cause(error)
                if not isinstance(cause, REPLICA_FAILURES):
                    raise cause from None
                if streamed:
                    raise ReplicaLostError(
                        f"the replica serving request {request_id} failed after it had started "
                        f"streaming; retry the request ({type(cause).__name__}: {cause})"
                    ) from None
                if attempt == self.max_retries:
                    raise ReplicaLostError(
                        f"request {request_id} failed on {attempt + 1} replicas, the last with "
                        f"{type(cause).__name__}: {cause}"
                    ) from None
                logger.warning(
                    "request %s: its replica failed before streaming (%s); retrying",
                    request_id,
                    type(cause).__name__,
                )
            finally:
                self._streams.pop(request_id, None)
                if not finished:
                    stream.cancel()

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.cancel()

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self.abort(request_id)


def own_routing_id() -> None:
    """Files the next handle call of this task under a Ray Serve request id of its own.

    Ray Serve gives a handle call the internal id of the HTTP request it is made for, and its
    router keeps one pending call per id (`_pending_requests_by_id`): of the calls one HTTP
    request fans out to (a prompt list, several embedding inputs, each an engine request of its
    own) it routed the first and left the others waiting forever. Each generate call runs in a
    task of its own (the server's `Generation` pumps), so the id set here is that call's only.
    """
    context = _get_serve_request_context()
    _serve_request_context.set(dataclasses.replace(context, _internal_request_id=uuid.uuid4().hex))


def _cause(error: BaseException) -> BaseException:
    """The exception the replica raised, without Ray's wrapper."""
    if isinstance(error, RayTaskError) and isinstance(error.cause, BaseException):
        return error.cause
    return error


def pooled_stats(replicas: Iterable[EngineStats]) -> EngineStats:
    """The replicas' stats as one engine's: counts summed, KV usage over all their blocks.
    The heartbeat is now while any replica reports, else 0 (no replica serves)."""
    stats = list(replicas)
    if not stats:
        return EngineStats()
    num_blocks = sum(s.num_blocks for s in stats)
    used = sum(s.kv_cache_usage * s.num_blocks for s in stats)
    return EngineStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        kv_cache_usage=used / num_blocks if num_blocks else 0.0,
        num_blocks=num_blocks,
        num_free_blocks=sum(s.num_free_blocks for s in stats),
        num_cached_blocks=sum(s.num_cached_blocks for s in stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        num_steps=sum(s.num_steps for s in stats),
        step_token_budget=sum(s.step_token_budget for s in stats),
        num_requests=sum(s.num_requests for s in stats),
        kv_cache_dtype=stats[0].kv_cache_dtype,
        block_size=stats[0].block_size,
        max_num_seqs=sum(s.max_num_seqs for s in stats),
        heartbeat=time.monotonic(),
    )
