"""The fused kernels of cuda/fused_ops.cu on an NVIDIA GPU (issue 12) against their pure-PyTorch
references — residual add + RMSNorm, RoPE + KV-cache write (model dtype and INT8 cache), SiLU·mul
— on odd sizes, outputs and caches poisoned before each run, bounds per dtype; and the start-up
check passing every kernel. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from aieng.attention.backend import QuantizedKVCache
from aieng.kernels.fused import (
    add_rms_norm,
    add_rms_norm_reference,
    check_fused_ops,
    rope_kv_write,
    rope_kv_write_reference,
    silu_and_mul,
)
from aieng.kernels.reference import dequantize_int8
from aieng.kernels.reference import silu_and_mul_torch as silu_and_mul_reference

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.version.cuda is None,
    reason="needs an NVIDIA GPU: the fused CUDA kernels run only there (compile checks: "
    "tests/test_cuda_compile.py)",
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Largest relative (Frobenius) error against the reference: float32 ops in another order
# (rsqrt, sums), and in 16-bit types an occasional output rounded the other way.
BOUNDS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    assert bool(torch.isfinite(got).all()), "an output element was never written"
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 1), (3, 7), (17, 100), (5, 4096), (2, 5000)])
@pytest.mark.parametrize("with_branch", [True, False])
@pytest.mark.parametrize("weight_in_float32", [False, True])
def test_add_rms_norm(dtype, rows, hidden, with_branch, weight_in_float32) -> None:
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    branch = torch.randn_like(x) if with_branch else None
    weight = torch.randn(hidden, device="cuda", dtype=dtype)
    want_sum, want = add_rms_norm_reference(x, branch, weight, 1e-6, weight_in_float32)
    out = torch.full_like(x, float("nan"))
    summed = x.clone()
    got = add_rms_norm(summed, branch, weight, 1e-6, weight_in_float32, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(summed, want_sum)  # the residual add rounds as torch's
    assert relative(got, want) < BOUNDS[dtype]


def cache_of(dtype, quantized: bool, blocks: int, block: int, kv_heads: int, head_dim: int):
    shape = (blocks, block, kv_heads, head_dim)
    if not quantized:
        return tuple(torch.full(shape, float("nan"), dtype=dtype, device="cuda") for _ in range(2))
    values = [torch.full(shape, -128, dtype=torch.int8, device="cuda") for _ in range(2)]
    scales = [torch.full((*shape[:-1], 1), float("nan"), dtype=dtype, device="cuda") for _ in "kv"]
    return QuantizedKVCache(values[0], values[1], scales[0], scales[1])


def cache_values(cache) -> list[torch.Tensor]:
    if isinstance(cache, QuantizedKVCache):
        return [dequantize_int8(cache.k, cache.k_scale, torch.float64),
                dequantize_int8(cache.v, cache.v_scale, torch.float64)]  # fmt: skip
    return [cache[0].double(), cache[1].double()]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim"),
    [(1, 1, 1, 2), (5, 4, 2, 64), (33, 14, 2, 96), (7, 32, 8, 128), (3, 8, 8, 256)],
)
def test_rope_kv_write(dtype, quantized, tokens, heads, kv_heads, head_dim) -> None:
    block, blocks = 16, 8
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=dtype)
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    angles = torch.arange(4096, dtype=torch.float32)[:, None] * torch.rand(head_dim // 2)
    cos, sin = angles.cos().cuda(), angles.sin().cuda()
    slots = torch.randperm(blocks * block, device="cuda")[:tokens]
    slots[0] = -1 if tokens > 2 else slots[0]  # a padded row: nothing written

    def split(t):
        q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        return q.view(tokens, heads, -1), k.view(tokens, kv_heads, -1), v.view(tokens, kv_heads, -1)

    ours, theirs = qkv.clone(), qkv.clone()
    cache = cache_of(dtype, quantized, blocks, block, kv_heads, head_dim)
    reference_cache = cache_of(dtype, quantized, blocks, block, kv_heads, head_dim)
    q, k, v = split(ours)
    rope_kv_write(q, k, v, positions, cos, sin, slots, cache)
    rq, rk, rv = split(theirs)
    written = slots >= 0
    scratch = cache_of(dtype, quantized, blocks, block, kv_heads, head_dim)
    every_row = torch.arange(tokens, device="cuda")
    want_q, want_k = rope_kv_write_reference(rq, rk, rv, positions, cos, sin, every_row, scratch)
    rope_kv_write_reference(
        rq[written],
        rk[written],
        rv[written],
        positions[written],
        cos,
        sin,
        slots[written],
        reference_cache,
    )
    assert relative(q, want_q) < BOUNDS[dtype] and relative(k, want_k) < BOUNDS[dtype]
    assert torch.equal(v, rv)  # v is only read
    flat = slots[written]
    pairs = zip(cache_values(cache), cache_values(reference_cache), strict=True)
    for got, want in pairs:
        got, want = got.flatten(0, 1)[flat], want.flatten(0, 1)[flat]
        assert relative(got, want) < (2e-2 if quantized else BOUNDS[dtype])
    if tokens > 2:  # slot -1's row left the poison where the reference wrote row 0's slot
        untouched = torch.ones(blocks * block, dtype=torch.bool, device="cuda")
        untouched[flat] = False
        values = cache[0].flatten(0, 1)[untouched]
        assert bool((values == -128).all()) if quantized else bool(values.isnan().all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inter"), [(1, 1), (3, 7), (19, 1536), (1000, 3000)])
def test_silu_and_mul(dtype, rows, inter) -> None:
    x = torch.randn(rows, 2 * inter, device="cuda", dtype=dtype) * 4
    out = torch.full((rows, inter), float("nan"), device="cuda", dtype=dtype)
    got = silu_and_mul(x, out=out)
    assert relative(got, silu_and_mul_reference(x)) < BOUNDS[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_fused_kernel_passes_its_startup_check(dtype) -> None:
    assert len(check_fused_ops(torch.device("cuda"), dtype)) == 3
