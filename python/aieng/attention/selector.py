"""The one place an attention backend is chosen, by request, device, dtype and model config."""

from __future__ import annotations

import torch

from aieng.attention.backend import AttentionBackend
from aieng.attention.torch_paged import TorchPagedAttention
from aieng.config.model_config import ModelConfig
from aieng.distributed.parallel_state import kv_heads_per_rank

BACKENDS = ("auto", "torch", "cuda", "cpu")


def select_attention_backend(
    name: str,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    block_size: int | None = None,
) -> AttentionBackend:
    """`name` is EngineArgs.attention_backend: 'auto' picks the fastest backend verified for
    this device, the model's dtype and the cache's (EngineArgs.kv_cache_dtype): the CUDA
    kernels on an NVIDIA GPU in float16/bfloat16 when they compile and pass their self-check,
    the Rust core's kernel on the CPU in float32/bfloat16 (a float or INT8 cache) when it passes
    its own, else the torch
    reference; 'cuda' and 'cpu' ask for those kernels (ValueError where they cannot serve the
    model; the reference, after a warning, where they fail the self-check); 'torch' forces the
    reference. `block_size`: the engine's cache blocks, checked with the CUDA kernels'
    own set of block sizes."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name in ("auto", "cuda"):
        from aieng.attention.cuda_self_check import checked_cuda_backend, cuda_unsupported_reason

        reason = cuda_unsupported_reason(config, device, dtype)
        cuda = None
        if reason is None:
            cuda = checked_cuda_backend(config, device, dtype, kv_cache_dtype, block_size)
        if cuda is not None:
            return cuda
        if reason is not None and name == "cuda":
            raise ValueError(f"attention_backend 'cuda' cannot serve this model: {reason}")
    if name in ("auto", "cpu"):
        from aieng.attention.cpu_paged import checked_cpu_backend, cpu_attention_unsupported_reason

        reason = cpu_attention_unsupported_reason(device, dtype, kv_cache_dtype)
        int8 = kv_cache_dtype == "int8"
        if reason is None and (cpu := checked_cpu_backend(config, dtype, int8)):
            return cpu
        if reason is not None and name == "cpu":
            raise ValueError(f"attention_backend 'cpu' cannot serve this model: {reason}")
    # Decode groups are sized by the context as attention reads it: in the model's dtype (an
    # INT8 cache's context is dequantized to it), over this tensor-parallel rank's KV heads.
    token_bytes = kv_heads_per_rank(config.num_key_value_heads) * config.head_dim * dtype.itemsize
    # One set of masks per step for each sliding window the layers use (Gemma: two).
    windows = config.layer_sliding_windows or (config.sliding_window,)
    return TorchPagedAttention(sliding_windows=windows, token_bytes=token_bytes)
