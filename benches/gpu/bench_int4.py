"""The fused INT4 dequant-matmul kernels on the GPU, against the device's copy bandwidth and torch's
float16 matmul on the dequantized weights, in the same run.

1. GEMV at M = 1 for Llama-3-8B's MLP and attention shapes, (N, K) = (4096, 4096),
   (14336, 4096) and (4096, 14336): bytes read (packed weights, float16 scale/zero pairs, x, y)
   over the kernel's time, as a fraction of the measured device-to-device copy bandwidth (goal
   >= 70%). Weights rotate over enough copies to exceed the L2 cache several times.
2. Latency for M = 1 ... 256 at each shape: the path aieng picks (GEMV up to M = 16, then the
   tensor-core GEMM), each path forced, and torch's float16 `F.linear` on the dequantized weight
   (goal: M <= 16 within 1.25x of M = 1).
Times: `common.CudaTimer` (CUDA events after warm-up, median of the repetitions).

It cannot report a path that did not run: each (shape, M, path) output is checked row by row
against the float32 reference (`aieng.kernels.int4.reference_matmul`) before it is timed, within
the tolerance of the engine's own start-up check.

`--smoke`: the same steps on the CPU, tiny shapes, the kernels' host emulations in place of the
kernels (`gemv_reference` for the GEMV, `reference_matmul` for the GEMM) and `common.SmokeTimer`
(CI runs it so that the script cannot rot); nothing is recorded in benches/results/.
Prints the tables and writes bench_gpu_int4.{json,md} to --out (and benches/results/).
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
    SmokeTimer,
    Timer,
    WrongOutput,
    check_rows,
    copy_bandwidth,
    write_results,
)

from aieng.kernels.int4 import (
    Int4Weights,
    choose_path,
    dequantize_weights,
    gemv_reference,
    int4_matmul,
    reference_matmul,
    repack,
)

GROUP_SIZE = 128
Int4Matmul = Callable[[torch.Tensor, Int4Weights, str], torch.Tensor]


def host_emulation(x: torch.Tensor, weights: Int4Weights, path: str) -> torch.Tensor:
    """The smoke run's stand-in for `int4_matmul`: each kernel's algebra in torch on the CPU."""
    if path == "gemv":
        return gemv_reference(x, weights).to(x.dtype)
    return reference_matmul(x, weights)


@dataclass(frozen=True)
class Setup:
    device: torch.device
    matmul: Int4Matmul
    timer: Timer
    shapes: tuple[tuple[int, int], ...]  # (N out_features, K in_features)
    m_values: tuple[int, ...]
    l2_multiple: int  # rotated weights hold at least this many L2 caches
    copy_bytes: int
    smoke: bool


GPU = Setup(
    torch.device("cuda"), int4_matmul, CudaTimer(inner=10, reps=15),
    ((4096, 4096), (14336, 4096), (4096, 14336)), (1, 2, 4, 8, 16, 32, 64, 128, 256), 4,
    1 << 30, False,
)  # fmt: skip
SMOKE = Setup(
    torch.device("cpu"), host_emulation, SmokeTimer(), ((96, 256), (64, 384)), (1, 3, 17), 1,
    1 << 20, True,
)  # fmt: skip


def random_weights(n: int, k: int, copies: int, device: torch.device) -> list[Int4Weights]:
    generator = torch.Generator(device=device).manual_seed(n + k)
    out = []
    for _ in range(copies):
        q = torch.randint(0, 16, (n, k), generator=generator, device=device, dtype=torch.int32)
        scales = torch.rand(n, k // GROUP_SIZE, generator=generator, device=device) * 0.01 + 1e-3
        zeros = torch.randint(0, 16, (n, k // GROUP_SIZE), generator=generator, device=device)
        out.append(repack(q, scales, zeros.float()))
    return out


def rotating(run_one: Callable[[int], object], count: int) -> Callable[[], object]:
    """A callable that runs `run_one(i)` for i = 1, 2, ... count - 1, 0, 1, ... on each call."""
    state = {"i": 0}

    def run() -> object:
        state["i"] = (state["i"] + 1) % count
        return run_one(state["i"])

    return run


def bench_shape(setup: Setup, n: int, k: int, dtype: torch.dtype, l2_bytes: int) -> dict:
    device, timer = setup.device, setup.timer
    weight_bytes = n * k // 2 + n * (k // GROUP_SIZE) * 4
    copies = max(2, -(-setup.l2_multiple * l2_bytes // weight_bytes))
    weights = random_weights(n, k, copies, device)
    dense_copies = max(2, -(-setup.l2_multiple * l2_bytes // (2 * n * k)))
    dense = [dequantize_weights(weights[i % copies]).half() for i in range(dense_copies)]
    generator = torch.Generator(device=device).manual_seed(k)
    tolerance = ROW_TOLERANCE[dtype]
    rows = []
    for m in setup.m_values:
        x = torch.randn(m, k, generator=generator, device=device).to(dtype)
        x16 = x.to(torch.float16)
        path = choose_path(m, dtype)
        if path is None:
            raise WrongOutput(f"no INT4 kernel path takes M = {m} in {dtype}")
        row: dict = {"M": m, "path": path}
        want = reference_matmul(x.float(), weights[0])
        for kernel in ("gemv", "gemm"):
            label = f"{kernel} {n} x {k} M={m} {dtype}"
            got = setup.matmul(x, weights[0], kernel).float()
            row[f"{kernel}_error"] = check_rows(got, want, tolerance, label)

            def run(i: int, kernel: str = kernel, x: torch.Tensor = x) -> object:
                return setup.matmul(x, weights[i], kernel)

            row[f"{kernel}_ms"] = timer.time_ms(rotating(run, copies))
        row["aieng_ms"] = row[f"{path}_ms"]
        row["torch_fp16_ms"] = timer.time_ms(
            rotating(lambda i, x16=x16: F.linear(x16, dense[i]), len(dense))
        )
        rows.append(row)
        print({"N": n, "K": k, **row}, flush=True)
    moved = weight_bytes + (n + k) * dtype.itemsize
    return {
        "N": n,
        "K": k,
        "gemv_m1_ms": rows[0]["gemv_ms"],
        "gemv_m1_gb_s": moved / rows[0]["gemv_ms"] / 1e6,
        "latency": rows,
    }


def markdown(result: dict) -> str:
    lines = [
        f"INT4 dequant-matmul on {result['device']} ({result['dtype']}, group {GROUP_SIZE}); "
        f"copy bandwidth {result['copy_gb_s']:.0f} GB/s. Every output checked row by row "
        "against the float32 reference before timing.",
        "",
        f"| N x K | GEMV M={result['shapes'][0]['latency'][0]['M']} ms | GB/s "
        "| % of copy (goal >= 70) |",
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
            "| M | path | aieng ms | x M=1 | gemv ms | gemm ms | torch fp16 ms | aieng / torch "
            "| worst row error gemv / gemm |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in shape["latency"]:
            lines.append(
                f"| {row['M']} | {row['path']} | {row['aieng_ms']:.4f} | "
                f"{row['aieng_ms'] / base:.2f} | {row['gemv_ms']:.4f} | {row['gemm_ms']:.4f} | "
                f"{row['torch_fp16_ms']:.4f} | {row['aieng_ms'] / row['torch_fp16_ms']:.2f} | "
                f"{row['gemv_error']:.1e} / {row['gemm_error']:.1e} |"
            )
    if result["smoke"]:
        lines += ["", "Smoke run on the CPU (host emulations): the times mean nothing."]
    return "\n".join(lines) + "\n"


def run(setup: Setup, dtype: torch.dtype) -> dict:
    if setup.device.type == "cuda":
        properties = torch.cuda.get_device_properties(setup.device)
        l2_bytes = getattr(properties, "L2_cache_size", 60 << 20)  # an H200's, where unknown
        device_name = torch.cuda.get_device_name()
    else:
        l2_bytes, device_name = 1 << 16, "cpu (smoke)"
    return {
        "device": device_name,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "smoke": setup.smoke,
        "copy_gb_s": copy_bandwidth(setup.timer, setup.device, setup.copy_bytes),
        "shapes": [bench_shape(setup, n, k, dtype, l2_bytes) for n, k in setup.shapes],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the tables")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of every step")
    args = parser.parse_args(argv)
    setup = SMOKE if args.smoke else GPU
    if not setup.smoke and not torch.cuda.is_available():
        print(
            f"bench_int4: {NO_GPU}",
            file=sys.stderr,
        )
        return 2
    try:
        result = run(setup, getattr(torch, args.dtype))
    except WrongOutput as error:
        print(f"bench_int4: FAILED: {error}", file=sys.stderr)
        return 1
    table = markdown(result)
    print(table)
    write_results("bench_gpu_int4", result, table, args.out, record=not setup.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
