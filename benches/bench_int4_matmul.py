"""The CPU INT4 matmul: which kernel aieng uses, and why.

For the linear shapes of the ~134M "base" model of bench_offline (hidden 768, MLP 2048) and one
4096 x 4096 layer, and batch sizes M from 1 (a single decode stream) to 256 (prefill), times:
- `fp32 dense`: F.linear on the float32 weight (MKL) — the unquantized baseline;
- `int4 fused (bf16 act)`: torch's `_weight_int4pack_mm_for_cpu` with bf16 activations, the
  weight packed and dequantized inside the kernel — what aieng's INT4 linear method runs;
- `int4 fused (fp32 act)`: the same op with float32 activations (a scalar path in torch);
- `dequant + matmul`: aieng's reference, the weight dequantized to float32 on every call.
Group size 128, asymmetric. Prints a table and writes benches/results/bench_int4_matmul.{json,md}.

    .venv/bin/python benches/bench_int4_matmul.py [--threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from aieng.benchmarks.offline import machine
from aieng.config.quantization import WeightScheme
from aieng.layers.linear import Linear
from aieng.quantization.linear_method import QuantizedLinearMethod
from aieng.quantization.packing import pack_int32

SHAPES = {  # name: (out_features, in_features)
    "base qkv 2304x768": (2304, 768),
    "base gate_up 4096x768": (4096, 768),
    "base down 768x2048": (768, 2048),
    "4096x4096": (4096, 4096),
}
GROUP = 128


def quantized_layer(out_features: int, in_features: int, use_kernel: bool) -> Linear:
    scheme = WeightScheme("compressed-tensors", 4, GROUP, symmetric=False)
    method = QuantizedLinearMethod(scheme, "bench", use_kernel=use_kernel)
    layer = Linear(in_features, out_features, methods=lambda prefix: method)
    generator = torch.Generator().manual_seed(0)
    groups = in_features // GROUP
    q = torch.randint(0, 16, (out_features, in_features), generator=generator)
    z = torch.randint(0, 16, (out_features, groups), generator=generator)
    layer.weight_packed.data.copy_(pack_int32(q, 4, dim=1))
    layer.weight_scale.data.copy_(torch.rand(out_features, groups, generator=generator) * 0.01)
    layer.weight_zero_point.data.copy_(pack_int32(z, 4, dim=0))
    method.process_weights_after_loading(layer)
    return layer


def timed(min_seconds: float, fn, *args) -> float:
    """Median seconds per call of fn(*args) over repeats filling ~min_seconds."""
    fn(*args)
    start = time.perf_counter()
    fn(*args)
    once = max(time.perf_counter() - start, 1e-6)
    repeats = max(3, min(200, int(min_seconds / once)))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="fewer sizes, shorter timing")
    parser.add_argument("--out", default="benches/results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [1, 16, 64] if args.quick else [1, 4, 16, 64, 256]
    budget = 0.05 if args.quick else 0.3
    rows = []
    for shape_name, (n, k) in SHAPES.items():
        fused = quantized_layer(n, k, use_kernel=True)
        reference = quantized_layer(n, k, use_kernel=False)
        assert fused.method.kernel == "int4pack", "the CPU INT4 kernel is not available here"
        dense = torch.randn(n, k)
        pairs, packed = fused.int4_scales_zeros, fused.int4_packed
        for m in sizes:
            x = torch.randn(m, k)
            times = {
                "fp32 dense": timed(budget, F.linear, x, dense),
                "int4 fused (bf16 act)": timed(budget, fused, x),
                "dequant + matmul": timed(budget, reference, x),
            }
            if m <= 16:  # the fp32-activation path is too slow to time at large M
                kernel = torch.ops.aten._weight_int4pack_mm_for_cpu
                fp32_pairs = pairs.float()
                times["int4 fused (fp32 act)"] = timed(budget, kernel, x, packed, GROUP, fp32_pairs)
            rows.append({"shape": shape_name, "m": m, "ms": {k: v * 1e3 for k, v in times.items()}})
            print(
                f"{shape_name:>22} M={m:<4} "
                + "  ".join(f"{name} {t * 1e3:8.3f} ms" for name, t in times.items()),
                flush=True,
            )
    info = machine(args.threads)
    weight_bytes = {
        name: {
            "fp32": n * k * 4,
            "int4 packed + bf16 scales/zeros": n * k // 2 + n * k // GROUP * 4,
        }
        for name, (n, k) in SHAPES.items()
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"machine": info, "group_size": GROUP, "rows": rows, "weight_bytes": weight_bytes}
    (out / "bench_int4_matmul.json").write_text(json.dumps(result, indent=2))
    methods = ["fp32 dense", "int4 fused (bf16 act)", "int4 fused (fp32 act)", "dequant + matmul"]
    lines = [
        "# CPU INT4 matmul: torch's fused kernel vs float32 and the dequantize reference",
        "",
        f"Machine: {info['nproc']} CPUs ({info['cpu']}; {info['cpu_features']}; torch kernels "
        f"{info['torch_cpu_capability']}), torch {info['torch']}, {args.threads} threads. "
        f"Group size {GROUP}, asymmetric. Median ms per call.",
        "",
        "| layer (out x in) | M | " + " | ".join(methods) + " | fused speed-up vs fp32 |",
        "|---|---|" + "---|" * len(methods) + "---|",
    ]
    for row in rows:
        ms = row["ms"]
        cells = [f"{ms[m]:.3f}" if m in ms else "—" for m in methods]
        speedup = ms["fp32 dense"] / ms["int4 fused (bf16 act)"]
        lines.append(
            f"| {row['shape']} | {row['m']} | " + " | ".join(cells) + f" | {speedup:.2f}x |"
        )
    lines += ["", "Command: `.venv/bin/python benches/bench_int4_matmul.py`", ""]
    (out / "bench_int4_matmul.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
