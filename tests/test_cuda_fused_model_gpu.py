"""The fused kernels in the model path on an NVIDIA GPU (issue 12), skipped without one: the
engine end to end with the fusions on against `AIENG_DISABLE_FUSED=1` — identical greedy tokens
in float32 (torch attention: its kernels take 16-bit types), vLLM's first-divergence rule with
close logprobs in float16 (cuda attention, model-dtype cache) and bfloat16 (cuda attention, INT8
cache), CUDA graphs on — with every fused kernel the configuration reaches seen launching; and
the cuda backend's K/V write holding exactly what the reference writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from core_driver import CoreDriver
from tiny_models import VOCAB_SIZE, build_checkpoint

import aieng.kernels.fused as fused
from aieng.attention.backend import QuantizedKVCache
from aieng.attention.cuda_paged import write_step_kv
from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import create_engine_config
from aieng.kernels import fused_dispatch
from aieng.kernels.fused_dispatch import kernel_name
from aieng.kernels.reference import write_kv_cache, write_quantized_kv_cache
from aieng.sampling import SamplingParams
from aieng.worker.runner import ModelRunner

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.version.cuda is None,
    reason="needs an NVIDIA GPU: the fused kernels run only there (their CPU checks: "
    "test_fused_dispatch.py, test_cuda_fused_model_on_host.py)",
)

PROMPT_LENS = [1, 7, 40, 23, 100]
MAX_TOKENS = 12


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the fused kernels the model path launches (they still run), after the
    start-up check has passed every kernel in every dtype (its own launches not counted)."""
    device = torch.device("cuda", torch.cuda.current_device())
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert len(fused_dispatch.FUSED.passed(device, dtype)) == 3
    names: list[str] = []
    launch = fused._launch

    def recorded(kernel: str, *args) -> None:
        names.append(kernel)
        launch(kernel, *args)

    monkeypatch.setattr(fused, "_launch", recorded)
    monkeypatch.delenv("AIENG_DISABLE_FUSED", raising=False)
    return names


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    return build_checkpoint(
        "llama", folder, hidden_size=256, intermediate_size=512, num_attention_heads=4
    )  # head_dim 64, two KV heads


def run_engine(folder: Path, dtype: str, backend: str, kv_cache_dtype: str) -> list:
    args = EngineArgs(
        model=str(folder), device="cuda", dtype=dtype, block_size=16, kv_cache_memory=1 << 24,
        attention_backend=backend, kv_cache_dtype=kv_cache_dtype, max_num_seqs=8,
    )  # fmt: skip
    runner = ModelRunner(create_engine_config(args))
    assert runner.attention.name == backend
    scheduler = CoreDriver(runner)
    generator = torch.Generator().manual_seed(3)
    for n in PROMPT_LENS:
        prompt = torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist()
        scheduler.add(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2))
    return scheduler.run()


CASES = [
    # dtype, attention backend, cache, the fused kernels it reaches
    ("float32", "torch", "auto", {"add_rms_norm_f32", "silu_and_mul_f32"}),
    ("float16", "cuda", "auto", {"add_rms_norm_f16", "silu_and_mul_f16", "rope_kv_write_f16"}),
    ("bfloat16", "cuda", "int8", {"add_rms_norm_bf16", "silu_and_mul_bf16", "rope_kv_write_bf16"}),
]


@pytest.mark.parametrize(("dtype", "backend", "kv_cache_dtype", "kernels"), CASES)
def test_the_engine_with_fusions_follows_it_without(
    checkpoint: Path,
    launched: list[str],
    monkeypatch: pytest.MonkeyPatch,
    dtype: str,
    backend: str,
    kv_cache_dtype: str,
    kernels: set[str],
) -> None:
    ours = run_engine(checkpoint, dtype, backend, kv_cache_dtype)
    assert kernels <= set(launched), f"launched only {sorted(set(launched))}"
    monkeypatch.setenv("AIENG_DISABLE_FUSED", "1")
    count = len(launched)
    reference = run_engine(checkpoint, dtype, backend, kv_cache_dtype)
    assert len(launched) == count, "a fused kernel ran with AIENG_DISABLE_FUSED=1"
    for a, b in zip(ours, reference, strict=True):
        if dtype == "float32":
            assert a.output == b.output
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-3
            continue
        for i, (mine, theirs) in enumerate(zip(a.output, b.output, strict=True)):
            if mine != theirs:  # vLLM's rule: theirs in our top 2, nearly tied with ours
                top = a.top_logprobs[i]
                assert theirs in top and top[mine] - top[theirs] < 0.1
                break
            assert abs(a.logprobs[i] - b.logprobs[i]) < 0.1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("int8", [False, True], ids=["kv", "int8"])
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim"), [(1, 8, 8, 64), (37, 32, 8, 128)]
)
def test_the_backends_kv_write_is_the_reference(
    launched: list[str], dtype, int8, tokens, heads, kv_heads, head_dim
) -> None:
    """k fresh (as RoPE leaves it), v a view of the qkv projection; caches poisoned: exactly the
    reference's values (and INT8 scales) in the written slots, the poison elsewhere."""
    blocks, block = 8, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda").to(dtype)
    _, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    k = (k.reshape(tokens, kv_heads, head_dim) * 2).contiguous()
    v = v.view(tokens, kv_heads, head_dim)
    slots = torch.randperm(blocks * block, device="cuda")[:tokens]

    def cache():
        shape = (blocks, block, kv_heads, head_dim)
        if not int8:
            return tuple(torch.full(shape, float("nan"), dtype=dtype, device="cuda") for _ in "kv")
        values = [torch.full(shape, -128, dtype=torch.int8, device="cuda") for _ in "kv"]
        scales = [
            torch.full((*shape[:-1], 1), float("nan"), dtype=dtype, device="cuda") for _ in "kv"
        ]
        return QuantizedKVCache(values[0], values[1], scales[0], scales[1])

    ours, reference = cache(), cache()
    with torch.inference_mode():
        write_step_kv(k, v, ours, slots)
    assert launched[-1:] == [kernel_name("rope_kv_write", dtype)]
    if int8:
        write_quantized_kv_cache(k, v, reference, slots)
    else:
        write_kv_cache(k, v, reference[0], reference[1], slots)
    for got, want in zip(ours, reference, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bits, NaN too
