"""Gated MLP activations over a fused [gate | up] projection: SwiGLU (Shazeer, 2020),
silu(gate) * up, and GeGLU with GELU's tanh approximation, gelu_tanh(gate) * up (Gemma's
`gelu_pytorch_tanh`)."""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)  # (..., 2 * I) -> 2 x (..., I)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)  # (..., 2 * I) -> 2 x (..., I)
    return F.gelu(gate, approximate="tanh") * up
