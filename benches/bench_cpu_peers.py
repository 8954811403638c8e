"""CPU peers: aieng's CPU kernels and engine against llama.cpp — one run, same machine, 2 threads.

1. Kernels (aieng's Rust core): the machine's copy bandwidth (torch, measured here); GEMV at
   M = 1 in GB/s of weights read and as a fraction of that bandwidth — int8 W4A8 and W8A8,
   int8x2 (two int8 terms per activation), dense float32 and bfloat16, each beside torch
   (F.linear, torch's INT4 kernel); the int8 GEMM at M = 512 in int8 operations/s against the
   measured `vpdpbusd` peak (`_core.int8_peak_ops`: independent chains on registers).
2. Engines on the "base" Llama of benches/bench_offline.py (random weights, vocabulary 32000):
   aieng fp32 (cpu attention, dense GEMV), W4A16 (torch int4pack), W4A8 (int8), int8x2 (the
   default `auto`) — the INT4 checkpoint by `aieng quantize` (RTN, g128, asymmetric, LM head
   too) — and llama.cpp F32, Q8_0, Q4_0 (benches/llama_cpp_peer.py). Offline: N requests
   (default 64), prompt and output lengths U[16, 256], output tokens/s; one stream: a 128-token
   prompt and 128 greedy tokens, decode tokens/s and time to the first token. llama.cpp runs
   the offline requests twice: one at a time (the high-level `Llama.generate`) and continuously
   batched in one context of up to 64 sequences (benches/llama_cpp_batched.py); the batched
   run's greedy tokens are compared with the one-at-a-time run's, request by request.
3. `--shape qwen0.5b`: the same engines on a random-weight Llama of Qwen2.5-0.5B's shape
   (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocabulary 151,936, tied
   embeddings; the INT4 checkpoint quantizes the tied head too) — fp32, W4A16, W4A8 — with
   16 offline requests by default (the 64 of the base run take too long here at fp32), and no
   kernel rows. Results go to bench_cpu_peers_qwen0.5b.md/json; the base run is unchanged.

    .venv/bin/python benches/bench_cpu_peers.py [--shape base|qwen0.5b] [--requests N] [--quick]
        [--llama-cpp-src /path/to/llama-cpp-python-sdist/vendor/llama.cpp] [--out benches/results]

Without --llama-cpp-src (or without llama_cpp installed) the llama.cpp rows are left out.

OpenMP's threads (torch's, and llama.cpp's ggml built with OpenMP) spin-wait between parallel
regions by default; on a machine shared with other work that spin holds the core a descheduled
peer needs, and small torch ops took 40x longer here (1.7 ms against 77 ms in one measurement).
The run therefore sets OMP_WAIT_POLICY=PASSIVE (unless set) for every engine alike, and records it.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads the OpenMP runtime

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

import bench_offline
import llama_cpp_batched
import llama_cpp_peer

from aieng import _core
from aieng.benchmarks.offline import machine, run_aieng, workload
from aieng.kernels.cpu_dense import dense_gemv
from aieng.kernels.cpu_int8 import int8_matmul, pack_int8_weights

THREADS = 2
# One-stream runs per engine, the median reported: one run varied by about ±20% on these VMs.
STREAM_TRIALS = 5
SETTING = (1024, 64)  # max_num_batched_tokens, max_num_seqs
AIENG_MODES = {  # row name -> EngineArgs.cpu_quant_kernel (None: the fp32 checkpoint)
    "aieng fp32": None,
    "aieng W4A16 (int4pack)": "int4pack",
    "aieng W4A8 (int8)": "int8",
    "aieng W4A16-equivalent (int8x2, auto)": "int8x2",
}
LLAMA_MODES = ("F32", "Q8_0", "Q4_0")
LLAMA_SLOTS = 64  # sequences one batched llama.cpp context decodes together
# Qwen2.5-0.5B's shape as a Llama (no attention biases), random weights.
QWEN05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
)
# --only's names: aieng's cpu_quant_kernel (fp32: the float checkpoint), llama.cpp's types.
ENGINE_KEYS = ("fp32", *(k for k in AIENG_MODES.values() if k), *LLAMA_MODES)
SHAPES = {  # --shape -> (aieng rows, default offline requests)
    "base": (tuple(AIENG_MODES), 64),
    "qwen0.5b": (("aieng fp32", "aieng W4A16 (int4pack)", "aieng W4A8 (int8)"), 16),
}


def best_time(run, reps: int) -> float:
    run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth() -> float:
    """STREAM-style copy: bytes read + bytes written per second (256 MiB)."""
    source = torch.randn(64 << 20)
    target = torch.empty_like(source)
    return 2 * source.numel() * 4 / best_time(lambda: target.copy_(source), 5)


def read_bandwidth() -> float:
    """Bytes read per second by torch's sum over 256 MiB: the ceiling a GEMV streams at."""
    source = torch.randn(64 << 20)
    return source.numel() * 4 / best_time(lambda: source.sum(), 5)


def kernel_rows(bandwidth: float, reading: float) -> list[dict]:
    n, k = 16384, 4096  # 32 MiB at 4 bits: past the last-level cache
    generator = torch.Generator().manual_seed(0)
    q4 = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.int32)
    q8 = torch.randint(0, 256, (n, k), generator=generator, dtype=torch.int32)
    scales = torch.rand(n, k // 128, generator=generator) * 0.01 + 0.001
    zeros4, zeros8 = torch.full_like(scales, 8.0), torch.full_like(scales, 128.0)
    w4 = pack_int8_weights(q4, scales, zeros4, 4)
    w8 = pack_int8_weights(q8, scales, zeros8, 8)
    x = torch.randn(1, k, generator=generator)
    rows = []

    def row(name: str, seconds: float, nbytes: int) -> None:
        rate = nbytes / seconds
        rows.append(
            {
                "kernel": name,
                "M": 1,
                "ms": seconds * 1e3,
                "GB/s": rate / 1e9,
                "of_copy": rate / bandwidth,
                "of_read": rate / reading,
            }
        )

    row("aieng int8 W4A8 GEMV", best_time(lambda: int8_matmul(x, w4), 20), w4.nbytes)
    row("aieng int8x2 W4 GEMV", best_time(lambda: int8_matmul(x, w4, split=True), 20), w4.nbytes)
    row("aieng int8 W8A8 GEMV", best_time(lambda: int8_matmul(x, w8), 20), w8.nbytes)
    if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
        pairs = torch.stack([scales.t(), (8 - zeros4.t()) * scales.t()], -1).to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        seconds = best_time(
            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, 128, pairs), 20
        )
        row("torch int4pack W4A16 GEMV", seconds, packed.numel() + pairs.numel() * 2)
    dense = torch.randn(n // 2, k, generator=generator)  # 128 MiB float32
    for dtype in (torch.float32, torch.bfloat16):
        w = dense.to(dtype)
        nbytes = w.numel() * w.element_size()
        row(f"aieng dense GEMV {dtype}", best_time(lambda w=w: dense_gemv(x, w), 10), nbytes)
        xd = x.to(dtype)
        row(f"torch F.linear {dtype}", best_time(lambda w=w, xd=xd: F.linear(xd, w), 10), nbytes)
    peak = _core.int8_peak_ops(THREADS)
    m, gemm_n, gemm_k = 512, 4096, 4096
    wg = pack_int8_weights(q4[:gemm_n, :gemm_k], scales[:gemm_n, :32], zeros4[:gemm_n, :32], 4)
    xg = torch.randn(m, gemm_k, generator=generator)
    out = torch.empty(m, gemm_n)
    for name, split in (("aieng int8 W4A8 GEMM", False), ("aieng int8x2 W4 GEMM", True)):
        seconds = best_time(lambda split=split: int8_matmul(xg, wg, out=out, split=split), 3)
        ops = 2 * m * gemm_n * gemm_k * (2 if split else 1)  # int8 operations the kernel runs
        rows.append(
            {
                "kernel": name,
                "M": m,
                "ms": seconds * 1e3,
                "int8 GOPS": ops / seconds / 1e9,
                "of_peak": ops / seconds / peak if peak else None,
            }
        )
    xf = torch.randn(m, gemm_k, generator=generator)
    wf = dense[:gemm_n, :gemm_k].contiguous()
    seconds = best_time(lambda: F.linear(xf, wf), 3)
    rows.append({"kernel": "torch F.linear float32 GEMM", "M": m, "ms": seconds * 1e3})
    rows.append({"kernel": "vpdpbusd peak (measured)", "int8 GOPS": (peak or 0) / 1e9})
    return rows


def quantized_checkpoint(folder: Path, out: Path) -> Path:
    from aieng.config.model_config import ModelConfig
    from aieng.quantizer.compressed_tensors_writer import QuantScheme
    from aieng.quantizer.quantize import QuantizeOptions, largest_group_size, quantize_checkpoint

    group = largest_group_size(ModelConfig.from_pretrained(folder))
    options = QuantizeOptions(
        method="rtn", scheme=QuantScheme(4, group, symmetric=False), quantize_lm_head=True
    )
    quantize_checkpoint(folder, out, options, progress=None)
    return out


def qwen_checkpoint(folder: Path) -> tuple[Path, int]:
    """A random-weight Llama of Qwen2.5-0.5B's shape, beside bench_offline's tokenizer files
    (the small checkpoint is built for them, then its config and weights are replaced)."""
    import transformers

    bench_offline.build_checkpoint("small", folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        torch_dtype="float32", **QWEN05B,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    del model
    return folder, params


def aieng_rows(
    folder: Path, int4: Path, prompts, output_lens, kv_bytes: int, stream, names
) -> list[dict]:
    rows = []
    for name in names:
        kernel = AIENG_MODES[name]
        model = folder if kernel is None else int4
        options = {"cpu_quant_kernel": kernel} if kernel else {}
        batch = prompts and run_aieng(
            model, prompts, output_lens, kv_cache_memory=kv_bytes,
            max_num_batched_tokens=SETTING[0], max_num_seqs=SETTING[1], **options,
        )  # fmt: skip
        one = run_aieng(
            model, [stream[0]], [stream[1]], kv_cache_memory=64 << 20, max_num_seqs=1,
            reps=STREAM_TRIALS, **options,
        )  # fmt: skip
        decodes = [(stream[1] - 1) / (end - first) for first, end in one.first_request_s]
        rows.append(
            {
                "engine": name,
                "offline_tokens_per_s": batch.tokens_per_s if batch else None,
                "stream_decode_tokens_per_s": float(np.median(decodes)),
                "stream_decode_trials": decodes,
                "stream_ttft_ms": float(np.median([f for f, _ in one.first_request_s])) * 1e3,
            }
        )
        print(rows[-1], flush=True)
    return rows


def llama_rows(
    folder: Path, src: Path, work: Path, prompts, output_lens, stream, modes=LLAMA_MODES
) -> list[dict]:
    f32 = llama_cpp_peer.convert(folder, work / "model-f32.gguf", src)
    slots = min(LLAMA_SLOTS, len(prompts))
    rows: list[dict] = []
    for mode in modes:
        path = f32 if mode == "F32" else work / f"model-{mode}.gguf"
        if mode != "F32":
            llama_cpp_peer.quantize(f32, path, mode, THREADS)
        llm = llama_cpp_peer.load(path, THREADS, 1024)
        serial = prompts and llama_cpp_peer.run_requests(llm, prompts, output_lens)
        one = llama_cpp_peer.run_stream(llm, stream[0], stream[1], reps=STREAM_TRIALS)
        del llm
        rows.append(
            {
                "engine": f"llama.cpp {mode}" + (" (one request at a time)" if serial else ""),
                "offline_tokens_per_s": serial["tokens_per_s"] if serial else None,
                "stream_decode_tokens_per_s": one["decode_tokens_per_s"],
                "stream_decode_trials": one["decode_trials"],
                "stream_ttft_ms": one["ttft_s"] * 1e3,
            }
        )
        print(rows[-1], flush=True)
        if not serial:
            continue
        batched = llama_cpp_batched.run_batched(path, prompts, output_lens, THREADS, slots)
        pairs = list(zip(serial["token_ids"], batched["token_ids"], strict=True))
        rows.append(
            {
                "engine": f"llama.cpp {mode} (batched, {slots} sequences)",
                "offline_tokens_per_s": batched["tokens_per_s"],
                "greedy_same_as_one_at_a_time": f"{sum(a == b for a, b in pairs)}/{len(pairs)}",
                "first_difference": [common_prefix(a, b) for a, b in pairs if a != b],
            }
        )
        print(rows[-1], flush=True)
    return rows


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def table(rows: list[dict], columns: list[str]) -> str:
    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=tuple(SHAPES), default="base")
    ap.add_argument(
        "--requests", type=int, default=None, help="64 (base), 16 (qwen0.5b); 0: one stream only"
    )
    ap.add_argument("--quick", action="store_true", help="8 requests, a smoke run")
    ap.add_argument("--llama-cpp-src", type=Path, default=None)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument(
        "--only", default=None,
        help="comma-separated engines to run, of: " + ",".join(ENGINE_KEYS) + " (default all)",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    names, default_requests = SHAPES[args.shape]
    llama_modes = LLAMA_MODES
    if args.only:
        wanted = args.only.split(",")
        if unknown := [w for w in wanted if w not in ENGINE_KEYS]:
            ap.error(f"--only: unknown engines {unknown}; known: {', '.join(ENGINE_KEYS)}")
        names = tuple(n for n in names if (AIENG_MODES[n] or "fp32") in wanted)
        llama_modes = tuple(m for m in LLAMA_MODES if m in wanted)
    requests = 8 if args.quick else default_requests if args.requests is None else args.requests
    qwen = args.shape == "qwen0.5b"
    vocab = QWEN05B["vocab_size"] if qwen else 32000
    load = os.getloadavg()
    info = {
        **machine(THREADS),
        "aieng_cpu_isa": _core.cpu_isa(),
        "OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"],
    }
    print(info, flush=True)
    bandwidth, reading = copy_bandwidth(), read_bandwidth()
    kernels = [] if args.skip_kernels or qwen else kernel_rows(bandwidth, reading)
    for row in kernels:
        print(row, flush=True)
    prompts, output_lens = workload(requests, vocab) if requests else ([], [])
    stream = (workload(1, 32000, max_len=128, seed=1)[0][0][:16] * 8, 128)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if qwen:
            folder, params = qwen_checkpoint(work / "model")
            config = QWEN05B
        else:
            folder, params = bench_offline.build_checkpoint("base", work / "model")
            config = bench_offline.MODELS["base"]
        int4 = quantized_checkpoint(folder, work / "model-int4")
        kv_bytes = bench_offline.kv_budget(config, requests)
        engines = aieng_rows(folder, int4, prompts, output_lens, kv_bytes, stream, names)
        if args.llama_cpp_src is not None:
            engines += llama_rows(
                folder, args.llama_cpp_src, work, prompts, output_lens, stream, llama_modes
            )
    load_after = os.getloadavg()
    result = {
        "machine": info,
        "load_average_before": load,
        "load_average_after": load_after,
        "copy_bandwidth_GB_s": bandwidth / 1e9,
        "read_bandwidth_GB_s": reading / 1e9,
        "model": {"name": args.shape, "parameters": params, **config},
        "requests": requests,
        "kernels": kernels,
        "engines": engines,
    }
    md = [
        "# aieng CPU kernels and engine against llama.cpp (benches/bench_cpu_peers.py)",
        "",
        f"{info['cpu']} ({info['cpu_features']}), {info['nproc']} CPUs, {THREADS} threads for "
        f"every engine; aieng's kernels on {info['aieng_cpu_isa']}; torch {info['torch']}; "
        f"OMP_WAIT_POLICY={info['OMP_WAIT_POLICY']}. "
        f"Measured bandwidth: copy {bandwidth / 1e9:.1f} GB/s (read + written), read "
        f"{reading / 1e9:.1f} GB/s (torch.sum). Load average (1, 5, 15 min) {fmt_load(load)} at "
        f"the start, {fmt_load(load_after)} at the end (2 cores: above about 2, other jobs "
        f"shared them). One stream: the median of {STREAM_TRIALS} runs per engine (every run is "
        "in the JSON); offline: one run.",
        "",
    ]
    if kernels:
        columns = ["kernel", "M", "ms", "GB/s", "of_copy", "of_read", "int8 GOPS", "of_peak"]
        md += ["## Kernels", "", table(kernels, columns), ""]
    model = (
        "Qwen2.5-0.5B-shaped Llama (tied embeddings" if qwen else "base Llama (untied head"
    ) + f", {params / 1e6:.0f}M parameters, random weights)"
    md += [
        f"## Engines: {model}, "
        + (f"{requests} requests U[16, 256]" if requests else "no offline run")
        + "; one stream of a 128-token prompt and 128 greedy tokens",
        "",
        table(
            engines,
            [
                "engine",
                "offline_tokens_per_s",
                "stream_decode_tokens_per_s",
                "stream_ttft_ms",
                "greedy_same_as_one_at_a_time",
            ],
        ),
        "",
        "greedy_same_as_one_at_a_time: requests whose batched llama.cpp tokens equal its "
        "one-at-a-time tokens; first_difference in the JSON gives where the others part.",
        "",
    ]
    text = "\n".join(md)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "bench_cpu_peers" + ("_qwen0.5b" if qwen else "")
    (args.out / f"{stem}.md").write_text(text)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))


def fmt_load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.1f}" for x in load)


if __name__ == "__main__":
    main()
