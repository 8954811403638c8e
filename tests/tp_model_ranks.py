"""Runs model forwards on tensor-parallel ranks for tests/test_tp_model_sharding.py.

Kept apart from the test module so that each spawned rank imports only aieng and torch (not
transformers and the test's fixtures): a rank starts in seconds.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import numpy as np
import torch

from aieng.config.engine_config import create_engine_config


@dataclass(frozen=True)
class Case:
    """One checkpoint and the prompts to score on it."""

    name: str
    folder: str
    prompts: list[list[int]]
    chunk_size: int | None = None  # prefill in chunks that read the earlier ones from the cache
    int4_kernel: bool = False  # let INT4 layers use torch's CPU kernel (bf16 activations)


def score(cases: list[Case]) -> dict[str, list[np.ndarray]]:
    """Each case's prompt logprobs through an ordinary ModelRunner on this process's rank."""
    from aieng.config.engine_args import EngineArgs
    from aieng.quantization import linear_method
    from aieng.worker.runner import ModelRunner

    kernel_available = linear_method.int4_kernel_available
    results = {}
    for case in cases:
        linear_method.int4_kernel_available = (
            kernel_available if case.int4_kernel else (lambda: False)
        )
        try:
            kernel = "int4pack" if case.int4_kernel else "dequant"
            args = EngineArgs(
                model=case.folder,
                block_size=4,
                kv_cache_memory=1 << 22,
                cpu_quant_kernel=kernel,
                kv_cache_dtype="float32",  # one rank alone runs native: its default is bfloat16
            )
            runner = ModelRunner(create_engine_config(args))
            results[case.name] = [
                runner.prompt_logprobs(prompt, case.chunk_size).numpy() for prompt in case.prompts
            ]
        finally:
            linear_method.int4_kernel_available = kernel_available
    return results


def rank_main(rank: int, world_size: int, port: int, cases: list[Case], queue) -> None:
    """One rank: join the group over tcp://, score every case, put (rank, results or the
    error's traceback) on `queue`."""
    from aieng.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(1)
    try:
        init_tensor_parallel(rank, world_size, "gloo", f"tcp://127.0.0.1:{port}", timeout_s=60)
        queue.put((rank, score(cases)))
    except BaseException:
        queue.put((rank, traceback.format_exc()))
    finally:
        destroy_tensor_parallel()
