"""aieng's CUDA kernels run on the CPU (issue 12), without a GPU: the sources of int4_gemv.cu,
int4_gemm.cu and fused_ops.cu compiled with the host's C++ compiler over
tests/cuda_host/emulate.h (a block's threads as std::threads, __syncthreads and warp shuffles
as barriers), launched with the grids Python computes, against the pure-PyTorch references.
This checks the kernels' indexing and arithmetic; the PTX itself (loads, conversions, mma) only
runs on a GPU (tests/test_cuda_*_gpu.py). Skipped where no C++20 compiler is found."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cuda_int4 import CHECKPOINT_FORMATS, checkpoint_layer

from aieng.attention.backend import QuantizedKVCache
from aieng.kernels.fused import (
    add_rms_norm_reference,
    norm_threads,
    rope_grid,
    rope_kv_write_reference,
)
from aieng.kernels.int4 import (
    DEFAULT_SMS,
    ONE_GROUP_SHIFT,
    dequantize_weights,
    gemm_launch,
    gemv_launch,
    gemv_reference,
    gemv_tile,
    group_shift,
    kernel_args,
    launch_for,
    reference_matmul,
    repack,
    staged_weights,
)
from aieng.kernels.self_check import disagreement
from aieng.layers.activation import silu_and_mul
from aieng.quantization.cuda_int4 import CudaInt4LinearMethod, check_bound

ROOT = Path(__file__).resolve().parents[1]
COMPILER = shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler (g++ or clang++)")
RUN_KERNEL = ROOT / "tests/cuda_host/run_kernel.cpp"
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


# AddressSanitizer and the alignment check of UndefinedBehaviorSanitizer, where the compiler
# has them: a read past a buffer's end (buffers are exactly their tensor's storage) or a vector
# load from a misaligned address stops the launch, as memcheck would on the GPU.
SANITIZERS = ["-fsanitize=address,alignment", "-fno-sanitize-recover=all", "-g"]


def sanitizers_available(folder: Path) -> bool:
    probe = folder / "probe.cpp"
    probe.write_text("int main() { return 0; }\n")
    command = [COMPILER, *SANITIZERS, str(probe), "-o", str(folder / "probe")]
    built = subprocess.run(command, capture_output=True, timeout=120)
    return built.returncode == 0 and subprocess.run([folder / "probe"]).returncode == 0


_BUILT: dict[Path, Path] = {}  # source -> its binary, built once per test session


def build_host_binary(source: Path, folder: Path) -> Path:
    """`source` built with the host compiler over emulate.h (and the sanitizers, if it has
    them) into `folder`, once per session (every test module that runs kernels on the host
    shares the build) -> the binary."""
    if source not in _BUILT:
        binary = folder / source.stem
        command = [COMPILER, "-std=c++20", "-O1", "-pthread", "-ffp-contract=off"]
        if sanitizers_available(folder):
            command += SANITIZERS
        command += [f"-I{ROOT / 'cuda'}", f"-I{ROOT / 'tests/cuda_host'}", str(source), "-o"]
        subprocess.run([*command, str(binary)], check=True, capture_output=True, timeout=900)
        _BUILT[source] = binary
    return _BUILT[source]


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory) -> HostKernels:
    binary = build_host_binary(RUN_KERNEL, tmp_path_factory.mktemp("cuda_host"))
    return HostKernels(binary, tmp_path_factory.mktemp("buffers"))


class HostKernels:
    """Launches a kernel of the host build; tensors go through files and come back updated."""

    def __init__(self, binary: Path, folder: Path):
        self.binary, self.folder = binary, folder

    def launch(self, kernel: str, grid, block, args, early_copies: bool = False) -> None:
        """One launch of the host build; each tensor's whole storage goes as one buffer (a
        view, such as q of a fused QKV projection, points into it as on the GPU) and comes back
        in place. early_copies: every cp.async lands when issued (emulate.h)."""
        grid, block = (*np.atleast_1d(grid), 1, 1)[:3], (*np.atleast_1d(block), 1)[:2]
        words, buffers = [], []
        bases: dict[int, int] = {}  # storage address -> the argument that carries it
        for index, arg in enumerate(args):
            if arg is None:
                words.append("n")
            elif isinstance(arg, torch.Tensor):
                storage = arg.untyped_storage()
                offset = arg.data_ptr() - storage.data_ptr()
                if storage.data_ptr() in bases:  # a view into an earlier argument's buffer
                    words.append(f"o:{bases[storage.data_ptr()]}:{offset}")
                    continue
                bases[storage.data_ptr()] = index
                raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
                path = self.folder / f"{kernel}-{index}.bin"
                path.write_bytes(raw.numpy().tobytes())
                words.append(f"p:{offset}:{path}")
                buffers.append((raw, path))
            elif isinstance(arg, ctypes.c_int64):
                words.append(f"l:{arg.value}")
            elif isinstance(arg, float):
                words.append(f"f:{arg!r}")
            else:
                words.append(f"i:{arg}")
        dims = [str(int(d)) for d in (*grid, *block)]
        env = {**os.environ, "AIENG_HOST_COPIES": "early" if early_copies else "at-wait"}
        run = subprocess.run(
            [str(self.binary), kernel, *dims, *words], capture_output=True, text=True,
            timeout=600, env=env,
        )  # fmt: skip
        if run.returncode != 0:  # an AddressSanitizer report, a misaligned copy, an abort
            raise HostLaunchError(f"{kernel} exited with {run.returncode}:\n{run.stderr[-4000:]}")
        for raw, path in buffers:  # the whole storage, written back in place
            raw.copy_(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8))


class HostLaunchError(RuntimeError):
    """The host build stopped a launch: a sanitizer report, a misaligned cp.async, a crash."""


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    assert bool(torch.isfinite(got).all()), "an output element was never written"
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def int4_case(m: int, n: int, k: int, group: int, dt: str, seed: int):
    """Random asymmetric INT4 weights in the layout, x (M, K) and y poisoned with NaN."""
    dtype = DTYPES[dt]
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.int32)
    scales = torch.rand(n, k // group, generator=generator) * 0.02 + 1e-3
    zeros = torch.randint(0, 16, (n, k // group), generator=generator).float()
    weights = repack(q, scales, zeros)
    x = torch.randn(m, k, generator=generator).to(dtype)
    return weights, x, torch.full((m, n), float("nan"), dtype=dtype)


def run_gemv(host_kernels, x, weights, y, num_sms: int = DEFAULT_SMS) -> str:
    m, k = x.shape
    n = weights.out_features
    launch = gemv_launch(m, n, k, x.dtype, weights.group_size, num_sms)
    host_kernels.launch(launch.kernel, launch.grid, launch.block, kernel_args(x, weights, y))
    return launch.kernel


HALF_ULP = {"f16": 2**-11, "bf16": 2**-8}  # relative rounding of y to its dtype


def row_errors(got: torch.Tensor, want: torch.Tensor, dt: str) -> torch.Tensor:
    """Per row: the largest element error beyond y's own rounding, over the row's RMS (one
    wrong element shows)."""
    assert bool(torch.isfinite(got).all()), "an output element was never written"
    want = want.double()
    error = (got.double() - want).abs() - HALF_ULP[dt] * want.abs()
    return error.amax(-1).clamp_min(0) / want.pow(2).mean(-1).sqrt().clamp_min(1e-30)


# Every dispatched tensor-core variant (m8: M 1-8, m16: M 9-16, passes of 16 beyond; groups under
# 128 and _g128), N not a multiple of the 16-row CTA step, K not a multiple of the 128-k warp
# block or of the 2048-k step of the 8 warps (the masked tail step), groups 32/64/128/256.
@pytest.mark.parametrize(
    ("m", "n", "k", "group"),
    [
        (1, 9, 96, 32),
        (1, 5, 4096, 64),  # two full steps per warp, no tail
        (2, 6, 3328, 128),  # full steps, then a tail step on some warps
        (2, 40, 416, 32),
        (3, 17, 256, 64),
        (4, 33, 384, 128),
        (5, 20, 160, 32),
        (8, 16, 1152, 128),
        (9, 7, 320, 64),
        (12, 18, 640, 128),
        (13, 9, 1024, 256),
        (16, 23, 224, 32),
        (21, 5, 128, 64),  # two passes of 16 rows
    ],
)
@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_int4_gemv_tensor_cores(host_kernels, m, n, k, group, dt) -> None:
    weights, x, y = int4_case(m, n, k, group, dt, seed=m * n + k)
    kernel = run_gemv(host_kernels, x, weights, y, num_sms=1)  # the grid-stride loop runs
    suffix = "_g128" if group >= 128 else ""  # scaled after the MMA, in float32
    assert kernel == f"int4_gemv_{dt}_m{8 if m <= 8 else 16}{suffix}"
    # The weights as the kernel makes them, multiplied exactly and summed in float32.
    exact = x.double() @ staged_weights(weights, x.dtype).double().t()
    assert float(row_errors(y, exact, dt).max()) < 1e-5  # float32 sums beyond y's rounding
    bound = {"f16": 1e-3, "bf16": 6e-3}[dt]  # the GPU test's bound against float64
    assert relative(y, reference_matmul(x.double(), weights)) < bound


@pytest.mark.parametrize(
    ("m", "n", "k", "group"),
    [(1, 9, 96, 32), (2, 5, 1024, 128), (3, 17, 256, 64), (7, 6, 64, 32), (21, 3, 160, 32)],
)
def test_int4_gemv_float32(host_kernels, m, n, k, group) -> None:
    weights, x, y = int4_case(m, n, k, group, "f32", seed=m * n + k)
    run_gemv(host_kernels, x, weights, y)
    exact = gemv_reference(x.float(), weights)  # the kernel's own algebra, in float32
    assert relative(y, exact) < 1e-6
    assert relative(y, reference_matmul(x.double(), weights)) < 1e-5


@pytest.mark.parametrize(("m", "k", "dt"), [(3, 96, "bf16"), (11, 160, "f16")])
def test_int4_gemv_one_group_per_row(host_kernels, m, k, dt) -> None:
    """Per-channel scales: one group of K (not a power of two, the last 128-k block partly past
    K) per row, scaled after the MMA."""
    weights, x, y = int4_case(m, 10, k, k, dt, seed=4)
    assert group_shift(weights) == ONE_GROUP_SHIFT
    assert run_gemv(host_kernels, x, weights, y) == f"int4_gemv_{dt}_m{gemv_tile(m, x.dtype)}_g128"
    exact = x.double() @ staged_weights(weights, x.dtype).double().t()
    assert float(row_errors(y, exact, dt).max()) < 1e-5


def test_int4_gemv_catches_one_wrong_weight(host_kernels) -> None:
    """The per-row bound above fails when a single weight of the layout is wrong."""
    weights, x, y = int4_case(2, 12, 256, 64, "f16", seed=9)
    run_gemv(host_kernels, x, weights, y)
    exact = x.double() @ staged_weights(weights, x.dtype).double().t()
    assert float(row_errors(y, exact, "f16").max()) < 1e-5
    weights.qweight[5, 77] ^= 0x80  # one nibble changed by 8
    run_gemv(host_kernels, x, weights, y)
    assert float(row_errors(y, exact, "f16").max()) > 1e-2


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
    host_kernels.launch(launch.kernel, launch.grid, launch.block, kernel_args(x, weights, y))
    # the dequantized weights rounded to x's dtype, as the kernel stages them for the MMA
    staged = dequantize_weights(weights).to(dtype).double()
    assert relative(y, x.double() @ staged.t()) < (2e-3 if dt == "f16" else 1e-2)


def host_int4_matmul(host_kernels: HostKernels):
    """`int4_matmul` on the host build: the kernel `launch_for` names, into a NaN-filled y."""

    def matmul(x: torch.Tensor, weights, path: str) -> torch.Tensor:
        flat = x.reshape(-1, weights.in_features).contiguous()
        y = torch.full((flat.shape[0], weights.out_features), float("nan"), dtype=x.dtype)
        launch = launch_for(path, flat.shape[0], weights, x.dtype)
        host_kernels.launch(launch.kernel, launch.grid, launch.block, kernel_args(flat, weights, y))
        return y.view(*x.shape[:-1], weights.out_features)

    return matmul


@pytest.mark.parametrize("fmt", CHECKPOINT_FORMATS)
def test_checkpoint_layers_through_the_kernel_source(host_kernels, fmt) -> None:
    """One layer of each checkpoint format, packed byte by byte from its specification, loaded
    and unpacked by aieng, its start-up check run on the host-built kernels, then through them:
    against x @ W^T with the format writer's own dequantized W."""

    def method_for(scheme):
        return CudaInt4LinearMethod(scheme, fmt, matmul=host_int4_matmul(host_kernels),
                                    runs_on=lambda device: True)  # fmt: skip

    layer, method, dense = checkpoint_layer(fmt, 40, 256, torch.float16, method_for)
    assert method.kernel == "cuda_int4" and method.paths == ("gemv", "gemm")
    for m in (1, 17):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).half()
        why = disagreement(layer(x), x.float() @ dense.t(), check_bound(torch.float16))
        assert why is None, (m, why)


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
