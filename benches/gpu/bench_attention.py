"""Decode attention on the GPU: aieng's paged kernel against the device's copy bandwidth and two
peers in the same run — the torch reference backend (`attention_backend="torch"`) and torch's
scaled_dot_product_attention over the same context stored dense (no paging, no gather).

Shapes (batch x context): 64 x 1k, 16 x 4k, 1 x 32k, Llama-3-8B's attention (32 query heads,
8 KV heads, head_dim 128), block size 16, bfloat16 and float16, model-dtype and INT8 caches.
Bytes read = every attended K and V element (and INT8 scales) once; the goal is >= 75% of the
measured device-to-device copy bandwidth (copy: 2 x bytes / time over a 2 GiB buffer, beyond L2).
Times: CUDA events around back-to-back calls queued behind a sleep kernel (GPU time, not launch
overhead), after warm-up, median of the repetitions; every shape's KV cache outgrows L2 (smallest
in bf16: 1 x 32k = 134 MB).

Prints a table and writes bench_gpu_attention.{json,md} to --out and to benches/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from aieng.attention.cuda_paged import (
    CudaPagedAttention,
    build_cuda_metadata,
    paged_cache,
)
from aieng.attention.cuda_self_check import RequestSpec, random_cache, random_step
from aieng.attention.layer import Attention
from aieng.attention.torch_paged import TorchPagedAttention

SHAPES = [(64, 1024), (16, 4096), (1, 32768)]
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
RESULTS = Path(__file__).resolve().parents[1] / "results"


def time_ms(run: Callable[[], object], inner: int = 10, reps: int = 15) -> float:
    """Median milliseconds of one `run`, by CUDA events around `inner` back-to-back calls. A
    sleep kernel queued first keeps the GPU busy while Python queues the calls, so that the
    events time the GPU's work, not the launch overhead between calls."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(4_000_000)  # ~2 ms of cycles
        start.record()
        for _ in range(inner):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy, GB/s counting bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), inner=5)
    return 2 * src.numel() / ms / 1e6


def bench_shape(
    cuda: CudaPagedAttention, batch: int, context: int, dtype: torch.dtype, int8: bool
) -> dict[str, float | int | str]:
    device = torch.device("cuda")
    specs = [RequestSpec(context - 1, 1)] * batch
    inputs, num_blocks = random_step(specs, BLOCK_SIZE, device)
    generator = torch.Generator(device=device).manual_seed(0)
    cache = random_cache(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype, int8, device, generator)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=generator, device=device).to(dtype)
    layer = Attention(HEADS, KV_HEADS, HEAD_DIM, 0)
    out = torch.empty_like(q)
    metadata = build_cuda_metadata(inputs)
    kernel_ms = time_ms(lambda: cuda.attend(layer, q, paged_cache(cache), metadata, out))

    element = 1 if int8 else dtype.itemsize
    scale_bytes = dtype.itemsize if int8 else 0
    read = 2 * batch * context * KV_HEADS * (HEAD_DIM * element + scale_bytes)

    reference = TorchPagedAttention()
    ref_meta = reference.build_metadata(inputs)
    k_new = torch.zeros(batch, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    torch_ms = time_ms(lambda: reference.forward(layer, q, k_new, k_new, cache, ref_meta), 2, 5)

    dense_k = torch.randn(batch, KV_HEADS, context, HEAD_DIM, device=device).to(dtype)
    dense_v = torch.randn_like(dense_k)
    dense_q = q[:, :, None, :]
    sdpa_ms = time_ms(
        lambda: F.scaled_dot_product_attention(dense_q, dense_k, dense_v, enable_gqa=True)
    )
    assert metadata.decode is not None
    ((plan, _),) = metadata.decode.plans.values()  # the plan the timed launches used
    return {
        "batch": batch,
        "context": context,
        "dtype": str(dtype).removeprefix("torch."),
        "cache": "int8" if int8 else "model dtype",
        "splits": plan.num_splits,
        "bytes_read": read,
        "kernel_ms": kernel_ms,
        "kernel_gbps": read / kernel_ms / 1e6,
        "torch_reference_ms": torch_ms,
        "sdpa_dense_ms": sdpa_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the tables")
    args = parser.parse_args()
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    cuda = CudaPagedAttention(torch.device("cuda"))
    rows = [
        bench_shape(cuda, batch, context, dtype, int8)
        for dtype in (torch.bfloat16, torch.float16)
        for int8 in (False, True)
        for batch, context in SHAPES
    ]
    for row in rows:
        row["of_copy_bandwidth"] = float(row["kernel_gbps"]) / bandwidth
    result = {
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "copy_gbps": bandwidth,
        "heads": [HEADS, KV_HEADS, HEAD_DIM],
        "block_size": BLOCK_SIZE,
        "rows": rows,
    }
    lines = [
        "# Paged decode attention on the GPU: aieng's kernel vs copy bandwidth and torch",
        "",
        f"GPU: {gpu}; torch {torch.__version__}, CUDA {torch.version.cuda}. Llama-3-8B attention "
        f"({HEADS} query heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}), block size "
        f"{BLOCK_SIZE}. Device-to-device copy: {bandwidth:.0f} GB/s (read + written). Median ms "
        "by CUDA events; GB/s counts the K/V bytes (and INT8 scales) read once.",
        "",
        "| batch x context | dtype | cache | splits | aieng kernel ms | GB/s | of copy bw "
        "| torch reference ms | SDPA dense ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['batch']} x {row['context']} | {row['dtype']} | {row['cache']} "
            f"| {row['splits']} | {row['kernel_ms']:.3f} | {row['kernel_gbps']:.0f} "
            f"| {row['of_copy_bandwidth']:.0%} | {row['torch_reference_ms']:.3f} "
            f"| {row['sdpa_dense_ms']:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    for folder in dict.fromkeys((args.out, RESULTS)):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "bench_gpu_attention.json").write_text(json.dumps(result, indent=2))
        (folder / "bench_gpu_attention.md").write_text(text)


if __name__ == "__main__":
    main()
