"""The fused CUDA ops' dispatch (aieng.kernels.fused_dispatch) without a GPU: with the CPU's own
element-wise kernels off (tests/test_cpu_fused.py covers them), every layer runs its torch ops,
bit for bit what they computed before the dispatch existed (the formulas are written out here),
no kernel is checked or launched; the selection — a start-up
check run once per device and dtype, a failing kernel named in a warning and replaced by torch,
AIENG_DISABLE_FUSED, autograd — with the kernels' checks injected."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import aieng.kernels.fused as fused
from aieng.attention.backend import ForwardContext
from aieng.attention.causal import CausalAttention, DenseBatch
from aieng.config.model_config import ModelConfig
from aieng.kernels import fused_dispatch
from aieng.kernels.errors import KernelError
from aieng.kernels.fused import CheckCase
from aieng.kernels.fused_dispatch import FusedKernels
from aieng.kernels.self_check import RowBound
from aieng.layers.activation import silu_and_mul
from aieng.layers.linear import dense_everywhere
from aieng.layers.norm import RMSNorm
from aieng.layers.rotary import RotaryEmbedding
from aieng.models.llama import LlamaDecoderLayer


def old_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, in_float32: bool):
    """RMSNorm as layers/norm.py computed it before the fused kernels were wired in."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32).to(x.dtype) if in_float32 else weight * x32.to(x.dtype)


@pytest.fixture(autouse=True)
def no_cpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's element-wise kernels off: these tests are about the CUDA kernels' dispatch."""
    monkeypatch.setattr(fused_dispatch, "CPU_FUSED", FusedKernels(runs_on=lambda device: False))


@pytest.fixture
def no_kernels(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Any start-up check or kernel launch is recorded (and fails the test where it happens)."""
    calls: list[str] = []

    def check(device, dtype):
        calls.append(f"check {device} {dtype}")
        raise AssertionError("a fused kernel check ran on the CPU")

    def launch(kernel, *args):
        calls.append(kernel)
        raise AssertionError(f"{kernel} launched on the CPU")

    monkeypatch.setattr(fused_dispatch, "FUSED", FusedKernels(check=check))
    monkeypatch.setattr(fused, "_launch", launch)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_float32", [False, True])
@torch.inference_mode()
def test_norms_and_silu_on_the_cpu_are_the_torch_ops(no_kernels, dtype, in_float32) -> None:
    generator = torch.Generator().manual_seed(0)
    x, branch = (torch.randn(9, 96, generator=generator).to(dtype) for _ in range(2))
    norm = RMSNorm(96, 1e-5, dtype, weight_in_float32=in_float32)
    norm.weight.copy_(torch.rand(96, generator=generator) + 0.5)
    before = x.clone(), branch.clone()
    assert torch.equal(norm(x), old_rms_norm(x, norm.weight, 1e-5, in_float32))
    summed, normed = norm.add_and_norm(x, branch)
    assert torch.equal(summed, x + branch)
    assert torch.equal(normed, old_rms_norm(x + branch, norm.weight, 1e-5, in_float32))
    assert torch.equal(x, before[0]) and torch.equal(branch, before[1])  # nothing in place
    gate_up = torch.randn(9, 2 * 40, generator=generator).to(dtype)
    assert torch.equal(silu_and_mul(gate_up), F.silu(gate_up[:, :40]) * gate_up[:, 40:])
    assert no_kernels == []


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(
        architecture="LlamaForCausalLM", model_type="llama", vocab_size=64, hidden_size=48,
        intermediate_size=80, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, rms_norm_eps=1e-6, max_position_embeddings=64,
    )  # fmt: skip
    return ModelConfig(**{**fields, **overrides})


@pytest.mark.parametrize("residual_multiplier", [1.0, 0.22])  # Llama; Granite's multiplier
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_the_llama_decoder_layer_on_the_cpu_is_unchanged(
    no_kernels, residual_multiplier, dtype
) -> None:
    """The pre-norm layer with add_and_norm gives, bit for bit, the two torch ops it replaced:
    x = x + m * attn(norm(x)); x + m * mlp(post_attention_layernorm(x))."""
    config = tiny_config(residual_multiplier=residual_multiplier)
    rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope)
    layer = LlamaDecoderLayer(config, rotary, dtype, dense_everywhere, 0)
    generator = torch.Generator().manual_seed(1)
    for parameter in layer.parameters():
        parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    batch, length = 2, 5
    x = torch.randn(batch * length, config.hidden_size, generator=generator).to(dtype)
    positions = torch.arange(length).repeat(batch)
    ctx = ForwardContext(CausalAttention(), DenseBatch(batch, length), None)

    def scaled(branch: torch.Tensor) -> torch.Tensor:
        return branch if residual_multiplier == 1.0 else branch * residual_multiplier

    h = x + scaled(layer.self_attn(positions, layer.input_layernorm(x), ctx))
    want = h + scaled(layer.mlp(layer.post_attention_layernorm(h)))
    assert torch.equal(layer(positions, x, ctx), want)
    assert no_kernels == []


# --- the selection, with the start-up check's kernels injected ---


def on_every_device(device: torch.device) -> bool:
    return True


def injected_cases(failing: dict[str, str]):
    """check_cases stand-in: each kernel's run is its reference, except `failing`'s, which
    raise ("raise") or give another answer ("differ")."""

    def cases(device: torch.device, dtype: torch.dtype):
        want = torch.arange(6, dtype=dtype, device=device)
        runs = {"raise": lambda: (_ for _ in ()).throw(KernelError("injected")),
                "differ": lambda: want + 1}  # fmt: skip
        names = [fused_dispatch.kernel_name(op, dtype) for op in OPS]
        bound = RowBound.rounding(dtype)
        return {
            name: (
                CheckCase(runs.get(failing.get(name, ""), lambda: want), lambda: want, bound, ""),
            )
            for name in names
        }

    return cases


OPS = ("add_rms_norm", "rope_kv_write", "silu_and_mul")


def test_a_kernel_failing_its_check_is_named_and_torch_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    failing = {"silu_and_mul_f32": "differ", "add_rms_norm_f32": "raise"}
    checks: list[torch.dtype] = []
    cases = injected_cases(failing)

    def counted_cases(device, dtype):
        checks.append(dtype)
        return cases(device, dtype)

    launched: list[str] = []
    monkeypatch.setattr(fused, "check_cases", counted_cases)
    monkeypatch.setattr(fused, "_launch", lambda kernel, *args: launched.append(kernel))
    selection = FusedKernels(runs_on=on_every_device)
    monkeypatch.setattr(fused_dispatch, "FUSED", selection)
    x = torch.randn(4, 32)
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        assert torch.equal(silu_and_mul(x), F.silu(x[:, :16]) * x[:, 16:])
        norm = RMSNorm(32, 1e-6)
        assert torch.equal(norm(x), old_rms_norm(x, norm.weight, 1e-6, False))
        for _ in range(3):  # checked once per device and dtype, not per call
            silu_and_mul(x)
    assert checks == [torch.float32]
    assert launched == []  # neither kernel ran after failing
    warned = " ".join(record.getMessage() for record in caplog.records)
    assert "silu_and_mul_f32 differs from its reference" in warned
    assert "add_rms_norm_f32 cannot run (injected)" in warned
    assert "rope_kv_write_f32" not in warned
    assert selection.passed(x.device, torch.float32) == {"rope_kv_write_f32"}


def test_kernels_that_pass_are_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every check passing, the layers launch the kernels (here recorded, not run) on a
    device the selection accepts; with AIENG_DISABLE_FUSED=1, or while autograd records, or
    in a dtype the kernels lack, they run torch and nothing is checked."""
    launched: list[str] = []
    checks: list[torch.dtype] = []

    def counted_cases(device, dtype):
        checks.append(dtype)
        return injected_cases({})(device, dtype)

    monkeypatch.setattr(fused, "check_cases", counted_cases)
    monkeypatch.setattr(fused, "_launch", lambda kernel, *args: launched.append(kernel))
    monkeypatch.setattr(fused_dispatch, "FUSED", FusedKernels(runs_on=on_every_device))
    norm = RMSNorm(32, 1e-6)
    x = torch.randn(4, 32)
    monkeypatch.setenv("AIENG_DISABLE_FUSED", "1")
    with torch.inference_mode():
        norm(x), silu_and_mul(x)
    assert launched == [] and checks == []
    monkeypatch.setenv("AIENG_DISABLE_FUSED", "0")
    norm(x)  # the weight requires grad and autograd records: torch
    with torch.inference_mode():
        norm(x.double()), silu_and_mul(x.double())  # no float64 kernels
        assert launched == [] and checks == []
        norm(x)
        norm.add_and_norm(x, torch.randn(4, 32))
        silu_and_mul(x)
        silu_and_mul(x[:, :30])  # not contiguous: torch
        norm(torch.randn(4, 64)[:, :32])  # not contiguous: torch
    assert launched == ["add_rms_norm_f32", "add_rms_norm_f32", "silu_and_mul_f32"]
    assert checks == [torch.float32]


def test_a_reentrant_call_during_the_check_gets_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reference that itself goes through the dispatch (it must not: they are the torch ops)
    cannot recurse into the check."""
    selection = FusedKernels(runs_on=on_every_device)

    def check(device, dtype):
        assert not selection.usable("silu_and_mul", torch.zeros(2, 4))
        return {"silu_and_mul_f32"}

    selection.check = check
    with torch.inference_mode():
        assert selection.usable("silu_and_mul", torch.zeros(2, 4))


def test_the_model_paths_launch_what_the_compiled_kernels_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every launch the layers and the cuda backend make packs the arguments (count, order,
    widths) that NVRTC's PTX of fused_ops.cu declares, within CUDA's grid and block limits."""
    from aieng.attention.backend import QuantizedKVCache
    from aieng.attention.cuda_paged import write_step_kv
    from aieng.kernels import compile_kernel_source
    from aieng.kernels.launch import check_arguments, dim3, pack_args

    launches: list[tuple] = []
    monkeypatch.setattr(fused, "check_cases", injected_cases({}))
    monkeypatch.setattr(fused, "_launch", lambda *launch: launches.append(launch))
    monkeypatch.setattr(fused_dispatch, "FUSED", FusedKernels(runs_on=on_every_device))
    dtype = torch.bfloat16
    with torch.inference_mode():
        norm = RMSNorm(64, 1e-6, dtype, weight_in_float32=True)
        x = torch.randn(5, 64, dtype=dtype)
        norm(x), norm.add_and_norm(x, torch.randn(5, 64, dtype=dtype))
        silu_and_mul(torch.randn(5, 256, dtype=dtype))
        qkv = torch.randn(5, 8 * 64, dtype=dtype)
        k, v = qkv[:, 4 * 64 :].view(5, 4, 64).split(2, dim=1)
        slots = torch.arange(5)
        plain = tuple(torch.zeros(2, 4, 2, 64, dtype=dtype) for _ in "kv")
        int8 = QuantizedKVCache(*(torch.zeros(2, 4, 2, 64, dtype=torch.int8) for _ in "kv"),
                                *(torch.zeros(2, 4, 2, 1, dtype=dtype) for _ in "kv"))  # fmt: skip
        write_step_kv(k.contiguous(), v, plain, slots)
        write_step_kv(k.contiguous(), v, int8, slots)
    kernels = [launch[0] for launch in launches]
    assert kernels == ["add_rms_norm_bf16"] * 2 + ["silu_and_mul_bf16"] + ["rope_kv_write_bf16"] * 2
    parameters = compile_kernel_source("fused_ops", 90).parameters
    for kernel, grid, block, args in launches:
        check_arguments(kernel, parameters[kernel], pack_args(args)[1])
        dim3(grid, "grid")
        dim3(block, "block")


def test_a_check_that_cannot_start_turns_every_kernel_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(device, dtype):
        raise RuntimeError("no NVRTC")

    selection = FusedKernels(runs_on=on_every_device, check=broken)
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        assert not any(selection.usable(op, torch.zeros(2, 4)) for op in OPS)
    assert "start-up check failed (no NVRTC)" in caplog.text
