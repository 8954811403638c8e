"""Causal attention over dense training batches — the backend `aieng train` runs the model with.

A training step is B rows of L tokens, no KV cache (`ForwardContext.kv_caches` is None): the
model's flat (B * L, H, D) q/k/v are viewed back as rows, each row attends causally to itself
with `scaled_dot_product_attention`, and everything stays differentiable. Each layer brings its
own sliding window (one mask per distinct window, built by the first layer that needs it) and
its own score soft-capping (`aieng.attention.sdpa`, as the paged backend computes it). Not a
serving backend (the selector never picks it): the trainer constructs it itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from aieng.attention.backend import AttentionBackend, KVCache
from aieng.attention.sdpa import attend

if TYPE_CHECKING:
    from aieng.attention.layer import Attention


@dataclass
class DenseBatch:
    """B rows of L tokens, flattened row by row into the step's T = B * L tokens."""

    batch_size: int
    seq_len: int
    # sliding window -> (L, L) mask, True where query i may attend to key j; built by the first
    # layer that needs it, shared by the rest
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, window: int, device: torch.device) -> torch.Tensor:
        if window not in self.window_masks:
            query = torch.arange(self.seq_len, device=device)[:, None]
            key = torch.arange(self.seq_len, device=device)[None, :]
            self.window_masks[window] = (key <= query) & (key > query - window)
        return self.window_masks[window]


class CausalAttention(AttentionBackend):
    """Each row of a dense batch attends causally to itself (within the layer's sliding window,
    its scores soft-capped where the layer says)."""

    name = "causal"

    def build_metadata(self, inputs: DenseBatch) -> DenseBatch:  # type: ignore[override]
        """A training step has no scheduler's arrays: its metadata is the batch's shape."""
        return inputs

    def forward(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache | None,
        metadata: DenseBatch,
    ) -> torch.Tensor:
        if kv_cache is not None:
            raise ValueError("the causal attention backend keeps no KV cache")
        b, length = metadata.batch_size, metadata.seq_len
        num_heads, head_dim = q.shape[1:]
        q = q.view(b, length, num_heads, head_dim).transpose(1, 2)  # (B, H, L, D)
        k = k.view(b, length, -1, head_dim).transpose(1, 2)  # (B, H_kv, L, D)
        v = v.view(b, length, -1, head_dim).transpose(1, 2)
        window = layer.sliding_window
        mask = None if window is None else metadata.window_mask(window, q.device)
        out = attend(q, k, v, mask, mask is None, layer.scale, layer.logit_softcap)
        return out.transpose(1, 2).reshape(b * length, num_heads, head_dim)  # (T, H, D)
