"""Work off the event loop in threads of its own, served in fair shares between clients.

Waiting jobs are ordered by a `FairQueue` over the client's (address, key), in the cost the
caller gives (bytes): a flood from one client queues behind itself while another client's job
runs next. Used for tokenizing (`TokenizerPool`) and for parsing large bodies (`offloop`),
never asyncio's default pool, which anything else may fill.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from aieng.engine.thread_names import name_os_thread
from aieng.server.fair_queue import FairQueue

T = TypeVar("T")


@dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future


class FairPool:
    def __init__(self, threads: int, name: str) -> None:
        self.threads = threads
        self._executor = ThreadPoolExecutor(
            threads, thread_name_prefix=name, initializer=name_os_thread
        )
        self._waiting: FairQueue[_Job] = FairQueue(depth=2)
        self._running = 0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    async def run(self, client: tuple[str, str], cost: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a pool thread once the client's fair share comes; `cost`: its bytes."""
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop.create_future())
        self._waiting.push(client, job, cost)
        self._dispatch(loop)
        try:
            return await job.future
        except asyncio.CancelledError:
            self._waiting.remove(client, job)  # a no-op once it runs: it finishes unread
            raise

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        while self._running < self.threads and len(self._waiting):
            job = self._waiting.pop()
            self._running += 1
            running = self._executor.submit(job.fn, *job.args)
            running.add_done_callback(lambda done, job=job: _call_soon(loop, self._done, job, done))

    def _done(self, job: _Job, done: Future) -> None:
        self._running -= 1
        if not job.future.done():
            error = done.exception()
            if error is None:
                job.future.set_result(done.result())
            else:
                job.future.set_exception(error)
        self._dispatch(asyncio.get_running_loop())

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop closed: nobody waits for this job
        pass
