"""`AsyncLLMEngine`: the engine step loop in its own thread, an async generator per request.

The thread owns the `LLMEngine` and is the only one that touches it. The asyncio side talks to
it through a command queue (add, abort, call) and gets outputs back in one
`call_soon_threadsafe` per step, so the event loop never waits on a step and a step never
waits on the event loop. An abort is applied before the next step starts.

Failures, two kinds:
- A request the engine finished with finish_reason "error" (its step failed; the engine freed
  its blocks and goes on) is delivered to its stream like any finished request: the caller
  decides what to make of it. The loop keeps serving.
- The loop dies when an exception escapes `step()` or the engine sets `dead_reason` (a failure
  that leaves the device unusable). Then `failure` says why, every open stream and every later
  `generate()` or `call()` raises `EngineDeadError`, and nothing is served again: the process
  should exit so that its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from aieng._core import Grammar
from aieng.config.engine_args import EngineArgs
from aieng.engine.engine_client import EngineStats, ModelInfo
from aieng.engine.llm_engine import EngineDeadError, LLMEngine
from aieng.engine.thread_names import name_os_thread
from aieng.engine.within import within
from aieng.outputs import RequestOutput
from aieng.pooling import PoolingParams
from aieng.sampling import SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAKE_S = 0.25  # an idle loop still beats this often, so liveness stays visible
_Item = tuple[str | None, RequestOutput | BaseException]  # request id None: every request


@dataclass
class _Add:
    request_id: str
    prompt: Sequence[int]
    params: SamplingParams | PoolingParams
    priority: int
    client: str | None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: Future


class AsyncLLMEngine:
    """Serves one `LLMEngine` to asyncio code; start it from inside the event loop."""

    def __init__(self, engine: LLMEngine, on_step: Callable[[int], None] | None = None):
        self.engine = engine
        self.on_step = on_step  # called in the loop thread with each step's scheduled tokens
        self.stats: EngineStats = engine.stats()
        self.failure: str | None = None  # why the loop died; None while it runs or after shutdown
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False  # the loop thread no longer takes calls (guarded by _lock)
        self._release_on_exit = False  # shutdown(): the loop thread releases the engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ asyncio side

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="aieng-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, on_step: Callable[[int], None] | None = None
    ) -> AsyncLLMEngine:
        """A new engine for `engine_args` (it loads the model: call it off the event loop),
        served by a new AsyncLLMEngine; `start()` it inside the event loop."""
        return cls(LLMEngine(engine_args), on_step)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the loop, then releases the engine: its workers, KV cache and threads. The
        loop thread releases it once its step ends (a step is never cut short); `timeout`
        bounds the wait for that. Idempotent."""
        with self._lock:
            release_here = self._thread is None or self._closed
            self._release_on_exit = True
        self._stopping = True
        self._wake.set()
        if release_here:
            self.engine.shutdown()
        elif self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        running = self._thread is not None and self._thread.is_alive()
        return running and self.failure is None and not self._stopping

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_info(self) -> ModelInfo:
        return self.engine.model_info

    def compile_grammar(self, params: SamplingParams) -> Grammar | None:
        """The compiled constraint of params; thread-safe (the engine's compiler locks)."""
        return self.engine.compile_grammar(params)

    def gpu_memory(self):
        return self.engine.gpu_memory()

    async def generate(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        deadline: float | None = None,
        client: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's deltas up to its finished one. Past `deadline` (monotonic) the
        request is aborted and the last delta has finish_reason "abort". Leaving the loop early
        aborts the request."""
        if not self.alive:
            raise EngineDeadError(self.not_running())
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._send(_Add(request_id, prompt, params, priority, client))
        finished = False
        try:
            while not finished:
                item = await _get(stream, deadline)
                if item is None:  # past the deadline: the abort's output comes next
                    self.abort(request_id)
                    deadline = None
                    continue
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Ends a request before the next step; a no-op for one that has finished."""
        self._send(_Abort(request_id))

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self.abort(request_id)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Runs fn(engine) in the loop thread between two steps; returns its result."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise EngineDeadError(self.not_running())
            self._send(_Call(fn, future))
        return await asyncio.wrap_future(future)

    def not_running(self) -> str:
        """Why the loop is not running, for an error message."""
        if self.failure is not None:
            return f"the engine loop died: {self.failure}"
        return "the engine loop is not running"

    def _send(self, command: _Add | _Abort | _Call) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, items: list[_Item]) -> None:
        for request_id, item in items:
            if request_id is None:  # the loop's end, for every request
                for stream in self._streams.values():
                    stream.put_nowait(item)
                continue
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(item)

    # ------------------------------------------------------------------ loop thread

    def _run(self) -> None:
        name_os_thread()
        try:
            while not self._stopping and self._dead_reason() is None:
                self._turn()
            self.failure = self._dead_reason()
            if self.failure is not None:
                logger.error("the engine is dead: %s", self.failure)
        except BaseException as error:
            logger.exception("the engine loop failed")
            self.failure = f"{type(error).__name__}: {error}"
        self._post([(None, EngineDeadError(self.not_running()))])
        with self._lock:
            self._closed = True
            release = self._release_on_exit
        self._fail_calls()
        if release:
            self.engine.shutdown()

    def _turn(self) -> None:
        if not self.engine.has_unfinished():
            self._wake.wait(IDLE_WAKE_S)
        self._wake.clear()
        timed = logger.isEnabledFor(logging.DEBUG)
        if timed:
            turn_start = time.monotonic()
        items = self._apply_commands()
        if self.engine.has_unfinished():
            if timed:
                step_start, cpu_start = time.monotonic(), time.thread_time()
            # A request whose step failed comes back finished with finish_reason "error".
            items += [(out.request_id, out) for out in self.engine.step()]
            if timed:
                step_s, cpu_s = time.monotonic() - step_start, time.thread_time() - cpu_start
            if self.on_step is not None:
                self.on_step(self.engine.last_step_num_tokens)
        else:
            timed = False
        self.stats = self.engine.stats()
        if items:
            self._post(items)
        if timed:
            _log_step(self.engine.last_step_num_tokens, step_s, cpu_s, turn_start)

    def _dead_reason(self) -> str | None:
        return getattr(self.engine, "dead_reason", None)

    def _apply_commands(self) -> list[_Item]:
        items: list[_Item] = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return items
            if isinstance(command, _Add):
                try:
                    self.engine.add_request(
                        command.request_id,
                        command.prompt,
                        command.params,
                        priority=command.priority,
                        stream=True,
                        client=command.client,
                    )
                except Exception as error:  # bad input: that request fails, the loop goes on
                    items.append((command.request_id, error))
            elif isinstance(command, _Abort):
                out = self.engine.abort(command.request_id)
                if out is not None:
                    items.append((command.request_id, out))
            else:
                try:
                    command.future.set_result(command.fn(self.engine))
                except Exception as error:
                    command.future.set_exception(error)

    def _post(self, items: list[_Item]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # the event loop closed meanwhile
                pass

    def _fail_calls(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Call):
                command.future.set_exception(EngineDeadError(self.not_running()))


async def _get(stream: asyncio.Queue, deadline: float | None):
    """The next item, or None once `deadline` (monotonic) has passed."""
    if deadline is None:
        return await stream.get()
    remaining = deadline - time.monotonic()
    if remaining <= 0 and stream.empty():
        return None
    try:
        return await within(stream.get(), max(remaining, 0.0))
    except TimeoutError:
        return None


def _log_step(tokens: int, step_s: float, cpu_s: float, turn_start: float) -> None:
    """At debug level, one line per step: its tokens, its wall time, the CPU time this thread
    had in it (the rest it was off its core: preempted, or waiting for the GIL; a wait for the
    kernels' workers spins, on the core), and the
    whole turn's wall time (the step with the loop's own work around it)."""
    turn_s = time.monotonic() - turn_start
    logger.debug("step tokens=%d step_s=%.6f cpu_s=%.6f turn_s=%.6f", tokens, step_s, cpu_s, turn_s)
