"""`Worker`: one rank's share of the engine — its ModelRunner (weights, KV cache, sampler) on its
device. The executor drives it: `available_kv_cache_memory()` on every rank, then
`initialize_cache(num_blocks)` with the minimum, then `execute(step)` once per engine step."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aieng.config.engine_config import EngineConfig
from aieng.worker.runner import ModelRunner
from aieng.worker.runner_io import ModelRunnerOutput, RunnerStep


class Worker:
    def __init__(self, config: EngineConfig, samples: bool = True):
        """samples: False on tensor-parallel ranks > 0, which run the model but leave sampling
        (and the grammar masks) to rank 0."""
        self.config = config
        self.runner = ModelRunner(config, allocate_cache=False)
        self.runner.samples = samples

    def available_kv_cache_memory(self) -> int:
        return self.runner.available_kv_cache_memory()

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.initialize_cache(num_blocks)

    def execute(self, step: RunnerStep) -> ModelRunnerOutput:
        return self.runner.execute(step)

    def prompt_logprobs(
        self, token_ids: Sequence[int], chunk_size: int | None = None
    ) -> torch.Tensor:
        return self.runner.prompt_logprobs(token_ids, chunk_size)
