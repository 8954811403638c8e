"""The paged attention kernels against the torch reference on an NVIDIA GPU (skipped without
one): random caches and queries of many shapes — MHA and GQA groups of 1 to 20 query heads, head
dims 64 and 128, block sizes 8 to 128, contexts of one token, of lengths around the block and
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
    QUERY_SCALE,
    RequestSpec,
    bounds,
    clone_cache,
    fused_qkv,
    random_cache,
    random_step,
    reference_attention,
)
from aieng.attention.layer import Attention
from aieng.kernels.reference import write_kv_cache, write_quantized_kv_cache
from aieng.kernels.self_check import disagreement

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

    q = randn(tokens, heads, head_dim) * QUERY_SCALE
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


def assert_close(
    got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, decode_rows: torch.Tensor
) -> None:
    """Every (token, head) row within the start-up check's own `RowBound` (`bounds`: decode
    rows the decode kernel's, the others the prefill kernel's), no NaN left: one dropped or
    repeated position fails it at any context length."""
    assert not got.isnan().any(), f"{int(got.isnan().any(-1).sum())} rows left unwritten"
    decode_rows = decode_rows.to(got.device)
    for kind, rows in (("decode", decode_rows), ("prefill", ~decode_rows)):
        if rows.any():
            why = disagreement(got[rows], want[rows], bounds(dtype)[kind])
            assert why is None, f"{kind} rows: {why}"


def decode_rows_of(specs: Sequence[RequestSpec]) -> torch.Tensor:
    """Per token of a step: whether its request decodes (one new token)."""
    return torch.tensor([spec.new == 1 for spec in specs for _ in range(spec.new)])


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
    (8, 2, 128, 64, None, [1, 65, 1000]),  # block sizes beside 16 and 32
    (16, 4, 64, 8, None, [9, 300]),
    (32, 8, 128, 128, 1000, [129, 4096]),
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
    assert_close(got, want, dtype, decode_rows_of(specs))


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
    assert_close(got, want, dtype, decode_rows_of(specs))


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
    q, k, v = fused_qkv(tokens, heads, kv_heads, head_dim, dtype, generator, device)
    cache = random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, int8, device, generator)
    layer = Attention(heads, kv_heads, head_dim, 0, sliding_window=window)
    want = reference_attention(layer, q, k, v, clone_cache(cache), inputs)
    got = backend.forward(layer, q, k, v, cache, backend.build_metadata(inputs))
    assert_close(got, want, dtype, decode_rows_of(MIXED))


@pytest.mark.parametrize("int8", [False, True], ids=["kv", "int8"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 1, 64), (32, 8, 128)])
def test_graph_planned_decodes(
    backend: CudaPagedAttention, heads: int, kv_heads: int, head_dim: int, int8: bool
) -> None:
    """Decodes planned as a captured CUDA graph plans them (for 32,768 positions: as many
    splits as this GPU gives, up to 128) over far shorter live contexts: most splits hold no
    position and must add nothing."""
    device = torch.device("cuda")
    specs = [RequestSpec(299, 1), RequestSpec(0, 1), RequestSpec(1999, 1)]
    inputs, num_blocks = random_step(specs, 16, device, seed=7)
    generator = torch.Generator(device=device).manual_seed(7)
    dtype = torch.bfloat16
    q, k, v = fused_qkv(3, heads, kv_heads, head_dim, dtype, generator, device)
    cache = random_cache(num_blocks, 16, kv_heads, head_dim, dtype, int8, device, generator)
    layer = Attention(heads, kv_heads, head_dim, 0)
    want = reference_attention(layer, q, k, v, clone_cache(cache), inputs)
    metadata = backend.build_metadata(inputs)
    metadata.decode.planned_len = 32768
    got = backend.forward(layer, q, k, v, cache, metadata)
    [(plan, _)] = metadata.decode.plans.values()
    assert plan.num_splits > 8, plan
    assert_close(got, want, dtype, decode_rows_of(specs))


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
