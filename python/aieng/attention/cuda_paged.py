"""Paged attention on aieng's CUDA kernels — the `cuda` backend.

Same cache layout and semantics as the torch reference (`torch_paged`): the step's new K/V are
written into the cache first, then every query reads its context from the cache. The write is one
launch of the fused `rope_kv_write` kernel without its rotation (`kernels.fused.kv_write`) when
that kernel passed its start-up check, else the reference's own `write_kv_cache` /
`write_quantized_kv_cache`; either way an INT8 cache is quantized as the reference quantizes it
(the same float32 division and round-half-even). RoPE stays in the model's layer: a backend is
handed q, k and v already positioned and sees neither the positions nor the rotary tables (the
`AttentionBackend.forward` seam every backend shares); fusing it here would make the backend
apply the model's position encoding.

Decode rows (one new token) go to `paged_attention_decode.cu` (GQA-aware, split-K over long
contexts when the batch is small); rows of requests with more than one new token (prefills and
prefill chunks) go to `paged_attention_prefill.cu`.

`build_metadata` runs on the host once per step: it splits the requests into decodes and
prefills, lists the prefill tiles and uploads the int32 arrays the kernels read. The split-K
plan depends on the layer's shape and sliding window, so it is made (and its float32 partial
buffers allocated) by the first layer of each kind in a step and shared by the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from aieng.attention.backend import AttentionBackend, AttentionInputs, KVCache, QuantizedKVCache
from aieng.attention.torch_paged import write_kv_cache, write_quantized_kv_cache
from aieng.kernels import KernelError, load_module
from aieng.kernels.fused_dispatch import fused_kv_write
from aieng.kernels.paged_attention import (
    DECODE_SOURCE,
    DECODE_THREADS,
    PREFILL_SOURCE,
    PagedCache,
    SplitPlan,
    attended_lengths,
    check_supported,
    choose_splits,
    decode_kernel_name,
    decode_launches,
    decode_tile,
    heads_per_cta,
    instantiation_options,
    prefill_launch,
    prefill_tiles,
    q_is_aligned,
    run,
)

if TYPE_CHECKING:
    from aieng.attention.layer import Attention


@dataclass
class DecodeBatch:
    """The step's requests with one new token (R_d of them), as the decode kernel reads them."""

    rows: torch.Tensor  # (R_d,) int32: each one's token row in q and out
    seq_lens: torch.Tensor  # (R_d,) int32
    block_tables: torch.Tensor  # (R_d, W) int32
    seq_lens_host: np.ndarray  # (R_d,) int64
    # The context the split-K plan is made for when longer than the live ones: a captured CUDA
    # graph's bucket (its grid is fixed at capture, its lengths are read on the device).
    planned_len: int | None = None
    # (window, num_heads, num_kv_heads, head_dim) -> the split plan and its partial buffers
    plans: dict[tuple[int | None, int, int, int], tuple[SplitPlan, tuple[torch.Tensor, ...]]] = (
        field(default_factory=dict)
    )


@dataclass
class PrefillBatch:
    """The step's requests with several new tokens, as the prefill kernel reads them: the step's
    whole arrays (indexed by request) and the CTA tiles that cover the prefill requests."""

    query_start: torch.Tensor  # (R + 1,) int32
    num_computed: torch.Tensor  # (R,) int32
    seq_lens: torch.Tensor  # (R,) int32
    block_tables: torch.Tensor  # (R, W) int32
    tile_request: torch.Tensor  # (tiles,) int32
    tile_first: torch.Tensor  # (tiles,) int32


@dataclass
class CudaAttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) cache slot of each new token's K/V
    num_tokens: int
    decode: DecodeBatch | None
    prefill: PrefillBatch | None


def build_cuda_metadata(inputs: AttentionInputs) -> CudaAttentionMetadata:
    """Host arrays of a step -> the kernels' int32 device arrays (nothing waits on the device)."""
    device = inputs.slot_mapping.device
    query_start = np.asarray(inputs.query_start_loc, np.int64)
    num_computed = np.asarray(inputs.num_computed_tokens, np.int64)
    seq_lens = np.asarray(inputs.seq_lens, np.int64)
    block_tables = np.asarray(inputs.block_tables, np.int32)
    query_lens = np.diff(query_start)

    def to_device(array: np.ndarray) -> torch.Tensor:
        contiguous = np.ascontiguousarray(array, dtype=np.int32)
        return torch.from_numpy(contiguous).to(device, non_blocking=True)

    decode = prefill = None
    decodes = np.flatnonzero(query_lens == 1)
    if len(decodes):
        decode = DecodeBatch(
            rows=to_device(query_start[decodes]),
            seq_lens=to_device(seq_lens[decodes]),
            block_tables=to_device(block_tables[decodes]),
            seq_lens_host=seq_lens[decodes],
        )
    prefills = np.flatnonzero(query_lens > 1)
    if len(prefills):
        tile_request, tile_first = prefill_tiles(query_lens, prefills)
        prefill = PrefillBatch(
            query_start=to_device(query_start),
            num_computed=to_device(num_computed),
            seq_lens=to_device(seq_lens),
            block_tables=to_device(block_tables),
            tile_request=to_device(tile_request),
            tile_first=to_device(tile_first),
        )
    return CudaAttentionMetadata(inputs.slot_mapping, int(query_start[-1]), decode, prefill)


def plan_for_lengths(
    lengths: np.ndarray, window: int | None, num_heads: int, num_kv_heads: int, head_dim: int,
    num_sms: int, ctas_per_sm: int,
) -> SplitPlan:  # fmt: skip
    """The split-K plan of decode rows whose contexts are `lengths` (R,) for one layer shape and
    window, on `num_sms` SMs that each hold `ctas_per_sm` of the decode kernel's CTAs: its
    splits cover the longest context any row attends."""
    _, chunks = heads_per_cta(num_heads // num_kv_heads)
    base_ctas = len(lengths) * num_kv_heads * chunks
    longest = int(attended_lengths(lengths, window).max())
    return choose_splits(base_ctas, longest, num_sms, decode_tile(head_dim), ctas_per_sm)


def split_plan(
    decode: DecodeBatch, window: int | None, num_heads: int, num_kv_heads: int, head_dim: int,
    num_sms: int, ctas_per_sm: int,
) -> SplitPlan:  # fmt: skip
    """The split-K plan of a decode batch (`plan_for_lengths`), made for `planned_len`
    positions when that is longer than its live contexts (a captured CUDA graph's bucket)."""
    lengths = np.asarray(decode.seq_lens_host, np.int64)
    if decode.planned_len is not None:
        lengths = np.maximum(lengths, decode.planned_len)
    return plan_for_lengths(
        lengths, window, num_heads, num_kv_heads, head_dim, num_sms, ctas_per_sm
    )


def paged_cache(kv_cache: KVCache) -> PagedCache:
    if isinstance(kv_cache, QuantizedKVCache):
        return PagedCache(kv_cache.k, kv_cache.v, kv_cache.k_scale, kv_cache.v_scale)
    return PagedCache(kv_cache[0], kv_cache[1])


def write_step_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor
) -> None:
    """k, v (T, H_kv, D) into their slots of the cache: the fused kernel where it applies, else
    the reference's writes."""
    if fused_kv_write(k, v, kv_cache, slot_mapping):
        return
    if isinstance(kv_cache, QuantizedKVCache):
        write_quantized_kv_cache(k, v, kv_cache, slot_mapping)
    else:
        write_kv_cache(k, v, kv_cache[0], kv_cache[1], slot_mapping)


class CudaPagedAttention(AttentionBackend):
    """The paged attention kernels: float16/bfloat16, head_dim 64 or 128, the model's dtype or
    an INT8 cache, any power-of-two block size, each layer's own sliding window."""

    name = "cuda"
    kv_cache_dtypes = ("auto", "int8")

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype | None = None,
        int8: bool | None = None,
        head_dim: int | None = None,
    ):
        """Compiles (or reads from the cache) and loads both kernel sources on `device`, only
        the instantiations for `dtype`, an INT8 cache or not, `head_dim` where given (None: all);
        KernelError when that fails."""
        if device.type != "cuda":
            raise KernelError(f"the cuda attention backend runs on a CUDA device, not {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        options = instantiation_options(dtype, int8, head_dim)
        self.decode = load_module(DECODE_SOURCE, options, device=index)
        self.prefill = load_module(PREFILL_SOURCE, options, device=index)
        self.num_sms = torch.cuda.get_device_properties(index).multi_processor_count
        self._ctas_per_sm: dict[str, int] = {}

    def ctas_per_sm(self, kernel: str) -> int:
        """CTAs of a decode kernel one SM holds at once (the driver's answer, asked once)."""
        if kernel not in self._ctas_per_sm:
            self._ctas_per_sm[kernel] = self.decode.max_active_ctas(kernel, DECODE_THREADS)
        return self._ctas_per_sm[kernel]

    def build_metadata(self, inputs: AttentionInputs) -> CudaAttentionMetadata:
        return build_cuda_metadata(inputs)

    def forward(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache | None,
        metadata: CudaAttentionMetadata,
    ) -> torch.Tensor:
        if kv_cache is None:
            raise ValueError("the paged attention backend needs a KV cache")
        if getattr(layer, "logit_softcap", None) is not None:
            raise KernelError("the cuda attention kernels do not soft-cap scores")
        check_supported(q.dtype, q.shape[2])
        write_step_kv(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self.attend(layer, q, paged_cache(kv_cache), metadata, out)
        return out

    def attend(
        self,
        layer: Attention,
        q: torch.Tensor,
        cache: PagedCache,
        metadata: CudaAttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """The kernels alone: q (T, H, D) over the cache (the new K/V already written) into
        out (T, H, D), contiguous; only the step's rows are written."""
        num_heads, head_dim = q.shape[1:]
        if not q_is_aligned(q):  # the kernels step rows by q.stride(0): a QKV view serves
            q = q.contiguous()
        window = layer.sliding_window
        if (decode := metadata.decode) is not None:
            kernel = decode_kernel_name(
                q.dtype, cache.int8, head_dim, num_heads // cache.k.shape[2]
            )
            plan, partials = self._plan(
                decode, window, num_heads, cache.k.shape[2], head_dim, self.ctas_per_sm(kernel)
            )
            launches = decode_launches(
                out, q, cache, decode.block_tables, decode.seq_lens, decode.rows, plan,
                layer.scale, window, (partials[0], partials[1]) if partials else None,
            )  # fmt: skip
            run(self.decode, launches)
        if (prefill := metadata.prefill) is not None:
            launch = prefill_launch(
                out, q, cache, prefill.block_tables, prefill.query_start, prefill.num_computed,
                prefill.seq_lens, prefill.tile_request, prefill.tile_first, layer.scale, window,
            )  # fmt: skip
            run(self.prefill, [launch])

    def _plan(
        self, decode: DecodeBatch, window: int | None, num_heads: int, num_kv_heads: int,
        head_dim: int, ctas_per_sm: int,
    ) -> tuple[SplitPlan, tuple[torch.Tensor, ...]]:  # fmt: skip
        key = (window, num_heads, num_kv_heads, head_dim)
        if key not in decode.plans:
            plan = split_plan(
                decode, window, num_heads, num_kv_heads, head_dim, self.num_sms, ctas_per_sm
            )
            partials: tuple[torch.Tensor, ...] = ()
            if plan.num_splits > 1:
                shape = (len(decode.seq_lens_host), num_heads, plan.num_splits)
                partials = (
                    torch.empty((*shape, head_dim), dtype=torch.float32, device=self.device),
                    torch.empty((*shape, 2), dtype=torch.float32, device=self.device),
                )
            decode.plans[key] = (plan, partials)
        return decode.plans[key]
