"""Paged attention over a block KV cache — the pure-PyTorch reference backend (`torch`).

The cache of one layer is a K and a V tensor of shape (num_blocks, block_size, num_kv_heads,
head_dim); token slot s lives at block s // block_size, offset s % block_size. Context positions
past a request's length are read through the block table's padding (block 0) and masked; the runner
zero-fills the cache so that such reads are always finite.

A step is split into decode rows (query length 1) and prefill rows. The decode rows, sorted by
length, go in groups: one batched attention per group over the contexts gathered block by block
into (R_group, L, H_kv, D) with a length mask, a group's gather sized to stay in cache. Each
prefill row is its own `scaled_dot_product_attention` — causal over the new tokens' own K/V when
nothing of the request is cached yet, else over its cached context with the causal mask offset by
the cached length. The index tensors and masks are built once per step, not per layer.

Layers may differ in their sliding window (Gemma alternates windowed and global layers): the
backend is built with every window the model uses, each step builds one mask per window (only
the masks differ; the gathers are shared), and each layer reads the masks of its own
`Attention.sliding_window`. A layer with `Attention.logit_softcap` (Gemma 2) has its scores
capped, written out in `aieng.attention.sdpa` since SDPA cannot; the other layers keep SDPA.

INT8 cache (`kv_cache_dtype="int8"`, a `QuantizedKVCache`): each new token's K and V are
quantized symmetrically per KV head as they are written — scale = max|x| / 127 over head_dim
(at least the scale dtype's smallest normal, so an all-zero vector is fine), q = round(x / scale)
in [-127, 127], computed in float32 with the scale as stored — and attention dequantizes only the
context it gathers for a decode group or a prefill with a cached context (`q * scale`, in the
model's dtype), never the whole cache. A prefill with nothing cached attends over the new
tokens' *quantized-then-dequantized* K/V, not the exact ones (vLLM uses the exact ones there):
attention then sees the same values whether a context was computed in this step, an earlier
chunk or another request (a prefix-cache hit), so chunked prefill, prefix hits and preemption
give what one whole prefill gives, and a one-prefill perplexity (`aieng eval`) measures what
decoding reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from aieng.attention.backend import AttentionBackend, AttentionInputs, KVCache, QuantizedKVCache
from aieng.attention.sdpa import attend
from aieng.kernels.reference import (
    dequantize_int8,
    write_kv_cache,
    write_quantized_kv_cache,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    from aieng.attention.layer import Attention

# A layer's sliding window (None: the whole context) -> a mask built for it this step.
Window = int | None


@dataclass
class PrefillSpan:
    """One request of the step with more than one query token."""

    start: int  # its tokens are rows start:end of the step's T
    end: int
    context_len: int  # L: its sequence length after this step
    blocks: torch.Tensor | None  # (ceil(L / block_size),) its blocks; None: attend to new K/V only
    # per window: (Q, L) True where query i may attend to position j; None: causal
    masks: dict[Window, torch.Tensor | None]


@dataclass
class DecodeGroup:
    """Decode requests (query length 1) attended together, padded to the longest of them."""

    rows: slice | torch.Tensor  # their rows of the step's T
    blocks: torch.Tensor  # (R_g, B) their block tables
    context_len: int  # L_g: the longest context in the group
    # per window: (R_g, 1, 1, L_g) True where attended; None: all of L_g
    masks: dict[Window, torch.Tensor | None]


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer (built once per step by `build_metadata`)."""

    slot_mapping: torch.Tensor  # (T,) cache slot for each new token's K/V
    num_tokens: int
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    fresh_prefills: bool = False  # some prefill attends to the new K/V only (nothing cached)


# A decode group's gathered K (or V) is kept near this size, so that it stays in cache between
# the gather and the attention that reads it; groups hold requests of similar lengths.
DECODE_GROUP_BYTES = 1 << 21


def build_attention_metadata(
    inputs: AttentionInputs, sliding_windows: Iterable[Window] = (None,), token_bytes: int = 0
) -> AttentionMetadata:
    """Only `inputs.slot_mapping` is on the device; the other arrays are host numpy, so that
    building this never waits on the device. sliding_windows: the windows the model's layers use
    (a mask is built for each). token_bytes: bytes of one token's K in one layer (sizes the
    decode groups; 0 puts every decode request in one group)."""
    windows = tuple(dict.fromkeys(sliding_windows))
    slot_mapping, block_size = inputs.slot_mapping, inputs.block_size
    device = slot_mapping.device
    query_start_loc = np.asarray(inputs.query_start_loc, np.int64)
    num_computed = np.asarray(inputs.num_computed_tokens, np.int64)
    seq_lens = np.asarray(inputs.seq_lens, np.int64)
    block_tables = np.asarray(inputs.block_tables, np.int64)
    query_lens = np.diff(query_start_loc)

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)

    decodes = np.flatnonzero(query_lens == 1)
    decodes = decodes[np.argsort(seq_lens[decodes], kind="stable")]
    groups = []
    lo = 0
    while lo < len(decodes):
        hi = len(decodes)
        if token_bytes > 0:  # lengths ascend: the group's longest is its last
            longest = seq_lens[decodes[lo:]]
            sizes = np.arange(1, hi - lo + 1) * longest * token_bytes  # ascending
            hi = lo + max(1, int(np.count_nonzero(sizes <= DECODE_GROUP_BYTES)))
        members = decodes[lo:hi]
        tokens = query_start_loc[members]
        rows: slice | torch.Tensor
        if np.all(np.diff(tokens) == 1):
            rows = slice(int(tokens[0]), int(tokens[0]) + len(tokens))
        else:
            rows = to_device(tokens)
        lens = seq_lens[members]
        context_len = int(lens.max())
        blocks = to_device(block_tables[members, : -(-context_len // block_size)])
        positions = np.arange(context_len)
        masks: dict[Window, torch.Tensor | None] = {}
        for window in windows:
            mask = positions[None, :] < lens[:, None]
            if window is not None:
                mask &= positions[None, :] > lens[:, None] - 1 - window
            masks[window] = None if mask.all() else to_device(mask[:, None, None, :])
        groups.append(DecodeGroup(rows, blocks, context_len, masks))
        lo = hi

    prefills = []
    for r in np.flatnonzero(query_lens > 1):
        start, end = int(query_start_loc[r]), int(query_start_loc[r + 1])
        computed, context_len = int(num_computed[r]), int(seq_lens[r])
        blocks = None
        if computed > 0:
            blocks = to_device(block_tables[r, : -(-context_len // block_size)])
        query_pos = computed + np.arange(end - start)[:, None]
        positions = np.arange(context_len)[None, :]
        span_masks: dict[Window, torch.Tensor | None] = {}
        for window in windows:
            if computed == 0 and window is None:
                span_masks[window] = None  # causal over the new tokens
                continue
            allowed = positions <= query_pos
            if window is not None:
                allowed &= positions > query_pos - window
            span_masks[window] = to_device(allowed)
        prefills.append(PrefillSpan(start, end, context_len, blocks, span_masks))

    return AttentionMetadata(
        slot_mapping=slot_mapping,
        num_tokens=int(query_start_loc[-1]),
        decodes=groups,
        prefills=prefills,
        fresh_prefills=any(span.blocks is None for span in prefills),
    )


def _gather_context(
    cache: torch.Tensor,
    blocks: torch.Tensor,
    length: int,
    scales: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """cache (N, B, H_kv, D), blocks (..., nb) -> (..., H_kv, length, D). With `scales`
    (N, B, H_kv, 1) the cache is INT8: only the gathered context is dequantized, to `dtype`."""
    num_kv_heads, head_dim = cache.shape[2:]
    # index_select over the flat block ids: about twice as fast as cache[blocks] on the CPU.
    index, lead = blocks.reshape(-1), blocks.shape[:-1]
    gathered = cache.index_select(0, index).view(*lead, -1, num_kv_heads, head_dim)
    gathered = gathered[..., :length, :, :]  # (..., length, H_kv, D)
    if scales is not None:
        scale = scales.index_select(0, index).view(*lead, -1, num_kv_heads, 1)
        gathered = dequantize_int8(gathered, scale[..., :length, :, :], dtype or scales.dtype)
    return gathered.transpose(-3, -2)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: Window = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q (T, H, D) over each request's cached context (new tokens already written) -> (T, H, D).
    k, v (T, H_kv, D): the step's new K/V, used directly by prefills with no cached context.
    k_scale, v_scale: an INT8 cache's scales (the caches are then int8). sliding_window: the
    layer's, one of the windows `meta` was built for; softcap: its score cap (None: none)."""
    out = torch.empty_like(q)
    for group in meta.decodes:
        qd = q[group.rows][:, :, None, :]  # (R_g, H, 1, D)
        # (R_g, H_kv, L_g, D)
        kd = _gather_context(k_cache, group.blocks, group.context_len, k_scale, q.dtype)
        vd = _gather_context(v_cache, group.blocks, group.context_len, v_scale, q.dtype)
        od = attend(qd, kd, vd, _mask(group.masks, sliding_window), False, scale, softcap)
        out[group.rows] = od[:, :, 0, :]
    for span in meta.prefills:
        qp = q[span.start : span.end].transpose(0, 1)  # (H, Q, D)
        if span.blocks is None and k is not None and v is not None:
            kp = k[span.start : span.end].transpose(0, 1)  # (H_kv, Q, D)
            vp = v[span.start : span.end].transpose(0, 1)
        else:
            blocks = span.blocks
            if blocks is None:  # no new K/V given: read them back from the cache
                raise ValueError("paged_attention needs k and v for prefills without a context")
            kp = _gather_context(k_cache, blocks, span.context_len, k_scale, q.dtype)
            vp = _gather_context(v_cache, blocks, span.context_len, v_scale, q.dtype)
        mask = _mask(span.masks, sliding_window)
        op = attend(qp, kp, vp, mask, mask is None, scale, softcap)
        out[span.start : span.end] = op.transpose(0, 1)
    return out


def _mask(masks: dict[Window, torch.Tensor | None], window: Window) -> torch.Tensor | None:
    try:
        return masks[window]
    except KeyError:
        raise ValueError(
            f"sliding window {window}: the attention metadata was built for the windows "
            f"{sorted(masks, key=str)} only (the backend must be given every layer's window)"
        ) from None


class TorchPagedAttention(AttentionBackend):
    """The reference backend: any device, any float dtype, per-layer sliding windows, soft-capped
    scores, an INT8 cache."""

    name = "torch"
    kv_cache_dtypes = ("auto", "int8")

    def __init__(self, sliding_windows: Iterable[Window] = (None,), token_bytes: int = 0):
        """sliding_windows: every window the model's layers use (None: whole context);
        token_bytes: bytes of one token's K in one layer (sizes the decode groups)."""
        self.sliding_windows = tuple(dict.fromkeys(sliding_windows))
        self.token_bytes = token_bytes

    def build_metadata(self, inputs: AttentionInputs) -> AttentionMetadata:
        return build_attention_metadata(inputs, self.sliding_windows, self.token_bytes)

    def forward(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if kv_cache is None:
            raise ValueError("the paged attention backend needs a KV cache")
        window, softcap = layer.sliding_window, layer.logit_softcap
        if isinstance(kv_cache, QuantizedKVCache):
            (kq, ks), (vq, vs) = write_quantized_kv_cache(k, v, kv_cache, metadata.slot_mapping)
            if metadata.fresh_prefills:  # they attend to the new K/V as the cache holds them
                k, v = dequantize_int8(kq, ks, q.dtype), dequantize_int8(vq, vs, q.dtype)
            return paged_attention(
                q,
                kv_cache.k,
                kv_cache.v,
                metadata,
                layer.scale,
                k,
                v,
                kv_cache.k_scale,
                kv_cache.v_scale,
                window,
                softcap,
            )
        k_cache, v_cache = kv_cache
        write_kv_cache(k, v, k_cache, v_cache, metadata.slot_mapping)
        return paged_attention(
            q, k_cache, v_cache, metadata, layer.scale, k, v, sliding_window=window, softcap=softcap
        )
