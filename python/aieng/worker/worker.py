"""`Worker`: one rank's share of the engine, on the device it owns. It selects its device and
joins the tensor-parallel group (`init_device`), loads the model into its ModelRunner (weights,
KV cache, sampler: `load_model`), profiles the memory its KV cache may take
(`determine_available_memory`), allocates that cache (`initialize_cache`, which returns the
`WorkerInfo` the engine reports), then executes one step at a time.

The executor reaches a worker only through these methods — on every rank the same calls, in the
same order — and never its runner."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from aieng.config.engine_config import EngineConfig
from aieng.errors import EngineStateError
from aieng.worker.device import RankPlace, join_group
from aieng.worker.gpu_memory import GpuMemory, gpu_memory_figures
from aieng.worker.runner import ModelRunner
from aieng.worker.runner_io import ModelRunnerOutput, RunnerStep

if TYPE_CHECKING:
    import torch.distributed as dist


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker with its cache allocated tells the engine about itself."""

    device: str  # the torch device, e.g. "cpu" or "cuda:0"
    block_bytes: int  # one KV block's bytes (the draft model's included)
    kv_cache_dtype: str
    kernels: dict[str, str]  # the compute paths chosen at load
    load_phases: dict[str, float]  # seconds per phase of the load


class Worker:
    def __init__(
        self, engine_config: EngineConfig, place: RankPlace | None = None, samples: bool = True
    ):
        """place: this rank's place in a tensor-parallel group (None: the only rank).
        samples: False on ranks > 0, which run the model but leave sampling (and the grammar
        masks) to rank 0."""
        self.place = place
        self.engine_config = (
            engine_config if place is None else engine_config.for_rank(place.rank, place.local_rank)
        )
        self.samples = samples
        self.device = self.engine_config.torch_device
        self._runner: ModelRunner | None = None

    def init_device(self) -> dist.ProcessGroup | None:
        """Selects this rank's device and, in a tensor-parallel group, joins the group: the
        group of step messages (None for the only rank)."""
        if self.device.type == "cuda" and self.place is not None:
            torch.cuda.set_device(self.device)
        if self.place is None:
            return None
        return join_group(self.engine_config, self.place)

    def load_model(self) -> None:
        """Loads the weights into a ModelRunner on this device; the KV cache comes later."""
        self._runner = ModelRunner(self.engine_config, allocate_cache=False)
        self._runner.samples = self.samples

    @property
    def runner(self) -> ModelRunner:
        """The loaded ModelRunner (EngineStateError before `load_model` or after `shutdown`).
        For tests and tools that inspect the model in this process; the executor never reads
        it."""
        if self._runner is None:
            raise EngineStateError("the worker holds no model (before load_model, or shut down)")
        return self._runner

    def determine_available_memory(self) -> int:
        """Bytes this device gives the KV cache (profiled on CUDA; see ModelRunner)."""
        return self.runner.available_kv_cache_memory()

    def num_blocks_for(self, memory: int) -> int:
        """How many KV blocks `memory` bytes hold (ValueError when not one)."""
        return self.runner.num_blocks_for(memory)

    def initialize_cache(self, num_blocks: int) -> WorkerInfo:
        self.runner.initialize_cache(num_blocks)
        return self.info()

    def info(self) -> WorkerInfo:
        runner = self.runner
        return WorkerInfo(
            device=str(runner.device),
            block_bytes=runner.block_bytes,
            kv_cache_dtype=runner.kv_spec.cache_dtype,
            kernels=runner.kernel_names(),
            load_phases=runner.load_times.phases(),
        )

    def execute(self, step: RunnerStep) -> ModelRunnerOutput:
        return self.runner.execute(step)

    def prompt_logprobs(
        self, token_ids: Sequence[int], chunk_size: int | None = None
    ) -> torch.Tensor:
        return self.runner.prompt_logprobs(token_ids, chunk_size)

    def shutdown(self) -> None:
        """Releases the model, the KV cache and the CUDA graphs now. Idempotent."""
        if self._runner is not None:
            self._runner.release()
            self._runner = None

    def gpu_memory(self) -> GpuMemory | None:
        """This rank's GPU memory figures now; None off CUDA or once shut down."""
        return None if self._runner is None else gpu_memory_figures(self._runner)
