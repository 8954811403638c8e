"""The native CPU decoder against the torch runner path, on the "base" Llama of
benches/bench_offline.py (random weights, vocabulary 32000), 2 threads, one run, same process.

Rows: aieng with `cpu_native="auto"` (the native decoder: one Rust call per step) and with
`cpu_native="off"` (the torch model walked op by op, the same kernels underneath), both on a
float32 KV cache, then the native decoder on its default cache (`auto`: bfloat16), in float32 and
with INT4 weights (`aieng quantize --method rtn`, the LM head too) on the default `int8x2`
kernel. Workloads: one stream (a 128-token prompt, 128 greedy tokens: decode tokens/s and time
to the first token, median of STREAM_TRIALS runs) and offline (N requests, default 64, prompt
and output lengths U[16, 256]: output tokens/s). The greedy tokens of the two paths are
compared request by request. Nothing is recorded: the table is printed with the CPU it ran on.

    .venv/bin/python benches/bench_cpu_native.py [--requests 64] [--quick] [--no-int4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import bench_offline

from aieng.benchmarks.offline import machine, run_aieng, workload

THREADS = 2
STREAM_TRIALS = 5
SETTING = dict(max_num_batched_tokens=1024, max_num_seqs=64)
# row name -> options: the two paths on the same float32 cache, then the native default cache
MODES = {
    "native decoder": dict(cpu_native="auto", kv_cache_dtype="float32"),
    "torch runner": dict(cpu_native="off", kv_cache_dtype="float32"),
    "native decoder, default cache (bfloat16)": dict(cpu_native="auto"),
}


def one_stream(folder: Path, trials: int, **options) -> tuple[float, float]:
    """(decode tokens/s, time to the first token in s), medians over `trials` runs."""
    from aieng import LLM, SamplingParams

    llm = LLM(str(folder), kv_cache_memory=64 << 20, max_num_seqs=1, **options)
    # A prompt of its own for every run: a repeated prompt would be a prefix-cache hit, and its
    # first token would time one token's prefill, not 128.
    prompts, _ = workload(trials + 1, 32000, max_len=512, seed=1)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate([(prompts[0] * 8)[:128]], params, use_tqdm=False)  # warm-up
    decode, first = [], []
    for prompt in prompts[1:]:
        prompt = (prompt * 8)[:128]
        start = time.monotonic()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        m = out.metrics
        first.append(m.first_token_time - start)
        decode.append((len(out.outputs[0].token_ids) - 1) / (m.finished_time - m.first_token_time))
    del llm
    return statistics.median(decode), statistics.median(first)


def quantize(folder: Path, out: Path) -> Path:
    """`aieng quantize --method rtn` (INT4, the largest group size that divides, asymmetric,
    the LM head too), as bench_offline.py's `--quantization rtn` does."""
    from aieng.config.model_config import ModelConfig
    from aieng.quantizer.compressed_tensors_writer import QuantScheme
    from aieng.quantizer.quantize import QuantizeOptions, largest_group_size, quantize_checkpoint

    group = largest_group_size(ModelConfig.from_pretrained(folder))
    scheme = QuantScheme(4, group, symmetric=False)
    options = QuantizeOptions(method="rtn", scheme=scheme, quantize_lm_head=True)
    quantize_checkpoint(folder, out, options, progress=None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="8 requests, 2 stream trials")
    ap.add_argument("--no-int4", action="store_true", help="float32 only")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    requests = 8 if args.quick else args.requests
    trials = 2 if args.quick else STREAM_TRIALS
    with tempfile.TemporaryDirectory() as tmp:
        folder, _ = bench_offline.build_checkpoint("base", Path(tmp) / "base")
        checkpoints = {"fp32": folder}
        if not args.no_int4:
            checkpoints["INT4 (int8x2)"] = quantize(folder, Path(tmp) / "int4")
        prompts, output_lens = workload(requests, 32000)
        kv = bench_offline.kv_budget(bench_offline.MODELS["base"], requests)
        rows = []
        for weights, path in checkpoints.items():
            runs = {}
            for mode, options in MODES.items():
                offline = run_aieng(
                    path, prompts, output_lens, kv_cache_memory=kv, **options, **SETTING
                )
                decode, first = one_stream(path, trials, **options)
                runs[mode] = offline
                rows.append((weights, mode, decode, first, offline.tokens_per_s))
            native, torch_path = runs["native decoder"], runs["torch runner"]
            same = sum(a == b for a, b in zip(native.token_ids, torch_path.token_ids, strict=True))
            print(f"{weights}: {same}/{requests} identical greedy requests on a float32 cache")
    info = machine(THREADS)
    print(
        f"\nCPU: {info['cpu']} ({info['cpu_features']}), {THREADS} threads, torch {info['torch']}"
    )
    print(f"base Llama (vocabulary 32000), {requests} offline requests, one stream 128 + 128\n")
    print("| weights | path | one stream decode tok/s | first token (128) ms | offline tok/s |")
    print("|---|---|---|---|---|")
    for weights, mode, decode, first, offline in rows:
        print(f"| {weights} | {mode} | {decode:.1f} | {first * 1e3:.0f} | {offline:.1f} |")


if __name__ == "__main__":
    main()
