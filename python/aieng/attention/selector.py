"""The one place an attention backend is chosen, by request, device, dtype and model config."""

from __future__ import annotations

import torch

from aieng.attention.backend import AttentionBackend
from aieng.attention.torch_paged import TorchPagedAttention
from aieng.config import ModelConfig

BACKENDS = ("auto", "torch")


def select_attention_backend(
    name: str,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
) -> AttentionBackend:
    """`name` is EngineArgs.attention_backend: 'auto' picks the fastest backend verified for
    this device, the model's dtype and the cache's (EngineArgs.kv_cache_dtype; today the torch
    reference everywhere), 'torch' forces the reference."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    # Decode groups are sized by the context as attention reads it: in the model's dtype (an
    # INT8 cache's context is dequantized to it).
    token_bytes = config.num_key_value_heads * config.head_dim * dtype.itemsize
    # One set of masks per step for each sliding window the layers use (Gemma: two).
    windows = config.layer_sliding_windows or (config.sliding_window,)
    return TorchPagedAttention(sliding_windows=windows, token_bytes=token_bytes)
