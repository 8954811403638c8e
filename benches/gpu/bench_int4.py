"""The fused INT4 dequant-matmul kernels on the GPU, against the device's copy bandwidth and torch's
float16 matmul on the dequantized weights, in the same run.

1. GEMV at M = 1 for Llama-3-8B's MLP and attention shapes, (N, K) = (4096, 4096),
   (14336, 4096) and (4096, 14336): bytes read (packed weights, float16 scale/zero pairs, x, y)
   over the kernel's time, as a fraction of the measured device-to-device copy bandwidth (goal
   >= 70%). Weights rotate over enough copies to exceed the L2 cache several times.
2. Latency for M = 1 ... 256 at each shape: the path aieng picks (GEMV up to M = 16, then the
   tensor-core GEMM), each path forced, and torch's float16 `F.linear` on the dequantized weight
   (goal: M <= 16 within 1.25x of M = 1).
Times: CUDA events after warm-up, median of the runs (bench_attention's timer and copy).

Prints the tables and writes bench_gpu_int4.{json,md} to --out and to benches/results/.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (N out_features, K in_features)
M_VALUES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
GROUP_SIZE = 128
L2_MULTIPLE = 4  # rotated weights hold at least this many L2 caches
RESULTS = Path(__file__).resolve().parents[1] / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the tables")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--runs", type=int, default=50, help="timed runs per measurement")
    return parser.parse_args(argv)


def random_weights(n: int, k: int, copies: int, device: torch.device):
    from aieng.kernels.int4 import repack

    generator = torch.Generator(device=device).manual_seed(n + k)
    out = []
    for _ in range(copies):
        q = torch.randint(0, 16, (n, k), generator=generator, device=device, dtype=torch.int32)
        scales = torch.rand(n, k // GROUP_SIZE, generator=generator, device=device) * 0.01 + 1e-3
        zeros = torch.randint(0, 16, (n, k // GROUP_SIZE), generator=generator, device=device)
        out.append(repack(q, scales, zeros.float()))
    return out


def rotating(run_one, count: int):
    """A callable that runs `run_one(i)` for i = 0, 1, ... count - 1, 0, ... on each call."""
    state = {"i": 0}

    def run() -> object:
        state["i"] = (state["i"] + 1) % count
        return run_one(state["i"])

    return run


def bench_shape(n: int, k: int, dtype: torch.dtype, runs: int, l2_bytes: int) -> dict:
    from bench_attention import time_ms

    from aieng.kernels.int4 import choose_path, dequantize_weights, int4_matmul

    device = torch.device("cuda")
    weight_bytes = n * k // 2 + n * (k // GROUP_SIZE) * 4
    copies = max(2, -(-L2_MULTIPLE * l2_bytes // weight_bytes))
    weights = random_weights(n, k, copies, device)
    dense_copies = max(2, -(-L2_MULTIPLE * l2_bytes // (2 * n * k)))
    dense = [dequantize_weights(weights[i % copies]).half() for i in range(dense_copies)]
    rows = {}
    for m in M_VALUES:
        x = torch.randn(m, k, device=device, dtype=dtype)
        x16 = x.to(torch.float16)
        row = {"M": m, "path": choose_path(m, dtype)}
        for path in ("gemv", "gemm"):

            def run(i: int, path: str = path, x: torch.Tensor = x) -> object:
                return int4_matmul(x, weights[i], path)

            row[f"{path}_ms"] = time_ms(rotating(run, copies), runs=runs)
        row["aieng_ms"] = row[f"{row['path']}_ms"]
        row["torch_fp16_ms"] = time_ms(
            rotating(lambda i, x16=x16: F.linear(x16, dense[i]), len(dense)), runs=runs
        )
        rows[m] = row
    moved = weight_bytes + (n + k) * dtype.itemsize
    return {
        "N": n,
        "K": k,
        "gemv_m1_ms": rows[1]["gemv_ms"],
        "gemv_m1_gb_s": moved / rows[1]["gemv_ms"] / 1e6,
        "latency": list(rows.values()),
    }


def markdown(result: dict) -> str:
    lines = [
        f"INT4 dequant-matmul on {result['device']} ({result['dtype']}, group {GROUP_SIZE}); "
        f"copy bandwidth {result['copy_gb_s']:.0f} GB/s",
        "",
        "| N x K | GEMV M=1 ms | GB/s | % of copy (goal >= 70) |",
        "|---|---|---|---|",
    ]
    for shape in result["shapes"]:
        share = 100 * shape["gemv_m1_gb_s"] / result["copy_gb_s"]
        lines.append(
            f"| {shape['N']} x {shape['K']} | {shape['gemv_m1_ms']:.4f} | "
            f"{shape['gemv_m1_gb_s']:.0f} | {share:.0f}% |"
        )
    for shape in result["shapes"]:
        base = shape["latency"][0]["aieng_ms"]
        lines += [
            "",
            f"Latency, N x K = {shape['N']} x {shape['K']} (goal: M <= 16 within 1.25x of M=1)",
            "",
            "| M | path | aieng ms | x M=1 | gemv ms | gemm ms | torch fp16 ms | aieng / torch |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in shape["latency"]:
            lines.append(
                f"| {row['M']} | {row['path']} | {row['aieng_ms']:.4f} | "
                f"{row['aieng_ms'] / base:.2f} | {row['gemv_ms']:.4f} | {row['gemm_ms']:.4f} | "
                f"{row['torch_fp16_ms']:.4f} | {row['aieng_ms'] / row['torch_fp16_ms']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_int4: needs an NVIDIA GPU (CUDA); nothing measured", file=sys.stderr)
        return 2
    from bench_attention import copy_bandwidth

    dtype = getattr(torch, args.dtype)
    properties = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(properties, "L2_cache_size", 50 << 20)
    result = {
        "device": torch.cuda.get_device_name(),
        "dtype": args.dtype,
        "copy_gb_s": copy_bandwidth(),
        "shapes": [bench_shape(n, k, dtype, args.runs, l2_bytes) for n, k in SHAPES],
    }
    table = markdown(result)
    print(table)
    for folder in filter(None, (args.out, RESULTS)):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "bench_gpu_int4.json").write_text(json.dumps(result, indent=1))
        (folder / "bench_gpu_int4.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
