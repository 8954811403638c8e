"""Launching the paged attention kernels (`cuda/paged_attention_decode.cu`, `..._prefill.cu`):
which instantiation serves a shape, the grids, the split-K choice, and the launches themselves.

Everything here is pure — plain ints, numpy arrays, and `Launch` values (kernel, grid, block,
arguments) built from tensors without touching their data — so that CI checks the launch
parameters, and the arguments against each kernel's parameter list, on the CPU; `run` hands the
launches to a loaded module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from aieng.kernels.errors import KernelError
from aieng.kernels.launch import KernelArg, KernelModule

DECODE_SOURCE = "paged_attention_decode"
PREFILL_SOURCE = "paged_attention_prefill"
HEAD_DIMS = (64, 128)
DTYPE_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16"}
DECODE_THREADS = 128
DECODE_PASSES = 4  # tokens per thread per tile, kPasses in the kernel
HEADS_PER_CTA = (1, 2, 4, 8)  # the decode kernel's HG instantiations
PREFILL_BLOCK_M = 64  # queries per prefill CTA, kBM in the kernel
PREFILL_THREADS = 128
# Split-K: a split holds at least this many positions (fewer would spend more time combining
# than reading) and there are at most MAX_SPLITS; within that, a batch that leaves CTA slots
# free is split until its grid fills one wave of them (cuda/README.md, "Attention kernels").
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 128


def check_supported(dtype: torch.dtype, head_dim: int) -> None:
    """KernelError unless the kernels have an instantiation for this dtype and head_dim."""
    if dtype not in DTYPE_NAMES:
        raise KernelError(f"the paged attention kernels take float16 or bfloat16, not {dtype}")
    if head_dim not in HEAD_DIMS:
        raise KernelError(f"the paged attention kernels take head_dim 64 or 128, not {head_dim}")


def instantiation_options(
    dtype: torch.dtype | None = None, int8: bool | None = None, head_dim: int | None = None
) -> list[str]:
    """NVRTC options that compile only the kernels for this dtype / cache / head_dim (None: all
    of that kind), the filters of common.cuh: one model needs 4 decode kernels, not 34."""
    options = []
    if dtype is not None:
        check_supported(dtype, HEAD_DIMS[0])
        options.append(f"-DAIENG_DTYPE={list(DTYPE_NAMES).index(dtype) + 1}")
    if int8 is not None:
        options.append(f"-DAIENG_INT8={int(int8)}")
    if head_dim is not None:
        check_supported(next(iter(DTYPE_NAMES)), head_dim)
        options.append(f"-DAIENG_HEAD_DIM={head_dim}")
    return options


def heads_per_cta(group: int) -> tuple[int, int]:
    """GQA group size (query heads per KV head) -> (query heads per decode CTA, CTAs per KV
    head): the smallest instantiation that holds the group, and more CTAs past 8 heads."""
    if group < 1:
        raise KernelError(f"query heads per KV head must be >= 1, got {group}")
    per_cta = next(h for h in HEADS_PER_CTA if h >= min(group, HEADS_PER_CTA[-1]))
    return per_cta, math.ceil(group / per_cta)


def decode_tile(head_dim: int) -> int:
    """Positions a decode CTA scores per tile: head_dim / 8 lanes per token, 128 threads."""
    return DECODE_THREADS // (head_dim // 8) * DECODE_PASSES


def decode_kernel_name(dtype: torch.dtype, int8_cache: bool, head_dim: int, group: int) -> str:
    check_supported(dtype, head_dim)
    cache = "i8" if int8_cache else "kv"
    return f"paged_decode_{DTYPE_NAMES[dtype]}_{cache}_d{head_dim}_g{heads_per_cta(group)[0]}"


def decode_reduce_kernel_name(dtype: torch.dtype) -> str:
    return f"paged_decode_reduce_{DTYPE_NAMES[dtype]}"


def prefill_kernel_name(dtype: torch.dtype, int8_cache: bool, head_dim: int) -> str:
    check_supported(dtype, head_dim)
    return f"paged_prefill_{DTYPE_NAMES[dtype]}_{'i8' if int8_cache else 'kv'}_d{head_dim}"


def attended_lengths(seq_lens: np.ndarray, window: int | None) -> np.ndarray:
    """Positions each decode query reads: its whole context, or the last `window` of it."""
    seq_lens = np.asarray(seq_lens, np.int64)
    return seq_lens if window is None else np.minimum(seq_lens, window)


@dataclass(frozen=True)
class SplitPlan:
    """How a decode batch's contexts are cut: split s of a request covers its attended positions
    [s * split_tokens, (s + 1) * split_tokens); num_splits is the grid's z (the longest's)."""

    num_splits: int
    split_tokens: int


def choose_splits(
    base_ctas: int, longest: int, num_sms: int, tile: int, ctas_per_sm: int
) -> SplitPlan:
    """Split the context (flash-decoding) only when the batch alone leaves CTA slots idle:
    base_ctas = requests x KV-head CTAs, longest = the most positions one query reads,
    ctas_per_sm = the decode kernel's occupancy. The grid then holds at most one wave
    (num_sms x ctas_per_sm CTAs): a second, partial wave would run alone at the end."""
    if min(base_ctas, longest, num_sms, tile, ctas_per_sm) < 1:
        raise KernelError(
            f"bad decode shape: {base_ctas=}, {longest=}, {num_sms=}, {tile=}, {ctas_per_sm=}"
        )
    wanted = num_sms * ctas_per_sm // base_ctas
    splits = min(wanted, longest // MIN_SPLIT_TOKENS, MAX_SPLITS)
    if splits <= 1:
        return SplitPlan(1, longest)
    split_tokens = math.ceil(math.ceil(longest / splits) / tile) * tile  # whole tiles
    return SplitPlan(math.ceil(longest / split_tokens), split_tokens)


def prefill_tiles(query_lens: np.ndarray, requests: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The prefill grid's x: for each listed request, one CTA per PREFILL_BLOCK_M of its queries
    -> (request index, first query) per CTA, int32."""
    requests = np.asarray(requests, np.int64)
    counts = -(-np.asarray(query_lens, np.int64)[requests] // PREFILL_BLOCK_M)
    tile_request = np.repeat(requests, counts)
    starts = np.cumsum(counts) - counts
    tile_first = (np.arange(int(counts.sum())) - np.repeat(starts, counts)) * PREFILL_BLOCK_M
    return tile_request.astype(np.int32), tile_first.astype(np.int32)


def block_shift(block_size: int) -> int:
    if block_size < 1 or block_size & (block_size - 1):
        raise KernelError(
            f"the paged attention kernels need a power-of-two block size: {block_size}"
        )
    return block_size.bit_length() - 1


@dataclass(frozen=True)
class PagedCache:
    """One layer's cache as the kernels read it: K/V (num_blocks, block_size, H_kv, D) and,
    for an INT8 cache, the scales (num_blocks, block_size, H_kv, 1); None otherwise."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def int8(self) -> bool:
        return self.k_scale is not None


@dataclass(frozen=True)
class Launch:
    """One kernel launch, as `KernelModule.launch` takes it."""

    kernel: str
    grid: tuple[int, ...]
    block: int
    args: list[KernelArg]


# Alignment the kernels' loads rely on, in bytes: the cache's K/V rows are copied by cp.async in
# 16-byte (8 for INT8) pieces and read by 16- and 8-byte vector loads; q is read as 32-bit pairs
# (prefill) and out written as them. A misaligned address faults on the GPU (or reads the wrong
# bytes), so every launch checks it here rather than trusting each cache to be its own
# allocation.
CACHE_ALIGNMENT = 16
Q_ALIGNMENT = 4


def q_is_aligned(q: torch.Tensor) -> bool:
    """q (T, H, D) as the kernels read it: rows of contiguous heads of contiguous dims (a row
    stride of its own: a view of a fused QKV projection), each row Q_ALIGNMENT-aligned."""
    _, num_heads, head_dim = q.shape
    row_bytes = q.stride(0) * q.element_size()
    return (
        q.stride(2) == 1
        and q.stride(1) == head_dim
        and q.stride(0) >= num_heads * head_dim
        and q.data_ptr() % Q_ALIGNMENT == 0
        and row_bytes % Q_ALIGNMENT == 0
    )


def check_layouts(kernel: str, out: torch.Tensor, q: torch.Tensor, cache: PagedCache) -> None:
    """KernelError unless the tensors are laid out and aligned as `kernel` reads them: the
    cache contiguous with CACHE_ALIGNMENT-aligned K/V, q as `q_is_aligned`, out contiguous."""
    for what, tensor in (("K cache", cache.k), ("V cache", cache.v)):
        if not tensor.is_contiguous() or tensor.data_ptr() % CACHE_ALIGNMENT:
            raise KernelError(
                f"{kernel}: the {what} must be contiguous and {CACHE_ALIGNMENT}-byte aligned "
                f"(cp.async), got strides {tuple(tensor.stride())} at address "
                f"{tensor.data_ptr():#x}"
            )
    for what, scale in (("K scales", cache.k_scale), ("V scales", cache.v_scale)):
        if scale is not None and not scale.is_contiguous():
            raise KernelError(f"{kernel}: the INT8 cache's {what} must be contiguous")
    if not q_is_aligned(q):
        raise KernelError(
            f"{kernel}: q must be (T, H, D) with contiguous heads and dims and {Q_ALIGNMENT}-byte "
            f"aligned rows, got strides {tuple(q.stride())} at address {q.data_ptr():#x}"
        )
    if not out.is_contiguous() or out.data_ptr() % Q_ALIGNMENT:
        raise KernelError(f"{kernel}: out must be contiguous and {Q_ALIGNMENT}-byte aligned")


def decode_launches(
    out: torch.Tensor,
    q: torch.Tensor,
    cache: PagedCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
    plan: SplitPlan,
    scale: float,
    window: int | None,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[Launch]:
    """out[rows[r]] (H, D) = attention of q[rows[r]] over request r's cache, for the R requests
    of block_tables (R, W) int32 / seq_lens (R,) int32 / rows (R,) int32: the decode kernel, and
    with plan.num_splits > 1 the reduction; `partials` then holds (acc (R, H, S, D),
    (max, sum) (R, H, S, 2)) float32."""
    num_requests = rows.shape[0]
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = cache.k.shape
    group = num_heads // num_kv_heads
    _, chunks = heads_per_cta(group)
    name = decode_kernel_name(q.dtype, cache.int8, head_dim, group)
    check_layouts(name, out, q, cache)
    split = plan.num_splits > 1
    if split and partials is None:
        raise KernelError(f"{name}: {plan.num_splits} splits need partial buffers")
    acc, max_sum = partials if split and partials is not None else (None, None)
    args: list[KernelArg] = [
        out, acc, max_sum, q, q.stride(0), cache.k, cache.v, cache.k_scale, cache.v_scale,
        block_tables, block_tables.stride(0), seq_lens, rows, num_heads, num_kv_heads, group,
        chunks, block_shift(block_size), window or 0, float(scale), plan.split_tokens,
    ]  # fmt: skip
    grid = (num_kv_heads * chunks, num_requests, plan.num_splits)
    launches = [Launch(name, grid, DECODE_THREADS, args)]
    if split:
        reduce_args: list[KernelArg] = [
            out, acc, max_sum, seq_lens, rows, plan.num_splits, window or 0, plan.split_tokens,
        ]  # fmt: skip
        reduce = decode_reduce_kernel_name(q.dtype)
        launches.append(Launch(reduce, (num_heads, num_requests), head_dim, reduce_args))
    return launches


def prefill_launch(
    out: torch.Tensor,
    q: torch.Tensor,
    cache: PagedCache,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    num_computed: torch.Tensor,
    seq_lens: torch.Tensor,
    tile_request: torch.Tensor,
    tile_first: torch.Tensor,
    scale: float,
    window: int | None,
) -> Launch:
    """out rows of the listed tiles' requests = causal attention of their queries over their
    cache (the step's arrays, int32 on the device; tiles from `prefill_tiles`)."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = cache.k.shape
    name = prefill_kernel_name(q.dtype, cache.int8, head_dim)
    check_layouts(name, out, q, cache)
    return Launch(
        name,
        (tile_request.shape[0], num_heads),
        PREFILL_THREADS,
        [
            out, q, q.stride(0), cache.k, cache.v, cache.k_scale, cache.v_scale, block_tables,
            block_tables.stride(0), query_start, num_computed, seq_lens, tile_request,
            tile_first, num_heads, num_kv_heads, block_shift(block_size), window or 0,
            float(scale),
        ],
    )  # fmt: skip


def run(module: KernelModule, launches: list[Launch]) -> None:
    for launch in launches:
        module.launch(launch.kernel, launch.grid, launch.block, launch.args)
