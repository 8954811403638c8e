"""`UniprocExecutor`: the one worker in this process (tensor_parallel_size 1)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from aieng.config.engine_config import EngineConfig
from aieng.executor.base import Executor
from aieng.worker.runner_io import ModelRunnerOutput, RunnerStep
from aieng.worker.worker import Worker


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.config = config
        self.driver = Worker(config)
        self.driver.init_device()
        self.driver.load_model()

    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        reduce: str | None = None,
    ) -> Any:
        return getattr(self.driver, method)(*args, **(kwargs or {}))

    def execute(self, step: RunnerStep) -> ModelRunnerOutput:
        return self.driver.execute(step)

    def shutdown(self) -> None:
        self.driver.shutdown()
