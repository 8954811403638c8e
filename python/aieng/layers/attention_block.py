"""The self-attention block every decoder family shares, written once: q/k/v in one
column-parallel matmul (`qkv_proj`), optional q/k RMSNorm (per head, or across all heads as
OLMo 2 does), RoPE (skipped on layers without it), attention through the `ForwardContext`'s
backend, and the row-parallel output projection (`o_proj`). Under tensor parallelism each rank
builds its share of the heads. A family says how it differs in `AttentionOptions`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from aieng.attention.backend import ForwardContext
from aieng.attention.layer import Attention
from aieng.config.model_config import ModelConfig
from aieng.distributed.parallel_state import heads_per_rank, kv_heads_per_rank
from aieng.layers.linear import Linear, LinearMethodChooser
from aieng.layers.parallel import qkv_parallel, row_parallel
from aieng.layers.rotary import RotaryEmbedding

# Builds a q or k norm: (size, this rank's (offset, length) of the projection) -> the module.
NormFactory = Callable[[int, tuple[int, int]], nn.Module]


@dataclass(frozen=True)
class AttentionOptions:
    """How one layer's attention differs between families and layers."""

    o_proj_bias: bool  # Llama's `o_proj_bias`; Gemma's `attention_bias`
    sliding_window: int | None
    logit_softcap: float | None = None  # Gemma 2's attention soft-capping
    qk_norm: NormFactory | None = None
    qk_norm_per_head: bool = True  # False: over the whole q and k projections (OLMo 2)


class DecoderSelfAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding | None,
        dtype: torch.dtype,
        methods: LinearMethodChooser,
        layer_index: int,
        prefix: str,
        options: AttentionOptions,
    ):
        super().__init__()
        # This tensor-parallel rank's heads (all of them with one rank).
        self.num_heads = heads_per_rank(config.num_attention_heads)
        self.num_kv_heads = kv_heads_per_rank(config.num_key_value_heads)
        self.head_dim = config.head_dim
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        hidden = config.hidden_size
        self.qkv_proj = Linear(
            hidden,
            [q_size, kv_size, kv_size],
            config.attention_bias,
            dtype,
            methods,
            f"{prefix}.qkv_proj",
            qkv_parallel(
                hidden, config.num_attention_heads, config.num_key_value_heads, self.head_dim
            ),
        )
        self.o_proj = Linear(
            q_size,
            hidden,
            options.o_proj_bias,
            dtype,
            methods,
            f"{prefix}.o_proj",
            row_parallel(q_size, [hidden], "num_attention_heads"),
        )
        self.norm_per_head = options.qk_norm_per_head
        self.has_qk_norm = options.qk_norm is not None
        if options.qk_norm is not None:
            q_part, k_part, _ = self.qkv_proj.shard.output_slices
            if self.norm_per_head:
                self.q_norm = options.qk_norm(self.head_dim, (0, self.head_dim))
                self.k_norm = options.qk_norm(self.head_dim, (0, self.head_dim))
            else:
                self.q_norm = options.qk_norm(q_size, q_part)
                self.k_norm = options.qk_norm(kv_size, k_part)
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            layer_index,
            scale=config.attention_scale,
            sliding_window=options.sliding_window,
            logit_softcap=options.logit_softcap,
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        if self.has_qk_norm and not self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(-1, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (T, H_kv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm and self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, ctx)  # (T, H, D)
        return self.o_proj(out.flatten(1))
