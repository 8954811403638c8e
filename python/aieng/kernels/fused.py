"""Launches of the fused element-wise kernels (`cuda/fused_ops.cu`), their pure-PyTorch
references (the model's own functions, step for step) and their start-up check.

- `add_rms_norm(x, branch, weight, eps)`: x += branch in place, returns RMSNorm(x) — the
  residual add and the next norm of a decoder layer in one pass (branch None: the norm alone);
- `rope_kv_write(q, k, v, positions, cos, sin, slot_mapping, kv_cache)`: neox RoPE on q and k in
  place, then k and v into their cache slots — quantized to INT8 with a scale per token and KV
  head when the cache is a `QuantizedKVCache` (as `write_quantized_kv_cache` does);
  `kv_write(k, v, slot_mapping, kv_cache)` is the same kernel without q and the rotation (the
  cuda attention backend's write of the step's K/V);
- `silu_and_mul(x)`: SwiGLU's silu(gate) * up over a fused [gate | up] projection.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from aieng.kernels.check_child import checked_names
from aieng.kernels.errors import KernelError
from aieng.kernels.int4 import DTYPE_NAMES
from aieng.kernels.reference import (
    KVCache,
    QuantizedKVCache,
    apply_rotary,
    rms_norm,
    write_kv_cache,
    write_quantized_kv_cache,
)
from aieng.kernels.reference import silu_and_mul_torch as silu_and_mul_reference
from aieng.kernels.self_check import Bound, Outputs, RowBound, passes_check

SOURCE = "fused_ops"
NORM_THREADS = 256  # most threads of an add_rms_norm block (fused_ops.cu's kNormThreads)
MAX_HEAD_DIM = 256  # rope_kv_write: 4 pairs per lane of a warp
ELEMENTWISE_THREADS = 256
MAX_ELEMENTWISE_BLOCKS = 65535


def _kernel(op: str, dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise KernelError(f"{op}: no kernel for {dtype}")
    return f"{op}_{DTYPE_NAMES[dtype]}"


def _launch(kernel: str, grid, block, args) -> None:
    from aieng.kernels.launch import load_module

    load_module(SOURCE).launch(kernel, grid, block, args)


# ------------------------------------------------------------------ residual add + RMSNorm


def norm_threads(hidden: int) -> int:
    """Threads of an add_rms_norm block: a whole number of warps, at most NORM_THREADS, no more
    than the row has elements (rounded up to a warp)."""
    return min(NORM_THREADS, 32 * -(-hidden // 32))


def add_rms_norm_reference(
    x: torch.Tensor,
    branch: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_in_float32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (x + branch, rms_norm(x + branch)), out of place."""
    summed = x if branch is None else x + branch
    return summed, rms_norm(summed, weight, eps, weight_in_float32)


def add_rms_norm(
    x: torch.Tensor,
    branch: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_in_float32: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (..., H) += branch in place (when given); returns the RMSNorm of the sum."""
    hidden = x.shape[-1]
    tensors = [x, weight] + ([] if branch is None else [branch])
    if any(t.dtype != x.dtype or not t.is_contiguous() for t in tensors):
        raise KernelError("add_rms_norm: x, branch and weight must be contiguous, of one dtype")
    if branch is not None and branch.shape != x.shape:
        raise KernelError(f"add_rms_norm: branch {tuple(branch.shape)} is not x's shape")
    out = torch.empty_like(x) if out is None else out
    rows = x.numel() // hidden
    args = [x, branch, weight, out, hidden, float(eps), int(weight_in_float32)]
    _launch(_kernel("add_rms_norm", x.dtype), rows, norm_threads(hidden), args)
    return out


# ------------------------------------------------------------------ RoPE + KV-cache write


def rope_kv_write_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: KVCache,
    rotate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rotated q, rotated k), out of place; writes k and v into the cache as the torch
    backend does."""
    if rotate:
        q, k = (
            apply_rotary(q, cos[positions], sin[positions]),
            apply_rotary(k, cos[positions], sin[positions]),
        )
    if isinstance(kv_cache, QuantizedKVCache):
        write_quantized_kv_cache(k, v, kv_cache, slot_mapping)
    else:
        write_kv_cache(k, v, kv_cache[0], kv_cache[1], slot_mapping)
    return q, k


def rope_grid(num_tokens: int, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """One warp per (token, head) of q, k and v."""
    return num_tokens, num_heads + 2 * num_kv_heads


def check_head_layout(name: str, x: torch.Tensor, dtype: torch.dtype) -> int:
    """x (T, heads, D) with heads contiguous and token rows `stride(0)` apart -> that stride."""
    head_dim = x.shape[2]
    if x.dtype != dtype or x.stride(2) != 1 or x.stride(1) != head_dim:
        raise KernelError(
            f"rope_kv_write: {name} must be {dtype} with contiguous heads, got {x.dtype} "
            f"strides {x.stride()}"
        )
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        raise KernelError(f"rope_kv_write: head_dim {head_dim} must be even and <= {MAX_HEAD_DIM}")
    return x.stride(0)


def rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: KVCache,
    rotate: bool = True,
) -> None:
    """q (T, H, D), k and v (T, H_kv, D) (views of one qkv projection are fine): rotates q and k
    in place by cos/sin (max_positions, D / 2) float32 at `positions` (T,) int64, then writes k
    and v to `slot_mapping` (T,) int64 of the cache (a negative slot: not written)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    strides = [check_head_layout(n, t, q.dtype) for n, t in (("q", q), ("k", k), ("v", v))]
    for name, index in (("positions", positions), ("slot_mapping", slot_mapping)):
        if index.dtype != torch.int64 or not index.is_contiguous():
            raise KernelError(f"rope_kv_write: {name} must be contiguous int64")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise KernelError("rope_kv_write: cos and sin must be float32 tables")
    args = [q, k, v, *strides, positions, slot_mapping, cos.contiguous(), sin.contiguous()]
    args += [int(rotate), *cache_args(kv_cache, q.dtype), num_heads, num_kv_heads, head_dim]
    args.append(float(torch.finfo(q.dtype).tiny))
    _launch(
        _kernel("rope_kv_write", q.dtype), rope_grid(num_tokens, num_heads, num_kv_heads), 32, args
    )


def cache_args(kv_cache: KVCache, dtype: torch.dtype) -> list[torch.Tensor | None]:
    """rope_kv_write's cache arguments: k_cache, v_cache, k_scale, v_scale (None unless INT8)."""
    quantized = isinstance(kv_cache, QuantizedKVCache)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k_scale = kv_cache.k_scale if isinstance(kv_cache, QuantizedKVCache) else None
    v_scale = kv_cache.v_scale if isinstance(kv_cache, QuantizedKVCache) else None
    cache_dtype = torch.int8 if quantized else dtype
    parts = [k_cache, v_cache] + ([k_scale, v_scale] if quantized else [])
    if any(not t.is_contiguous() for t in parts if t is not None) or k_cache.dtype != cache_dtype:
        raise KernelError(f"rope_kv_write: the cache must be contiguous {cache_dtype}")
    if k_scale is not None and k_scale.dtype != dtype:
        raise KernelError(f"rope_kv_write: INT8 cache scales must be {dtype}")
    return [k_cache, v_cache, k_scale, v_scale]


def kv_write(
    k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, kv_cache: KVCache
) -> None:
    """k and v (T, H_kv, D) into `slot_mapping` (T,) int64 of the cache (quantized to INT8 for a
    `QuantizedKVCache`), as `rope_kv_write_reference(..., rotate=False)` writes them: the same
    kernel with no q heads in its grid, so nothing is rotated and q, positions, cos and sin are
    never read."""
    num_tokens, num_kv_heads, head_dim = k.shape
    strides = [check_head_layout(n, t, k.dtype) for n, t in (("k", k), ("v", v))]
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise KernelError("kv_write: slot_mapping must be contiguous int64")
    args: list[torch.Tensor | int | float | None] = [None, k, v, 0, *strides, None, slot_mapping]
    args += [None, None, 0]  # cos, sin, rotate
    args += [*cache_args(kv_cache, k.dtype), 0, num_kv_heads, head_dim]
    args.append(float(torch.finfo(k.dtype).tiny))
    _launch(_kernel("rope_kv_write", k.dtype), rope_grid(num_tokens, 0, num_kv_heads), 32, args)


# ------------------------------------------------------------------ SiLU * mul


def elementwise_grid(elements: int) -> int:
    return max(1, min(MAX_ELEMENTWISE_BLOCKS, -(-elements // ELEMENTWISE_THREADS)))


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., 2I) = [gate | up] -> silu(gate) * up (..., I)."""
    if not x.is_contiguous() or x.shape[-1] % 2:
        raise KernelError("silu_and_mul: x must be contiguous with an even last dimension")
    inter = x.shape[-1] // 2
    rows = x.numel() // max(1, x.shape[-1])
    out = x.new_empty(*x.shape[:-1], inter) if out is None else out
    grid = elementwise_grid(rows * inter)
    args = [x, out, ctypes.c_int64(rows), inter]
    _launch(_kernel("silu_and_mul", x.dtype), grid, ELEMENTWISE_THREADS, args)
    return out


# ------------------------------------------------------------------ the start-up check


@dataclass(frozen=True)
class CheckCase:
    """One start-up check of a kernel: `run` it, run its `reference`, compare within `bound`
    (per row, `self_check.RowBound`); `label` says which shape and form it was."""

    run: Callable[[], Outputs]
    reference: Callable[[], Outputs]
    bound: Bound
    label: str


def dequantized(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """An INT8 cache's K and V as float32 values (q * scale); a float cache's K and V widened."""
    if isinstance(cache, QuantizedKVCache):
        return cache.k.float() * cache.k_scale.float(), cache.v.float() * cache.v_scale.float()
    return cache[0].float(), cache[1].float()


def check_cases(device: torch.device, dtype: torch.dtype) -> dict[str, tuple[CheckCase, ...]]:
    """Per kernel, its checks: add_rms_norm with and without a branch (the residual it writes
    in place compared too), in the float32-weight form, on rows of one warp's width and of
    several per thread; rope_kv_write into an INT8 and a model-dtype cache (the cache compared
    dequantized: one quantization step of a row may differ by rounding) for head_dim 64 and 128;
    kv_write; silu_and_mul on short and long rows."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    # The kernels compute in float32 and round once; the references round each step: two
    # roundings of the output apart.
    rounded = RowBound.rounding(dtype, output=2)
    norm_cases = []
    for rows, hidden, with_branch, in_float32 in (
        (5, 200, True, False), (3, 4160, True, False), (2, 4160, False, False),
        (5, 200, True, True), (3, 4160, True, True),
    ):  # fmt: skip
        x, weight = randn(rows, hidden), randn(hidden)
        branch = randn(rows, hidden) if with_branch else None

        def norm_run(x=x, branch=branch, weight=weight, f32=in_float32) -> Outputs:
            residual = x.clone()
            return residual, add_rms_norm(residual, branch, weight, 1e-6, f32)

        def norm_reference(x=x, branch=branch, weight=weight, f32=in_float32) -> Outputs:
            return add_rms_norm_reference(x, branch, weight, 1e-6, f32)

        form = ("with a branch" if with_branch else "alone") + (", float32 weight" * in_float32)
        norm_cases.append(
            CheckCase(norm_run, norm_reference, rounded, f"{rows} x {hidden}, {form}")
        )

    rope_cases = [
        rope_case(randn, tokens, heads, kv_heads, head_dim, device, dtype, generator)
        for tokens, heads, kv_heads, head_dim in ((6, 4, 2, 64), (5, 8, 2, 128))
    ]
    silu_cases = []
    for rows, inter in ((7, 96), (3, 1000)):
        gate_up = randn(rows, 2 * inter)
        silu_cases.append(
            CheckCase(
                lambda gate_up=gate_up: silu_and_mul(gate_up),
                lambda gate_up=gate_up: silu_and_mul_reference(gate_up),
                rounded,
                f"{rows} x {inter}",
            )
        )
    return {
        _kernel("add_rms_norm", dtype): tuple(norm_cases),
        _kernel("rope_kv_write", dtype): tuple(rope_cases),
        _kernel("silu_and_mul", dtype): tuple(silu_cases),
    }


def rope_case(
    randn: Callable[..., torch.Tensor], tokens: int, heads: int, kv_heads: int, head_dim: int,
    device: torch.device, dtype: torch.dtype, generator: torch.Generator,
) -> CheckCase:  # fmt: skip
    """RoPE + an INT8 write, then kv_write (the attention backend's use) into a model-dtype
    cache, of one fused qkv projection's views."""
    block, blocks = 4, 2 * -(-tokens // 4) + 1
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim)
    positions = torch.randint(0, 32, (tokens,), generator=generator).to(device)
    angles = torch.arange(32, dtype=torch.float32)[:, None] * torch.rand(
        head_dim // 2, generator=generator
    )
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    slots = torch.randperm(blocks * block, generator=generator)[:tokens].to(device)

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return q.view(tokens, heads, -1), k.view(tokens, kv_heads, -1), v.view(tokens, kv_heads, -1)

    def caches() -> tuple[QuantizedKVCache, tuple[torch.Tensor, torch.Tensor]]:
        shape = (blocks, block, kv_heads, head_dim)
        values = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in "kv"]
        scales = [torch.zeros(*shape[:-1], 1, dtype=dtype, device=device) for _ in "kv"]
        plain = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in "kv")
        return QuantizedKVCache(values[0], values[1], scales[0], scales[1]), plain  # type: ignore[return-value]

    def run() -> Outputs:
        q, k, v = split(qkv.clone())
        int8, plain = caches()
        rope_kv_write(q, k, v, positions, cos, sin, slots, int8)
        _, k_view, v_view = split(qkv)
        kv_write(k_view, v_view, slots, plain)
        return q, *dequantized(int8), *plain

    def reference() -> Outputs:
        q, k, v = split(qkv.clone())
        int8, plain = caches()
        q, _ = rope_kv_write_reference(q, k, v, positions, cos, sin, slots, int8)
        rope_kv_write_reference(*split(qkv), positions, cos, sin, slots, plain, rotate=False)
        return q, *dequantized(int8), *plain

    rotated = RowBound.rounding(dtype, output=2)
    # a slot's head: each value within one quantization step (1/127 of the row's largest)
    quantized = RowBound(torch.finfo(dtype).eps, 1.5 / 127)
    copied = RowBound.rounding(dtype, output=0)  # kv_write copies: exact
    bounds = (rotated, quantized, quantized, copied, copied)
    return CheckCase(
        run, reference, bounds, f"{tokens} tokens, {heads}/{kv_heads} heads of {head_dim}"
    )


def fused_checks(
    device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[str, Callable[[], bool]]]:
    """The start-up check suite (`check_child`): per kernel, all its cases pass."""
    for name, cases in check_cases(device, dtype).items():

        def check(name: str = name, cases: tuple[CheckCase, ...] = cases) -> bool:
            return all(
                passes_check(name, case.run, case.reference, case.bound, f"fused {case.label}")
                for case in cases
            )

        yield name, check


def check_fused_ops(device: torch.device, dtype: torch.dtype) -> set[str]:
    """Run each fused kernel's checks against its reference (on a CUDA device, in a child
    process first: a kernel that faults there is turned off, not run here); -> the names of
    those that pass (the others are logged, by name, as turned off)."""
    isolate = device.type == "cuda"
    return set(checked_names(fused_checks, (device, dtype), isolate, label="fused kernels'"))
