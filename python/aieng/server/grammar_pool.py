"""Grammar compilation in a pool of its own, bounded in threads, queue and time.

Compiling a large schema or grammar takes CPU seconds (the GIL released). In asyncio's
default pool it would hold up what else runs there (prompt tokenization, chat templates) for
every request. Here at most `THREADS` compiles run and `QUEUED` wait; past that a request is
answered 503 at once. A compile that has not started within `QUEUE_WAIT_S` is dropped (503); one
that runs past `COMPILE_BUDGET_S` is a 400 naming the field, and finishes in its thread, which
it holds until then, so the pool stays bounded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from aieng.server.errors import ApiError, invalid

THREADS = 2
QUEUED = 16
QUEUE_WAIT_S = 10.0
COMPILE_BUDGET_S = 10.0

T = TypeVar("T")


class GrammarPool:
    def __init__(
        self,
        threads: int = THREADS,
        queued: int = QUEUED,
        queue_wait_s: float = QUEUE_WAIT_S,
        budget_s: float = COMPILE_BUDGET_S,
    ) -> None:
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="aieng-grammar")
        self._capacity = threads + queued
        self._queue_wait_s, self._budget_s = queue_wait_s, budget_s
        self._lock = threading.Lock()
        self._pending = 0  # submitted and not finished (or dropped unstarted)

    async def run(self, field: str, compile_fn: Callable[[], T]) -> T:
        """`compile_fn()` in the pool; its errors propagate. `field` names the request field
        the constraint came from, for the 400 of a compile past the budget."""
        with self._lock:
            if self._pending >= self._capacity:
                raise busy(field)
            self._pending += 1
        started = asyncio.Event()
        loop = asyncio.get_running_loop()
        started_at: list[float] = []

        def job() -> T:
            started_at.append(time.monotonic())
            try:
                loop.call_soon_threadsafe(started.set)
            except RuntimeError:  # the loop closed: nobody waits for this compile
                pass
            return compile_fn()

        future: Future[T] = self._executor.submit(job)
        future.add_done_callback(self._release)
        try:
            await asyncio.wait_for(started.wait(), self._queue_wait_s)
        except asyncio.TimeoutError:
            if future.cancel():
                raise busy(field) from None
        except asyncio.CancelledError:  # the client went away: drop the compile if queued
            future.cancel()
            raise
        start = started_at[0] if started_at else time.monotonic()
        left = self._budget_s - (time.monotonic() - start)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), left)
        except asyncio.TimeoutError:
            raise invalid(
                f"{field}: compiling the constraint took more than {self._budget_s:g} s; "
                "simplify it",
                field,
                code="grammar_too_complex",
            ) from None

    def _release(self, _future: Future) -> None:
        with self._lock:
            self._pending -= 1


def busy(field: str) -> ApiError:
    return ApiError(
        503,
        f"{field}: the server is busy compiling other constraints; retry shortly",
        code="grammar_pool_full",
        headers={"Retry-After": "1"},
    )


_pool: GrammarPool | None = None
_pool_lock = threading.Lock()


def grammar_pool() -> GrammarPool:
    """The process's pool, started on first use (servers in one process share it)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = GrammarPool()
        return _pool
