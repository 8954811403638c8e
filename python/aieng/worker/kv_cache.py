"""The KV cache spec: how many bytes a block takes and how the per-layer caches are allocated.

The runner sizes the pool from `block_bytes` and the backend decides the layout of one layer's
cache (`AttentionBackend.kv_cache_shape`). With `kv_cache_dtype="auto"` the elements are in the
model's dtype (once `resolve_kv_cache_dtype` has decided "auto": bfloat16 where the native CPU
decoder serves a float32 model) and a layer's cache is a (K, V) tuple. With `"float32"` or
`"bfloat16"` they are in that dtype whatever the model's (a dtype other than the model's is the
native CPU decoder's: the torch attention backends take the model's dtype only). With `"int8"`
they are int8 and every token of every KV head also carries one scale for K and one for V, in the
model's dtype (a float32 scale on a float16 model would cost head_dim 64 a further 2 bytes in 66,
and buy nothing: values are quantized with the stored scale, so its rounding never adds error); a
layer's cache is then a `QuantizedKVCache`.
`token_bytes` and `block_bytes` count the scales, so a fixed budget holds
D * s / (D + s') times the blocks, s and s' the bytes of a model element and of a scale: for
head_dim 64, 128 / 66 = 1.94x those of float16 and 256 / 68 = 3.76x those of float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aieng.attention.backend import AttentionBackend, KVCache, QuantizedKVCache
from aieng.config.engine_args import FLOAT_KV_CACHE_DTYPES, KV_CACHE_DTYPES
from aieng.config.model_config import ModelConfig
from aieng.distributed.parallel_state import kv_heads_per_rank


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype, native: bool) -> str:
    """EngineArgs.kv_cache_dtype with "auto" decided for a runner of a `dtype` model: bfloat16
    where the native CPU decoder serves a float32 model (half the bytes every decode step reads;
    the torch path reads only the model's dtype), the model's dtype ("auto") otherwise."""
    if kv_cache_dtype == "auto" and native and dtype == torch.float32:
        return "bfloat16"
    return kv_cache_dtype


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # of the cache's elements: the model's, or torch.int8
    scale_dtype: torch.dtype | None = None  # INT8: of the per-token, per-KV-head scales

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> KVCacheSpec:
        """dtype: the model's; kv_cache_dtype: EngineArgs.kv_cache_dtype. Under tensor
        parallelism, the cache of this rank's KV heads (aieng.layers.parallel)."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {kv_cache_dtype!r}"
            )
        quantized = kv_cache_dtype == "int8"
        if kv_cache_dtype in FLOAT_KV_CACHE_DTYPES:  # this dtype under any model's
            dtype = getattr(torch, kv_cache_dtype)
        return cls(
            0 if config.is_encoder else config.num_hidden_layers,  # an encoder caches nothing
            kv_heads_per_rank(config.num_key_value_heads),  # this tensor-parallel rank's
            config.head_dim,
            block_size,
            torch.int8 if quantized else dtype,
            dtype if quantized else None,
        )

    @property
    def quantized(self) -> bool:
        return self.scale_dtype is not None

    @property
    def cache_dtype(self) -> str:
        """The cache's dtype by name: 'int8', or the model's ('float32', 'bfloat16', ...)."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer, its scales included."""
        elements = self.num_kv_heads * self.head_dim * self.dtype.itemsize
        if self.scale_dtype is None:
            return elements
        return elements + self.num_kv_heads * self.scale_dtype.itemsize

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
        # finite (a zero scale dequantizes to zero).
        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        if self.scale_dtype is None:
            return [
                (zeros(shape, self.dtype), zeros(shape, self.dtype)) for _ in range(self.num_layers)
            ]
        scale_shape = backend.kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, 1)
        return [
            QuantizedKVCache(
                zeros(shape, self.dtype),
                zeros(shape, self.dtype),
                zeros(scale_shape, self.scale_dtype),
                zeros(scale_shape, self.scale_dtype),
            )
            for _ in range(self.num_layers)
        ]
