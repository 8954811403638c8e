"""The Rust core's element-wise CPU kernels (aieng.kernels.cpu_fused) against their torch
references, and their dispatch (aieng.kernels.fused_dispatch.CPU_FUSED): float32 on the CPU
after the start-up check, torch everywhere else (bfloat16, autograd, AIENG_DISABLE_FUSED, a
failing check)."""

from __future__ import annotations

import logging

import pytest
import torch
from test_fused_dispatch import tiny_config

from aieng.errors import InvalidArgumentError
from aieng.kernels import cpu_fused, fused_dispatch
from aieng.kernels.fused_dispatch import FusedKernels, on_cpu
from aieng.kernels.reference import apply_rotary, rms_norm, silu_and_mul_torch, write_kv_cache
from aieng.layers.activation import silu_and_mul
from aieng.layers.norm import RMSNorm
from aieng.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(
    not cpu_fused.cpu_fused_available(), reason="the Rust core was built without the kernels"
)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def fresh_selection(monkeypatch: pytest.MonkeyPatch) -> FusedKernels:
    """A CPU selection of its own, so each test runs (and can count) the start-up check."""
    selection = FusedKernels(runs_on=on_cpu, check=fused_dispatch.check_cpu_fused_ops)
    monkeypatch.setattr(fused_dispatch, "CPU_FUSED", selection)
    monkeypatch.delenv("AIENG_DISABLE_FUSED", raising=False)
    return selection


def count_kernel_calls(selection: FusedKernels, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the cpu_fused kernels called from here on, in order (the start-up check
    runs first, so its own calls are not counted)."""
    selection.passed(torch.device("cpu"), torch.float32)
    calls: list[str] = []
    for name in ("add_rms_norm", "silu_and_mul", "rotary", "kv_write"):
        real = getattr(cpu_fused, name)

        def counted(*args, _real=real, _name=name):
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(cpu_fused, name, counted)
    return calls


def test_the_start_up_check_passes_every_kernel_in_float32_only() -> None:
    cpu = torch.device("cpu")
    names = {"add_rms_norm_f32", "silu_and_mul_f32", "rotary_f32", "kv_write_f32"}
    assert cpu_fused.check_cpu_fused_ops(cpu, torch.float32) == names
    assert cpu_fused.check_cpu_fused_ops(cpu, torch.bfloat16) == set()


@pytest.mark.parametrize("rows", [1, 3, 1000])  # 1000 x 96 runs on the pool's threads
@pytest.mark.parametrize("add", [False, True])
def test_rms_norm_adds_in_place_and_matches_torch(rows: int, add: bool) -> None:
    x, branch, weight = randn(rows, 96, seed=1), randn(rows, 96, seed=2), randn(96, seed=3)
    mine = x.clone()
    out = cpu_fused.add_rms_norm(mine, branch if add else None, weight, 1e-6)
    want_sum = x + branch if add else x
    assert torch.equal(mine, want_sum)
    torch.testing.assert_close(out, rms_norm(want_sum, weight, 1e-6), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 7, 400])
def test_silu_and_mul_matches_torch_including_large_inputs(rows: int) -> None:
    x = randn(rows, 2 * 200, seed=4) * 30  # |gate| up to ~100: e^-gate at the clamp's edge
    torch.testing.assert_close(
        cpu_fused.silu_and_mul(x), silu_and_mul_torch(x), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("tokens", [1, 5, 700])
def test_rotary_of_strided_q_and_k_matches_torch(tokens: int) -> None:
    qkv = randn(tokens, (4 + 2 + 2) * 16, seed=5)
    q = qkv[:, : 4 * 16].view(tokens, 4, 16)
    k = qkv[:, 4 * 16 : 6 * 16].view(tokens, 2, 16)
    angles = randn(tokens, 8, seed=6) * 10
    cos, sin = angles.cos(), angles.sin()
    for x in (q, k):
        got = cpu_fused.rotary(x, cos, sin)
        assert got.is_contiguous()
        torch.testing.assert_close(got, apply_rotary(x, cos, sin), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_fills_the_named_slots(dtype: torch.dtype) -> None:
    kv = randn(4, 2 * 3 * 8, seed=7)
    k, v = kv[:, :24].view(4, 3, 8), kv[:, 24:].view(4, 3, 8)  # strided, as the projection's
    slots = torch.tensor([9, 0, 4, 15])
    mine = torch.zeros(4, 4, 3, 8, dtype=dtype), torch.zeros(4, 4, 3, 8, dtype=dtype)
    want = torch.zeros(4, 4, 3, 8, dtype=dtype), torch.zeros(4, 4, 3, 8, dtype=dtype)
    cpu_fused.kv_write(k, v, slots, *mine)
    write_kv_cache(k.to(dtype), v.to(dtype), *want, slots)
    assert torch.equal(mine[0], want[0]) and torch.equal(mine[1], want[1])


def test_bad_arguments_are_refused_by_name() -> None:
    k = randn(2, 1, 8)
    caches = torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8)
    with pytest.raises(InvalidArgumentError, match="slot 4 is outside the cache's 4"):
        cpu_fused.kv_write(k, k, torch.tensor([0, 4]), *caches)
    with pytest.raises(InvalidArgumentError, match="caches"):
        cpu_fused.kv_write(k, k, torch.tensor([0, 1]), torch.zeros(2, 2, 2, 8), caches[1])
    with pytest.raises(InvalidArgumentError, match="rotary"):
        cpu_fused.rotary(randn(3, 2, 8), randn(2, 4), randn(2, 4))
    with pytest.raises(InvalidArgumentError, match="rms_norm"):
        cpu_fused.add_rms_norm(randn(3, 8), randn(2, 8), randn(8), 1e-6)


@torch.inference_mode()
def test_float32_layers_use_the_kernels_and_others_use_torch(
    fresh_selection: FusedKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = count_kernel_calls(fresh_selection, monkeypatch)
    norm, x = RMSNorm(64, 1e-6), randn(3, 64)
    torch.testing.assert_close(norm(x), rms_norm(x, norm.weight, 1e-6), rtol=1e-5, atol=1e-6)
    summed, _ = norm.add_and_norm(x, branch := randn(3, 64, seed=1))
    assert summed is branch  # the fresh sublayer output holds the sum, as on the GPU
    silu_and_mul(randn(3, 64))
    config = tiny_config(head_dim=16)
    rotary = RotaryEmbedding(16, 32, config.rope)
    rotary(torch.arange(3), randn(3, 4, 16), randn(3, 2, 16))
    assert calls == ["add_rms_norm", "add_rms_norm", "silu_and_mul", "rotary", "rotary"]
    calls.clear()
    bf16 = RMSNorm(64, 1e-6, torch.bfloat16)
    bf16(x.bfloat16()), silu_and_mul(x.bfloat16())  # no bfloat16 kernels
    monkeypatch.setenv("AIENG_DISABLE_FUSED", "1")
    norm(x), silu_and_mul(x)
    assert calls == []


def test_autograd_gets_torch(fresh_selection: FusedKernels) -> None:
    norm = RMSNorm(64, 1e-6)
    y = norm(randn(3, 64))  # the weight requires grad: torch, so the graph is kept
    y.sum().backward()
    assert norm.weight.grad is not None


def test_a_kernel_failing_its_check_is_named_and_torch_runs(
    fresh_selection: FusedKernels,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(cpu_fused, "silu_and_mul", lambda x: x[..., : x.shape[-1] // 2] * 0)
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        x = randn(3, 64)
        assert torch.equal(silu_and_mul(x), silu_and_mul_torch(x))
    assert "cpu silu_and_mul differs from its reference" in caplog.text
    assert fresh_selection.passed(torch.device("cpu"), torch.float32) == {
        "add_rms_norm_f32",
        "rotary_f32",
        "kv_write_f32",
    }


def test_hf_parity_holds_through_the_kernels(
    tmp_path, fresh_selection: FusedKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny Llama's torch runner (CPU attention backend; the native decoder, which runs these
    kernels from Rust, off) gives transformers' greedy tokens and logprobs, batched and chunked,
    with every element-wise kernel in the path."""
    from hf_parity import HFReference, check_batched
    from tiny_models import build_checkpoint

    folder = build_checkpoint("llama", tmp_path / "model")
    reference = HFReference(folder, [5, 11, 17], seed=0, cpu_native="off")
    calls = count_kernel_calls(fresh_selection, monkeypatch)
    check_batched(reference, chunk_size=4)
    assert set(calls) == {"add_rms_norm", "silu_and_mul", "rotary", "kv_write"}
