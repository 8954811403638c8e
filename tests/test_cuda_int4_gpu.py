"""The CUDA INT4 kernels on an NVIDIA GPU (issue 12): GEMV and GEMM against the float64
reference of the same layout on many shapes (odd sizes, one row, M past the GEMV's tile, N not a
multiple of any tile), outputs poisoned with NaN before each run, relative error bounds per
dtype; the linear method taking over a layer; and the engine end to end with the kernels on vs
the dequantize reference. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from core_driver import CoreDriver
from test_cuda_int4 import quantized_layer_from, random_int4, scheme
from tiny_models import VOCAB_SIZE, build_checkpoint

from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import create_engine_config
from aieng.kernels.int4 import int4_matmul, reference_matmul, repack
from aieng.layers.linear import Linear
from aieng.quantization import methods
from aieng.quantization.cuda_int4 import CudaInt4LinearMethod
from aieng.quantization.linear_method import QuantizedLinearMethod, dequantize
from aieng.quantizer.compressed_tensors_writer import QuantScheme
from aieng.quantizer.quantize import QuantizeOptions, quantize_checkpoint
from aieng.sampling import SamplingParams
from aieng.worker.runner import ModelRunner

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


@pytest.mark.parametrize("path", ["gemv", "gemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "group"), SHAPES)
def test_kernel_matches_reference(path, dtype, m, n, k, group) -> None:
    if (path, dtype) not in BOUNDS:
        pytest.skip("the tensor-core GEMM takes float16 and bfloat16 only")
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


PROMPT_LENS = [1, 7, 40, 23]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4-gpu")
    source = build_checkpoint("llama", root / "float", hidden_size=256, intermediate_size=512)
    rtn = QuantizeOptions(method="rtn", scheme=QuantScheme(4, 32, symmetric=False))
    quantize_checkpoint(source, root / "int4", rtn, progress=None)  # aieng's own writer
    return root / "int4"


def run_engine(folder, dtype: str, kernels: bool, monkeypatch) -> list:
    with monkeypatch.context() as patch:
        if not kernels:  # the torch reference: dequantize then matmul
            patch.setattr(methods, "CudaInt4LinearMethod", QuantizedLinearMethod)
        args = EngineArgs(
            model=str(folder), device="cuda", dtype=dtype, block_size=16, kv_cache_memory=1 << 24
        )
        runner = ModelRunner(create_engine_config(args))
    kinds = methods.describe_linear_kernels(runner.model)
    assert ("cuda_int4" in kinds) == kernels, kinds
    scheduler = CoreDriver(runner)
    generator = torch.Generator().manual_seed(3)
    for n in PROMPT_LENS:
        prompt = torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist()
        scheduler.add(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2))
    return scheduler.run()


def test_engine_float32_kernels_give_the_reference_tokens(int4_checkpoint, monkeypatch) -> None:
    ours = run_engine(int4_checkpoint, "float32", True, monkeypatch)
    reference = run_engine(int4_checkpoint, "float32", False, monkeypatch)
    for a, b in zip(ours, reference, strict=True):
        assert a.output == b.output
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=2e-3, rtol=0
        )


def test_engine_bfloat16_kernels_follow_the_reference(int4_checkpoint, monkeypatch) -> None:
    """vLLM's first-divergence rule: identical tokens with close logprobs up to the first
    difference; there the reference's token is in our top 2, nearly tied with ours."""
    ours = run_engine(int4_checkpoint, "bfloat16", True, monkeypatch)
    reference = run_engine(int4_checkpoint, "bfloat16", False, monkeypatch)
    for a, b in zip(ours, reference, strict=True):
        for i, (mine, theirs) in enumerate(zip(a.output, b.output, strict=True)):
            if mine != theirs:
                top = a.top_logprobs[i]
                assert theirs in top and top[mine] - top[theirs] < 0.1
                break
            assert abs(a.logprobs[i] - b.logprobs[i]) < 0.1
