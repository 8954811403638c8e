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
    kv_cache_dtype: torch.dtype,
) -> AttentionBackend:
    """`name` is EngineArgs.attention_backend: 'auto' picks the fastest backend verified for
    this device and dtype (today the torch reference everywhere), 'torch' forces the reference."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    token_bytes = config.num_key_value_heads * config.head_dim * kv_cache_dtype.itemsize
    return TorchPagedAttention(sliding_window=config.sliding_window, token_bytes=token_bytes)
