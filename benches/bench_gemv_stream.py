"""Where one-stream decode's bandwidth goes: the W4A8 / W8A8 GEMV (M = 1) with its weights in
the caches against the same GEMV streaming them from memory, beside torch.sum reading the same
bytes (the read-bandwidth limit `bench_cpu_peers.py` divides by), in one run.

For each layer shape (Qwen2.5-1.5B's gate_up and down, the base model's gate_up) and kernel:
- `cached`: one packed matrix (a few MB: it fits the L3) multiplied again and again;
- `streamed`: distinct matrices of the same shape totalling STREAM_BYTES, each read once a pass
  (what a decode step does: every weight once);
- `torch.sum`: a float32 tensor of STREAM_BYTES summed, its default threads (the limit), on
  ordinary 4 KiB pages, as the engine's weights are.
Rates are weight bytes (packed data and scales) per second, best of REPS passes. If `cached` is
well above `streamed`, the kernel's arithmetic is not what bounds decode: the memory is; the
`streamed / torch.sum` column is the GEMV's share of the read bandwidth the machine gave in
that minute.

    .venv/bin/python benches/bench_gemv_stream.py [--threads 2] [--quick] [--out benches/results]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from bench_int8_gemm import weights

from aieng import _core
from aieng.benchmarks.offline import machine

SHAPES = {  # name: (out_features, in_features)
    "1.5B gate_up": (17920, 1536),
    "1.5B down": (1536, 8960),
    "base gate_up": (4096, 768),
}
KERNELS = {"w4a8": (4, 128), "w8a8": (8, None)}  # bits, group (None: per channel)
STREAM_BYTES = 512 << 20
REPS = 3


def gemv_rate(matrices: list, threads: int, passes: int, reps: int) -> float:
    """Weight bytes a second of x (1, K) @ W^T, `passes` passes over `matrices`, best of reps."""
    k, n = matrices[0].in_features, matrices[0].out_features
    x = np.random.default_rng(0).standard_normal((1, k)).astype(np.float32)
    y = np.empty((1, n), np.float32)
    for w in matrices:
        w.matmul(x, y, threads, None, False)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(passes):
            for w in matrices:
                w.matmul(x, y, threads, None, False)
        best = min(best, time.perf_counter() - start)
    return sum(w.nbytes for w in matrices) * passes / best


def sum_rate(tensor: torch.Tensor, reps: int) -> float:
    tensor.sum()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        tensor.sum()
        best = min(best, time.perf_counter() - start)
    return tensor.numel() * tensor.element_size() / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one shape, 128 MiB streamed, 2 reps")
    ap.add_argument("--out", type=Path, help="folder to record bench_gemv_stream.md in")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    stream_bytes = (128 << 20) if args.quick else STREAM_BYTES
    reps = 2 if args.quick else REPS
    shapes = dict(list(SHAPES.items())[:1]) if args.quick else SHAPES
    info = machine(args.threads)
    lines = [
        "# Decode's GEMV: weights in the caches vs streamed from memory "
        "(benches/bench_gemv_stream.py)",
        "",
        f"{info['cpu']} ({info['cpu_features']}), {args.threads} threads, ISA "
        f"{_core.cpu_isa()}; streamed: {stream_bytes >> 20} MiB of distinct matrices a pass; "
        f"best of {reps}. GB/s of weight bytes (packed data and scales).",
        "",
        "| layer | N x K | kernel | MB | cached GB/s | streamed GB/s | torch.sum GB/s "
        "(same bytes) | streamed / torch.sum | cached / streamed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for name, (n, k) in shapes.items():
        for kernel, (bits, group) in KERNELS.items():
            one = weights(n, k, bits, group)
            cached = gemv_rate(
                [one], args.threads, passes=max(1, (64 << 20) // one.nbytes), reps=reps
            )
            count = max(2, stream_bytes // one.nbytes)
            matrices = [one] + [weights(n, k, bits, group) for _ in range(count - 1)]
            streamed = gemv_rate(matrices, args.threads, passes=1, reps=reps)
            total = sum(w.nbytes for w in matrices)
            del matrices
            floats = torch.randn(total // 4)
            limit = sum_rate(floats, reps)
            del floats
            row = (
                f"| {name} | {n}x{k} | {kernel} | {one.nbytes / 1e6:.1f} | {cached / 1e9:.1f} | "
                f"{streamed / 1e9:.1f} | {limit / 1e9:.1f} | {streamed / limit:.0%} | "
                f"{cached / streamed:.2f} |"
            )
            print(row, flush=True)
            lines.append(row)
    if args.quick:
        lines.append("\n(--quick: a smoke run, not a result)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_gemv_stream.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
