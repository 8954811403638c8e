"""The attention seam: what every backend implements, and what a layer hands it.

A backend turns a step's scheduling arrays into its own metadata once per step
(`build_metadata`), then every attention layer of the model calls `forward` with that metadata
and its layer's KV cache. Model files only hold an `aieng.attention.layer.Attention` layer;
which backend runs is decided in one place, `aieng.attention.selector`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from aieng.kernels.reference import KVCache, QuantizedKVCache

__all__ = [
    "AttentionBackend",
    "AttentionInputs",
    "AttentionLayer",
    "ForwardContext",
    "KVCache",
    "QuantizedKVCache",
]


class AttentionLayer(Protocol):
    """What a backend reads of the layer it computes (`aieng.attention.layer.Attention`)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_index: int
    scale: float
    sliding_window: int | None
    logit_softcap: float | None


@dataclass
class AttentionInputs:
    """One step's scheduling arrays, as a backend needs them. R requests, T tokens."""

    slot_mapping: torch.Tensor  # (T,) int64 on the device: cache slot of each new token's K/V
    query_start_loc: np.ndarray  # (R + 1,) host: request r's tokens are [qsl[r], qsl[r + 1])
    num_computed_tokens: np.ndarray  # (R,) host: tokens already in the cache before this step
    seq_lens: np.ndarray  # (R,) host: context length after this step
    block_tables: np.ndarray  # (R, W) host int32: each request's block ids (padding: 0)
    block_size: int


@dataclass
class ForwardContext:
    """What a model's forward needs beside its input ids and positions."""

    backend: AttentionBackend
    metadata: Any  # the backend's, from build_metadata
    kv_caches: list[KVCache] | None  # one per layer; None: no cache (training)


class AttentionBackend(ABC):
    """A way to compute attention; one instance serves every layer of a model."""

    name: str
    # The EngineArgs.kv_cache_dtype values whose caches this backend reads: "auto" hands it
    # (K, V) tuples, "int8" QuantizedKVCache.
    kv_cache_dtypes: tuple[str, ...] = ("auto",)

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """Shape of one layer's K (and V) cache; an INT8 cache's scales take this shape with
        head_dim 1."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    @abstractmethod
    def build_metadata(self, inputs: AttentionInputs) -> Any:
        """Called once per step; the result is shared by every layer."""

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache | None,
        metadata: Any,
    ) -> torch.Tensor:
        """q (T, H, D), k and v (T, H_kv, D): write k, v into the cache, attend -> (T, H, D)."""
