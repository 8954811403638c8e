"""`BroadcastExecutor`: what the multiprocess and the Ray executor share — rank 0's worker in this
process, every call first broadcast to the other ranks (one message per step), and any failure
fatal: after one the ranks are out of step.

A subclass holds its other ranks in `_ranks` (`Ranks`: spawned processes, Ray actors), its group in
`_group`, and says in `_fail` what a failed step means for its kind of rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from aieng.executor.base import Executor, WorkerFailedError

if TYPE_CHECKING:
    import torch.distributed as dist

    from aieng.runner_io import ModelRunnerOutput, RunnerStep

FAILURE = "tensor-parallel group failed"


class Ranks(Protocol):
    """Ranks 1..N-1 as rank 0 keeps them."""

    failure: str | None  # why the group failed; None while it serves
    closing: bool  # shutting down: a failure now is the shutdown, not news

    def fail(self, reason: str) -> None: ...

    def close(self, goodbye: Callable[[], None] | None) -> None: ...


class BroadcastExecutor(Executor):
    _ranks: Ranks
    _group: dist.ProcessGroup
    _threads: int | None
    _finalizer: Callable[[], Any]

    def execute(self, step: RunnerStep) -> ModelRunnerOutput:
        from aieng.distributed.messages import Execute

        return self._on_every_rank(Execute.of(step), lambda: self.driver.execute(step))

    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        reduce: str | None = None,
    ) -> Any:
        from aieng.distributed.messages import Call, run_call

        message = Call(method, tuple(args), dict(kwargs or {}), reduce)
        return self._on_every_rank(message, lambda: run_call(self.driver, message))

    def _on_every_rank(self, message: Any, run_local: Callable[[], Any]) -> Any:
        import torch

        from aieng.distributed.messages import broadcast_message

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

    def _fail(self, error: Exception) -> WorkerFailedError:
        """The step raised: why (a rank died, hung, or this one failed), recorded as the
        group's failure."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Tells the ranks to leave, joins them, leaves the group. Idempotent."""
        self._finalizer()


def close_group(ranks: Ranks, group: dist.ProcessGroup, threads_before: int) -> None:
    """The finalizer: the ranks told to leave and closed, the group left, torch's threads back."""
    import torch

    from aieng.distributed import parallel_state
    from aieng.distributed.messages import Shutdown, broadcast_message

    ranks.close(lambda: broadcast_message(Shutdown(), group))
    parallel_state.destroy_tensor_parallel()
    torch.set_num_threads(threads_before)
