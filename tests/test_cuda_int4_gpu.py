"""The CUDA INT4 kernels on an NVIDIA GPU (issue 12): GEMV and GEMM against the float64
reference of the same layout on many shapes (odd sizes, one row, M past the GEMV's tile, N not a
multiple of any tile), outputs poisoned with NaN before each run, relative error bounds per
dtype; the linear method taking over a layer. Kernel tests only (benches/gpu/run.sh's `tests`
part): the engine end to end is tests/test_cuda_int4_engine_gpu.py. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from test_cuda_int4 import (
    CHECKPOINT_FORMATS,
    checkpoint_layer,
    quantized_layer_from,
    random_int4,
    scheme,
)

from aieng.kernels.int4 import int4_matmul, reference_matmul, repack
from aieng.kernels.self_check import disagreement
from aieng.layers.linear import Linear
from aieng.quantization.cuda_int4 import CudaInt4LinearMethod, check_bound
from aieng.quantization.linear_method import dequantize

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.version.cuda is None,
    reason="needs an NVIDIA GPU: the CUDA INT4 kernels run only there (CPU checks: "
    "tests/test_cuda_int4.py)",
)

# Relative error (Frobenius) against float64, per path and dtype: float32 accumulation with
# float16 (2^-11) or bfloat16 (2^-8) rounding of the output — and, on tensor cores, of the
# dequantized weights.
BOUNDS = {
    ("gemv", torch.float32): 1e-5,
    ("gemv", torch.float16): 1e-3,
    ("gemv", torch.bfloat16): 6e-3,
    ("gemm", torch.float16): 2e-3,
    ("gemm", torch.bfloat16): 1.2e-2,
}
SHAPES = [  # (M, N, K, group)
    (1, 1, 32, 32),
    (1, 7, 96, 32),
    (1, 4096, 4096, 128),
    (2, 129, 1024, 64),
    (3, 300, 2048, 128),
    (5, 64, 4096, 32),
    (8, 1000, 14336, 128),
    (13, 33, 160, 32),
    (16, 4097, 512, 64),
    (17, 250, 384, 128),
    (64, 128, 1024, 64),
    (100, 511, 768, 32),
    (257, 1024, 2048, 128),
]


def weights_on_gpu(n: int, k: int, group: int, seed: int):
    q, scales, zeros = random_int4(n, k, group, seed)
    return repack(q.cuda(), scales.cuda(), zeros.cuda())


# Only the (path, dtype) pairs a kernel exists for: the tensor-core GEMM takes float16 and
# bfloat16 (float32 goes to the GEMV at every M, `choose_path`). A parameter that skipped would
# fail the device run (benches/gpu/junit_summary.py): nothing here may skip on a GPU.
PATHS = [pytest.param(path, dtype, id=f"{path}-{str(dtype)[6:]}") for path, dtype in BOUNDS]


@pytest.mark.parametrize(("path", "dtype"), PATHS)
@pytest.mark.parametrize(("m", "n", "k", "group"), SHAPES)
def test_kernel_matches_reference(path, dtype, m, n, k, group) -> None:
    weights = weights_on_gpu(n, k, group, seed=m + n + k)
    generator = torch.Generator(device="cuda").manual_seed(m * n)
    x = torch.randn(m, k, generator=generator, device="cuda").to(dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    got = int4_matmul(x, weights, path, out=out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert bool(torch.isfinite(got).all()), "an output element was never written"
    want = reference_matmul(x.double(), weights).double()
    error = float((got.double() - want).norm() / want.norm())
    assert error < BOUNDS[(path, dtype)], error


@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_strided_and_batched_inputs(path) -> None:
    weights = weights_on_gpu(96, 256, 64, seed=5)
    wide = torch.randn(2, 9, 300, device="cuda", dtype=torch.bfloat16)
    x = wide[..., 7:263]  # (2, 9, 256), rows not contiguous
    got = int4_matmul(x, weights, path)
    assert got.shape == (2, 9, 96)
    want = reference_matmul(x.double(), weights)
    assert float((got.double() - want).norm() / want.norm()) < BOUNDS[(path, torch.bfloat16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_method_takes_over_layers_on_the_gpu(dtype) -> None:
    method = CudaInt4LinearMethod(scheme(64, False), "gpu_layer")
    with torch.device("cuda"):
        layer = Linear(512, 200, bias=True, dtype=dtype, methods=lambda prefix: method)
    torch.nn.init.normal_(layer.bias)
    quantized_layer_from(layer, method, 64)
    assert method.kernel == "cuda_int4"
    assert method.paths == (("gemv",) if dtype == torch.float32 else ("gemv", "gemm"))
    for m in (1, 4, 16, 17, 200):
        x = torch.randn(m, 512, device="cuda", dtype=dtype)
        want = x.double() @ dequantize(layer).double().t() + layer.bias.double()
        got = layer(x)
        error = float((got.double() - want).norm() / want.norm())
        assert error < 2e-2, (m, error)


# One dtype per format: each (dtype, shape) costs a child process's start-up screen (seconds).
CHECKPOINT_CASES = list(zip(CHECKPOINT_FORMATS, [torch.float16, torch.bfloat16] * 2, strict=False))


@pytest.mark.parametrize(("fmt", "dtype"), CHECKPOINT_CASES)
def test_checkpoint_layers_against_their_own_dequantization(fmt: str, dtype: torch.dtype) -> None:
    """A layer of each checkpoint format, packed byte by byte from the format's specification
    (not aieng's packing), unpacked by aieng and taken over by the kernels: every M a path
    dispatches against x @ W^T with the writer's own dequantized W, per row within the start-up
    check's bound — a checkpoint-unpacking bug shows here, where the kernels' own reference
    (built from the unpacked weights) cannot see it."""

    def method_for(scheme):
        return CudaInt4LinearMethod(scheme, fmt)

    layer, method, dense = checkpoint_layer(fmt, 296, 1024, dtype, method_for, device="cuda")
    assert method.kernel == "cuda_int4" and method.paths == ("gemv", "gemm")
    for m in (1, 5, 9, 16, 17, 64):
        x = torch.randn(m, 1024, device="cuda").to(dtype)
        got = layer(x)
        torch.cuda.synchronize()
        why = disagreement(got, x.float() @ dense.t(), check_bound(dtype))
        assert why is None, (m, why)
