"""Gated MLP activations over a fused [gate | up] projection: SwiGLU (Shazeer, 2020),
silu(gate) * up, and GeGLU with GELU's tanh approximation, gelu_tanh(gate) * up (Gemma's
`gelu_pytorch_tanh`).

SwiGLU runs as one fused kernel on an NVIDIA GPU (`aieng.kernels.fused`, chosen by
`aieng.kernels.fused_dispatch`) and as `silu_and_mul_torch` everywhere else."""

import torch
import torch.nn.functional as F

from aieng.kernels.fused_dispatch import fused_silu_and_mul
from aieng.kernels.reference import silu_and_mul_torch


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    fused = fused_silu_and_mul(x)
    return silu_and_mul_torch(x) if fused is None else fused


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)  # (..., 2 * I) -> 2 x (..., I)
    return F.gelu(gate, approximate="tanh") * up
