"""Where the fused kernels stand in for torch ops, and where they do not: on an NVIDIA GPU those
of `cuda/fused_ops.cu`, on the CPU the Rust core's element-wise kernels (`aieng.kernels.cpu_fused`,
float32 only).

A fused kernel runs only when every tensor is on an NVIDIA GPU, in a dtype it has (float32,
float16, bfloat16), laid out as it reads them, with no autograd graph to build (the kernels have
no backward), fusions are not turned off (`AIENG_DISABLE_FUSED=1`), and the kernel passed its
start-up check (`aieng.kernels.fused.check_fused_ops`, run once per process for each device and
dtype; a kernel that fails it is named in a warning and torch runs instead). On the CPU the same
rules hold with float32 tensors and `check_cpu_fused_ops` as the check (`AIENG_DISABLE_FUSED=1`
turns these off too). Everywhere else each function below returns None (or False) and the caller
runs its own torch ops unchanged.

The layers call `fused_add_rms_norm`, `fused_silu_and_mul` and `fused_rotary` (CPU only); the
cuda and cpu attention backends call `fused_kv_write`. `aieng.kernels.fused` is imported only on
the GPU path (it imports the layers for its references).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from aieng.kernels.int4 import DTYPE_NAMES

if TYPE_CHECKING:
    from aieng.kernels.reference import KVCache

logger = logging.getLogger(__name__)

DISABLE_VARIABLE = "AIENG_DISABLE_FUSED"
MAX_HEAD_DIM = 256  # rope_kv_write holds a head in one warp, 4 pairs per lane

FusedCheck = Callable[[torch.device, torch.dtype], Collection[str]]


def on_nvidia_gpu(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.cuda is not None


def on_cpu(device: torch.device) -> bool:
    return device.type == "cpu"


def fusions_disabled() -> bool:
    """True when `AIENG_DISABLE_FUSED` is set to anything but "" or "0"."""
    return os.environ.get(DISABLE_VARIABLE, "") not in ("", "0")


def check_fused_ops(device: torch.device, dtype: torch.dtype) -> Collection[str]:
    from aieng.kernels.fused import check_fused_ops as check

    return check(device, dtype)


def check_cpu_fused_ops(device: torch.device, dtype: torch.dtype) -> Collection[str]:
    from aieng.kernels.cpu_fused import check_cpu_fused_ops as check

    return check(device, dtype)


def kernel_name(op: str, dtype: torch.dtype) -> str:
    return f"{op}_{DTYPE_NAMES[dtype]}"


@dataclass
class FusedKernels:
    """Which fused kernels may run on which tensors. `runs_on` and `check` are the device test
    and the start-up check (tests inject a CPU stand-in or a failing check through them)."""

    runs_on: Callable[[torch.device], bool] = on_nvidia_gpu
    check: FusedCheck = check_fused_ops
    # (device, dtype) -> the names of the kernels that passed their check there
    checked: dict[tuple[torch.device, torch.dtype], frozenset[str]] = field(default_factory=dict)

    def usable(self, op: str, *tensors: torch.Tensor) -> bool:
        """True when `op`'s kernel may run on `tensors` (layouts are the caller's to check)."""
        first = tensors[0]
        if not self.runs_on(first.device) or first.dtype not in DTYPE_NAMES:
            return False
        if fusions_disabled():
            return False
        if any(t.device != first.device or t.dtype != first.dtype for t in tensors[1:]):
            return False
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return False
        return kernel_name(op, first.dtype) in self.passed(first.device, first.dtype)

    def passed(self, device: torch.device, dtype: torch.dtype) -> frozenset[str]:
        """The kernels that passed their start-up check on `device` in `dtype` (checked at the
        first call; none while a CUDA graph is being captured, where the check cannot run)."""
        key = (device, dtype)
        if key not in self.checked:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return frozenset()
            self.checked[key] = frozenset()  # a call from inside the check itself gets torch
            try:
                self.checked[key] = frozenset(self.check(device, dtype))
            except Exception as error:  # a check that cannot even start turns every kernel off
                logger.warning("the fused kernels' start-up check failed (%s); torch runs", error)
            logger.info(
                "fused kernels on %s in %s: %s", device, dtype, ", ".join(sorted(self.checked[key]))
            )
        return self.checked[key]


FUSED = FusedKernels()
CPU_FUSED = FusedKernels(runs_on=on_cpu, check=check_cpu_fused_ops)


def fused_add_rms_norm(
    x: torch.Tensor,
    branch: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_in_float32: bool,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x (..., H) (+= branch in place, when given) -> (x, rms_norm(x)) by the add_rms_norm
    kernel, or None where it does not apply."""
    tensors = (x, weight) if branch is None else (x, weight, branch)
    on_gpu = FUSED.usable("add_rms_norm", *tensors)
    if not on_gpu and not CPU_FUSED.usable("add_rms_norm", *tensors):
        return None
    if any(not t.is_contiguous() for t in tensors) or weight.shape != x.shape[-1:]:
        return None
    if branch is not None and branch.shape != x.shape:
        return None
    if not on_gpu:  # float32: weight_in_float32 changes nothing
        from aieng.kernels import cpu_fused

        return x, cpu_fused.add_rms_norm(x, branch, weight, eps)
    from aieng.kernels.fused import add_rms_norm

    return x, add_rms_norm(x, branch, weight, eps, weight_in_float32)


def fused_silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """x (..., 2I) = [gate | up] -> silu(gate) * up by the silu_and_mul kernel, or None where it
    does not apply."""
    on_gpu = FUSED.usable("silu_and_mul", x)
    if not on_gpu and not CPU_FUSED.usable("silu_and_mul", x):
        return None
    if not x.is_contiguous() or x.dim() == 0 or x.shape[-1] % 2:
        return None
    if not on_gpu:
        from aieng.kernels import cpu_fused

        return cpu_fused.silu_and_mul(x)
    from aieng.kernels.fused import silu_and_mul

    return silu_and_mul(x)


def fused_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q (T, H, D), k (T, H_kv, D), cos and sin (T, D/2) -> rotate-half RoPE of q and k (new,
    contiguous tensors) by the CPU rotary kernel, or None where it does not apply (the GPU
    path rotates with torch ops, as before)."""
    if not CPU_FUSED.usable("rotary", q, k, cos, sin):
        return None
    if q.dim() != 3 or k.dim() != 3 or q.stride(2) != 1 or k.stride(2) != 1:
        return None
    if not cos.is_contiguous() or not sin.is_contiguous() or cos.shape != sin.shape:
        return None
    from aieng.kernels import cpu_fused

    return cpu_fused.rotary(q, cos, sin), cpu_fused.rotary(k, cos, sin)


def fused_kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    slot_mapping: torch.Tensor,
) -> bool:
    """k, v (T, H_kv, D) into their slots of the cache -> True: on a GPU by one rope_kv_write
    launch without rotation (quantized for an INT8 cache), on the CPU by the kv_write kernel
    (float32 or bfloat16 caches); False (nothing written) where neither applies."""
    from aieng.kernels.reference import QuantizedKVCache

    if not FUSED.usable("rope_kv_write", k, v):
        return _cpu_kv_write(k, v, kv_cache, slot_mapping)
    head_dim = k.shape[-1]
    if k.dim() != 3 or v.shape != k.shape or head_dim % 2 or head_dim > MAX_HEAD_DIM:
        return False
    if any(t.stride(2) != 1 or t.stride(1) != head_dim for t in (k, v)):
        return False
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        return False
    if any(not t.is_contiguous() or t.device != k.device for t in kv_cache):
        return False
    if isinstance(kv_cache, QuantizedKVCache):
        if kv_cache.k.dtype != torch.int8 or kv_cache.k_scale.dtype != k.dtype:
            return False
    elif kv_cache[0].dtype != k.dtype:
        return False
    from aieng.kernels.fused import kv_write

    kv_write(k, v, slot_mapping, kv_cache)
    return True


def _cpu_kv_write(
    k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor
) -> bool:
    """The CPU kv_write kernel for float32 k, v into float32 or bfloat16 caches -> True;
    False (nothing written) where it does not apply (the INT8 cache writes with torch)."""
    from aieng.kernels.reference import QuantizedKVCache

    if isinstance(kv_cache, QuantizedKVCache) or not CPU_FUSED.usable("kv_write", k, v):
        return False
    k_cache, v_cache = kv_cache
    if k_cache.dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype != k_cache.dtype:
        return False
    if k.dim() != 3 or v.shape != k.shape or k.stride(2) != 1 or v.stride(2) != 1:
        return False
    if k_cache.device.type != "cpu" or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        return False
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        return False
    from aieng.kernels import cpu_fused

    cpu_fused.kv_write(k, v, slot_mapping, k_cache, v_cache)
    return True
