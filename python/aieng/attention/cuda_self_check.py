"""The start-up check of the `cuda` attention backend, and the random steps it (and the GPU
tests and benchmarks) run on.

Before the selector hands out a `CudaPagedAttention`, each of its kernels runs once, for the
model's head shape, dtype, cache dtype and sliding windows, on small random paged caches
(block sizes 16 and 32) — a decode batch long enough to be split, one short enough not to be,
and fresh and chunked prefills — against the torch reference computed in float32 over the same
cache contents. A kernel that cannot be compiled, loaded or launched, or that disagrees, is
reported by name in a warning and the engine runs on the reference instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from aieng.attention.backend import AttentionBackend, AttentionInputs, KVCache, QuantizedKVCache
from aieng.attention.cuda_paged import CudaPagedAttention
from aieng.attention.torch_paged import TorchPagedAttention
from aieng.config import ModelConfig
from aieng.distributed.parallel_state import heads_per_rank, kv_heads_per_rank
from aieng.kernels.paged_attention import (
    DTYPE_NAMES,
    HEAD_DIMS,
    decode_kernel_name,
    prefill_kernel_name,
)
from aieng.kernels.self_check import passes_check

if TYPE_CHECKING:
    from aieng.attention.layer import Attention

logger = logging.getLogger(__name__)

# Relative (norm) error of a kernel's output against the float32 reference: the kernels round
# P (prefill), dequantized INT8 values (prefill) and the output to the model's dtype.
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2.5e-2}


@dataclass(frozen=True)
class RequestSpec:
    """One request of a step: `computed` positions already cached, `new` tokens this step."""

    computed: int
    new: int


def random_step(
    specs: Sequence[RequestSpec], block_size: int, device: torch.device, seed: int = 0
) -> tuple[AttentionInputs, int]:
    """A step over disjoint, shuffled blocks (block 0 left as the tables' padding) -> (inputs,
    number of blocks the cache needs)."""
    rng = np.random.default_rng(seed)
    counts = [-(-(s.computed + s.new) // block_size) for s in specs]
    num_blocks = sum(counts) + 1
    order = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(specs), max(counts) + 1), np.int32)  # a padding column, as the core's
    slots = []
    used = 0
    for r, (spec, count) in enumerate(zip(specs, counts, strict=True)):
        tables[r, :count] = order[used : used + count]
        used += count
        positions = np.arange(spec.computed, spec.computed + spec.new)
        slots.append(tables[r, positions // block_size].astype(np.int64) * block_size)
        slots[-1] += positions % block_size
    query_lens = np.array([s.new for s in specs], np.int64)
    inputs = AttentionInputs(
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device),
        query_start_loc=np.concatenate([[0], np.cumsum(query_lens)]),
        num_computed_tokens=np.array([s.computed for s in specs], np.int64),
        seq_lens=np.array([s.computed + s.new for s in specs], np.int64),
        block_tables=tables,
        block_size=block_size,
    )
    return inputs, num_blocks


def random_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    int8: bool, device: torch.device, generator: torch.Generator,
) -> KVCache:  # fmt: skip
    """A cache full of random values (so that reading a wrong slot shows)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if not int8:
        return tuple(  # type: ignore[return-value]
            torch.randn(shape, generator=generator, device=device).to(dtype) for _ in range(2)
        )
    values = [
        torch.randint(-127, 128, shape, generator=generator, device=device, dtype=torch.int8)
        for _ in range(2)
    ]
    scales = [
        (0.005 + 0.02 * torch.rand((*shape[:3], 1), generator=generator, device=device)).to(dtype)
        for _ in range(2)
    ]
    return QuantizedKVCache(values[0], values[1], scales[0], scales[1])


def clone_cache(cache: KVCache) -> KVCache:
    if isinstance(cache, QuantizedKVCache):
        return QuantizedKVCache(*(t.clone() for t in cache))
    return (cache[0].clone(), cache[1].clone())


def reference_attention(
    layer: Attention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache,
    inputs: AttentionInputs,
) -> torch.Tensor:
    """The torch reference in float32 over the same cache contents -> (T, H, D) float32. An INT8
    cache keeps its int8 values and scales (the new K/V quantized exactly as the kernel backend
    quantizes them; dequantized products exact in float32); a float cache is widened."""
    reference = TorchPagedAttention(sliding_windows=(layer.sliding_window,))
    metadata = reference.build_metadata(inputs)
    wide: KVCache
    if isinstance(cache, QuantizedKVCache):
        wide = clone_cache(cache)
    else:
        wide = (cache[0].float(), cache[1].float())
    return reference.forward(layer, q.float(), k.float(), v.float(), wide, metadata)


def run_case(
    backend: AttentionBackend, layer: Attention, specs: Sequence[RequestSpec], block_size: int,
    dtype: torch.dtype, int8: bool, device: torch.device, seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One random step through `backend` and through the float32 reference -> (got, want)."""
    inputs, num_blocks = random_step(specs, block_size, device, seed)
    generator = torch.Generator(device=device).manual_seed(seed)
    num_tokens = int(inputs.query_start_loc[-1])
    heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device).to(dtype)

    q = randn(num_tokens, heads, head_dim)
    k, v = randn(num_tokens, kv_heads, head_dim), randn(num_tokens, kv_heads, head_dim)
    cache = random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, int8, device, generator)
    want = reference_attention(layer, q, k, v, clone_cache(cache), inputs)
    out = backend.forward(layer, q, k, v, cache, backend.build_metadata(inputs))
    return out, want


# Decodes: one split over many positions, short ones, a block boundary, a one-token prompt.
SPLIT_DECODES = (RequestSpec(699, 1), RequestSpec(4, 1), RequestSpec(31, 1), RequestSpec(0, 1))
WHOLE_DECODES = (RequestSpec(10, 1), RequestSpec(100, 1), RequestSpec(200, 1))
# Prefills: fresh (odd length), a chunk after a cached prefix, several query tiles.
PREFILLS = (RequestSpec(0, 37), RequestSpec(50, 70), RequestSpec(0, 130))


def check_case(
    backend: AttentionBackend, name: str, layer: Attention, specs: Sequence[RequestSpec],
    block_size: int, dtype: torch.dtype, int8: bool, device: torch.device, seed: int,
    where: str,
) -> bool:  # fmt: skip
    """One random step through `backend` against the reference, within TOLERANCE; a failure
    (or any exception) logs a warning naming `name`."""
    wanted: list[torch.Tensor] = []

    def run() -> torch.Tensor:
        got, want = run_case(backend, layer, specs, block_size, dtype, int8, device, seed)
        wanted.append(want)
        return got

    label = f"{where} (block size {block_size}, window {layer.sliding_window})"
    return passes_check(name, run, lambda: wanted[0], TOLERANCE.get(dtype, 1e-5), label)


def self_check(
    backend: AttentionBackend, num_heads: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, int8: bool, windows: Sequence[int | None], device: torch.device,
    where: str = "cuda attention self-check",
) -> bool:  # fmt: skip
    """Every kernel the model will use, once per block size and window, against the reference
    in float32; False (after a warning naming the kernel) at the first failure."""
    from aieng.attention.layer import Attention

    supported = dtype in DTYPE_NAMES and head_dim in HEAD_DIMS
    kernels = {
        decode_kernel_name(dtype, int8, head_dim, num_heads // num_kv_heads)
        if supported
        else f"{backend.name} decode": (SPLIT_DECODES, WHOLE_DECODES),
        prefill_kernel_name(dtype, int8, head_dim) if supported else f"{backend.name} prefill": (
            PREFILLS,
        ),
    }
    for name, cases in kernels.items():
        for window in dict.fromkeys(windows):
            layer = Attention(num_heads, num_kv_heads, head_dim, 0, sliding_window=window)
            for block_size in (16, 32):
                for seed, specs in enumerate(cases):
                    args = (layer, specs, block_size, dtype, int8, device, seed, where)
                    if not check_case(backend, name, *args):
                        return False
    return True


def cuda_unsupported_reason(
    config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> str | None:
    """Why the cuda backend cannot serve this model here, or None when it can."""
    if device.type != "cuda" or torch.version.hip is not None:
        return f"it runs on NVIDIA GPUs only (device {device})"
    if dtype not in DTYPE_NAMES:
        return f"its kernels take float16 or bfloat16, not {dtype}"
    if config.head_dim not in HEAD_DIMS:
        return f"its kernels take head_dim 64 or 128, not {config.head_dim}"
    if config.num_attention_heads % config.num_key_value_heads:
        return "the query heads are not a multiple of the KV heads"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "its kernels do not soft-cap attention scores"
    return None


def checked_cuda_backend(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, kv_cache_dtype: str
) -> CudaPagedAttention | None:
    """A `CudaPagedAttention` whose kernels compiled and passed the self-check for this model,
    or None after a warning naming what failed."""
    try:
        backend = CudaPagedAttention(device, dtype, kv_cache_dtype == "int8", config.head_dim)
    except Exception as error:  # NVRTC, the driver, a torch without CUDA: the reference serves
        logger.warning("cuda attention kernels unavailable, using the torch reference: %s", error)
        return None
    windows = getattr(config, "layer_sliding_windows", ()) or (config.sliding_window,)
    ok = self_check(  # on the heads this tensor-parallel rank's layers hold
        backend,
        heads_per_rank(config.num_attention_heads),
        kv_heads_per_rank(config.num_key_value_heads),
        config.head_dim,
        dtype,
        kv_cache_dtype == "int8",
        windows,
        backend.device,
    )
    return backend if ok else None
