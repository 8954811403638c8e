"""The attention layer of a model: its shape, and a call into the step's attention backend. It
lives beside the backends it calls; model files import it from here."""

from __future__ import annotations

import torch
from torch import nn

from aieng.attention.backend import ForwardContext


class Attention(nn.Module):
    """Scaled dot-product attention of one layer over the step's tokens (and their KV cache).

    sliding_window: each query sees only the last `sliding_window` positions, itself included
    (None: the whole context); models may give each layer its own. logit_softcap: the scores are
    capped as cap * tanh(score / cap) before the mask and the softmax (Gemma 2); None: not."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_index: int,
        scale: float | None = None,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_index = layer_index
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """q (T, H, D), k and v (T, H_kv, D) -> (T, H, D)."""
        kv_cache = None if ctx.kv_caches is None else ctx.kv_caches[self.layer_index]
        return ctx.backend.forward(self, q, k, v, kv_cache, ctx.metadata)
