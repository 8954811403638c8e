"""SwiGLU's gate (Shazeer, 2020): silu(gate) * up over a fused [gate | up] projection."""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)  # (..., 2 * I) -> 2 x (..., I)
    return F.silu(gate) * up
