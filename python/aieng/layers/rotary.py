"""Rotary position embedding (Su et al., 2021, RoFormer), in the rotate-half (GPT-NeoX) layout
that Hugging Face Llama checkpoints use; with linear, Llama-3.1, YaRN (Peng et al., 2023),
dynamic-NTK and LongRoPE (Ding et al., 2024) frequency scaling, computed as transformers does.

A position's rotation is fixed (one table for the whole context), which is what transformers
computes for every sequence within `max_position_embeddings` — the only ones aieng serves:
- dynamic NTK rescales the base only once a sequence exceeds `max_position_embeddings`, so within
  the context its frequencies are the formula's at seq_len = max_position_embeddings;
- longrope rotates positions before the original context with the short factors and positions
  from it on with the long factors (when `max_position_embeddings` exceeds the original context).
  transformers instead picks one set for a whole sequence: the long factors once it is longer
  than the original context — for a prompt that long, all of it; and for Phi-3, when generation
  crosses that length, it drops the cache and recomputes every position with the long factors.
  The two agree exactly on every sequence within the original context; past it, aieng's earlier
  positions keep their short-factor rotation. A table per position, not per request, keeps
  batching and prefix caching exact (a cached block's keys never depend on what follows them).
"""

import math
from dataclasses import replace

import torch
from torch import nn

from aieng.config.model_config import RopeConfig
from aieng.kernels.fused_dispatch import fused_rotary
from aieng.kernels.reference import apply_rotary


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)  # (head_dim / 2,)
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    if rope.type == "yarn":
        return _yarn_scaled(rope.theta**exponents, head_dim, rope)
    if rope.type == "dynamic":
        # The NTK-aware base at seq_len = max_position_embeddings (a ratio of 1 for the factor).
        length = rope.max_position_embeddings
        scale = rope.factor * length / length - (rope.factor - 1)
        base = rope.theta * scale ** (head_dim / (head_dim - 2))
        return 1.0 / (base**exponents)
    if rope.type == "longrope":
        factors = rope.long_factor if rope.use_long_factor else rope.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents)
    return inv_freq


def _yarn_scaled(wavenumbers: torch.Tensor, head_dim: int, rope: RopeConfig) -> torch.Tensor:
    # YaRN: dimensions that rotate more than beta_fast times over the original context keep their
    # frequency, those rotating fewer than beta_slow times are divided by `factor`, with a linear
    # ramp over the dimensions in between.
    def dimension(rotations: float) -> float:
        turns = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(rope.theta))

    low, high = dimension(rope.beta_fast), dimension(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (divided by factor)
    # wavenumbers: theta ** (2i / head_dim), the inverse of the unscaled frequencies
    interpolated, extrapolated = 1.0 / (rope.factor * wavenumbers), 1.0 / wavenumbers
    return interpolated * (1 - keep) + extrapolated * keep


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the middle blended.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig):
        super().__init__()
        freqs = torch.arange(max_positions).float()[:, None] * rope_inv_freq(head_dim, rope)[None]
        if rope.type == "longrope" and rope.use_long_factor:
            # positions before the original context keep the short factors (module docstring)
            short = replace(rope, use_long_factor=False)
            original = min(rope.original_max_position_embeddings, max_positions)
            positions = torch.arange(original).float()[:, None]
            freqs[:original] = positions * rope_inv_freq(head_dim, short)[None]
        # yarn / longrope scale cos and sin by the attention factor (1 otherwise).
        scale = rope.attention_factor
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)  # (max_positions, D / 2)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)
        self._positions: torch.Tensor | None = None
        self._cos_src: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] = (self.cos[:0], self.sin[:0])

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer of a step passes the same positions tensor: look cos/sin up once per step.
        if positions is not self._positions or self._cos_src is not self.cos:
            self._positions, self._cos_src = positions, self.cos
            self._cos_sin = (self.cos[positions], self.sin[positions])
        cos, sin = self._cos_sin
        fused = fused_rotary(q, k, cos, sin)
        if fused is not None:
            return fused
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
