"""Rotary position embedding (Su et al., 2021, RoFormer), in the rotate-half (GPT-NeoX) layout
that Hugging Face Llama checkpoints use; with linear and Llama-3.1 frequency scaling."""

import math

import torch
from torch import nn

from aieng.config import RopeConfig


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)  # (head_dim / 2,)
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D); cos, sin (T, D / 2)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig):
        super().__init__()
        freqs = torch.arange(max_positions).float()[:, None] * rope_inv_freq(head_dim, rope)[None]
        self.register_buffer("cos", freqs.cos(), persistent=False)  # (max_positions, D / 2)
        self.register_buffer("sin", freqs.sin(), persistent=False)
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
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
