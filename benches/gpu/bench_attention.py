"""Decode attention on the GPU: aieng's paged kernel against the device's copy bandwidth and two
peers in the same run — the torch reference backend (`attention_backend="torch"`) and torch's
scaled_dot_product_attention over the same context stored dense (no paging, no gather).

Shapes (batch x context): 64 x 1k, 16 x 4k, 1 x 32k, Llama-3-8B's attention (32 query heads,
8 KV heads, head_dim 128), block size 16, bfloat16 and float16, model-dtype and INT8 caches.
Bytes read = every attended K and V element (and INT8 scales) once; the goal is >= 75% of the
measured device-to-device copy bandwidth (copy: 2 x bytes / time over a 1 GiB buffer, beyond L2).
Times: `common.CudaTimer` (CUDA events, median); every shape's KV cache outgrows L2 (smallest in
bf16: 1 x 32k = 134 MB).

It cannot report a path that did not run: the backend comes from aieng's selector
(`attention_backend="cuda"`, which runs the start-up self-check and falls back to the torch
reference when it fails — a fallback stops the bench), and each shape's output is checked row by
row against the float32 reference before it is timed.

`--smoke`: the same steps on the CPU with the torch backend, tiny shapes and `common.SmokeTimer`
(CI runs it so that the script cannot rot); nothing is recorded in benches/results/.
Prints a table and writes bench_gpu_attention.{json,md} to --out (and benches/results/).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from common import (
    NO_GPU,
    ROW_TOLERANCE,
    CudaTimer,
    PathMismatch,
    SmokeTimer,
    Timer,
    WrongOutput,
    check_rows,
    copy_bandwidth,
    write_results,
)

from aieng.attention.backend import AttentionBackend
from aieng.attention.cuda_paged import CudaAttentionMetadata, CudaPagedAttention, paged_cache
from aieng.attention.cuda_self_check import (
    RequestSpec,
    clone_cache,
    random_cache,
    random_step,
    reference_attention,
)
from aieng.attention.layer import Attention
from aieng.attention.selector import select_attention_backend
from aieng.attention.torch_paged import TorchPagedAttention
from aieng.config.model_config import ModelConfig

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Setup:
    device: torch.device
    backend: str  # what the selector must hand out: "cuda", or "torch" in a smoke run
    timer: Timer
    heads: tuple[int, int, int]  # query heads, KV heads, head_dim
    shapes: tuple[tuple[int, int], ...]  # (batch, context)
    copy_bytes: int
    smoke: bool


GPU = Setup(
    torch.device("cuda"), "cuda", CudaTimer(), (32, 8, 128),
    ((64, 1024), (16, 4096), (1, 32768)), 1 << 30, False,
)  # fmt: skip
SMOKE = Setup(
    torch.device("cpu"), "torch", SmokeTimer(), (4, 2, 64), ((3, 40), (1, 100)), 1 << 20, True
)


def model_config(heads: tuple[int, int, int], sliding_window: int | None = None) -> ModelConfig:
    """The attention-relevant part of a model the selector checks its kernels for."""
    num_heads, num_kv_heads, head_dim = heads
    return ModelConfig(
        architecture="LlamaForCausalLM",
        model_type="llama",
        vocab_size=128256,
        hidden_size=num_heads * head_dim,
        intermediate_size=4 * num_heads * head_dim,
        num_hidden_layers=1,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        max_position_embeddings=65536,
        sliding_window=sliding_window,
    )


def selected_backend(setup: Setup, dtype: torch.dtype, int8: bool) -> AttentionBackend:
    """The selector's backend for `setup.backend`; PathMismatch when it handed out another (the
    kernels failed to compile or their start-up self-check)."""
    config = model_config(setup.heads)
    cache_dtype = "int8" if int8 else "auto"
    backend = select_attention_backend(setup.backend, config, setup.device, dtype, cache_dtype)
    if backend.name != setup.backend:
        raise PathMismatch(
            f"attention_backend {setup.backend!r} ({dtype}, {cache_dtype} cache) gave the "
            f"{backend.name!r} backend: its start-up check failed (see the warning above)"
        )
    return backend


def splits_used(metadata: object) -> int:
    """The split-K plan the timed decode launches used (the CUDA backend keeps it in the step's
    metadata); 1 for a backend that does not split."""
    if not isinstance(metadata, CudaAttentionMetadata):
        return 1
    assert metadata.decode is not None, "every request of the step decodes one token"
    ((plan, _),) = metadata.decode.plans.values()
    return plan.num_splits


def kernel_call(
    backend: AttentionBackend, layer: Attention, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, cache, metadata,
) -> Callable[[], object]:  # fmt: skip
    """What is timed: the CUDA kernels alone (the new K/V already written); the whole forward
    for a backend without that entry point."""
    if isinstance(backend, CudaPagedAttention):
        out, paged = torch.empty_like(q), paged_cache(cache)
        return lambda: backend.attend(layer, q, paged, metadata, out)
    return lambda: backend.forward(layer, q, k, v, cache, metadata)


def bench_shape(
    setup: Setup, backend: AttentionBackend, batch: int, context: int, dtype: torch.dtype,
    int8: bool,
) -> dict[str, float | int | str]:  # fmt: skip
    heads, kv_heads, head_dim = setup.heads
    device, timer = setup.device, setup.timer
    specs = [RequestSpec(context - 1, 1)] * batch
    inputs, num_blocks = random_step(specs, BLOCK_SIZE, device)
    generator = torch.Generator(device=device).manual_seed(context + batch)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device).to(dtype)

    cache = random_cache(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype, int8, device, generator)
    q = randn(batch, heads, head_dim)
    k, v = randn(batch, kv_heads, head_dim), randn(batch, kv_heads, head_dim)
    layer = Attention(heads, kv_heads, head_dim, 0)
    label = f"{batch} x {context} {dtype} {'int8' if int8 else 'model-dtype'} cache"

    want = reference_attention(layer, q, k, v, clone_cache(cache), inputs)
    metadata = backend.build_metadata(inputs)
    got = backend.forward(layer, q, k, v, cache, metadata)  # writes the new K/V, as a step does
    worst = check_rows(got.float(), want, ROW_TOLERANCE[dtype], label)
    kernel_ms = timer.time_ms(kernel_call(backend, layer, q, k, v, cache, metadata))

    element = 1 if int8 else dtype.itemsize
    scale_bytes = dtype.itemsize if int8 else 0
    read = 2 * batch * context * kv_heads * (head_dim * element + scale_bytes)

    reference = TorchPagedAttention()
    ref_meta = reference.build_metadata(inputs)
    torch_ms = timer.scaled(inner=2, reps=5).time_ms(
        lambda: reference.forward(layer, q, k, v, cache, ref_meta)
    )
    dense_k = randn(batch, kv_heads, context, head_dim)
    dense_v = randn(batch, kv_heads, context, head_dim)
    dense_q = q[:, :, None, :]
    sdpa_ms = timer.time_ms(
        lambda: F.scaled_dot_product_attention(dense_q, dense_k, dense_v, enable_gqa=True)
    )
    splits = splits_used(metadata)
    return {
        "batch": batch,
        "context": context,
        "dtype": str(dtype).removeprefix("torch."),
        "cache": "int8" if int8 else "model dtype",
        "backend": backend.name,
        "splits": splits,
        "worst_row_error": worst,
        "bytes_read": read,
        "kernel_ms": kernel_ms,
        "kernel_gbps": read / kernel_ms / 1e6,
        "torch_reference_ms": torch_ms,
        "sdpa_dense_ms": sdpa_ms,
    }


def markdown(result: dict) -> str:
    heads, kv_heads, head_dim = result["heads"]
    lines = [
        "# Paged decode attention on the GPU: aieng's kernel vs copy bandwidth and torch",
        "",
        f"Device: {result['device']}; torch {result['torch']}, CUDA {result['cuda']}. "
        f"{heads} query heads, {kv_heads} KV heads, head_dim {head_dim}, block size "
        f"{BLOCK_SIZE}. Device-to-device copy: {result['copy_gbps']:.0f} GB/s (read + written). "
        "Median ms by CUDA events; GB/s counts the K/V bytes (and INT8 scales) read once. Every "
        "output checked row by row against the float32 reference before timing.",
        "",
        "| batch x context | dtype | cache | backend | splits | worst row error "
        "| aieng kernel ms | GB/s | of copy bw | torch reference ms | SDPA dense ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['batch']} x {row['context']} | {row['dtype']} | {row['cache']} "
            f"| {row['backend']} | {row['splits']} | {row['worst_row_error']:.1e} "
            f"| {row['kernel_ms']:.3f} | {row['kernel_gbps']:.0f} "
            f"| {row['of_copy_bandwidth']:.0%} | {row['torch_reference_ms']:.3f} "
            f"| {row['sdpa_dense_ms']:.3f} |"
        )
    if result["smoke"]:
        lines += ["", "Smoke run on the CPU: the times are one call each and mean nothing."]
    return "\n".join(lines) + "\n"


def run(setup: Setup) -> dict:
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(setup.timer, setup.device, setup.copy_bytes)
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for int8 in (False, True):
            backend = selected_backend(setup, dtype, int8)
            for batch, context in setup.shapes:
                rows.append(bench_shape(setup, backend, batch, context, dtype, int8))
                print(rows[-1], flush=True)
    for row in rows:
        row["of_copy_bandwidth"] = float(row["kernel_gbps"]) / bandwidth
    return {
        "device": torch.cuda.get_device_name() if setup.device.type == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "copy_gbps": bandwidth,
        "heads": list(setup.heads),
        "block_size": BLOCK_SIZE,
        "smoke": setup.smoke,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the tables")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of every step")
    args = parser.parse_args(argv)
    setup = SMOKE if args.smoke else GPU
    if not setup.smoke and not torch.cuda.is_available():
        print(
            f"bench_attention: {NO_GPU}",
            file=sys.stderr,
        )
        return 2
    try:
        result = run(setup)
    except (PathMismatch, WrongOutput) as error:
        print(f"bench_attention: FAILED: {error}", file=sys.stderr)
        return 1
    table = markdown(result)
    print(table)
    write_results("bench_gpu_attention", result, table, args.out, record=not setup.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
