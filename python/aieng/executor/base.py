"""`Executor`: how the engine reaches its workers — one in this process, or one per
tensor-parallel rank — and the typed failures it raises.

The engine asks it for the KV-cache memory every rank can give (the minimum over ranks),
sizes the block pool from that, has every rank allocate it, then sends one step at a time.
`collective_rpc` runs a Worker method on every rank and returns rank 0's result.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from aieng.config.engine_config import EngineConfig
from aieng.errors import EngineFatalError
from aieng.worker.gpu_memory import GpuMemory
from aieng.worker.runner_io import ModelRunnerOutput, RunnerStep
from aieng.worker.worker import Worker, WorkerInfo


class ExecutorError(RuntimeError):
    """The executor cannot serve: a rank died, hung, or could not start."""


class WorkerFailedError(ExecutorError, EngineFatalError):
    """A tensor-parallel rank failed (died, hung past distributed_timeout_s, or raised while the
    group was out of step); the group is stopped and the engine with it."""


class Executor(ABC):
    """The engine's one way to its workers. `driver` is rank 0's worker, in this process."""

    config: EngineConfig
    driver: Worker

    @abstractmethod
    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        reduce: str | None = None,
    ) -> Any:
        """Runs Worker.`method` on every rank; rank 0's result, or with reduce="min" the
        minimum over the ranks' (integer) results."""

    @abstractmethod
    def execute(self, step: RunnerStep) -> ModelRunnerOutput:
        """One engine step on every rank; rank 0's sampled tokens."""

    @abstractmethod
    def shutdown(self) -> None:
        """Releases every process, thread and group it started, and its workers' device
        memory. Idempotent."""

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache that every rank can give: the minimum over the ranks."""
        return int(self.collective_rpc("determine_available_memory", reduce="min"))

    def num_blocks_for(self, memory: int) -> int:
        """How many KV blocks `memory` bytes hold on every rank (ValueError when not one)."""
        return self.driver.num_blocks_for(memory)

    def initialize_cache(self, num_blocks: int) -> WorkerInfo:
        """Every rank allocates `num_blocks` KV blocks; rank 0's WorkerInfo."""
        return self.collective_rpc("initialize_cache", (num_blocks,))

    def prompt_logprobs(self, token_ids: Sequence[int], chunk_size: int | None = None):
        return self.collective_rpc("prompt_logprobs", (token_ids,), {"chunk_size": chunk_size})

    def gpu_memory(self) -> GpuMemory | None:
        """Rank 0's GPU memory figures now; None off CUDA."""
        return self.driver.gpu_memory()
