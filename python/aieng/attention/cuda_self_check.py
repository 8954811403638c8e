"""The start-up check of the `cuda` attention backend, and the random steps it (and the GPU
tests and benchmarks) run on.

Before the selector hands out a `CudaPagedAttention`, each of its kernels runs, for the model's
head shape, dtype, cache dtype and sliding windows, on random paged caches of each block size in
`CHECK_BLOCK_SIZES` and the engine's own — decode batches split more than twice (a 4k context),
split with a window, short enough not to be split, planned as a captured CUDA graph plans them
(as many splits as the GPU gives a context of `GRAPH_PLAN_LEN`, up to 128, most of them past the
live contexts), and fresh, chunked and long-prefix prefills — with q, k and v views of one fused
QKV projection as the model passes them, each case twice on fresh random inputs (`REPEATS`),
against the torch reference computed in float32 over the same cache contents, each (token,
head) row within a `RowBound` (`bounds`): tight enough that one dropped position or one wrong
output dimension fails it. The checks run first in a child process (`aieng.kernels.check_child`),
so a kernel that faults costs a warning, not the engine. A kernel that cannot be compiled,
loaded or launched, faults, or disagrees, is reported by name in a warning and the engine runs
on the reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from aieng.attention.backend import AttentionBackend, AttentionInputs, KVCache, QuantizedKVCache
from aieng.attention.cuda_paged import CudaPagedAttention
from aieng.attention.torch_paged import TorchPagedAttention
from aieng.config.model_config import ModelConfig
from aieng.distributed.parallel_state import heads_per_rank, kv_heads_per_rank
from aieng.kernels.check_child import checked_names
from aieng.kernels.paged_attention import (
    DTYPE_NAMES,
    HEAD_DIMS,
    MAX_SPLITS,
    MIN_SPLIT_TOKENS,
    decode_kernel_name,
    prefill_kernel_name,
)
from aieng.kernels.self_check import Bound, RowBound, passes_check

if TYPE_CHECKING:
    from aieng.attention.layer import Attention

logger = logging.getLogger(__name__)

# Relative (norm) error against the float32 reference of the CPU kernel's check (which reuses
# these cases); the CUDA kernels are held to `bounds`, per row.
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2.5e-2}
# Queries scaled so that scores spread by about 0.5: every position's weight lies within a few
# times the mean, so dropping any one of a 4k context moves its rows past the bound.
QUERY_SCALE = 0.5
CHECK_BLOCK_SIZES = (16, 32, 128)  # below, at and above a decode tile (32 or 64 positions)
# Graph-mode decode plans: a captured graph's split-K plan covers its context bucket (up to the
# longest context the engine allows) while the live contexts are shorter, so most splits hold
# no position. Planned for this many positions, a decode gets the most splits the GPU gives it
# (at most MAX_SPLITS: MAX_SPLITS x MIN_SPLIT_TOKENS positions reach the cap).
GRAPH_PLAN_LEN = MAX_SPLITS * MIN_SPLIT_TOKENS
# Every case runs this many times, each on fresh random inputs (and a fresh output): a kernel
# that reads stale memory, or races, rarely gives the right rows twice.
REPEATS = 2
# The kernels that passed `checked_cuda_backend`'s checks, by its suite's arguments.
_PASSED: dict[tuple, frozenset[str]] = {}


def check_block_sizes(block_size: int | None = None) -> tuple[int, ...]:
    """CHECK_BLOCK_SIZES and the engine's own block size, ascending."""
    return tuple(sorted({*CHECK_BLOCK_SIZES, *((block_size,) if block_size else ())}))


def bounds(dtype: torch.dtype) -> dict[str, RowBound]:
    """Per kernel kind, each (token, head) row's bound: decode works in float32 and rounds the
    output once; prefill also rounds P (and an INT8 cache's dequantized values) to the model's
    dtype for the tensor cores."""
    return {
        "decode": RowBound.rounding(dtype, output=1, inner=1 / 8),
        "prefill": RowBound.rounding(dtype, output=1, inner=1),
    }


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


def fused_qkv(
    tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
    generator: torch.Generator, device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Random q (T, H, D), k and v (T, H_kv, D) as the model hands them to attention: views of
    one fused QKV projection's output (T, (H + 2 H_kv) D), rows strided by its width; q scaled
    by QUERY_SCALE."""
    widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    qkv = torch.randn(tokens, sum(widths), generator=generator, device=device)
    qkv[:, : widths[0]] *= QUERY_SCALE
    q, k, v = qkv.to(dtype).split(widths, dim=-1)
    return (
        q.view(tokens, heads, head_dim),
        k.view(tokens, kv_heads, head_dim),
        v.view(tokens, kv_heads, head_dim),
    )


def run_case(
    backend: AttentionBackend, layer: Attention, specs: Sequence[RequestSpec], block_size: int,
    dtype: torch.dtype, int8: bool, device: torch.device, seed: int,
    planned_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One random step through `backend` and through the float32 reference -> (got, want).
    `planned_len`: the decode rows' split-K plan made for that context, as a CUDA graph's."""
    inputs, num_blocks = random_step(specs, block_size, device, seed)
    generator = torch.Generator(device=device).manual_seed(seed)
    num_tokens = int(inputs.query_start_loc[-1])
    heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q, k, v = fused_qkv(num_tokens, heads, kv_heads, head_dim, dtype, generator, device)
    cache = random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, int8, device, generator)
    want = reference_attention(layer, q, k, v, clone_cache(cache), inputs)
    metadata = backend.build_metadata(inputs)
    if planned_len is not None and getattr(metadata, "decode", None) is not None:
        metadata.decode.planned_len = planned_len
    out = backend.forward(layer, q, k, v, cache, metadata)
    return out, want


# Decodes: one split over many positions, short ones, a block boundary, a one-token prompt.
SPLIT_DECODES = (RequestSpec(699, 1), RequestSpec(4, 1), RequestSpec(31, 1), RequestSpec(0, 1))
WHOLE_DECODES = (RequestSpec(10, 1), RequestSpec(100, 1), RequestSpec(200, 1))
# Prefills: fresh (odd length), a chunk after a cached prefix, several query tiles.
PREFILLS = (RequestSpec(0, 37), RequestSpec(50, 70), RequestSpec(0, 130))
# A 4k context alone (as many splits as the GPU allows), and with shorter ones beside it.
LONG_DECODES = (RequestSpec(4095, 1),)
MIXED_DECODES = (RequestSpec(2999, 1), RequestSpec(700, 1), RequestSpec(255, 1), RequestSpec(0, 1))
LONG_PREFILLS = (RequestSpec(3000, 70), RequestSpec(0, 3))


# Decodes planned as a captured graph plans them (for GRAPH_PLAN_LEN positions): one short
# context (nearly every split empty), and a 4k one beside a one-token prompt.
GRAPH_DECODES = ((RequestSpec(300, 1),), (RequestSpec(4095, 1), RequestSpec(0, 1)))


@dataclass(frozen=True)
class CheckCase:
    """One step a kernel kind is checked on: its requests and, for a graph-mode decode, the
    context its split-K plan is made for."""

    specs: tuple[RequestSpec, ...]
    planned_len: int | None = None


def check_cases(window: int | None) -> dict[str, tuple[CheckCase, ...]]:
    """The steps each kernel kind is checked on; with a window, contexts past it too (a split
    decode reading only the window, a prefill chunk crossing its edge)."""
    decodes = [SPLIT_DECODES, WHOLE_DECODES, LONG_DECODES, MIXED_DECODES]
    prefills = [PREFILLS, LONG_PREFILLS]
    if window is not None:
        decodes.append((RequestSpec(window + 1000, 1), RequestSpec(window, 1)))
        prefills.append((RequestSpec(window + 30, 50), RequestSpec(max(0, window - 20), 40)))
    graphs = tuple(CheckCase(specs, GRAPH_PLAN_LEN) for specs in GRAPH_DECODES)
    return {
        "decode": (*(CheckCase(specs) for specs in decodes), *graphs),
        "prefill": tuple(CheckCase(specs) for specs in prefills),
    }


def check_case(
    backend: AttentionBackend, name: str, layer: Attention, specs: Sequence[RequestSpec],
    block_size: int, dtype: torch.dtype, int8: bool, device: torch.device, seed: int,
    where: str, bound: Bound | None = None, planned_len: int | None = None,
) -> bool:  # fmt: skip
    """One random step through `backend` against the reference, within `bound` (None: the
    relative norm TOLERANCE of the CPU kernel's check); a failure (or any exception) logs a
    warning naming `name`."""
    wanted: list[torch.Tensor] = []

    def run() -> torch.Tensor:
        got, want = run_case(
            backend, layer, specs, block_size, dtype, int8, device, seed, planned_len
        )
        wanted.append(want)
        return got

    label = f"{where} (block size {block_size}, window {layer.sliding_window}"
    label += f", planned for {planned_len} positions)" if planned_len else ")"
    if bound is None:
        bound = TOLERANCE.get(dtype, 1e-5)
    return passes_check(name, run, lambda: wanted[0], bound, label)


def attention_checks(
    backend: AttentionBackend, num_heads: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, int8: bool, windows: Sequence[int | None], device: torch.device,
    block_sizes: Sequence[int] = CHECK_BLOCK_SIZES, where: str = "cuda attention self-check",
    repeats: int = REPEATS,
) -> Iterator[tuple[str, Callable[[], bool]]]:  # fmt: skip
    """(kernel name, its check) for the decode and the prefill kernel the model will use: every
    case of `check_cases`, for each window and block size, `repeats` times on fresh inputs,
    against the reference in float32."""
    from aieng.attention.layer import Attention

    supported = dtype in DTYPE_NAMES and head_dim in HEAD_DIMS
    names = {
        "decode": decode_kernel_name(dtype, int8, head_dim, num_heads // num_kv_heads)
        if supported
        else f"{backend.name} decode",
        "prefill": prefill_kernel_name(dtype, int8, head_dim)
        if supported
        else f"{backend.name} prefill",
    }
    for kind, name in names.items():

        def check(kind: str = kind, name: str = name) -> bool:
            for window in dict.fromkeys(windows):
                layer = Attention(num_heads, num_kv_heads, head_dim, 0, sliding_window=window)
                cases = check_cases(window)[kind]
                for block_size in block_sizes:
                    for repeat in range(repeats):
                        for index, case in enumerate(cases):
                            seed = index + repeat * len(cases)
                            args = (layer, case.specs, block_size, dtype, int8, device, seed)
                            bound = bounds(dtype)[kind]
                            if not check_case(backend, name, *args, where, bound, case.planned_len):
                                return False
            return True

        yield name, check


def self_check(
    backend: AttentionBackend, num_heads: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, int8: bool, windows: Sequence[int | None], device: torch.device,
    where: str = "cuda attention self-check", block_sizes: Sequence[int] = CHECK_BLOCK_SIZES,
) -> bool:  # fmt: skip
    """Every kernel the model will use, in this process, against the reference in float32;
    False (after a warning naming the kernel) at the first failure."""
    checks = attention_checks(
        backend, num_heads, num_kv_heads, head_dim, dtype, int8, windows, device, block_sizes,
        where,
    )  # fmt: skip
    return all(check() for _, check in checks)


def cuda_attention_checks(
    device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    int8: bool, windows: tuple[int | None, ...], block_sizes: tuple[int, ...],
) -> Iterator[tuple[str, Callable[[], bool]]]:  # fmt: skip
    """The check suite of `checked_cuda_backend` (run in a child process, then here): the
    backend's kernels (loaded from the compile cache after the first time) and their checks."""
    backend = CudaPagedAttention(device, dtype, int8, head_dim)
    yield from attention_checks(
        backend, num_heads, num_kv_heads, head_dim, dtype, int8, windows, backend.device,
        block_sizes,
    )  # fmt: skip


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
    config: ModelConfig, device: torch.device, dtype: torch.dtype, kv_cache_dtype: str,
    block_size: int | None = None,
) -> CudaPagedAttention | None:  # fmt: skip
    """A `CudaPagedAttention` whose kernels compiled and passed the self-check for this model
    and the engine's `block_size` (with CHECK_BLOCK_SIZES: first in a child process, then
    here), or None after a warning naming what failed."""
    block_sizes = check_block_sizes(block_size)
    int8 = kv_cache_dtype == "int8"
    try:
        backend = CudaPagedAttention(device, dtype, int8, config.head_dim)
    except Exception as error:  # NVRTC, the driver, a torch without CUDA: the reference serves
        logger.warning("cuda attention kernels unavailable, using the torch reference: %s", error)
        return None
    windows = getattr(config, "layer_sliding_windows", ()) or (config.sliding_window,)
    heads = heads_per_rank(config.num_attention_heads)  # those this tensor-parallel rank holds
    kv_heads = kv_heads_per_rank(config.num_key_value_heads)
    shape = (heads, kv_heads, config.head_dim, dtype, int8, tuple(windows))
    kernels = [name for name, _ in attention_checks(backend, *shape, backend.device)]
    args = (backend.device, *shape, tuple(block_sizes))
    if args not in _PASSED:  # once per process for each device and model shape
        _PASSED[args] = checked_names(
            cuda_attention_checks, args, isolate=True, label="cuda attention"
        )
    passed = _PASSED[args]
    if failed := [name for name in kernels if name not in passed]:
        logger.warning(
            "cuda attention kernels %s did not pass their start-up check; using the torch "
            "reference",
            ", ".join(failed),
        )
        return None
    return backend
