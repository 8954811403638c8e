"""The start-up checks' per-row bound (`aieng.kernels.self_check.RowBound`) proven by fault
injection on the CPU: the reference computed as the kernel computes it (in float32, rounded to
the model's dtype where the kernel rounds) passes against the exact answer in float64, and the
same output with one fault in it — one element of one row off, one token dropped from an
attention context, one output dimension zeroed or two swapped, one residual element not
updated — fails. Each check's bound is the one the start-up check uses."""

from __future__ import annotations

import pytest
import torch

from aieng.attention.backend import AttentionInputs, QuantizedKVCache
from aieng.attention.cuda_self_check import (
    QUERY_SCALE,
    RequestSpec,
    bounds,
    clone_cache,
    random_cache,
    random_step,
)
from aieng.kernels.fused import add_rms_norm_reference
from aieng.kernels.int4 import dequantize_weights, repack
from aieng.kernels.reference import write_kv_cache, write_quantized_kv_cache
from aieng.kernels.self_check import RowBound, disagreement, row_excess
from aieng.quantization.cuda_int4 import check_bound

CPU = torch.device("cpu")
DTYPES = [torch.bfloat16, torch.float16]


def passes(got: torch.Tensor, want: torch.Tensor, bound: RowBound) -> bool:
    return disagreement(got, want, bound) is None


# --- INT4 matmul: one element of one row, a swapped output dimension ---------------------------


def int4_problem(dtype: torch.dtype, m: int = 16, n: int = 256, k: int = 4096):
    generator = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.int32)
    scales = torch.rand(n, k // 128, generator=generator) * 0.02 + 1e-3
    zeros = torch.randint(0, 16, (n, k // 128), generator=generator).float()
    weight = dequantize_weights(repack(q, scales, zeros))  # (N, K) float32
    x = torch.randn(m, k, generator=generator).to(dtype)
    exact = x.double() @ weight.double().t()
    # as the GEMM computes it: weights staged in `dtype`, float32 sums, the output rounded
    honest = (x.float() @ weight.to(dtype).float().t()).to(dtype)
    return x, weight, exact, honest


@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_bound_passes_the_honest_output_and_fails_one_wrong_element(dtype) -> None:
    *_, exact, honest = int4_problem(dtype)
    bound = check_bound(dtype)
    assert passes(honest, exact, bound)
    # One element 2% of its row's largest magnitude off (about one 32-weight chunk of K = 4096
    # missing from one output), wherever it is.
    scale = exact.abs().amax(-1)
    for row, column in ((0, 0), (7, 100), (15, 255)):
        wrong = honest.clone()
        wrong[row, column] += 0.02 * float(scale[row])
        assert not passes(wrong, exact, bound), (row, column)
        assert int(row_excess(wrong, exact, bound).argmax()) == row


def test_int4_bound_fails_a_missing_chunk_in_float16() -> None:
    """The realistic fault itself: one output's sum skips one 16-byte chunk (32 weights)."""
    x, weight, exact, honest = int4_problem(torch.float16)
    for row, column, chunk in ((0, 3, 0), (5, 77, 64), (15, 200, 127)):
        part = slice(32 * chunk, 32 * chunk + 32)
        wrong = honest.clone()
        missing = x[row, part].double() @ weight[column, part].double()
        wrong[row, column] = (exact[row, column] - missing).to(torch.float16)
        assert not passes(wrong, exact, check_bound(torch.float16)), (row, column, chunk)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_bound_fails_swapped_or_zeroed_output_dimensions(dtype) -> None:
    *_, exact, honest = int4_problem(dtype)
    swapped = honest.clone()
    swapped[:, [10, 11]] = honest[:, [11, 10]]
    zeroed = honest.clone()
    zeroed[:, 42] = 0
    for wrong in (swapped, zeroed):
        assert not passes(wrong, exact, check_bound(dtype))


# --- attention: one token dropped, one dimension wrong ------------------------------------------


def attention_step(
    specs: list[RequestSpec], dtype: torch.dtype, int8: bool = False, block_size: int = 16,
    heads: int = 4, kv_heads: int = 2, head_dim: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionInputs]:  # fmt: skip
    """A random step as the start-up check builds it -> (q, K, V of the whole cache as float64
    after the step's writes, (num_slots, H_kv, D) each, the inputs)."""
    inputs, num_blocks = random_step(specs, block_size, CPU, seed=3)
    generator = torch.Generator().manual_seed(4)
    tokens = int(inputs.query_start_loc[-1])
    q = (torch.randn(tokens, heads, head_dim, generator=generator) * QUERY_SCALE).to(dtype)
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=generator).to(dtype) for _ in "kv")
    cache = clone_cache(
        random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, int8, CPU, generator)
    )
    if isinstance(cache, QuantizedKVCache):
        write_quantized_kv_cache(k, v, cache, inputs.slot_mapping)
        keys = cache.k.double() * cache.k_scale.double()
        values = cache.v.double() * cache.v_scale.double()
    else:
        write_kv_cache(k, v, cache[0], cache[1], inputs.slot_mapping)
        keys, values = cache[0].double(), cache[1].double()
    return q, keys.flatten(0, 1), values.flatten(0, 1), inputs


def dense_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, inputs: AttentionInputs,
    window: int | None = None, drop: tuple[int, int] | None = None,
    round_p: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    """Causal paged attention in float64, written from the definition -> (T, H, D): `drop`
    (request, position) leaves one position out of that request's context; `round_p` rounds the
    unnormalized probabilities to a dtype before they weigh V (as the prefill kernel does)."""
    tokens, heads, head_dim = q.shape
    group = heads // keys.shape[1]
    out = torch.empty(tokens, heads, head_dim, dtype=torch.float64)
    bs = inputs.block_size
    for r in range(len(inputs.seq_lens)):
        first, last = int(inputs.query_start_loc[r]), int(inputs.query_start_loc[r + 1])
        for t in range(first, last):
            position = int(inputs.num_computed_tokens[r]) + t - first
            start = 0 if window is None else max(0, position - window + 1)
            positions = [
                p for p in range(start, position + 1) if drop is None or (r, p) != tuple(drop)
            ]
            if not positions:  # its only position dropped: nothing to attend to
                out[t] = 0
                continue
            index = torch.tensor(positions)
            slots = torch.from_numpy(inputs.block_tables[r]).long()[index // bs] * bs + index % bs
            k, v = keys[slots], values[slots]  # (L, H_kv, D)
            for h in range(heads):
                scores = (k[:, h // group] @ q[t, h].double()) * head_dim**-0.5
                p = (scores - scores.max()).exp()
                weighed = p if round_p is None else p.to(round_p).double()
                out[t, h] = (weighed @ v[:, h // group]) / p.sum()
    return out


LONG = [RequestSpec(4095, 1)]  # one 4k context
MIXED = [RequestSpec(699, 1), RequestSpec(4, 1), RequestSpec(0, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_dropped_token_fails_the_decode_bound_even_in_4k(dtype) -> None:
    q, keys, values, inputs = attention_step(LONG, dtype)
    exact = dense_attention(q, keys, values, inputs)
    bound = bounds(dtype)["decode"]
    assert passes(exact.float().to(dtype), exact, bound)  # float32 inside, rounded once
    # the first, a split's edges (256-position multiples), the middle, the last
    for position in (0, 255, 256, 1023, 2048, 3071, 4094, 4095):
        dropped = dense_attention(q, keys, values, inputs, drop=(0, position))
        assert not passes(dropped.to(dtype), exact, bound), position


@pytest.mark.parametrize("window", [None, 300])
def test_a_dropped_token_fails_in_a_batch_and_with_a_window(window: int | None) -> None:
    dtype = torch.bfloat16
    q, keys, values, inputs = attention_step(MIXED, dtype, block_size=32)
    exact = dense_attention(q, keys, values, inputs, window)
    bound = bounds(dtype)["decode"]
    assert passes(exact.to(dtype), exact, bound)
    first_kept = 0 if window is None else 699 - window + 1
    for request, position in ((0, first_kept), (0, 699), (1, 0), (1, 4)):
        dropped = dense_attention(q, keys, values, inputs, window, drop=(request, position))
        assert not passes(dropped.to(dtype), exact, bound), (request, position)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("int8", [False, True], ids=["kv", "int8"])
def test_prefill_bound_passes_rounded_p_and_fails_a_dropped_token(dtype, int8) -> None:
    specs = [RequestSpec(0, 37), RequestSpec(50, 70)]
    q, keys, values, inputs = attention_step(specs, dtype, int8, head_dim=64)
    exact = dense_attention(q, keys, values, inputs)
    bound = bounds(dtype)["prefill"]
    if int8:  # the kernel dequantizes to the model's dtype
        values = values.to(dtype).double()
        keys = keys.to(dtype).double()
    honest = dense_attention(q, keys, values, inputs, round_p=dtype).to(dtype)
    assert passes(honest, exact, bound)
    for request, position in ((0, 0), (0, 36), (1, 0), (1, 49), (1, 119)):
        dropped = dense_attention(q, keys, values, inputs, drop=(request, position), round_p=dtype)
        assert not passes(dropped.to(dtype), exact, bound), (request, position)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_a_wrong_output_dimension_fails(kind: str) -> None:
    dtype = torch.bfloat16
    specs = LONG if kind == "decode" else [RequestSpec(50, 70)]
    q, keys, values, inputs = attention_step(specs, dtype)
    exact = dense_attention(q, keys, values, inputs)
    honest = exact.to(dtype)
    bound = bounds(dtype)[kind]
    assert passes(honest, exact, bound)
    zeroed, swapped, one_row = honest.clone(), honest.clone(), honest.clone()
    zeroed[..., 17] = 0
    swapped[..., [3, 90]] = honest[..., [90, 3]]
    one_row[-1, 2, [64, 65]] = honest[-1, 2, [65, 64]]  # one (token, head) only
    for wrong in (zeroed, swapped, one_row):
        assert not passes(wrong, exact, bound)


# --- add_rms_norm: the residual it writes, the norm, the float32-weight form ---------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_float32", [False, True])
def test_add_rms_norm_bound_catches_one_wrong_residual_element(dtype, in_float32) -> None:
    generator = torch.Generator().manual_seed(5)
    x, branch = (torch.randn(6, 896, generator=generator).to(dtype) for _ in "xb")
    weight = (torch.rand(896, generator=generator) + 0.5).to(dtype)
    summed = x.double() + branch.double()
    normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    bound = RowBound.rounding(dtype, output=2)  # fused.check_cases's bound for add_rms_norm
    residual, out = add_rms_norm_reference(x, branch, weight, 1e-6, in_float32)
    assert passes(residual, summed, bound) and passes(out, normed, bound)
    stale = residual.clone()
    stale[3, 500] = x[3, 500]  # one element of the residual never updated
    assert not passes(stale, summed, bound)
    wrong = out.clone()
    wrong[0, 7] *= 1.03  # one normalized element 3% off
    assert not passes(wrong, normed, bound)


def test_a_single_nan_or_a_wrong_shape_fails() -> None:
    want = torch.randn(4, 8, dtype=torch.float64)
    got = want.clone()
    got[2, 3] = float("nan")
    bound = RowBound.rounding(torch.float32)
    assert "row 2 is inf times its bound" in (disagreement(got, want, bound) or "")
    assert "shape" in (disagreement(want[:, :7], want, bound) or "")
    assert disagreement(want.clone(), want, bound) is None
    zero_row = torch.zeros(3, 5)
    assert disagreement(zero_row.clone(), zero_row, bound) is None  # exact zeros pass
    zero_row_got = zero_row.clone()
    zero_row_got[1, 1] = 1e-6
    assert disagreement(zero_row_got, zero_row, bound) is not None  # an untouched row written
