"""aieng's dense GEMV on the CPU from the Rust core (`rust/src/kernels/dense_gemv.rs`).

For M <= 8 rows (decode), x @ W^T with float32 or bfloat16 weights reads every weight byte once
for all rows, on torch's thread count with the GIL released: the weights' bytes over the memory
bandwidth. torch's CPU matmul reaches a fraction of that at these M (benches/bench_cpu_peers.py).
Each weight is checked once (`passes_dense_check`) before a layer uses the kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aieng import _core
from aieng.kernels.self_check import passes_check
from aieng.kernels.threads import kernel_threads

DENSE_MAX_M = 8
DENSE_DTYPES = (torch.float32, torch.bfloat16)
DENSE_TOLERANCE = 1e-4  # float32 sums in another order than torch's
CHECK_ROWS = (1, DENSE_MAX_M)


def dense_gemv_usable(weight: torch.Tensor) -> bool:
    """Whether the kernel can take this weight: a 2-D float32/bfloat16 CPU tensor, and a CPU
    with a vector path (the portable one is slower than torch)."""
    return (
        hasattr(_core, "dense_gemv")
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in DENSE_DTYPES
        and weight.is_contiguous()
        and _core.cpu_isa() != "scalar"
    )


def _weight_array(weight: torch.Tensor):
    w = weight.detach()
    return w.numpy() if w.dtype == torch.float32 else w.view(torch.int16).numpy()


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """x (..., K) with at most DENSE_MAX_M rows @ weight (N, K)^T -> (..., N) in x's dtype."""
    n, k = weight.shape
    flat = x.reshape(-1, k)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.to(torch.float32).contiguous()
    y = torch.empty(flat.shape[0], n, dtype=torch.float32)
    _core.dense_gemv(flat.numpy(), _weight_array(weight), y.numpy(), kernel_threads(), isa)
    y = y.view(*x.shape[:-1], n)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def passes_dense_check(weight: torch.Tensor, where: str) -> bool:
    """The kernel against float32 F.linear on random rows (1 and DENSE_MAX_M) of this weight;
    False (with a warning naming `where`) when it cannot run or disagrees."""
    if not dense_gemv_usable(weight):
        return False
    generator = torch.Generator().manual_seed(0)
    reference = weight.detach().float()
    for rows in CHECK_ROWS:
        x = torch.randn(rows, weight.shape[1], generator=generator)
        if not passes_check(
            f"dense_gemv ({str(weight.dtype).removeprefix('torch.')})",
            lambda x=x: dense_gemv(x, weight),
            lambda x=x: F.linear(x, reference),
            DENSE_TOLERANCE,
            where,
        ):
            return False
    return True
