"""What the multiprocess and the Ray executor share: rank 0's worker in this process, every call
first broadcast to the other ranks (one message per step), and every failure fatal — after one
the ranks are out of step.

A `BroadcastExecutor` holds its other ranks in `_ranks` (a `Ranks`: spawned processes, Ray
actors) and its group of step messages in `_group`; a subclass says how its ranks start and,
in `_fail`, what a failed step means for its kind of rank. The rules written here once:

- a step or call is broadcast, then run on rank 0; whatever raises (a rank died, hung past
  distributed_timeout_s, or rank 0 failed) stops the group and is a `WorkerFailedError`, as is
  every later call;
- the first failure is recorded, every rank stopped and the engine told once (`on_failure`);
- a close says goodbye (unless the group already failed), lets the ranks leave, then stops
  what is left; leaves the group, gives torch its threads back (`close_group`, the finalizer);
- a start that fails closes what it started and leaves no group (`abandon_start`), a failed
  rendezvous raised as the typed `WorkerFailedError` (`start_failure`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from aieng.config.engine_config import EngineConfig
from aieng.executor.base import Executor, WorkerFailedError

if TYPE_CHECKING:
    import torch.distributed as dist

    from aieng.worker.runner_io import ModelRunnerOutput, RunnerStep

logger = logging.getLogger(__name__)

FAILURE = "tensor-parallel group failed"
JOIN_S = 5.0  # how long the ranks get to leave after the shutdown message
START_S = 300.0  # how long new ranks may take to import torch and aieng (before the rendezvous)


class Ranks(ABC):
    """Ranks 1..N-1 as rank 0 keeps them, apart from the executor so that its finalizer can
    close them without holding it. A subclass says how its ranks stop, leave and are watched."""

    def __init__(self) -> None:
        self.failure: str | None = None  # why the group failed; None while it serves
        self.closing = False  # shutting down: a rank leaving now is the shutdown, not news
        self.lock = threading.Lock()
        self.on_failure: Callable[[str], None] | None = None

    @abstractmethod
    def stop(self) -> None:
        """Every rank still running stopped now, and nothing of it left."""

    @abstractmethod
    def join(self, timeout_s: float) -> None:
        """After the goodbye: waits up to timeout_s for the ranks to leave on their own."""

    @abstractmethod
    def stop_watching(self) -> None:
        """Before a close: tells the watcher that the ranks' leaving is no failure."""

    def fail(self, reason: str) -> None:
        """Records the first failure, stops every rank, tells the engine (once)."""
        with self.lock:
            if self.failure is not None or self.closing:
                return
            self.failure = reason
        self.stop()
        if self.on_failure is not None:
            self.on_failure(reason)

    def close(self, goodbye: Callable[[], None] | None) -> None:
        """A clean exit: `goodbye` broadcasts Shutdown, the ranks leave on their own."""
        with self.lock:
            if self.closing:
                return
            self.closing = True
            failed = self.failure is not None
        self.stop_watching()
        if goodbye is not None and not failed:
            try:
                goodbye()
                self.join(JOIN_S)
            except Exception as error:
                logger.warning("tensor-parallel shutdown message failed: %s", error)
        self.stop()


class BroadcastExecutor(Executor):
    """Rank 0 of a tensor-parallel group: its worker here, every call first broadcast."""

    world_size: int
    _ranks: Ranks
    _group: dist.ProcessGroup
    _threads: int | None  # torch threads of rank 0 on CPU (None on CUDA)
    _finalizer: weakref.finalize

    def _take_threads(self, config: EngineConfig) -> int:
        """Sets rank 0's share of the CPU threads; torch's count before, for the close."""
        import torch

        from aieng.worker.device import cpu_threads

        self.world_size = config.parallel.tensor_parallel_size
        self._threads = cpu_threads(config, self.world_size)
        threads_before = torch.get_num_threads()
        if self._threads is not None:
            torch.set_num_threads(self._threads)
            logger.info("tensor-parallel rank 0: %d CPU threads", self._threads)
        return threads_before

    def _started(self, threads_before: int) -> None:
        """The group formed: from now on the finalizer closes it."""
        self._finalizer = weakref.finalize(
            self, close_group, self._ranks, self._group, threads_before
        )

    def execute(self, step: RunnerStep) -> ModelRunnerOutput:
        from aieng.executor.messages import Execute

        return self._on_every_rank(Execute.of(step), lambda: self.driver.execute(step))

    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        reduce: str | None = None,
    ) -> Any:
        from aieng.executor.messages import Call, run_call

        message = Call(method, tuple(args), dict(kwargs or {}), reduce)
        return self._on_every_rank(message, lambda: run_call(self.driver, message))

    def _on_every_rank(self, message: Any, run_local: Callable[[], Any]) -> Any:
        import torch

        from aieng.executor.messages import broadcast_message

        if self._ranks.failure is not None:
            raise WorkerFailedError(self._ranks.failure)
        if self._ranks.closing:
            raise WorkerFailedError(f"{FAILURE}: the executor was shut down")
        if self._threads is not None and torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)  # the engine's loop may run in its own thread
        try:
            broadcast_message(message, self._group)
            return run_local()
        except Exception as error:
            # Whatever raised, the other ranks may be inside a collective this rank never
            # joins: the group is out of step, and the failure is fatal.
            raise self._fail(error) from error
        except BaseException as interrupt:  # Ctrl-C mid-step: out of step just the same
            self._ranks.fail(f"{FAILURE}: interrupted mid-step ({type(interrupt).__name__})")
            raise

    @abstractmethod
    def _fail(self, error: Exception) -> WorkerFailedError:
        """The step raised: why (a rank died, hung, or this one failed), recorded as the
        group's failure (`self._ranks.fail`)."""

    def shutdown(self) -> None:
        """Tells the ranks to leave, joins them, leaves the group, releases rank 0's worker.
        Idempotent."""
        self._finalizer()
        self.driver.shutdown()


def abandon_start(ranks: Ranks, threads_before: int) -> None:
    """A start that failed: the ranks started so far stopped, no group left in this process,
    torch's threads as they were."""
    import torch

    from aieng.distributed import parallel_state

    ranks.close(None)
    parallel_state.destroy_tensor_parallel()
    torch.set_num_threads(threads_before)


def close_group(ranks: Ranks, group: dist.ProcessGroup, threads_before: int) -> None:
    """The finalizer: the ranks told to leave and closed, the group left, torch's threads back."""
    import torch

    from aieng.distributed import parallel_state
    from aieng.executor.messages import Shutdown, broadcast_message

    ranks.close(lambda: broadcast_message(Shutdown(), group))
    parallel_state.destroy_tensor_parallel()
    torch.set_num_threads(threads_before)


def start_failure(
    error: BaseException, config: EngineConfig, rank_error: Exception | None = None
) -> BaseException:
    """What a failed start raises: `rank_error` (another rank's own failure, which explains
    rank 0's) unless rank 0's is an input error or an interrupt; a failed rendezvous (torch's
    DistError: a rank that never came, or left while the group formed) as the typed
    WorkerFailedError; anything else as it is."""
    import torch.distributed as dist

    if rank_error is not None and isinstance(error, Exception):
        if not isinstance(error, ValueError):
            return rank_error
    if not isinstance(error, dist.DistError):
        return error
    limit = config.parallel.distributed_timeout_s
    return WorkerFailedError(
        f"{FAILURE} at start-up: the ranks did not all join the group within "
        f"distributed_timeout_s = {limit:g} s ({type(error).__name__}: {error})"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@contextmanager
def master_env(addr: str, port: int):
    """MASTER_ADDR/MASTER_PORT for env:// while the driver joins, then as they were."""
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def weak_callback(callback: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """callback, held without keeping its object alive: a bound method (the engine's) must not
    be kept by the ranks' finalizer, or the engine could never be collected."""
    if callback is None or not hasattr(callback, "__self__"):
        return callback
    method = weakref.WeakMethod(callback)  # type: ignore[arg-type]

    def call(reason: str) -> None:
        target = method()
        if target is not None:
            target(reason)

    return call
