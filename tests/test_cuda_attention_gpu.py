"""The paged attention kernels against the torch reference on an NVIDIA GPU (skipped without
one): random caches and queries of many shapes — MHA and GQA groups of 1 to 20 query heads, head
dims 64 and 128, block sizes 16 and 32, contexts of one token, of lengths around the block and
tile sizes, and up to 32k (split-K) — in float16 and bfloat16, with the model's-dtype and the
INT8 cache, with and without a sliding window. Outputs are NaN-filled before each run, so a row
the kernel forgets (or one it must not touch) shows; the reference is computed in float32 over
the same cache contents (`cuda_self_check.reference_attention`)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from aieng.attention.backend import QuantizedKVCache
from aieng.attention.cuda_paged import CudaPagedAttention, build_cuda_metadata, paged_cache
from aieng.attention.cuda_self_check import (
    TOLERANCE,
    RequestSpec,
    clone_cache,
    random_cache,
    random_step,
    reference_attention,
)
from aieng.attention.layer import Attention
from aieng.kernels.reference import write_kv_cache, write_quantized_kv_cache

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.version.cuda is None,
    reason="needs an NVIDIA GPU: the kernels' CPU checks (NVRTC compile, launch parameters, "
    "self-check and fallback) are test_cuda_compile.py and test_cuda_attention_selection.py",
)

DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def backend() -> CudaPagedAttention:
    return CudaPagedAttention(torch.device("cuda"))


def run_step(
    backend: CudaPagedAttention, specs: Sequence[RequestSpec], heads: int, kv_heads: int,
    head_dim: int, block_size: int, window: int | None, dtype: torch.dtype, int8: bool,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The kernels on one random step, into a NaN-filled output -> (got, want)."""
    device = torch.device("cuda")
    inputs, num_blocks = random_step(specs, block_size, device, seed)
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = int(inputs.query_start_loc[-1])

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device).to(dtype)

    q = randn(tokens, heads, head_dim)
    k, v = randn(tokens, kv_heads, head_dim), randn(tokens, kv_heads, head_dim)
    cache = random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, int8, device, generator)
    layer = Attention(heads, kv_heads, head_dim, 0, sliding_window=window)
    want = reference_attention(layer, q, k, v, clone_cache(cache), inputs)
    metadata = build_cuda_metadata(inputs)
    if isinstance(cache, QuantizedKVCache):
        write_quantized_kv_cache(k, v, cache, metadata.slot_mapping)
    else:
        write_kv_cache(k, v, cache[0], cache[1], metadata.slot_mapping)
    out = torch.full_like(q, float("nan"))
    backend.attend(layer, q, paged_cache(cache), metadata, out)
    torch.cuda.synchronize()
    return out, want


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Every (token, head) row within the dtype's relative error (norm-wise), no NaN left."""
    assert not got.isnan().any(), f"{int(got.isnan().any(-1).sum())} rows left unwritten"
    got64, want64 = got.double(), want.double()
    rows = (got64 - want64).norm(dim=-1) / want64.norm(dim=-1).clamp_min(1e-12)
    worst = int(rows.argmax())
    bound = 2 * TOLERANCE[dtype]
    assert float(rows.max()) <= bound, (
        f"row {divmod(worst, rows.shape[1])} (token, head): relative error "
        f"{float(rows.max()):.2e} > {bound:.1e}"
    )
    total = float((got64 - want64).norm() / want64.norm())
    assert total <= TOLERANCE[dtype], f"relative error {total:.2e} > {TOLERANCE[dtype]:.1e}"


# (query heads, KV heads, head_dim, block size, window, context lengths)
DECODE_SHAPES = [
    (8, 8, 64, 16, None, [1, 2, 15, 16, 17, 33, 100]),  # MHA
    (32, 8, 128, 16, None, [1, 17, 511, 1000, 4096]),  # group 4
    (16, 2, 128, 32, None, [5, 31, 32, 33, 2049]),  # group 8
    (12, 4, 64, 32, 100, [1, 99, 100, 101, 3000]),  # group 3 (a padded head), window
    (28, 4, 128, 16, None, [7, 700]),  # group 7
    (40, 2, 128, 16, 4096, [32768]),  # group 20: three CTAs per KV head; window
    (8, 1, 64, 16, None, [32768]),  # one long context: split-K
    (16, 8, 64, 32, None, [4096] * 16),  # batch 16 x 4k
]


@pytest.mark.parametrize("int8", [False, True], ids=["kv", "int8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}d{s[2]}b{s[3]}")
def test_decode_matches_the_reference(
    backend: CudaPagedAttention, shape: tuple, dtype: torch.dtype, int8: bool
) -> None:
    heads, kv_heads, head_dim, block_size, window, lengths = shape
    specs = [RequestSpec(length - 1, 1) for length in lengths]
    got, want = run_step(backend, specs, heads, kv_heads, head_dim, block_size, window, dtype, int8)
    assert_close(got, want, dtype)


# (query heads, KV heads, head_dim, block size, window, (cached, new) per request)
PREFILL_SHAPES = [
    (8, 8, 64, 16, None, [(0, 2), (0, 37), (0, 64), (0, 65)]),
    (32, 8, 128, 16, None, [(0, 300), (100, 129), (17, 2)]),
    (16, 2, 128, 32, 64, [(0, 200), (500, 70)]),  # window inside the chunk and the prefix
    (12, 4, 64, 32, None, [(1000, 1000)]),  # a chunk after a long prefix
    (40, 8, 128, 16, 4096, [(8000, 129)]),
]


@pytest.mark.parametrize("int8", [False, True], ids=["kv", "int8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}d{s[2]}b{s[3]}")
def test_prefill_matches_the_reference(
    backend: CudaPagedAttention, shape: tuple, dtype: torch.dtype, int8: bool
) -> None:
    heads, kv_heads, head_dim, block_size, window, requests = shape
    specs = [RequestSpec(cached, new) for cached, new in requests]
    got, want = run_step(backend, specs, heads, kv_heads, head_dim, block_size, window, dtype, int8)
    assert_close(got, want, dtype)


MIXED = [RequestSpec(0, 37), RequestSpec(20, 1), RequestSpec(50, 70), RequestSpec(0, 1),
         RequestSpec(3000, 1), RequestSpec(0, 2)]  # fmt: skip


@pytest.mark.parametrize("int8", [False, True], ids=["kv", "int8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("window", [None, 48])
def test_a_mixed_step_through_forward(
    backend: CudaPagedAttention, dtype: torch.dtype, int8: bool, window: int | None
) -> None:
    """Decodes and prefills in one step, through `forward` (the cache written by it), with q a
    strided view as a fused QKV projection gives it."""
    device = torch.device("cuda")
    heads, kv_heads, head_dim, block_size = 16, 4, 128, 16
    inputs, num_blocks = random_step(MIXED, block_size, device, seed=5)
    generator = torch.Generator(device=device).manual_seed(5)
    tokens = int(inputs.query_start_loc[-1])
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator, device=device)
    q, k, v = qkv.to(dtype).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q = q.view(tokens, heads, head_dim)
    k, v = k.reshape(tokens, kv_heads, head_dim), v.reshape(tokens, kv_heads, head_dim)
    cache = random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, int8, device, generator)
    layer = Attention(heads, kv_heads, head_dim, 0, sliding_window=window)
    want = reference_attention(layer, q, k, v, clone_cache(cache), inputs)
    got = backend.forward(layer, q, k, v, cache, backend.build_metadata(inputs))
    assert_close(got, want, dtype)


def test_the_decode_kernel_touches_only_its_rows(backend: CudaPagedAttention) -> None:
    """Rows of the step that are not decode rows (here: a prefill's) stay as they were when only
    the decode kernel runs."""
    device = torch.device("cuda")
    specs = [RequestSpec(0, 5), RequestSpec(900, 1), RequestSpec(3, 1)]
    inputs, num_blocks = random_step(specs, 16, device, seed=1)
    generator = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(7, 8, 64, generator=generator, device=device).half()
    cache = random_cache(num_blocks, 16, 2, 64, torch.float16, False, device, generator)
    metadata = build_cuda_metadata(inputs)
    metadata.prefill = None
    out = torch.full_like(q, float("nan"))
    backend.attend(Attention(8, 2, 64, 0), q, paged_cache(cache), metadata, out)
    torch.cuda.synchronize()
    assert out[:5].isnan().all() and not out[5:].isnan().any()


def test_self_check_passes_on_this_gpu(backend: CudaPagedAttention) -> None:
    from aieng.attention.cuda_self_check import self_check

    for dtype in DTYPES:
        for int8 in (False, True):
            assert self_check(backend, 32, 8, 128, dtype, int8, (None, 64), backend.device)
