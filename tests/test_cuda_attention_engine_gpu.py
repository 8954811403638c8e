"""The cuda attention backend in the engine on an NVIDIA GPU (skipped without one): tiny Llama
(GQA 2 with head_dim 64, GQA 4 with head_dim 128) and Mistral (sliding window) checkpoints, greedy
decoding with the kernels against the torch reference backend, float16 with the model-dtype cache
and bfloat16 with an INT8 cache. An engine test: it builds checkpoints with the host's
transformers, so benches/gpu/run.sh runs it in the `engine-tests` part, after the kernel tests
(tests/test_cuda_attention_gpu.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from core_driver import CoreDriver
from tiny_models import VOCAB_SIZE, build_checkpoint

from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import create_engine_config
from aieng.sampling import SamplingParams
from aieng.worker.runner import ModelRunner

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.version.cuda is None,
    reason="needs an NVIDIA GPU: the kernels' CPU checks are test_cuda_attention_on_host.py and "
    "test_cuda_attention_selection.py",
)

PROMPT_LENS = [1, 7, 40, 23, 100]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["llama-gqa2-d64", "llama-gqa4-d128", "mistral-window"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, shape = {
        "llama-gqa2-d64": ("llama", dict(hidden_size=256, num_key_value_heads=2)),
        "llama-gqa4-d128": ("llama", dict(hidden_size=512, num_key_value_heads=1)),
        # sliding window 24: prompts of up to 100 tokens attend through it
        "mistral-window": ("mistral", dict(hidden_size=256, num_key_value_heads=2)),
    }[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return build_checkpoint(arch, folder, intermediate_size=512, num_attention_heads=4, **shape)


def run_engine(folder: Path, dtype: str, backend: str, kv_cache_dtype: str) -> list:
    args = EngineArgs(
        model=str(folder), device="cuda", dtype=dtype, block_size=16, kv_cache_memory=1 << 24,
        attention_backend=backend, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    runner = ModelRunner(create_engine_config(args))
    assert runner.attention.name == backend
    scheduler = CoreDriver(runner)
    generator = torch.Generator().manual_seed(3)
    for n in PROMPT_LENS:
        prompt = torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist()
        scheduler.add(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2))
    return scheduler.run()


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [("float16", "auto"), ("bfloat16", "int8")])
def test_engine_with_the_kernels_follows_the_reference(
    checkpoint: Path, dtype: str, kv_cache_dtype: str
) -> None:
    """vLLM's first-divergence rule: identical greedy tokens with close logprobs up to the first
    difference; there the reference's token is in our top 2, nearly tied with ours."""
    ours = run_engine(checkpoint, dtype, "cuda", kv_cache_dtype)
    reference = run_engine(checkpoint, dtype, "torch", kv_cache_dtype)
    for a, b in zip(ours, reference, strict=True):
        for i, (mine, theirs) in enumerate(zip(a.output, b.output, strict=True)):
            if mine != theirs:
                top = a.top_logprobs[i]
                assert theirs in top and top[mine] - top[theirs] < 0.1
                break
            assert abs(a.logprobs[i] - b.logprobs[i]) < 0.1
