"""aieng's element-wise CPU kernels from the Rust core (`rust/src/kernels/elementwise.rs`): the
residual add with the RMSNorm after it, SiLU(gate)·up, rotate-half RoPE and the KV-cache write,
each one call where torch runs a chain of small ops (at decode, their dispatch is most of a
layer's time outside the matmuls). float32 only; `aieng.kernels.fused_dispatch` decides when
they run, after `check_cpu_fused_ops` held each against its torch reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from aieng import _core
from aieng.kernels.reference import apply_rotary, rms_norm, silu_and_mul_torch, write_kv_cache
from aieng.kernels.self_check import passes_check
from aieng.kernels.threads import kernel_threads

logger = logging.getLogger(__name__)

CHECK_TOLERANCE = 1e-5  # relative; the kernels are torch's float32 arithmetic in another order


def cpu_fused_available() -> bool:
    return hasattr(_core, "rms_norm")


def _cache_array(cache: torch.Tensor) -> np.ndarray:
    return (cache.view(torch.uint16) if cache.dtype == torch.bfloat16 else cache).numpy()


def add_rms_norm(
    x: torch.Tensor, branch: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x (..., H) contiguous float32 (+= branch in place, when given) -> rms_norm(x)."""
    hidden = x.shape[-1]
    out = torch.empty_like(x)
    _core.rms_norm(
        x.view(-1, hidden).numpy(),
        weight.detach().numpy(),
        eps,
        out.view(-1, hidden).numpy(),
        kernel_threads(),
        None if branch is None else branch.view(-1, hidden).numpy(),
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2I) contiguous float32 = [gate | up] -> silu(gate) * up (..., I)."""
    width = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], width)
    _core.silu_and_mul(x.view(-1, 2 * width).numpy(), out.view(-1, width).numpy(), kernel_threads())
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) float32 (each head contiguous), cos and sin (T, D/2) -> RoPE'd x, contiguous."""
    out = torch.empty(x.shape, dtype=torch.float32)
    _core.rotary(x.numpy(), cos.numpy(), sin.numpy(), out.numpy(), kernel_threads())
    return out


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """k, v (T, H_kv, D) float32 into their slots (int64) of float32 or bfloat16 caches."""
    _core.kv_write(
        k.numpy(), v.numpy(), slot_mapping.numpy(), _cache_array(k_cache), _cache_array(v_cache)
    )


def _checks() -> dict[str, Callable[[], bool]]:
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    def norm_case(rows: int, add: bool) -> bool:
        x, branch, weight = randn(rows, 96), randn(rows, 96), randn(96)
        want_sum = x + branch if add else x

        def run() -> tuple[torch.Tensor, ...]:
            mine = x.clone()
            return mine, add_rms_norm(mine, branch if add else None, weight, 1e-6)

        return passes_check(
            "cpu rms_norm",
            run,
            lambda: (want_sum, rms_norm(want_sum, weight, 1e-6)),
            CHECK_TOLERANCE,
            f"{rows} rows, residual add {add}",
        )

    def silu_case(rows: int) -> bool:
        x = randn(rows, 2 * 160) * 4
        return passes_check(
            "cpu silu_and_mul",
            lambda: silu_and_mul(x),
            lambda: silu_and_mul_torch(x),
            CHECK_TOLERANCE,
            f"{rows} rows",
        )

    def rotary_case(tokens: int) -> bool:
        qkv = randn(tokens, 6 * 32)
        q = qkv[:, : 4 * 32].view(tokens, 4, 32)  # strided, as the projection's slices
        angles = randn(tokens, 16)
        cos, sin = angles.cos(), angles.sin()
        return passes_check(
            "cpu rotary",
            lambda: rotary(q, cos, sin),
            lambda: apply_rotary(q, cos, sin),
            CHECK_TOLERANCE,
            f"{tokens} tokens",
        )

    def kv_case(dtype: torch.dtype) -> bool:
        kv = randn(5, 2 * 2 * 16)
        k, v = kv[:, :32].view(5, 2, 16), kv[:, 32:].view(5, 2, 16)
        slots = torch.tensor([7, 0, 3, 12, 8])

        def caches() -> tuple[torch.Tensor, torch.Tensor]:
            return torch.zeros(4, 4, 2, 16, dtype=dtype), torch.zeros(4, 4, 2, 16, dtype=dtype)

        def run() -> tuple[torch.Tensor, ...]:
            kc, vc = caches()
            kv_write(k, v, slots, kc, vc)
            return kc.float(), vc.float()

        def reference() -> tuple[torch.Tensor, ...]:
            kc, vc = caches()
            write_kv_cache(k.to(dtype), v.to(dtype), kc, vc, slots)
            return kc.float(), vc.float()

        return passes_check("cpu kv_write", run, reference, CHECK_TOLERANCE, str(dtype))

    return {
        "add_rms_norm": lambda: all(norm_case(r, a) for r in (1, 700) for a in (False, True)),
        "silu_and_mul": lambda: all(silu_case(r) for r in (1, 300)),
        "rotary": lambda: all(rotary_case(t) for t in (1, 600)),
        "kv_write": lambda: all(kv_case(d) for d in (torch.float32, torch.bfloat16)),
    }


def check_cpu_fused_ops(device: torch.device, dtype: torch.dtype) -> set[str]:
    """The kernels that match their torch references (float32 on the CPU; none elsewhere), as
    `fused_dispatch.kernel_name` names them; a kernel that fails is named in a warning."""
    if device.type != "cpu" or dtype != torch.float32 or not cpu_fused_available():
        return set()
    with torch.inference_mode():
        passed = {name for name, check in _checks().items() if check()}
    return {f"{name}_f32" for name in passed}
