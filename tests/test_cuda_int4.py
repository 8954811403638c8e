"""CPU checks of the CUDA INT4 path (issue 12): the layout's repack and its round trip, the
kernels' math against `dequantize(layer)`, the launch parameters (the GEMV's thread-to-weight
mapping simulated over its grid), the start-up self-check turning a failing kernel off, and the
method's selection. The kernels themselves run in tests/test_cuda_int4_gpu.py."""

from __future__ import annotations

import itertools
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from quantized_checkpoints import awq_layer, gptq_layer, min_max_quantize

from aieng.attention.backend import AttentionInputs, QuantizedKVCache
from aieng.attention.layer import Attention
from aieng.attention.torch_paged import TorchPagedAttention
from aieng.config.default_model import default_model_path
from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import create_engine_config
from aieng.config.quantization import QuantizationConfig, WeightScheme
from aieng.kernels.check_child import Screening
from aieng.kernels.errors import KernelCompileError, KernelError
from aieng.kernels.fused import check_cases as fused_check_cases
from aieng.kernels.fused import (
    check_fused_ops,
    check_head_layout,
    elementwise_grid,
    norm_threads,
    rope_grid,
)
from aieng.kernels.int4 import (
    CHUNK,
    GEMM_TILE,
    GEMV_ROWS,
    GEMV_THREADS,
    MMA_CTAS_PER_SM,
    MMA_ROWS,
    MMA_THREADS,
    choose_path,
    dequantize_weights,
    from_packed,
    gemm_launch,
    gemv_launch,
    gemv_reference,
    gemv_tile,
    reference_matmul,
    repack,
    unpack,
)
from aieng.kernels.reference import quantize_int8
from aieng.kernels.self_check import disagreement, passes_check
from aieng.layers.linear import Linear
from aieng.quantization import cuda_int4, methods
from aieng.quantization.cpu_int8 import CpuQuantizedLinearMethod
from aieng.quantization.cuda_int4 import CudaInt4LinearMethod
from aieng.quantization.linear_method import QuantizedLinearMethod, dequantize
from aieng.quantization.packing import pack_int32
from aieng.worker.cuda_graphs import (
    GRAPH_PAD_BLOCKS,
    DecodeGraphs,
    GraphDecodeInputs,
    bucket_for,
    capture_sizes,
    context_buckets,
    distinct_buckets,
    graph_buckets,
    graph_metadata,
    graphs_wanted,
    is_decode_only,
    pad_decode,
    padded_size,
    step_bucket,
)
from aieng.worker.gpu_memory import (
    GpuMemory,
    gpu_memory_figures,
    kv_cache_tensors,
    model_tensors,
    tensor_bytes,
)
from aieng.worker.runner import ModelRunner


@pytest.fixture(autouse=True)
def fresh_kernel_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no kernel known to be unable to run and no layout checked against
    its checkpoint yet (an injected failure stays in its test)."""
    monkeypatch.setattr(cuda_int4, "_CANNOT_RUN", {})
    monkeypatch.setattr(cuda_int4, "_LAYOUT_CHECKED", {})


def random_int4(n: int, k: int, group: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.int32)
    scales = torch.rand(n, k // group, generator=generator) * 0.02 + 1e-3
    zeros = torch.randint(0, 16, (n, k // group), generator=generator).float()
    return q, scales, zeros


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize(("n", "k"), [(5, 128), (64, 256), (33, 384)])
def test_repack_round_trip(group: int, n: int, k: int) -> None:
    if k % group:
        pytest.skip("K not a multiple of the group")
    q, scales, zeros = random_int4(n, k, group, seed=n + k)
    weights = repack(q, scales, zeros)
    assert weights.qweight.shape == (n, k // 2) and weights.qweight.dtype == torch.uint8
    assert weights.scale_zero.shape == (n, k // group, 2)
    assert weights.scale_zero.dtype == torch.float16 and weights.group_size == group
    # The byte layout the kernels read: row-major, even k in the low nibble.
    assert int(weights.qweight[2, 3]) == int(q[2, 6]) | int(q[2, 7]) << 4
    q2, scales2, zeros2 = unpack(weights)
    assert torch.equal(q2, q)
    assert torch.equal(zeros2, zeros)
    assert torch.equal(scales2, scales.half().float())
    assert float(((scales2 - scales) / scales).abs().max()) <= 2**-11


def test_repack_refuses_what_the_kernels_cannot_read() -> None:
    q, scales, zeros = random_int4(4, 64, 32)
    with pytest.raises(KernelError, match="power of two >= 32"):
        repack(q[:, :48], scales[:, :3], zeros[:, :3])  # group of 16
    wide_q, wide_scales, wide_zeros = random_int4(4, 192, 96)
    with pytest.raises(KernelError, match="power of two >= 32"):
        repack(wide_q, wide_scales, wide_zeros)  # group of 96: not found by a shift
    assert repack(wide_q, wide_scales[:, :1], wide_zeros[:, :1]).group_size == 192  # one group
    with pytest.raises(KernelError, match="float16's range"):
        repack(q, scales * 1e-6, zeros)  # subnormal in float16
    with pytest.raises(KernelError, match=r"\[0, 16\)"):
        repack(q + 1, scales, zeros)
    with pytest.raises(KernelError, match="integers"):
        repack(q, scales, zeros + 0.5)
    with pytest.raises(KernelError, match=r"\[-128, 128\]"):
        repack(q, scales, zeros + 200)  # bfloat16's 128 + z would round


def quantized_layer(
    n: int, k: int, group: int | None, symmetric: bool, method: QuantizedLinearMethod
) -> Linear:
    """A compressed-tensors INT4 layer of random weights, loaded and processed by `method`."""
    generator = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=generator)
    q, s, z = min_max_quantize(w, 4, group, symmetric)
    layer = Linear(k, n, methods=lambda prefix: method)
    layer.weight_packed.data.copy_(pack_int32(q, 4, dim=1))
    layer.weight_scale.data.copy_(s)
    if not symmetric:
        layer.weight_zero_point.data.copy_(pack_int32(z, 4, dim=0))
    method.process_weights_after_loading(layer)
    return layer


def scheme(group: int | None, symmetric: bool) -> WeightScheme:
    return WeightScheme("compressed-tensors", 4, group, symmetric)


@pytest.mark.parametrize("group", [32, 64, 128, None])
@pytest.mark.parametrize("symmetric", [False, True])
def test_kernel_math_on_the_layout_matches_dequantize(group: int | None, symmetric: bool) -> None:
    n, k = 72, 512
    method = QuantizedLinearMethod(scheme(group, symmetric), "layer", use_kernel=False)
    layer = quantized_layer(n, k, group, symmetric, method)
    weights = from_packed(layer.qvalues, layer.scales, layer.zeros)
    assert weights.qweight.data_ptr() == layer.qvalues.data_ptr()  # the bytes are shared
    assert weights.group_size == (group or k)
    reference = dequantize(layer)
    # float16 scales: each weight within 2^-11 of its magnitude
    assert bool(((dequantize_weights(weights) - reference).abs() <= reference.abs() * 2**-11).all())
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = x @ reference.double().t()
    for got in (reference_matmul(x.float(), weights), gemv_reference(x.float(), weights)):
        error = float((got.double() - want).norm() / want.norm())
        assert error < 1e-3, error  # the float16 scales
    # The GEMV's 1 + q/16 algebra is exact up to float32 rounding
    exact = reference_matmul(x.float(), weights).double()
    error = float((gemv_reference(x.float(), weights).double() - exact).norm() / exact.norm())
    assert error < 1e-5, error


def simulate_gemv_coverage(m: int, n: int, k: int, dtype: torch.dtype, sms: int) -> torch.Tensor:
    """Counts, per (x row, output row, K chunk), how often int4_gemv.cu's indexing visits it
    over the launch's grid and block (rows and x rows past the end are not stored)."""
    launch = gemv_launch(m, n, k, dtype, 32, sms)
    tile = gemv_tile(m, dtype)
    visits = torch.zeros(m, n, k // CHUNK, dtype=torch.int32)
    (grid_x, grid_y), (threads_x, threads_y) = launch.grid, launch.block
    for by in range(grid_y):
        x_rows = [by * tile + i for i in range(tile) if by * tile + i < m]
        if dtype == torch.float32:  # CUDA cores: row groups of GEMV_ROWS rows, threads walk K
            rows = GEMV_ROWS[tile]
            assert threads_x * threads_y == GEMV_THREADS and threads_x % 32 == 0
            for bx, ty, tx in itertools.product(range(grid_x), range(threads_y), range(threads_x)):
                row0 = (bx * threads_y + ty) * rows
                mine = list(range(tx, k // CHUNK, threads_x))
                for row in range(row0, min(row0 + rows, n)):
                    for xr in x_rows:
                        visits[xr, row, mine] += 1
            continue
        # tensor cores: CTAs over 16-row blocks (grid-stride), warps over 128-k blocks, the
        # four lanes t of a fragment row over its 32-k chunks; an MMA sums over all of them
        assert (threads_x, threads_y) == (MMA_THREADS, 1)
        for bx in range(grid_x):
            for block in range(bx, -(-n // MMA_ROWS), grid_x):
                out_rows = range(block * MMA_ROWS, min(block * MMA_ROWS + MMA_ROWS, n))
                for warp in range(MMA_THREADS // 32):
                    for k0 in range(warp * 128, k, 8 * 128):
                        for t in range(4):
                            if k0 // CHUNK + t < k // CHUNK:
                                for xr in x_rows:
                                    visits[xr, out_rows, k0 // CHUNK + t] += 1
    return visits


@pytest.mark.parametrize(
    ("m", "n", "k", "dtype", "kernel", "grid", "block"),
    [
        (1, 100, 4096, torch.bfloat16, "int4_gemv_bf16_m8", (4, 1), (256, 1)),  # 7 blocks, 2 each
        (2, 40, 1024, torch.float16, "int4_gemv_f16_m8", (3, 1), (256, 1)),
        (9, 13, 96, torch.bfloat16, "int4_gemv_bf16_m16", (1, 1), (256, 1)),
        (37, 9, 160, torch.float16, "int4_gemv_f16_m16", (1, 3), (256, 1)),
        (3, 17, 2048, torch.float32, "int4_gemv_f32_m4", (5, 1), (64, 2)),
        (37, 9, 64, torch.float32, "int4_gemv_f32_m16", (3, 3), (32, 4)),
    ],
)
def test_gemv_launch_covers_every_weight_once(m, n, k, dtype, kernel, grid, block) -> None:
    launch = gemv_launch(m, n, k, dtype, 32, num_sms=2)
    assert (launch.kernel, launch.grid, launch.block) == (kernel, grid, block)
    assert launch.source == "int4_gemv"
    visits = simulate_gemv_coverage(m, n, k, dtype, sms=2)
    assert bool((visits == 1).all())


def test_gemv_grid_is_one_wave_of_resident_ctas() -> None:
    """Row blocks beyond what the SMs hold are walked by a grid-stride loop, not a new wave, and
    every CTA walks the same number of them (the last CTA fewer)."""
    small = gemv_launch(1, 4096, 4096, torch.float16, 128, num_sms=132)
    assert small.grid == (4096 // MMA_ROWS, 1)  # 256 CTAs, all resident at once
    for m, n in ((1, 14336), (1, 128256), (16, 14336), (16, 128256), (9, 28672)):
        launch = gemv_launch(m, n, 4096, torch.bfloat16, 128, num_sms=132)
        blocks, grid = -(-n // MMA_ROWS), launch.grid[0]
        assert grid <= 132 * MMA_CTAS_PER_SM
        per_cta = -(-blocks // grid)
        assert (grid - 1) * per_cta < blocks <= grid * per_cta
        assert per_cta == -(-blocks // (132 * MMA_CTAS_PER_SM))  # no more rounds needed
    assert gemv_launch(1, 14336, 4096, torch.float16, 128, 132).grid == (224, 1)  # 4 blocks each
    assert [gemv_tile(m, torch.float16) for m in (1, 5, 8, 9, 16, 40)] == [8, 8, 8, 16, 16, 16]
    assert [gemv_tile(m, torch.float32) for m in (1, 2, 3, 5, 9)] == [1, 2, 4, 8, 16]


def test_gemv_variant_by_group() -> None:
    """Groups of 128 or more, or one per row, are scaled after the MMA ("_g128")."""
    names = {
        (group, k): gemv_launch(3, 64, k, torch.bfloat16, group).kernel
        for group, k in ((32, 4096), (64, 4096), (128, 4096), (256, 4096), (96, 96), (4096, 4096))
    }
    assert names[(32, 4096)] == names[(64, 4096)] == "int4_gemv_bf16_m8"
    assert {names[key] for key in ((128, 4096), (256, 4096), (96, 96), (4096, 4096))} == {
        "int4_gemv_bf16_m8_g128"
    }
    assert gemv_launch(3, 64, 4096, torch.float32, 128).kernel == "int4_gemv_f32_m4"


def test_gemm_launch_tiles_the_output() -> None:
    launch = gemm_launch(200, 4097, torch.bfloat16)
    assert launch.kernel == "int4_gemm_bf16" and launch.block == (128, 1)
    assert launch.grid == (-(-4097 // GEMM_TILE), -(-200 // GEMM_TILE)) == (65, 4)


def test_path_choice() -> None:
    assert choose_path(1, torch.bfloat16) == "gemv"
    assert choose_path(16, torch.float16) == "gemv"
    assert choose_path(17, torch.float16) == "gemm"
    assert choose_path(512, torch.float32) == "gemv"  # no tensor-core path for float32
    assert choose_path(512, torch.bfloat16, gemm=False) == "gemv"
    assert choose_path(1, torch.bfloat16, gemv=False) == "gemm"
    assert choose_path(1, torch.float32, gemv=False) is None
    assert choose_path(4, torch.float64) is None


def reference_kernel(x: torch.Tensor, weights, path: str) -> torch.Tensor:
    """The kernels' math on the CPU, standing in for the GPU launch."""
    return reference_matmul(x, weights)


def cpu_method(group: int | None, matmul=reference_kernel) -> CudaInt4LinearMethod:
    return CudaInt4LinearMethod(
        scheme(group, False), "model.layers.0.mlp.down_proj", matmul=matmul, runs_on=lambda d: True
    )


def test_method_takes_the_layer_when_its_kernels_pass() -> None:
    method = cpu_method(64)
    layer = Linear(256, 48, dtype=torch.bfloat16, methods=lambda prefix: method)
    quantized_layer_from(layer, method, 64)
    assert method.kernel == "cuda_int4" and method.paths == ("gemv", "gemm")
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    want = x.float() @ dequantize(layer).t()
    got = layer(x)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want).norm() / want.norm()) < 1e-2


def quantized_layer_from(layer: Linear, method: CudaInt4LinearMethod, group: int | None) -> None:
    n, k = sum(layer.output_sizes), layer.input_size
    q, s, z = min_max_quantize(
        torch.randn(n, k, generator=torch.Generator().manual_seed(3)), 4, group, False
    )
    layer.weight_packed.data.copy_(pack_int32(q, 4, dim=1))
    layer.weight_scale.data.copy_(s)
    layer.weight_zero_point.data.copy_(pack_int32(z, 4, dim=0))
    method.process_weights_after_loading(layer)


# Checkpoint formats whose layers `checkpoint_layer` writes byte by byte from their specifications
# (tests/quantized_checkpoints.py, not aieng's packing): (scheme, writer of w (N, K)).
CHECKPOINT_FORMATS = {
    "awq-g32": (WeightScheme("awq", 4, 32, False), lambda w: awq_layer(w, 32)),
    "gptq-g64-sym": (
        WeightScheme("gptq", 4, 64, True, zero_point_offset=1),
        lambda w: gptq_layer(w, 4, 64, True),
    ),
    "gptq-g128-asym": (
        WeightScheme("gptq", 4, 128, False, zero_point_offset=1),
        lambda w: gptq_layer(w, 4, 128, False),
    ),
}


def checkpoint_layer(
    fmt: str, n: int, k: int, dtype: torch.dtype, method_for: Callable, device: str = "cpu"
) -> tuple[Linear, Any, torch.Tensor]:
    """A Linear (K -> N; N a multiple of 8, AWQ packing along it) loaded from one checkpoint
    layer of `fmt` as the checkpoint stores it -> (the layer after
    `process_weights_after_loading`, its method, the checkpoint's own dequantized weight (N, K)
    float32, computed by the format's writer)."""
    if n % 8:
        raise ValueError(f"N = {n}: the formats pack 8 output channels per word")
    scheme, write = CHECKPOINT_FORMATS[fmt]
    tensors, dense = write(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)))
    method = method_for(scheme)
    with torch.device(device):
        layer = Linear(k, n, dtype=dtype, methods=lambda prefix: method)
    for name, value in tensors.items():
        getattr(layer, name).data.copy_(value)
    method.process_weights_after_loading(layer)
    return layer, method, dense.to(device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", CHECKPOINT_FORMATS)
def test_checkpoint_layers_against_their_own_dequantization(fmt: str, dtype: torch.dtype) -> None:
    """A layer of each checkpoint format, packed byte by byte from the format's specification,
    through the CUDA method (the kernels' math standing in): its output against x @ W^T with
    the writer's own dequantized W, per row within the start-up check's bound (AWQ and GPTQ
    store float16 scales: the layout holds them exactly)."""

    def method_for(scheme: WeightScheme) -> CudaInt4LinearMethod:
        return CudaInt4LinearMethod(scheme, fmt, matmul=reference_kernel, runs_on=lambda d: True)

    layer, method, dense = checkpoint_layer(fmt, 48, 256, dtype, method_for)
    assert method.kernel == "cuda_int4" and method.paths == ("gemv", "gemm")
    assert cuda_int4.layout_disagreement(layer, layer.int4_weights) is None
    assert torch.equal(dequantize_weights(layer.int4_weights), dense)
    for m in (1, 9, 40):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(dtype)
        why = disagreement(layer(x), x.float() @ dense.t(), cuda_int4.check_bound(dtype))
        assert why is None, (m, why)


def test_a_layout_that_differs_from_its_checkpoint_turns_the_kernels_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One zero point off by one in the layout (a conversion bug the kernels' own reference,
    built from the layout, could not see): the first layer's comparison with the checkpoint
    finds it and every layer keeps the dequantize reference."""
    real = cuda_int4.from_packed

    def off_by_one(qweight, scales, zeros):
        zeros = zeros.clone()
        zeros[3, 1] += 1
        return real(qweight, scales, zeros)

    monkeypatch.setattr(cuda_int4, "from_packed", off_by_one)

    def method_for(scheme: WeightScheme) -> CudaInt4LinearMethod:
        return CudaInt4LinearMethod(scheme, "odd", matmul=reference_kernel, runs_on=lambda d: True)

    with caplog.at_level(logging.WARNING):
        _, method, _ = checkpoint_layer("awq-g32", 48, 256, torch.float16, method_for)
        _, second, _ = checkpoint_layer("gptq-g64-sym", 32, 128, torch.float16, method_for)
    assert method.kernel == "dequant" and second.kernel == "dequant"
    assert "differs from the checkpoint's dequantization (weight (3, " in caplog.text
    assert caplog.text.count("differs from the checkpoint") == 1


def test_a_kernel_that_disagrees_is_turned_off_by_name(caplog) -> None:
    def broken_gemm(x, weights, path):
        y = reference_matmul(x, weights)
        return y * 1.1 if path == "gemm" else y

    method = cpu_method(32, broken_gemm)
    layer = Linear(128, 32, dtype=torch.bfloat16, methods=lambda prefix: method)
    with caplog.at_level(logging.WARNING):
        quantized_layer_from(layer, method, 32)
    assert method.kernel == "cuda_int4" and method.paths == ("gemv",)
    assert "int4_gemm_bf16 differs from its reference" in caplog.text
    assert "model.layers.0.mlp.down_proj" in caplog.text
    x = torch.randn(40, 128, dtype=torch.bfloat16)  # a prefill: served by the GEMV, not the GEMM
    want = x.float() @ dequantize(layer).t()
    assert float((layer(x).float() - want).norm() / want.norm()) < 1e-2


def test_a_kernel_that_cannot_compile_leaves_the_reference(caplog) -> None:
    def no_compiler(x, weights, path):
        raise KernelCompileError("int4_gemv.cu", 90, "error: injected")

    method = cpu_method(None, no_compiler)
    layer = Linear(128, 32, dtype=torch.float32, methods=lambda prefix: method)
    with caplog.at_level(logging.WARNING):
        quantized_layer_from(layer, method, None)
    assert method.kernel == "dequant" and method.paths == ()
    assert "kernel int4_gemv_f32_m1 cannot run" in caplog.text and "injected" in caplog.text
    x = torch.randn(3, 128)
    assert torch.allclose(layer(x), x @ dequantize(layer).t(), atol=1e-5)


def test_a_kernel_that_cannot_run_is_tried_once_per_process(caplog) -> None:
    calls = []

    def no_driver(x, weights, path):
        calls.append(path)
        raise KernelError("no CUDA driver (injected)")

    for index in range(3):
        method = cpu_method(32, no_driver)
        layer = Linear(64, 16, dtype=torch.bfloat16, methods=lambda prefix, m=method: m)
        with caplog.at_level(logging.WARNING):
            quantized_layer_from(layer, method, 32)
        assert method.kernel == "dequant", index
    assert calls == ["gemv", "gemm"]  # the first layer tried each kernel; the others did not
    assert caplog.text.count("cannot run") == 2


def test_nan_output_fails_the_check(caplog) -> None:
    method = cpu_method(32, lambda x, w, p: reference_matmul(x, w) * float("nan"))
    layer = Linear(64, 16, dtype=torch.float16, methods=lambda prefix: method)
    with caplog.at_level(logging.WARNING):
        quantized_layer_from(layer, method, 32)
    assert method.kernel == "dequant"
    assert "int4_gemv_f16_m8 differs" in caplog.text and "int4_gemm_f16 differs" in caplog.text


def test_the_cuda_method_is_chosen_only_for_a_cuda_device(monkeypatch) -> None:
    """The target device decides, not whether this machine has a GPU."""
    config = QuantizationConfig("compressed-tensors", ((("Linear",), scheme(32, True)),))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for device, expected in (("cuda:0", CudaInt4LinearMethod), ("cpu", CpuQuantizedLinearMethod)):
        choose = methods.quantized_linear_methods(config, {}, device=device)
        assert type(choose("model.layers.0.mlp.up_proj")) is expected
    # On a CPU device the CUDA method is the torch one: the CPU INT4 kernel or dequant.
    method = CudaInt4LinearMethod(scheme(32, False), "cpu")
    layer = Linear(128, 32, methods=lambda prefix: method)
    quantized_layer_from(layer, method, 32)
    assert method.kernel in ("int4pack", "dequant") and method.paths == ()


# --- the fused element-wise kernels' launch logic and start-up check ------------------------------


def test_fused_launch_parameters() -> None:
    assert [norm_threads(h) for h in (1, 32, 33, 100, 256, 5000)] == [32, 32, 64, 128, 256, 256]
    assert rope_grid(7, 32, 8) == (7, 48)
    assert elementwise_grid(0) == 1 and elementwise_grid(257) == 2
    assert elementwise_grid(10**9) == 65535  # grid-stride beyond


def test_rope_kv_write_refuses_layouts_it_cannot_read() -> None:
    qkv = torch.zeros(3, (4 + 2 * 2) * 64)
    q = qkv[:, :256].view(3, 4, 64)
    assert check_head_layout("q", q, torch.float32) == qkv.stride(0)  # a view of the fused qkv
    with pytest.raises(KernelError, match="contiguous heads"):
        check_head_layout("q", q.transpose(0, 1), torch.float32)
    with pytest.raises(KernelError, match="contiguous heads"):
        check_head_layout("q", q, torch.float16)
    with pytest.raises(KernelError, match="head_dim 512"):
        check_head_layout("k", torch.zeros(2, 1, 512), torch.float32)


def test_fused_kernels_that_cannot_run_are_turned_off_by_name(caplog) -> None:
    """Without a GPU every launch fails: each kernel is named as turned off, none is kept — the
    same path a failed compile or a mismatch takes on a GPU."""
    with caplog.at_level(logging.WARNING):
        assert check_fused_ops(torch.device("cpu"), torch.bfloat16) == set()
    for name in ("add_rms_norm_bf16", "rope_kv_write_bf16", "silu_and_mul_bf16"):
        assert f"kernel {name} cannot run" in caplog.text


def test_fused_references_run_and_a_wrong_kernel_fails_its_check(caplog) -> None:
    cases = fused_check_cases(torch.device("cpu"), torch.float32)
    for name, checks in cases.items():
        for case in checks:
            want = case.reference()
            wants = want if isinstance(want, tuple) else (want,)
            assert all(bool(torch.isfinite(w).all()) for w in wants), name
            assert passes_check(name, lambda want=want: want, case.reference, case.bound)
            wrong = tuple(w * 1.01 for w in wants)
            with caplog.at_level(logging.WARNING):
                assert not passes_check(name, lambda wrong=wrong: wrong, case.reference, case.bound)
            assert f"kernel {name} differs from its reference" in caplog.text


# --- CUDA graphs: capture sizes, padding, and the graph metadata's math ---------------------------


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 4 + 16
    assert all(b - a == 16 for a, b in itertools.pairwise(sizes[4:]))
    with pytest.raises(ValueError, match="at least 1"):
        capture_sizes(0)


def test_padding_to_a_captured_size() -> None:
    sizes = capture_sizes(40)
    assert [padded_size(r, sizes) for r in (1, 3, 5, 9, 16, 17, 33, 40)] == [
        1, 4, 8, 16, 16, 32, 40, 40,
    ]  # fmt: skip
    assert padded_size(41, sizes) is None
    assert is_decode_only(np.array([0, 1, 2, 3]))
    assert not is_decode_only(np.array([0, 1, 5]))  # a prefill in the step
    assert not is_decode_only(np.array([0]))
    assert graphs_wanted(False, torch.device("cuda")) and not graphs_wanted(
        True, torch.device("cuda")
    )
    assert not graphs_wanted(False, torch.device("cpu"))


def test_pad_decode_fills_padding_rows_with_the_scratch_block() -> None:
    plan = SimpleNamespace(
        input_ids=np.array([5, 6, 7]),
        positions=np.array([10, 3, 20]),
        slot_mapping=np.array([42, 19, 84]),
        seq_lens=np.array([11, 4, 21], np.int32),
    )
    tables = np.array([[2, 1], [1, 0], [5, 3]], np.int32)
    padded = pad_decode(plan, tables, size=4, width=3, pad_block=9, block_size=16)
    assert padded.input_ids.tolist() == [5, 6, 7, 0]
    assert padded.positions.tolist() == [10, 3, 20, 0]
    assert padded.slot_mapping.tolist() == [42, 19, 84, 9 * 16]
    assert padded.seq_lens.tolist() == [11, 4, 21, 1]
    assert padded.block_tables.tolist() == [[2, 1, 9], [1, 0, 9], [5, 3, 9], [9, 9, 9]]


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("window", [None, 6])
def test_graph_metadata_attends_as_the_eager_step(int8: bool, window: int | None) -> None:
    """The torch backend over the graph's persistent, padded inputs (one group over the whole
    table width, masked by length) gives the eager step's attention for the real rows."""
    block, blocks, kv_heads, heads, dim = 4, 12, 2, 4, 8
    backend = TorchPagedAttention(sliding_windows=(window,))
    layer = Attention(heads, kv_heads, dim, 0, sliding_window=window)
    generator = torch.Generator().manual_seed(0)
    shape = (blocks, block, kv_heads, dim)

    def cache():
        k, v = (torch.randn(shape, generator=generator) for _ in range(2))
        if not int8:
            return k, v
        (kq, ks), (vq, vs) = quantize_int8(k, torch.float32), quantize_int8(v, torch.float32)
        return QuantizedKVCache(kq, vq, ks, vs)

    eager_cache = cache()
    copies = [t.clone() for t in eager_cache]
    graph_cache = QuantizedKVCache(*copies) if int8 else tuple(copies)
    seq_lens = np.array([7, 3, 10], np.int32)  # decode rows: their last token is new
    tables = np.array([[3, 5, 0], [8, 0, 0], [1, 2, 4]], np.int32)
    slots = np.array(
        [tables[r, (n - 1) // block] * block + (n - 1) % block for r, n in enumerate(seq_lens)],
        np.int64,
    )
    q = torch.randn(3, heads, dim, generator=generator)
    k = torch.randn(3, kv_heads, dim, generator=generator)
    v = torch.randn(3, kv_heads, dim, generator=generator)

    eager_inputs = AttentionInputs(
        slot_mapping=torch.from_numpy(slots),
        query_start_loc=np.arange(4),
        num_computed_tokens=seq_lens - 1,
        seq_lens=seq_lens,
        block_tables=tables,
        block_size=block,
    )
    want = backend.forward(layer, q, k, v, eager_cache, backend.build_metadata(eager_inputs))

    plan = SimpleNamespace(
        input_ids=np.zeros(3), positions=seq_lens - 1, slot_mapping=slots, seq_lens=seq_lens
    )
    padded = pad_decode(plan, tables, size=4, width=4, pad_block=blocks - 1, block_size=block)
    graph_inputs = GraphDecodeInputs(
        torch.from_numpy(padded.slot_mapping),
        torch.from_numpy(padded.seq_lens),
        torch.from_numpy(padded.block_tables),
        block,
        planned_len=4 * block,
    )
    pad = lambda t: torch.cat([t, t[:1]])  # noqa: E731 - the padding row's own q/k/v
    got = backend.forward(
        layer, pad(q), pad(k), pad(v), graph_cache, graph_metadata(backend, graph_inputs)
    )
    torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)
    for a, b in zip(eager_cache, graph_cache, strict=True):  # only the scratch block differs
        assert torch.equal(a[: blocks - 1], b[: blocks - 1])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_graph_computation_matches_the_eager_forward(kv_cache_dtype: str) -> None:
    """What a graph holds — the model over the padded persistent buffers with the graph
    metadata — run eagerly on the CPU gives the eager forward's hidden states (the check that
    turns graphs off on a GPU compares the replay the same way)."""
    model = str(default_model_path())
    args = EngineArgs(
        model,
        device="cpu",
        kv_cache_memory=1 << 20,
        max_num_seqs=8,
        kv_cache_dtype=kv_cache_dtype,
        attention_backend="torch",  # the reference backend's graph metadata
    )
    runner = ModelRunner(create_engine_config(args))
    runner.kv_caches = runner.kv_spec.allocate(
        runner.num_blocks + GRAPH_PAD_BLOCKS, runner.device, runner.attention
    )
    graphs = DecodeGraphs(runner, args.max_num_seqs, pad_block=runner.num_blocks)
    plan, _ = graphs.check_step()
    assert len(plan.input_ids) == 7 and graphs.sizes == [1, 2, 4, 8]  # padded by one row
    # float32 rounding, and with INT8 an occasional K/V element rounded to the next integer
    # (a batch of 8 rows, not 7, multiplies in another order)
    assert graphs.check(replay=False) < (1e-5 if kv_cache_dtype == "auto" else 1e-3)


def test_cuda_backend_graph_metadata_is_its_decode_batch() -> None:
    """The cuda backend's graph metadata (built on the CPU here, as its arrays are): every row a
    decode row over the persistent arrays, split-K planned for the graph's context bucket."""
    from aieng.attention.cuda_paged import CudaAttentionMetadata, split_plan

    inputs = GraphDecodeInputs(
        torch.arange(4), torch.ones(4, dtype=torch.int32), torch.zeros(4, 8, dtype=torch.int32), 16,
        planned_len=2048,
    )  # fmt: skip
    backend = SimpleNamespace(name="cuda")
    metadata = graph_metadata(backend, inputs)
    assert isinstance(metadata, CudaAttentionMetadata) and metadata.prefill is None
    decode = metadata.decode
    assert decode.rows.tolist() == [0, 1, 2, 3] and decode.seq_lens is inputs.seq_lens
    assert decode.block_tables is inputs.block_tables and metadata.num_tokens == 4
    assert decode.planned_len == 2048
    plan = split_plan(decode, None, 8, 2, 128, num_sms=132, ctas_per_sm=6)
    assert plan.num_splits * plan.split_tokens >= 2048 > (plan.num_splits - 1) * plan.split_tokens


def test_context_buckets_and_the_live_context() -> None:
    assert context_buckets(32768) == [1024, 2048, 4096, 8192, 16384, 32768]
    assert context_buckets(3000) == [1024, 2048, 3000] and context_buckets(512) == [512]
    with pytest.raises(ValueError):
        context_buckets(0)
    buckets = [1024, 2048, 4096]
    assert [bucket_for(n, buckets) for n in (1, 1024, 1025, 4096)] == [1024, 1024, 2048, 4096]
    # a bucket whose plan is the next one's needs no graph of its own
    assert distinct_buckets([1024, 2048, 4096, 8192], lambda n: min(n, 2048)) == [1024, 8192]
    assert distinct_buckets([1024, 2048], lambda n: None) == [2048]


def test_graph_plans_are_bucketed_by_the_live_context() -> None:
    """A decode batch of one short context under a long limit (issue 38: 1 x 1k under 32k ran
    3 splits of 94 with positions): the graph replayed is the smallest bucket holding the live
    context, whose split-K plan (the cuda backend's, for this model on 132 SMs of 6 decode
    CTAs each) leaves at most one split without positions; a batch that never splits keeps one
    graph per size."""
    from aieng.attention.cuda_paged import plan_for_lengths

    args = EngineArgs(
        str(default_model_path()), device="cpu", dtype="bfloat16", kv_cache_memory=1 << 20,
        max_num_seqs=8,
    )  # fmt: skip
    runner = ModelRunner(create_engine_config(args))
    cuda = SimpleNamespace(name="cuda", num_sms=132, ctas_per_sm=lambda kernel: 6)
    one = graph_buckets(cuda, runner, 1, 32768)
    assert one == context_buckets(32768)  # every bucket its own plan at one row
    assert graph_buckets(cuda, runner, 256, 32768) == [32768]  # 256 x 4 KV heads: no split
    assert graph_buckets(runner.attention, runner, 1, 32768) == [32768]  # the torch backend

    config = runner.model_config
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, 64
    live = np.array([1000])
    for planned, holding in ((bucket_for(1000, one), "all"), (32768, "few")):
        plan = plan_for_lengths(np.maximum(live, planned), None, heads, kv_heads, dim, 132, 6)
        used = -(-1000 // plan.split_tokens)
        if holding == "all":
            assert plan.num_splits - used <= 1, plan
        else:  # what a plan for the limit would run
            assert plan.num_splits == 128 and used <= 8, plan

    step = SimpleNamespace(input_ids=np.zeros(2), seq_lens=np.array([700, 3000]))
    assert step_bucket(step, [1, 2, 4], {1: one, 2: one, 4: [32768]}) == 4096
    assert step_bucket(step, [1, 2, 4], {1: one, 2: [2048, 32768], 4: [32768]}) == 32768


def test_runner_on_cpu_runs_eagerly() -> None:
    model = str(default_model_path())
    runner = ModelRunner(
        create_engine_config(
            EngineArgs(model, device="cpu", kv_cache_memory=1 << 20, max_num_seqs=4)
        )
    )
    assert runner.graphs is None
    assert runner.kv_caches[0][0].shape[0] == runner.num_blocks  # no scratch block on CPU


# --- GPU memory figures: the byte counts, the log line and the /metrics gauges -------------------


def test_tensor_bytes_count_each_storage_once() -> None:
    embedding = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight  # tied
    model = torch.nn.ModuleDict({"embed": embedding, "head": head})
    model.register_buffer("table", torch.zeros(3, dtype=torch.float16))
    assert tensor_bytes(model_tensors(model)) == 10 * 4 * 4 + 3 * 2
    cache = [(torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8))] * 2
    assert tensor_bytes(kv_cache_tensors(cache)) == 2 * 2 * 4 * 2 * 8 * 4  # the same layer twice


FIGURES = GpuMemory(
    weights=3 << 30, kv_cache=5 << 30, activation_peak=1 << 29, allocated=8 << 30,
    reserved=9 << 30, used=10 << 30, total=141 << 30,
)  # fmt: skip


def test_gpu_memory_log_line_and_gauges() -> None:
    assert FIGURES.describe() == (
        "GPU memory: weights 3.00 GiB, KV cache 5.00 GiB, activation peak 0.50 GiB, CUDA "
        "context and other n/a (no pynvml); device 10.00 GiB used of 141.00 GiB"
    )
    assert "process" not in FIGURES.gauges() and FIGURES.gauges()["kv_cache"] == 5 << 30


def test_gpu_memory_gauges_in_metrics_only_on_a_gpu() -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from aieng.server.metrics import ServerMetrics

    def gauges(metrics: ServerMetrics) -> dict[str, float]:
        text = generate_latest(metrics.registry).decode()
        return {
            sample.labels["component"]: sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "aieng_gpu_memory_bytes"
            for sample in family.samples
        }

    on_gpu = gauges(ServerMetrics("m", lambda: None, lambda: FIGURES))
    assert on_gpu == {name: float(value) for name, value in FIGURES.gauges().items()}
    assert on_gpu["weights"] == 3 << 30 and "cuda_context" not in on_gpu
    assert gauges(ServerMetrics("m", lambda: None)) == {}
    assert gpu_memory_figures(SimpleNamespace(device=torch.device("cpu"))) is None


# --- the GPU benchmarks parse their arguments and refuse to run without a GPU --------------------

BENCHES = Path(__file__).resolve().parents[1] / "benches" / "gpu"


@pytest.mark.parametrize("bench", ["bench_int4.py", "bench_e2e.py"])
def test_gpu_bench_scripts_parse_their_arguments(bench: str) -> None:
    run = subprocess.run(
        [sys.executable, str(BENCHES / bench), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "--out" in run.stdout
    if not torch.cuda.is_available():
        run = subprocess.run(
            [sys.executable, str(BENCHES / bench)], capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 2 and "needs an NVIDIA GPU" in run.stderr


def test_e2e_workload_is_nano_vllms_shape() -> None:
    sys.path.insert(0, str(BENCHES))
    try:
        import bench_e2e
    finally:
        sys.path.remove(str(BENCHES))
    prompts, output_lens = bench_e2e.workload(256, 100, 1024)
    assert len(prompts) == len(output_lens) == 256
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(
        100 <= n <= 1024 for n in output_lens
    )
    assert bench_e2e.workload(256, 100, 1024) == (prompts, output_lens)  # seed 0
    assert (
        bench_e2e.QWEN3_0_6B["num_hidden_layers"] == 28 and bench_e2e.QWEN3_0_6B["head_dim"] == 128
    )


# --- the CUDA INT4 method inside a whole model (the kernels' math standing in on the CPU) --------


def test_engine_with_the_cuda_int4_method_follows_the_reference(tmp_path, monkeypatch) -> None:
    """Every 4-bit layer of a loaded checkpoint (fused q/k/v and gate/up included) taken over by
    the CUDA method — its kernels' math run on the CPU — gives the dequantize reference's
    greedy tokens (float32: the float16 scales are the only difference)."""
    from core_driver import CoreDriver
    from quantized_checkpoints import write_compressed_tensors
    from tiny_models import VOCAB_SIZE, build_checkpoint

    from aieng.sampling import SamplingParams

    source = build_checkpoint("qwen2", tmp_path / "float")
    write_compressed_tensors(source, tmp_path / "int4", tmp_path / "dequantized", 4, 32)

    def run(cuda: bool) -> list[list[int]]:
        def method(scheme, prefix, use_kernels=True, cpu_kernel="auto"):
            if cuda:
                return CudaInt4LinearMethod(
                    scheme, prefix, use_kernels, reference_kernel, lambda d: True
                )
            return QuantizedLinearMethod(scheme, prefix, use_kernel=False)

        with monkeypatch.context() as patch:
            # The method chosen for a 4-bit layer on this (CPU) device: the CUDA one, or not.
            patch.setattr(methods, "CpuQuantizedLinearMethod", method)
            args = EngineArgs(
                str(tmp_path / "int4"), device="cpu", block_size=4, kv_cache_memory=1 << 22
            )
            runner = ModelRunner(create_engine_config(args))
        kinds = methods.describe_linear_kernels(runner.model)
        taken, other = ("cuda_int4", "dequant") if cuda else ("dequant", "cuda_int4")
        assert taken in kinds and other not in kinds, kinds
        scheduler = CoreDriver(runner)
        generator = torch.Generator().manual_seed(5)
        for n in (1, 6, 19):
            prompt = torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist()
            scheduler.add(prompt, SamplingParams(temperature=0.0, max_tokens=8))
        return [request.output for request in scheduler.run()]

    assert run(cuda=True) == run(cuda=False)


def test_every_weight_shape_is_screened_in_a_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CUDA device each distinct (N, K, group) is screened in its own child process once
    (a kernel faulting on one shape's grid is off for that shape), not only the first layer's."""
    screened: list[tuple] = []

    def screen(suite, args, label=""):  # type: ignore[no-untyped-def]
        screened.append(args[2:])
        return Screening(passed=[f"kernel for {args[2]}x{args[3]}"])

    monkeypatch.setattr(cuda_int4, "screen_in_child", screen)
    monkeypatch.setattr(cuda_int4, "_SCREENED", {})
    gpu = torch.device("cuda", 0)
    qkv, down = repack(*random_int4(96, 256, 64)), repack(*random_int4(256, 128, 64))
    for weights in (qkv, down, qkv, down):
        passed = cuda_int4.screened_kernels(gpu, torch.float16, weights)
        assert passed == {f"kernel for {weights.out_features}x{weights.in_features}"}
    assert screened == [(96, 256, 64), (256, 128, 64)]
    assert cuda_int4.screened_kernels(torch.device("cpu"), torch.float16, qkv) is None
