"""Paged attention over a block KV cache — the pure-PyTorch reference backend.

The cache of one layer is a K and a V tensor of shape (num_blocks, block_size, num_kv_heads,
head_dim); token slot s lives at block s // block_size, offset s % block_size. Context positions
past a request's length are read through the block table's padding (block 0) and masked; the runner
zero-fills the cache so that such reads are always finite.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer (built once by `build_attention_metadata`)."""

    slot_mapping: torch.Tensor  # (T,) cache slot for each new token's K/V
    context_slots: torch.Tensor  # (R, L) cache slot of each context position
    query_index: torch.Tensor  # (T,) flat index r * Q + i of token i of request r in (R, Q)
    mask: torch.Tensor  # (R, 1, Q, L) True where query (r, i) may attend to context position j
    num_requests: int
    max_query_len: int


def build_attention_metadata(
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
) -> AttentionMetadata:
    """Tensors are int64 on the model's device, shaped as in the StepPlan; the two maxima are
    passed as ints so that building this never waits on the device."""
    device = slot_mapping.device
    num_requests = seq_lens.shape[0]
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # (R,)

    positions = torch.arange(max_seq_len, device=device)  # (L,)
    blocks = block_tables[:, positions // block_size]  # (R, L)
    context_slots = blocks * block_size + positions % block_size

    request_of_token = torch.repeat_interleave(
        torch.arange(num_requests, device=device), query_lens, output_size=slot_mapping.shape[0]
    )  # (T,)
    token_in_request = (
        torch.arange(slot_mapping.shape[0], device=device) - query_start_loc[request_of_token]
    )
    query_index = request_of_token * max_query_len + token_in_request

    # Query i of request r sits at sequence position num_computed[r] + i; padding queries are
    # clamped to the last real position so that no row is fully masked (their output is dropped).
    query_positions = num_computed_tokens[:, None] + torch.arange(max_query_len, device=device)
    query_positions = torch.minimum(query_positions, seq_lens[:, None] - 1)  # (R, Q)
    mask = positions[None, None, :] <= query_positions[:, :, None]  # (R, Q, L)
    if sliding_window is not None:
        mask &= positions[None, None, :] > query_positions[:, :, None] - sliding_window
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        context_slots=context_slots,
        query_index=query_index,
        mask=mask[:, None],
        num_requests=num_requests,
        max_query_len=max_query_len,
    )


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v (T, H_kv, D) -> their slots of the caches."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q (T, H, D) over each request's cached context (new tokens already written) -> (T, H, D)."""
    _, num_heads, head_dim = q.shape
    _, _, num_kv_heads, _ = k_cache.shape
    num_requests, max_query_len = meta.num_requests, meta.max_query_len

    q_padded = q.new_zeros(num_requests * max_query_len, num_heads, head_dim)
    q_padded[meta.query_index] = q
    q_padded = q_padded.view(num_requests, max_query_len, num_heads, head_dim).transpose(1, 2)
    # (R, H, Q, D)
    k = k_cache.view(-1, num_kv_heads, head_dim)[meta.context_slots].transpose(1, 2)
    v = v_cache.view(-1, num_kv_heads, head_dim)[meta.context_slots].transpose(1, 2)
    # (R, H_kv, L, D)
    out = F.scaled_dot_product_attention(
        q_padded, k, v, attn_mask=meta.mask, scale=scale, enable_gqa=num_heads != num_kv_heads
    )  # (R, H, Q, D)
    out = out.transpose(1, 2).reshape(num_requests * max_query_len, num_heads, head_dim)
    return out[meta.query_index]
