"""The KV cache spec: how many bytes a block takes and how the per-layer caches are allocated.

The runner sizes the pool from `block_bytes` and the backend decides the layout of one layer's
cache (`AttentionBackend.kv_cache_shape`). The element dtype is the model's today; a quantized
cache (INT8 with per-token scales) changes `dtype` and adds its scales' bytes here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aieng.attention.backend import AttentionBackend, KVCache
from aieng.config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return cls(
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            block_size,
            dtype,
        )

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K and V over all layers."""
        return 2 * self.num_layers * self.block_size * self.token_bytes

    def allocate(
        self, num_blocks: int, device: torch.device, backend: AttentionBackend
    ) -> list[KVCache]:
        shape = backend.kv_cache_shape(
            num_blocks, self.block_size, self.num_kv_heads, self.head_dim
        )
        # Zeroed: masked context positions may be read (through padding block 0) and must be
        # finite.
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=device),
                torch.zeros(shape, dtype=self.dtype, device=device),
            )
            for _ in range(self.num_layers)
        ]
