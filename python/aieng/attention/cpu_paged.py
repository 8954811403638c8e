"""Paged attention on the CPU from the Rust core (`cpu`): every query token — decode rows and
(chunked) prefill rows alike — attends over its request's context read in place from the K/V
cache through the block table (`rust/src/kernels/paged_attention.rs`: GQA heads sharing each K/V
row, an online softmax over chunks of positions, sliding windows, soft-capped scores), on
torch's thread count with the GIL released. Nothing of the context is gathered or copied: the
step's new K/V are written to their slots first, then read back like the rest of the context.

It serves float32 and bfloat16 models with a cache in the model's dtype or the INT8 cache (one
scale per position and KV head, applied inside the kernel: nothing is dequantized into a copy);
the arithmetic is float32 (bfloat16 queries are widened, the output narrowed back).
`aieng.attention.selector` picks it on the CPU after it passed its start-up check against the
torch reference for the model's dtype and cache (`checked_cpu_backend`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from aieng import _core
from aieng.attention.backend import (
    AttentionBackend,
    AttentionInputs,
    AttentionLayer,
    KVCache,
    QuantizedKVCache,
)
from aieng.config.model_config import ModelConfig
from aieng.distributed.parallel_state import heads_per_rank, kv_heads_per_rank
from aieng.kernels.fused_dispatch import fused_kv_write
from aieng.kernels.reference import write_kv_cache, write_quantized_kv_cache
from aieng.kernels.threads import kernel_threads

logger = logging.getLogger(__name__)


@dataclass
class CpuAttentionMetadata:
    """The step's arrays as the kernel reads them (host int32, C order)."""

    slot_mapping: torch.Tensor  # (T,) cache slot of each new token's K/V
    query_start_loc: np.ndarray  # (R + 1,)
    seq_lens: np.ndarray  # (R,) context length after the step
    block_tables: np.ndarray  # (R, W)


def cpu_attention_unsupported_reason(
    device: torch.device, dtype: torch.dtype, kv_cache_dtype: str
) -> str | None:
    """Why the cpu backend cannot serve here, or None when it can."""
    if device.type != "cpu":
        return f"it runs on the CPU only (device {device})"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"it takes float32 and bfloat16 models, not {dtype}"
    if kv_cache_dtype not in CpuPagedAttention.kv_cache_dtypes:
        return f"it reads float and int8 caches, not kv_cache_dtype {kv_cache_dtype!r}"
    if not hasattr(_core, "paged_attention"):
        return "the Rust core was built without it"
    return None


class CpuPagedAttention(AttentionBackend):
    name = "cpu"
    kv_cache_dtypes = ("auto", "int8")

    def __init__(self, sliding_windows: tuple[int | None, ...] = (None,)):
        """sliding_windows: the model's (each layer passes its own; kept for introspection)."""
        self.sliding_windows = sliding_windows

    def build_metadata(self, inputs: AttentionInputs) -> CpuAttentionMetadata:
        return CpuAttentionMetadata(
            slot_mapping=inputs.slot_mapping,
            query_start_loc=np.ascontiguousarray(inputs.query_start_loc, np.int32),
            seq_lens=np.ascontiguousarray(inputs.seq_lens, np.int32),
            block_tables=np.ascontiguousarray(inputs.block_tables, np.int32),
        )

    def forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache | None,
        metadata: CpuAttentionMetadata,
    ) -> torch.Tensor:
        if kv_cache is None:
            raise ValueError("the cpu attention backend needs a KV cache")
        scales: dict[str, np.ndarray] = {}
        if isinstance(kv_cache, QuantizedKVCache):
            write_quantized_kv_cache(k, v, kv_cache, metadata.slot_mapping)
            k_cache, v_cache = kv_cache.k, kv_cache.v
            scales = {
                "k_scale": _as_array(kv_cache.k_scale),
                "v_scale": _as_array(kv_cache.v_scale),
            }
        else:
            k_cache, v_cache = kv_cache
            if not fused_kv_write(k, v, kv_cache, metadata.slot_mapping):
                write_kv_cache(k, v, k_cache, v_cache, metadata.slot_mapping)
        q32 = q.to(torch.float32).contiguous()
        out = torch.empty_like(q32)
        _core.paged_attention(
            q32.numpy(),
            _as_array(k_cache),
            _as_array(v_cache),
            out.numpy(),
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            layer.scale,
            layer.sliding_window or 0,
            layer.logit_softcap or 0.0,
            kernel_threads(),
            **scales,
        )
        return out.to(q.dtype)


def _as_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a cache tensor's buffer (bfloat16 as its uint16 bits: numpy has no
    bfloat16)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.uint16)
    return tensor.numpy()


def checked_cpu_backend(
    config: ModelConfig, dtype: torch.dtype = torch.float32, int8: bool = False
) -> CpuPagedAttention | None:
    """A `CpuPagedAttention` that passed the start-up check for this model's heads, windows,
    soft-cap, dtype and cache (`int8`: the INT8 cache) — decodes and fresh and chunked prefills,
    block sizes 16 and 32, against the torch reference — or None after a warning naming what
    failed."""
    from aieng.attention.cuda_self_check import PREFILLS, SPLIT_DECODES, check_case
    from aieng.attention.layer import Attention

    windows = tuple(
        dict.fromkeys(getattr(config, "layer_sliding_windows", ()) or (config.sliding_window,))
    )
    backend = CpuPagedAttention(windows)
    heads = heads_per_rank(config.num_attention_heads)
    kv_heads = kv_heads_per_rank(config.num_key_value_heads)
    softcap = getattr(config, "attn_logit_softcapping", None)
    for window in windows:
        layer = Attention(
            heads, kv_heads, config.head_dim, 0, sliding_window=window, logit_softcap=softcap
        )
        for block_size in (16, 32):
            for seed, specs in enumerate((SPLIT_DECODES, PREFILLS)):
                args = (specs, block_size, dtype, int8, torch.device("cpu"), seed)
                if not check_case(backend, "cpu paged_attention", layer, *args, "cpu attention"):
                    return None
    return backend
