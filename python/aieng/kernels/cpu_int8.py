"""aieng's CPU int8 matmul from the Rust core (`rust/src/kernels/`): W4A8 and W8A8.

The weight, w = (q - z) * s per group as the checkpoint formats unpack it, is repacked once
into `Int8Weights` (the layout `vpdpbusd` reads: 0.5 byte a weight at 4 bits, 1 at 8). Each call
quantizes the activations to int8 per block of 32 (scale max|x| / 127; with `split`, a second
int8 term holds what the first rounded away) and multiplies on the int8 dot-product
instructions of this CPU (AVX-512 VNNI, AVX-VNNI, AVX2, or portable code; the
`AIENG_CPU_ISA` environment variable forces a lower path), with int32 sums and float scales, on
torch's thread count, the GIL released, into a preallocated float32 output.
"""

from __future__ import annotations

import torch

from aieng import _core
from aieng.kernels.threads import kernel_threads

GEMV_MAX_M = 8  # rows of x the kernel multiplies in one pass over the weights


def cpu_int8_available() -> bool:
    return hasattr(_core, "Int8Weights")


def cpu_isa() -> str:
    """The instruction set the kernels run on (named in the start-up log)."""
    return _core.cpu_isa()


def pack_int8_weights(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int
) -> _core.Int8Weights:
    """q (N, K) integers in [0, 2^bits), scales and zeros (N, G) -> the kernels' layout.
    InvalidArgumentError naming the problem when they do not fit it (a group size that is not
    a multiple of 32, q out of range, non-finite scales)."""
    return _core.Int8Weights(
        q.to(torch.uint8).contiguous().numpy(),
        scales.float().contiguous().numpy(),
        zeros.float().contiguous().numpy(),
        bits,
    )


def int8_matmul(
    x: torch.Tensor,
    weights: _core.Int8Weights,
    out: torch.Tensor | None = None,
    isa: str | None = None,
    split: bool = False,
) -> torch.Tensor:
    """x (..., K) on the CPU @ W^T -> (..., N) in x's dtype (float32 inside). `split`: the
    activations as two int8 terms (about 15 bits, two dot products per weight byte) rather than
    one. `out`: a contiguous float32 (M, N) tensor to write into. InvalidArgumentError on a NaN
    or an infinity in x."""
    n, k = weights.out_features, weights.in_features
    flat = x.reshape(-1, k)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.to(torch.float32).contiguous()
    y = torch.empty(flat.shape[0], n, dtype=torch.float32) if out is None else out
    weights.matmul(flat.numpy(), y.numpy(), kernel_threads(), isa, split)
    y = y.view(*x.shape[:-1], n)
    return y if x.dtype == torch.float32 else y.to(x.dtype)
