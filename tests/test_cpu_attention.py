"""The CPU paged-attention backend (rust/src/kernels/paged_attention.rs) against the torch
reference: random steps (decodes, fresh and chunked prefills, GQA, windows, soft-capping), its
selection, and whole models with prefix hits, chunked prefill and preemption."""

import logging

import pytest
import torch
from core_driver import CoreDriver
from tiny_models import build_checkpoint

from aieng import _core
from aieng.attention.cpu_paged import CpuPagedAttention, checked_cpu_backend
from aieng.attention.cuda_self_check import (
    PREFILLS,
    SPLIT_DECODES,
    TOLERANCE,
    WHOLE_DECODES,
    RequestSpec,
    run_case,
)
from aieng.attention.layer import Attention
from aieng.attention.selector import select_attention_backend
from aieng.attention.torch_paged import TorchPagedAttention
from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import create_engine_config
from aieng.config.model_config import ModelConfig
from aieng.sampling import SamplingParams
from aieng.worker.runner import ModelRunner

CASES = [
    SPLIT_DECODES,
    WHOLE_DECODES,
    PREFILLS,
    (RequestSpec(9, 1), RequestSpec(3, 17), RequestSpec(0, 2)),
]


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim", [(4, 4, 64), (8, 2, 40), (14, 2, 64), (6, 1, 128)]
)
@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (50, 1.5), (None, 30.0)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_the_torch_reference(heads, kv_heads, head_dim, window, softcap, block_size):
    layer = Attention(heads, kv_heads, head_dim, 0, sliding_window=window, logit_softcap=softcap)
    for seed, specs in enumerate(CASES):
        got, want = run_case(
            CpuPagedAttention(),
            layer,
            specs,
            block_size,
            torch.float32,
            False,
            torch.device("cpu"),
            seed,
        )
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "dtype, int8",
    [(torch.float32, True), (torch.bfloat16, False), (torch.bfloat16, True)],
    ids=["fp32-int8-cache", "bf16", "bf16-int8-cache"],
)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 40), (6, 1, 128)])
@pytest.mark.parametrize("window, softcap", [(None, None), (7, 1.5)])
def test_bf16_and_int8_caches_match_the_torch_reference(
    dtype, int8, heads, kv_heads, head_dim, window, softcap
):
    """The cache read in place in the model's dtype or as int8 with its scales (applied inside
    the kernel): the torch reference dequantizes the same cache, so only arithmetic differs."""
    layer = Attention(heads, kv_heads, head_dim, 0, sliding_window=window, logit_softcap=softcap)
    for seed, specs in enumerate(CASES):
        got, want = run_case(
            CpuPagedAttention(), layer, specs, 16, dtype, int8, torch.device("cpu"), seed
        )
        assert got.dtype == dtype
        tolerance = TOLERANCE.get(dtype, 1e-4)
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("isa", _core.cpu_isa_paths())
def test_every_instruction_set_path(isa):
    layer = Attention(8, 2, 64, 0, sliding_window=33)
    backend = CpuPagedAttention()
    original = _core.paged_attention

    def forced(*args, **scales):
        return original(*args, isa, **scales)

    try:
        _core.paged_attention = forced
        for seed, specs in enumerate(CASES):
            for dtype, int8 in ((torch.float32, False), (torch.bfloat16, True)):
                got, want = run_case(
                    backend, layer, specs, 16, dtype, int8, torch.device("cpu"), seed
                )
                tolerance = TOLERANCE[dtype] if dtype != torch.float32 else 2e-5
                torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=1e-3)
    finally:
        _core.paged_attention = original


def llama_config(**changes):
    base = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "max_position_embeddings": 512,
        "torch_dtype": "float32",
    }
    return ModelConfig.from_dicts({**base, **changes})


def test_selection_and_its_check(monkeypatch, caplog):
    cpu = torch.device("cpu")
    assert isinstance(
        select_attention_backend("cpu", llama_config(), cpu, torch.float32), CpuPagedAttention
    )
    assert isinstance(
        select_attention_backend("torch", llama_config(), cpu, torch.float32), TorchPagedAttention
    )
    for dtype, cache in ((torch.bfloat16, "auto"), (torch.float32, "int8")):
        chosen = select_attention_backend("cpu", llama_config(), cpu, dtype, cache)
        assert isinstance(chosen, CpuPagedAttention)
    with pytest.raises(ValueError, match=r"'cpu' cannot serve this model: .*float16"):
        select_attention_backend("cpu", llama_config(), cpu, torch.float16)
    with pytest.raises(ValueError, match=r"'cpu' cannot serve this model: .*fp8"):
        select_attention_backend("cpu", llama_config(), cpu, torch.float32, "fp8")

    def wrong(q, k, v, out, *rest, **scales):
        out[:] = 0.0

    monkeypatch.setattr(_core, "paged_attention", wrong)
    with caplog.at_level(logging.WARNING):
        backend = select_attention_backend("auto", llama_config(), cpu, torch.float32)
    assert isinstance(backend, TorchPagedAttention)
    assert "cpu paged_attention differs from its reference" in caplog.text
    assert checked_cpu_backend(llama_config()) is None


def greedy_logprobs(folder, backend, **options):
    options = {"kv_cache_dtype": "float32", **options}  # auto: bfloat16 under the native decoder
    args = EngineArgs(
        model=str(folder),
        block_size=4,
        kv_cache_memory=1 << 22,
        attention_backend=backend,
        **options,
    )
    runner = ModelRunner(create_engine_config(args))
    assert runner.attention.name == backend
    scheduler = CoreDriver(runner)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (1, 6, 13, 30)]
    prompts.append(prompts[2] + [7, 8, 9])  # a prefix hit
    for prompt in prompts:
        scheduler.add(prompt, SamplingParams(temperature=0.0, max_tokens=10, logprobs=1))
    return [(r.output, r.logprobs) for r in scheduler.run()]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_models_follow_the_torch_backend(tmp_path, arch):
    """Same greedy tokens, logprobs within float32 rounding; with chunked prefill too (Gemma's
    windows and soft-caps run through it in test_gemma.py, `auto` picking it)."""
    folder = build_checkpoint(arch, tmp_path / arch)
    want = greedy_logprobs(folder, "torch")
    for options in ({}, {"max_num_batched_tokens": 8, "max_num_seqs": 2}):
        got = greedy_logprobs(folder, "cpu", **options)
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
            assert tokens == want_tokens
            torch.testing.assert_close(
                torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0
            )


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_models_follow_the_torch_backend_through_an_int8_cache(tmp_path, arch):
    """The INT8 cache read in place by the cpu kernel and dequantized by the torch reference:
    the same greedy tokens and logprobs within a quantization step. The two sum in different
    orders (rounding-level differences, ~1e-7 relative, in every attention output), and K/V
    are quantized again each step: a value that lands that close to a rounding boundary is
    stored one int8 step apart (1/127 of its row's largest value), which moves later logprobs
    by up to ~5e-4 on these random models (measured: 4.6e-4 on qwen3's prefix-hit prompt with
    the AVX-512 decode path, 1.4e-6 on the others), so the bound is 1e-3, not float32's 1e-4."""
    folder = build_checkpoint(arch, tmp_path / arch)
    want = greedy_logprobs(folder, "torch", kv_cache_dtype="int8")
    chunked = {"max_num_batched_tokens": 8, "max_num_seqs": 2}
    got = greedy_logprobs(folder, "cpu", kv_cache_dtype="int8", **chunked)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(
            torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-3, rtol=0
        )
