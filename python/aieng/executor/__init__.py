"""The engine's executors: one worker in this process, or one per tensor-parallel rank."""

from __future__ import annotations

from collections.abc import Callable

from aieng.config.engine_config import EngineConfig
from aieng.executor.base import Executor, ExecutorError, WorkerFailedError

__all__ = [
    "Executor",
    "ExecutorError",
    "LaunchedRankError",
    "WorkerFailedError",
    "make_executor",
]


class LaunchedRankError(ExecutorError):
    """This process is a rank > 0 that a launcher (torchrun) started: it serves as a worker
    (`run_as_launched_worker`), it cannot hold an engine."""


def make_executor(
    config: EngineConfig, on_failure: Callable[[str], None] | None = None
) -> Executor:
    """The executor for config.parallel.tensor_parallel_size. `on_failure(reason)` is called
    from a watcher thread when a worker dies between steps."""
    from aieng.distributed import parallel_state

    if parallel_state.get_tp_world_size() > 1:
        raise ExecutorError(
            "this process already holds a tensor-parallel engine (rank "
            f"{parallel_state.get_tp_rank()} of {parallel_state.get_tp_world_size()}); shut it "
            "down first (LLM.shutdown(), or leave its `with LLM(...)` block)"
        )
    if config.parallel.tensor_parallel_size == 1:
        from aieng.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config)
    if config.parallel.distributed_executor_backend == "ray":
        from aieng.executor.ray_executor import RayExecutor

        return RayExecutor(config, on_failure)
    from aieng.executor.multiproc import MultiprocExecutor
    from aieng.executor.rank import launched_place

    place = launched_place(config.parallel.tensor_parallel_size)
    if place is not None and place.rank > 0:
        raise LaunchedRankError(
            f"this process is tensor-parallel rank {place.rank} of {place.world_size}, started "
            "by a launcher: it serves as a worker "
            "(aieng.engine.llm_engine.run_as_launched_worker), and LLM(...) and `aieng serve` do "
            "that on their own"
        )
    return MultiprocExecutor(config, on_failure, launched=place is not None)
