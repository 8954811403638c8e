"""Scaled dot-product attention as the torch backends compute it: `scaled_dot_product_attention`
where it can, and the scores written out where they are soft-capped (Gemma 2: cap * tanh(s / cap)
before the mask and the softmax), which SDPA cannot do. Both backends call `attend`, so a layer's
attention is the same whether it is served (paged) or trained (dense rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """q (..., H, Q, D), k and v (..., H_kv, L, D) -> (..., H, Q, D). mask: broadcastable to
    (..., H, Q, L), True where a query may attend, or None; causal (with mask None): query i
    attends to keys 0..i."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=q.shape[-3] != k.shape[-3],
        )
    return softcapped_attention(q, k, v, mask, causal, scale, softcap)


def softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """`attend` with the scores capped, in the order Hugging Face's Gemma 2 computes them: scores in
    the inputs' dtype, capped, masked, softmax in float32 and cast back, times V."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:  # grouped-query attention: each KV head serves `group` query heads
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = q @ k.transpose(-1, -2) * scale  # (..., H, Q, L)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None and causal:
        queries, keys = scores.shape[-2:]
        mask = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
    return weights @ v  # (..., H, Q, D)
