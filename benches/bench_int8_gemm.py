"""The int8 matmul (rust/src/kernels/int8_matmul.rs) against the CPU's measured `vpdpbusd` peak.

For the linear layers of the ~134M "base" model (hidden 768, MLP 2048) and of Qwen2.5-0.5B's
shape (hidden 896, 14 + 2 + 2 heads of 64, MLP 4864), and M in {1, 8, 128, 512} rows, times
`Int8Weights.matmul` (activations quantized inside the call) with
- `w8a8`: 8-bit weights, channel-wise, symmetric; one int8 term per activation;
- `w4a8`: 4-bit weights, groups of 128, asymmetric; one int8 term per activation;
- `int8x2`: the 4-bit weights with two int8 terms per activation (two dot products a weight),
and torch's float32 matmul on the same shape. A row prints the effective rate (2·M·N·K per
second) and the int8 operations executed (x 2 for `int8x2`) as a % of `_core.int8_peak_ops`,
measured at the start of the run with the same threads (the best of three). The bench uses only
the public binding, so the same command on an older checkout times the kernel it had (old
design vs new).
The table is printed with the CPU it ran on, and with `--out DIR` recorded as
DIR/bench_int8_gemm.md.

    .venv/bin/python benches/bench_int8_gemm.py [--threads 2] [--quick] [--out benches/results]
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path

import torch

from aieng import _core
from aieng.benchmarks.offline import machine
from aieng.kernels.cpu_int8 import pack_int8_weights

SHAPES = {  # name: (out_features, in_features)
    "base qkv": (2304, 768),
    "base o": (768, 768),
    "base gate_up": (4096, 768),
    "base down": (768, 2048),
    "0.5B qkv": (1152, 896),
    "0.5B o": (896, 896),
    "0.5B gate_up": (9728, 896),
    "0.5B down": (896, 4864),
}
KERNELS = {  # name: (weight bits, group size or None for channel-wise, two activation terms)
    "w8a8": (8, None, False),
    "w4a8": (4, 128, False),
    "int8x2": (4, 128, True),
}


def weights(n: int, k: int, bits: int, group: int | None) -> _core.Int8Weights:
    generator = torch.Generator().manual_seed(n + k + bits)
    groups = k // group if group else 1
    q = torch.randint(0, 1 << bits, (n, k), generator=generator)
    s = torch.rand(n, groups, generator=generator) * 0.01 + 1e-3
    if group:
        z = torch.randint(0, 1 << bits, (n, groups), generator=generator).float()
    else:
        z = torch.full((n, groups), float(1 << (bits - 1)))
    return pack_int8_weights(q, s, z, bits)


def timed(seconds: float, fn) -> float:
    """Median seconds per call of fn() over repeats filling ~seconds."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-6)
    samples = []
    for _ in range(max(3, min(500, int(seconds / once)))):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and rows, short timing")
    parser.add_argument("--out", type=Path, help="folder to record bench_int8_gemm.md in")
    args = parser.parse_args()
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    torch.set_num_threads(args.threads)
    # The best of three runs: a peak, and a busy machine only ever lowers it.
    iterations = 2_000_000 if args.quick else 20_000_000
    peaks = [_core.int8_peak_ops(args.threads, iterations) for _ in range(3)]
    peak = None if peaks[0] is None else max(peaks)
    info = machine(args.threads)
    say(f"{info['cpu']} ({info['cpu_features']}), {args.threads} threads, ISA {_core.cpu_isa()}")
    if peak is None:
        say("no AVX-512 VNNI here: rates are printed without a % of peak")
    else:
        say(f"measured vpdpbusd peak: {peak / 1e9:.1f} G int8 ops/s")
    shapes = dict(list(SHAPES.items())[::2]) if args.quick else SHAPES
    sizes = [1, 128] if args.quick else [1, 8, 128, 512]
    budget = 0.05 if args.quick else 0.5
    say(
        f"{'layer':>13} {'N x K':>10} {'M':>4} | "
        + " | ".join(f"{k:>22}" for k in KERNELS)
        + " | fp32 matmul"
    )
    for name, (n, k) in shapes.items():
        packed = {
            kernel: weights(n, k, bits, group) for kernel, (bits, group, _) in KERNELS.items()
        }
        dense = torch.randn(n, k)
        for m in sizes:
            x = torch.randn(m, k)
            out = torch.empty(m, n)
            x_np, out_np = x.numpy(), out.numpy()
            ops = 2 * m * n * k
            cells = []
            for kernel, (_, _, split) in KERNELS.items():
                w = packed[kernel]
                seconds = timed(budget, partial(w.matmul, x_np, out_np, args.threads, None, split))
                share = f"{ops * (2 if split else 1) / seconds / peak:6.1%}" if peak else "     -"
                cells.append(f"{ops / seconds / 1e9:7.1f} G/s {share} peak")
            seconds = timed(budget, partial(torch.matmul, x, dense.t(), out=out))
            cells.append(f"{ops / seconds / 1e9:7.1f} GFLOP/s")
            say(f"{name:>13} {f'{n}x{k}':>10} {m:>4} | " + " | ".join(cells))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        title = "# The int8 matmul against the measured vpdpbusd peak (benches/bench_int8_gemm.py)"
        note = "(--quick: a smoke run, not a result)" if args.quick else ""
        body = "\n".join(lines)
        (args.out / "bench_int8_gemm.md").write_text(f"{title}\n\n```\n{body}\n```\n{note}\n")


if __name__ == "__main__":
    main()
