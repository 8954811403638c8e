"""Attention backends: the `AttentionBackend` seam, the pure-PyTorch paged reference, and the
selector that picks one per engine."""

from aieng.attention.backend import (
    AttentionBackend,
    AttentionInputs,
    ForwardContext,
    KVCache,
    QuantizedKVCache,
)
from aieng.attention.selector import select_attention_backend

__all__ = [
    "AttentionBackend",
    "AttentionInputs",
    "ForwardContext",
    "KVCache",
    "QuantizedKVCache",
    "select_attention_backend",
]
