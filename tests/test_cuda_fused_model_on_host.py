"""The fused paths the model calls (RMSNorm, the decoder's residual add + RMSNorm, SiLU·mul, the
cuda attention backend's K/V write) with cuda/fused_ops.cu built for the host
(tests/cuda_host/emulate.h): the dispatch is told the CPU is a GPU and `aieng.kernels.fused`
launches through the host build, so the very calls the GPU makes — argument packing, grids, views
of one qkv projection, the start-up check — run on the CPU against the torch ops, on the model's
shapes, and the engine end to end gives the torch path's greedy tokens. The PTX itself runs only
on a GPU (tests/test_cuda_fused_model_gpu.py). Skipped where no C++20 compiler is found."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from core_driver import CoreDriver
from test_cuda_kernels_on_host import COMPILER, RUN_KERNEL, HostKernels, build_host_binary
from test_fused_dispatch import tiny_config
from tiny_models import VOCAB_SIZE, build_checkpoint

import aieng.kernels.fused as fused
from aieng.attention.backend import ForwardContext, QuantizedKVCache
from aieng.attention.causal import CausalAttention, DenseBatch
from aieng.attention.cuda_paged import write_step_kv
from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import create_engine_config
from aieng.kernels import fused_dispatch
from aieng.kernels.fused_dispatch import FusedKernels
from aieng.kernels.reference import (
    rms_norm,
    silu_and_mul_torch,
    write_kv_cache,
    write_quantized_kv_cache,
)
from aieng.layers.activation import silu_and_mul
from aieng.layers.linear import dense_everywhere
from aieng.layers.norm import RMSNorm
from aieng.layers.rotary import RotaryEmbedding
from aieng.models.llama import LlamaDecoderLayer
from aieng.sampling import SamplingParams
from aieng.worker.runner import ModelRunner

pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler (g++ or clang++)")
BOUNDS = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module")
def binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_host_binary(RUN_KERNEL, tmp_path_factory.mktemp("cuda_host"))


class HostLaunch:
    """`aieng.kernels.fused._launch` on the host build (`HostKernels.launch`: the GPU's pointer
    semantics, a view of an earlier argument's storage pointing into its buffer), recording the
    kernels launched."""

    def __init__(self, binary: Path, folder: Path):
        self.host = HostKernels(binary, folder)
        self.launched: list[str] = []

    def __call__(self, kernel: str, grid, block, args) -> None:
        self.launched.append(kernel)
        self.host.launch(kernel, grid, block, args)


@pytest.fixture
def host_fused(binary: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HostLaunch:
    """The fused kernels selected on the CPU (after their real start-up check) and launched
    through the host build."""
    launch = HostLaunch(binary, tmp_path)
    monkeypatch.setattr(fused, "_launch", launch)
    selection = FusedKernels(runs_on=lambda device: device.type == "cpu")
    monkeypatch.setattr(fused_dispatch, "FUSED", selection)
    monkeypatch.delenv("AIENG_DISABLE_FUSED", raising=False)
    return launch


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_the_start_up_check_passes_on_the_host(host_fused: HostLaunch, dtype) -> None:
    passed = fused_dispatch.FUSED.passed(torch.device("cpu"), dtype)
    names = {fused_dispatch.kernel_name(op, dtype) for op in ("add_rms_norm", "silu_and_mul")}
    assert passed == names | {fused_dispatch.kernel_name("rope_kv_write", dtype)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_float32", [False, True])  # Llama's form; OLMo 2's
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 64), (7, 896), (3, 4096)])
@torch.inference_mode()
def test_rms_norm_and_add_and_norm(host_fused, dtype, in_float32, tokens, hidden) -> None:
    generator = torch.Generator().manual_seed(tokens + hidden)
    x, branch = (torch.randn(tokens, hidden, generator=generator).to(dtype) for _ in "xb")
    norm = RMSNorm(hidden, 1e-6, dtype, weight_in_float32=in_float32)
    norm.weight.copy_(torch.rand(hidden, generator=generator) + 0.5)
    want_sum = x + branch
    assert relative(norm(x), rms_norm(x, norm.weight, 1e-6, in_float32)) < BOUNDS[dtype]
    summed, normed = norm.add_and_norm(x, branch.clone())
    assert torch.equal(summed, want_sum)  # the residual add rounds as torch's
    assert relative(normed, rms_norm(want_sum, norm.weight, 1e-6, in_float32)) < BOUNDS[dtype]
    assert host_fused.launched[-2:] == [fused_dispatch.kernel_name("add_rms_norm", dtype)] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "inter"), [(1, 128), (9, 1536)])
@torch.inference_mode()
def test_silu_and_mul(host_fused, dtype, tokens, inter) -> None:
    x = (torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    assert relative(silu_and_mul(x), silu_and_mul_torch(x)) < BOUNDS[dtype]
    assert host_fused.launched[-1] == fused_dispatch.kernel_name("silu_and_mul", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8", [False, True], ids=["kv", "int8"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 64), (14, 2, 128)])
@torch.inference_mode()
def test_the_cuda_backends_kv_write(host_fused, dtype, int8, heads, kv_heads, head_dim) -> None:
    """As the backend gets them: k rotated (a fresh tensor), v a view of the qkv projection; the
    cache holds exactly what the reference writes (an INT8 cache: the same values and scales)."""
    tokens, blocks, block = 11, 4, 16
    generator = torch.Generator().manual_seed(heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    _, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    k = (k.reshape(tokens, kv_heads, head_dim) * 1.5).contiguous()
    v = v.view(tokens, kv_heads, head_dim)
    slots = torch.randperm(blocks * block, generator=generator)[:tokens]

    def cache():
        shape = (blocks, block, kv_heads, head_dim)
        if not int8:
            return torch.full(shape, 7.0, dtype=dtype), torch.full(shape, 7.0, dtype=dtype)
        values = [torch.full(shape, 5, dtype=torch.int8) for _ in "kv"]
        scales = [torch.full((*shape[:-1], 1), 3.0, dtype=dtype) for _ in "kv"]
        return QuantizedKVCache(values[0], values[1], scales[0], scales[1])

    ours, reference = cache(), cache()
    write_step_kv(k, v, ours, slots)
    assert host_fused.launched[-1] == fused_dispatch.kernel_name("rope_kv_write", dtype)
    if int8:
        write_quantized_kv_cache(k, v, reference, slots)
    else:
        write_kv_cache(k, v, reference[0], reference[1], slots)
    for got, want in zip(ours, reference, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("residual_multiplier", [1.0, 0.22])  # Llama; Granite's multiplier
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_the_decoder_layer(host_fused, residual_multiplier, dtype) -> None:
    """The pre-norm layer with its fused add + norm against the same layer with fusions off."""
    config = tiny_config(residual_multiplier=residual_multiplier)
    rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope)
    layer = LlamaDecoderLayer(config, rotary, dtype, dense_everywhere, 0)
    generator = torch.Generator().manual_seed(1)
    for parameter in layer.parameters():
        parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    x = torch.randn(2 * 5, config.hidden_size, generator=generator).to(dtype)
    positions = torch.arange(5).repeat(2)
    ctx = ForwardContext(CausalAttention(), DenseBatch(2, 5), None)
    fused_dispatch.FUSED.passed(x.device, dtype)  # the start-up check's own launches first
    host_fused.launched.clear()
    ours = layer(positions, x, ctx)
    assert host_fused.launched.count(fused_dispatch.kernel_name("add_rms_norm", dtype)) == 2
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIENG_DISABLE_FUSED", "1")
        reference = layer(positions, x, ctx)
    assert relative(ours, reference) < BOUNDS[dtype]


@pytest.fixture(scope="module", params=["llama", "qwen3"])  # qwen3: q/k norms on views, torch
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def greedy(folder: Path) -> list:
    args = EngineArgs(model=str(folder), device="cpu", block_size=4, kv_cache_memory=1 << 20)
    scheduler = CoreDriver(ModelRunner(create_engine_config(args)))
    generator = torch.Generator().manual_seed(3)
    for n in (1, 6, 13):
        prompt = torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist()
        scheduler.add(prompt, SamplingParams(temperature=0.0, max_tokens=4, logprobs=1))
    return scheduler.run()


def test_the_engine_with_the_fused_kernels_follows_torch(
    host_fused: HostLaunch, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32: the same greedy tokens, logprobs within float32 reordering."""
    ours = greedy(checkpoint)
    launched = set(host_fused.launched)
    monkeypatch.setenv("AIENG_DISABLE_FUSED", "1")
    count = len(host_fused.launched)
    reference = greedy(checkpoint)
    assert len(host_fused.launched) == count  # nothing launched with fusions off
    assert {"add_rms_norm_f32", "silu_and_mul_f32"} <= launched
    for a, b in zip(ours, reference, strict=True):
        assert a.output == b.output
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)
