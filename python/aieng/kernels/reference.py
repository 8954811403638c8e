"""The pure-PyTorch reference ops the kernels are checked against, and the KV-cache types they
write: every CUDA (and CPU) kernel of `aieng.kernels` has its reference here, and the layers and
attention backends use these same functions as their portable path, so a kernel and the model it
serves are held to one definition. Nothing here imports a layer, a backend or a model.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class QuantizedKVCache(NamedTuple):
    """One layer's INT8 cache (`kv_cache_dtype="int8"`): K and V as int8 in the backend's layout
    (`kv_cache_shape`), and one scale per token per KV head for each, in the model's dtype, laid
    out as the cache with head_dim 1 (so `k.to(dtype) * k_scale` dequantizes). A slot's value is
    `q * scale` with q in [-127, 127]."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor


# One layer's cache: K and V in the model's dtype, or a QuantizedKVCache (whose first two
# fields are still K and V).
KVCache = tuple[torch.Tensor, torch.Tensor] | QuantizedKVCache


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_in_float32: bool = False,
    unit_offset: bool = False,
) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weighted_norm(x32, x.dtype, weight, weight_in_float32, unit_offset)


def weighted_norm(
    x32: torch.Tensor,
    dtype: torch.dtype,
    weight: torch.Tensor,
    weight_in_float32: bool,
    unit_offset: bool,
) -> torch.Tensor:
    """The normalised float32 x times the weight, cast back to `dtype` as each family does."""
    if unit_offset:
        return (x32 * (1.0 + weight.float())).to(dtype)
    if weight_in_float32:
        return (weight * x32).to(dtype)
    return weight * x32.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D); cos, sin (T, D / 2)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)  # (..., 2 * I) -> 2 x (..., I)
    return F.silu(gate) * up


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v (T, H_kv, D) -> their slots of the caches."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def quantize_int8(x: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> (q int8 (..., D), scale (..., 1) in scale_dtype), x ~ q * scale: symmetric,
    one scale per vector, max|x| / 127, never below scale_dtype's smallest normal. q is computed
    with the scale as stored, so the scale's own rounding adds no error."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / 127).clamp_min_(torch.finfo(scale_dtype).tiny)
    scale = scale.to(scale_dtype)
    q = (xf / scale.float()).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q (..., D) int8, scale (..., 1) -> (..., D) in dtype."""
    return q.to(dtype).mul_(scale)


def write_quantized_kv_cache(
    k: torch.Tensor, v: torch.Tensor, cache: QuantizedKVCache, slot_mapping: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """k, v (T, H_kv, D) -> quantized into their slots of an INT8 cache; returns (q, scale) of
    each, as written."""
    _, _, num_kv_heads, head_dim = cache.k.shape
    written = []
    for x, values, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
        q, scale = quantize_int8(x, scales.dtype)
        values.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, q)
        scales.view(-1, num_kv_heads, 1).index_copy_(0, slot_mapping, scale)
        written.append((q, scale))
    return written[0], written[1]
