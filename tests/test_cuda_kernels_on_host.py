"""aieng's CUDA kernels run on the CPU (issue 12), without a GPU: the sources of int4_gemv.cu and
fused_ops.cu compiled with the host's C++ compiler over tests/cuda_host/emulate.h (a block's
threads as std::threads, __syncthreads and warp shuffles as barriers), launched with the grids
Python computes, against the pure-PyTorch references. This checks the kernels' indexing and
arithmetic; the PTX itself (loads, conversions, mma) only runs on a GPU
(tests/test_cuda_*_gpu.py). Skipped where no C++20 compiler is found."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from aieng.attention.backend import QuantizedKVCache
from aieng.kernels.fused import (
    add_rms_norm_reference,
    norm_threads,
    rope_grid,
    rope_kv_write_reference,
)
from aieng.kernels.int4 import (
    dequantize_weights,
    gemm_launch,
    gemv_launch,
    gemv_reference,
    reference_matmul,
    repack,
)
from aieng.layers.activation import silu_and_mul

ROOT = Path(__file__).resolve().parents[1]
COMPILER = shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler (g++ or clang++)")
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory) -> HostKernels:
    binary = tmp_path_factory.mktemp("cuda_host") / "run_kernel"
    command = [COMPILER, "-std=c++20", "-O1", "-pthread", "-ffp-contract=off"]
    command += [f"-I{ROOT / 'cuda'}", str(ROOT / "tests/cuda_host/run_kernel.cpp"), "-o"]
    subprocess.run([*command, str(binary)], check=True, capture_output=True, timeout=600)
    return HostKernels(binary, tmp_path_factory.mktemp("buffers"))


class HostKernels:
    """Launches a kernel of the host build; tensors go through files and come back updated."""

    def __init__(self, binary: Path, folder: Path):
        self.binary, self.folder = binary, folder

    def launch(self, kernel: str, grid, block, args) -> None:
        grid, block = (*np.atleast_1d(grid), 1, 1)[:3], (*np.atleast_1d(block), 1)[:2]
        words, buffers = [], []
        bases: dict[int, tuple[int, torch.Tensor]] = {}  # storage -> (its arg index, tensor)
        for index, arg in enumerate(args):
            if arg is None:
                words.append("n")
            elif isinstance(arg, torch.Tensor) and arg.untyped_storage().data_ptr() in bases:
                # a view into an earlier argument (q, k, v of one fused projection): a pointer
                # into that buffer, as on the GPU
                base_index, base = bases[arg.untyped_storage().data_ptr()]
                words.append(f"o:{base_index}:{arg.data_ptr() - base.data_ptr()}")
            elif isinstance(arg, torch.Tensor):
                if not arg.is_contiguous() or arg.storage_offset():
                    raise ValueError(f"argument {index}: pass the whole buffer first")
                bases[arg.untyped_storage().data_ptr()] = (index, arg)
                path = self.folder / f"{kernel}-{index}.bin"
                path.write_bytes(arg.contiguous().view(torch.uint8).numpy().tobytes())
                words.append(f"p:{path}")
                buffers.append((arg, path))
            elif isinstance(arg, ctypes.c_int64):
                words.append(f"l:{arg.value}")
            elif isinstance(arg, float):
                words.append(f"f:{arg!r}")
            else:
                words.append(f"i:{arg}")
        dims = [str(int(d)) for d in (*grid, *block)]
        subprocess.run([str(self.binary), kernel, *dims, *words], check=True, timeout=600)
        for tensor, path in buffers:  # written back in place (strides as given: contiguous)
            data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
            tensor.view(-1).view(torch.uint8).copy_(data)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    assert bool(torch.isfinite(got).all()), "an output element was never written"
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "dt"),
    [
        (1, 9, 96, 32, "bf16"),
        (2, 5, 1024, 128, "f32"),
        (3, 17, 256, 64, "f16"),
        (7, 6, 64, 32, "f32"),
        (16, 5, 128, 32, "bf16"),
        (21, 3, 160, 32, "f32"),  # more rows than a tile: two passes
    ],
)
def test_int4_gemv(host_kernels, m, n, k, group, dt) -> None:
    dtype = DTYPES[dt]
    generator = torch.Generator().manual_seed(m * n + k)
    q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.int32)
    scales = torch.rand(n, k // group, generator=generator) * 0.02 + 1e-3
    zeros = torch.randint(0, 16, (n, k // group), generator=generator).float()
    weights = repack(q, scales, zeros)
    x = torch.randn(m, k, generator=generator).to(dtype)
    y = torch.full((m, n), float("nan"), dtype=dtype)
    launch = gemv_launch(m, n, k, dtype)
    args = [x, weights.qweight, weights.scale_zero, y, m, n, k, group]
    host_kernels.launch(launch.kernel, launch.grid, launch.block, args)
    exact = gemv_reference(x.float(), weights)  # the kernel's own algebra, in float32
    bound = {"f32": 1e-6, "f16": 1e-3, "bf16": 6e-3}[dt]
    assert relative(y, exact) < bound
    assert relative(y, reference_matmul(x.double(), weights)) < max(bound, 1e-5)


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "dt"),
    [
        (1, 8, 32, 32, "f16"),
        (17, 70, 96, 32, "bf16"),
        (65, 64, 128, 64, "f16"),
        (5, 130, 64, 64, "bf16"),
    ],
)
def test_int4_gemm(host_kernels, m, n, k, group, dt) -> None:
    """Tensor-core tiles of 64 x 64 (mma.sync emulated from its fragment layout): rows and
    columns past M and N, several k tiles, one scale per group."""
    dtype = DTYPES[dt]
    generator = torch.Generator().manual_seed(m + n + k)
    q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.int32)
    scales = torch.rand(n, k // group, generator=generator) * 0.02 + 1e-3
    zeros = torch.randint(0, 16, (n, k // group), generator=generator).float()
    weights = repack(q, scales, zeros)
    x = torch.randn(m, k, generator=generator).to(dtype)
    y = torch.full((m, n), float("nan"), dtype=dtype)
    launch = gemm_launch(m, n, dtype)
    args = [x, weights.qweight, weights.scale_zero, y, m, n, k, group]
    host_kernels.launch(launch.kernel, launch.grid, launch.block, args)
    # the dequantized weights rounded to x's dtype, as the kernel stages them for the MMA
    staged = dequantize_weights(weights).to(dtype).double()
    assert relative(y, x.double() @ staged.t()) < (2e-3 if dt == "f16" else 1e-2)


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 7), (3, 100), (2, 300)])
@pytest.mark.parametrize("with_branch", [True, False])
def test_add_rms_norm(host_kernels, dt, rows, hidden, with_branch) -> None:
    dtype = DTYPES[dt]
    generator = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=generator).to(dtype)
    branch = torch.randn(rows, hidden, generator=generator).to(dtype) if with_branch else None
    weight = torch.randn(hidden, generator=generator).to(dtype)
    want_sum, want = add_rms_norm_reference(x, branch, weight, 1e-6)
    summed, out = x.clone(), torch.full_like(x, float("nan"))
    args = [summed, branch, weight, out, hidden, 1e-6, 0]
    host_kernels.launch(f"add_rms_norm_{dt}", rows, norm_threads(hidden), args)
    assert torch.equal(summed, want_sum)
    assert relative(out, want) < (1e-6 if dt == "f32" else 1e-2)


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_silu_and_mul(host_kernels, dt) -> None:
    dtype = DTYPES[dt]
    x = (torch.randn(3, 2 * 37, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    out = torch.full((3, 37), float("nan"), dtype=dtype)
    host_kernels.launch(f"silu_and_mul_{dt}", 1, 256, [x, out, ctypes.c_int64(3), 37])
    assert relative(out, silu_and_mul(x)) < (1e-6 if dt == "f32" else 2e-3)


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("quantized", [False, True])
def test_rope_kv_write(host_kernels, dt, quantized) -> None:
    dtype = DTYPES[dt]
    tokens, heads, kv_heads, head_dim, blocks, block = 5, 4, 2, 96, 3, 4
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    positions = torch.tensor([0, 7, 3, 30, 12])
    angles = torch.arange(32, dtype=torch.float32)[:, None] * torch.rand(
        head_dim // 2, generator=generator
    )
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([2, 9, -1, 0, 5])  # row 2 is padding: not written

    def split(t):
        q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        return q.view(tokens, heads, -1), k.view(tokens, kv_heads, -1), v.view(tokens, kv_heads, -1)

    def cache():
        shape = (blocks, block, kv_heads, head_dim)
        if not quantized:
            return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        values = [torch.zeros(shape, dtype=torch.int8) for _ in "kv"]
        scales = [torch.zeros(*shape[:-1], 1, dtype=dtype) for _ in "kv"]
        return QuantizedKVCache(values[0], values[1], scales[0], scales[1])

    ours, reference = qkv.clone(), qkv.clone()
    got_cache, want_cache = cache(), cache()
    q, k, v = split(ours)
    rq, rk, rv = split(reference)
    written = slots >= 0
    want_q, want_k = rope_kv_write_reference(
        rq, rk, rv, positions, cos, sin, torch.arange(tokens), cache()
    )
    rope_kv_write_reference(
        rq[written], rk[written], rv[written], positions[written], cos, sin, slots[written],
        want_cache,
    )  # fmt: skip
    # As kernels.fused.rope_kv_write passes them: q, k and v are views into the fused qkv rows
    # (token stride: the whole projection), the cache contiguous.
    k_scale = got_cache.k_scale if quantized else None
    v_scale = got_cache.v_scale if quantized else None
    args = [ours, k, v, *(t.stride(0) for t in (q, k, v)), positions, slots, cos, sin, 1]
    args += [got_cache[0], got_cache[1], k_scale, v_scale, heads, kv_heads, head_dim]
    args.append(float(torch.finfo(dtype).tiny))
    host_kernels.launch(f"rope_kv_write_{dt}", rope_grid(tokens, heads, kv_heads), 32, args)
    bound = 1e-6 if dt == "f32" else 1e-2
    assert relative(q, want_q) < bound and relative(k, want_k) < bound
    for got, want in zip(got_cache, want_cache, strict=True):
        assert torch.equal(got, want) if dt == "f32" else relative(got.float(), want.float()) < 2e-2
