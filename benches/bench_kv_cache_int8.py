"""KV cache dtypes (float32, bfloat16, INT8): sequences a budget holds, decode speed, perplexity.

1. Capacity: for a fixed budget (64 MiB on the default model, 1 GiB on base), the KV blocks
   and the 1,024-token sequences that fit, per cache dtype, on the bundled default model (6
   layers, 4 KV heads, head_dim 64; counted by building its runner) and on the ~134M "base"
   config of bench_offline.py (12 layers, 12 KV heads, head_dim 64; counted from its
   KVCacheSpec, no weights needed). An INT8 cache's bytes include its scales (one per token per
   KV head for K and for V, in the model's dtype).
2. Speed: the default model (float32) with a float32, a bfloat16 (the CPU's default under the
   native decoder) and an INT8 cache on the same greedy workloads (all requests at once, a
   budget that holds them all in each, so none preempts):
   output tokens/s end to end, and decode tokens/s = (output tokens - one per request) / (the
   run's wall time - the wall time of the same prompts with max_tokens=1); best of --reps,
   the dtypes alternating.
3. Quality: held-out perplexity of the default model (`aieng.benchmarks.evaluate`, window 512,
   stride 256) with each cache, on the first --ppl-tokens tokens of the KJV held-out books
   (written with Debian's bible-kjv when it is installed; skipped otherwise), against the
   accuracy contract: each cache within +0.5% of the float32 cache's perplexity.

    .venv/bin/python benches/bench_kv_cache_int8.py [--budget-mib 64] [--base-budget-mib 1024]
        [--reps 2] [--threads 1] [--ppl-tokens 4096] [--only capacity|speed|quality] (repeatable)
        [--out benches/results]

The perplexity rows alone, quickest: `--only quality --ppl-tokens 1024`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from aieng import LLM, SamplingParams
from aieng.benchmarks.offline import machine
from aieng.config.default_model import default_model_path
from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import create_engine_config
from aieng.worker.kv_cache import KVCacheSpec
from aieng.worker.runner import ModelRunner

SEQ_TOKENS = 1024
BLOCK_SIZE = 16
BASE = SimpleNamespace(num_hidden_layers=12, num_key_value_heads=12, head_dim=768 // 12)
# (cache dtype shown, the model's dtype, EngineArgs.kv_cache_dtype)
CACHES = [
    ("float32", torch.float32, "float32"),
    ("bfloat16 (float32 model, native decoder: the CPU default)", torch.float32, "bfloat16"),
    ("bfloat16 (bfloat16 model)", torch.bfloat16, "auto"),
    ("float16", torch.float16, "auto"),
    ("int8 (float32 scales, float32 model)", torch.float32, "int8"),
    ("int8 (float16 scales, float16 model)", torch.float16, "int8"),
]
# The caches held against each other: EngineArgs.kv_cache_dtype values, float32 the reference.
SPEED_CACHES = ("float32", "bfloat16", "int8")
PPL_LIMIT = 0.005  # the accuracy contract: perplexity within +0.5% of the float32 cache's
WORKLOADS = {
    # name: (requests, prompt tokens, output tokens)
    "short prompts, long outputs": (16, 32, 256),
    "long context": (16, 384, 96),
}


def capacity(budgets: dict[str, int]) -> list[dict]:
    rows = []
    for model, budget in budgets.items():
        plain = None
        for name, dtype, kv_cache_dtype in CACHES:
            if model == "default":  # the runner itself, weights in the model dtype
                args = EngineArgs(
                    model=str(default_model_path()),
                    dtype=str(dtype).removeprefix("torch."),
                    kv_cache_memory=budget,
                    kv_cache_dtype=kv_cache_dtype,
                )
                runner = ModelRunner(create_engine_config(args))
                spec, blocks = runner.kv_spec, runner.num_blocks
                del runner
            else:
                spec = KVCacheSpec.for_model(BASE, BLOCK_SIZE, dtype, kv_cache_dtype)
                blocks = budget // spec.block_bytes
            seqs = blocks // (SEQ_TOKENS // BLOCK_SIZE)
            if name == "float32":
                plain = blocks
            rows.append(
                {
                    "model": model,
                    "budget_mib": budget >> 20,
                    "cache": name,
                    "bytes_per_token": spec.block_bytes // BLOCK_SIZE,
                    "blocks": blocks,
                    "tokens": blocks * BLOCK_SIZE,
                    "sequences": seqs,
                    "blocks_vs_float32": blocks / plain if plain else None,
                }
            )
    return rows


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def speed(reps: int) -> list[dict]:
    engines = {
        name: LLM(
            str(default_model_path()),
            kv_cache_dtype=name,
            kv_cache_memory=128 << 20,
            max_num_seqs=16,
            enable_prefix_caching=False,
        )
        for name in SPEED_CACHES
    }
    rng = np.random.default_rng(0)
    vocab = engines["float32"].engine.vocab_size
    rows = []
    for workload, (n, prompt_len, output_len) in WORKLOADS.items():
        prompts = [rng.integers(3, vocab, prompt_len).tolist() for _ in range(n)]
        best: dict[str, dict] = {}
        for _ in range(reps):
            for name, llm in engines.items():
                prefill, _ = timed(llm, prompts, 1)
                wall, tokens = timed(llm, prompts, output_len)
                row = best.get(name)
                if row is None or wall < row["wall_s"]:
                    best[name] = {"wall_s": wall, "prefill_s": prefill, "token_ids": tokens}
                else:
                    row["prefill_s"] = min(row["prefill_s"], prefill)
        for name, row in best.items():
            out_tokens = n * output_len
            decode_s = row["wall_s"] - row["prefill_s"]
            rows.append(
                {
                    "workload": workload,
                    "requests": n,
                    "prompt_tokens": prompt_len,
                    "output_tokens": output_len,
                    "cache": engines[name].engine.model_info.kv_cache_dtype,
                    "wall_s": row["wall_s"],
                    "output_tokens_per_s": out_tokens / row["wall_s"],
                    "decode_tokens_per_s": (out_tokens - n) / decode_s,
                    "greedy_identical_to_float32": sum(
                        a == b
                        for a, b in zip(row["token_ids"], best["float32"]["token_ids"], strict=True)
                    ),
                }
            )
    return rows


def quality(max_tokens: int) -> list[dict]:
    from aieng.benchmarks.evaluate import perplexity
    from aieng.train.corpus import CorpusError, write_kjv

    try:
        _, heldout = write_kjv(tempfile.mkdtemp())
    except (OSError, CorpusError) as error:
        print(f"perplexity skipped: {error}", file=sys.stderr)
        return []
    rows = []
    for name in SPEED_CACHES:
        r = perplexity(
            default_model_path(),
            heldout,
            window=512,
            stride=256,
            max_tokens=max_tokens,
            kv_cache_dtype=name,
        )
        rows.append(
            {"cache": name, "tokens": r.tokens, "perplexity": r.perplexity, "nll": r.nll,
             "seconds": r.seconds}
        )  # fmt: skip
    return rows


def capacity_lines(cap: list[dict]) -> list[str]:
    lines = [
        "",
        f"## Capacity: a fixed KV budget per model, blocks of {BLOCK_SIZE} tokens",
        "",
        f"Sequences = blocks // {SEQ_TOKENS // BLOCK_SIZE} ({SEQ_TOKENS}-token sequences; the "
        "default model's own context is 512). INT8 bytes include the scales.",
        "",
        "| model | budget | KV cache | bytes/token | blocks | tokens | 1,024-token sequences | "
        "blocks vs float32 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in cap:
        lines.append(
            f"| {r['model']} | {r['budget_mib']} MiB | {r['cache']} | {r['bytes_per_token']:,} | "
            f"{r['blocks']:,} | "
            f"{r['tokens']:,} | {r['sequences']} | {r['blocks_vs_float32']:.2f}x |"
        )
    return [
        *lines,
        "",
        "default = the bundled model (6 layers, 4 KV heads, head_dim 64); base = bench_offline's "
        "~134M config (12 layers, 12 KV heads, head_dim 64).",
    ]


def speed_lines(fast: list[dict], reps: int) -> list[str]:
    lines = [
        "",
        "## Speed: the default model (float32 weights), float32 vs bfloat16 vs INT8 cache",
        "",
        f"Greedy, ignore_eos, random prompt ids (seed 0), all requests at once, max_num_seqs 16, "
        f"a 128 MiB budget (no preemption in any), prefix caching off; best of {reps}.",
        "",
        "| workload | requests x (prompt + output) | KV cache | output tok/s | decode tok/s | "
        "wall s | greedy identical to float32 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in fast:
        lines.append(
            f"| {r['workload']} | {r['requests']} x ({r['prompt_tokens']} + "
            f"{r['output_tokens']}) | {r['cache']} | {r['output_tokens_per_s']:.1f} | "
            f"{r['decode_tokens_per_s']:.1f} | {r['wall_s']:.2f} | "
            f"{r['greedy_identical_to_float32']}/{r['requests']} |"
        )
    return lines


def quality_lines(ppl: list[dict], ppl_tokens: int) -> list[str]:
    base = next(r["perplexity"] for r in ppl if r["cache"] == "float32")
    lines = [
        "",
        "## Quality: held-out perplexity of the default model",
        "",
        f"KJV held-out books, first {ppl_tokens:,} tokens, window 512, stride 256 "
        "(`aieng.benchmarks.evaluate.perplexity`, through the engine's forward and its cache "
        f"dtype). The contract: within {PPL_LIMIT:+.1%} of the float32 cache.",
        "",
        "| KV cache | tokens scored | perplexity | relative to float32 | contract |",
        "|---|---|---|---|---|",
    ]
    for r in ppl:
        change = r["perplexity"] / base - 1
        verdict = "reference" if r["cache"] == "float32" else (
            "within" if change <= PPL_LIMIT else "OUTSIDE"
        )  # fmt: skip
        lines.append(
            f"| {r['cache']} | {r['tokens']:,} | {r['perplexity']:.4f} | {change:+.4%} | "
            f"{verdict} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-mib", type=int, default=64, help="for the default model")
    ap.add_argument("--base-budget-mib", type=int, default=1024, help="for the base config")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ppl-tokens", type=int, default=4096, help="0: skip the perplexity")
    ap.add_argument(
        "--only",
        action="append",
        choices=("capacity", "speed", "quality"),
        help="run only these parts (repeatable; default: all)",
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    info = machine(args.threads)
    parts = set(args.only or ("capacity", "speed", "quality"))
    cap, fast, ppl = [], [], []
    if "capacity" in parts:
        cap = capacity({"default": args.budget_mib << 20, "base": args.base_budget_mib << 20})
        print(f"capacity done ({time.perf_counter() - started:.0f} s)", flush=True)
    if "speed" in parts:
        fast = speed(args.reps)
        print(f"speed done ({time.perf_counter() - started:.0f} s)", flush=True)
    if "quality" in parts and args.ppl_tokens:
        ppl = quality(args.ppl_tokens)
    seconds = time.perf_counter() - started

    lines = [
        "# bench_kv_cache_int8",
        "",
        f"Machine: {info['nproc']} CPUs ({info['cpu']}; {info['cpu_features']}; torch CPU "
        f"capability {info['torch_cpu_capability']}), torch {info['torch']}, Python "
        f"{info['python']}, torch.set_num_threads({args.threads}) (the other core was busy).",
    ]
    if cap:
        lines += capacity_lines(cap)
    if fast:
        lines += speed_lines(fast, args.reps)
    if ppl:
        lines += quality_lines(ppl, args.ppl_tokens)
    lines += [
        "",
        f"Run time: {seconds:.0f} s. Command: `" + " ".join(["python", *sys.argv]) + "`",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # A partial run (--only) is written beside the full results, never over them.
    name = "bench_kv_cache_int8" + "".join(f"_{p}" for p in sorted(args.only or ()))
    (out / f"{name}.md").write_text(text)
    result = {"machine": info, "args": vars(args), "capacity": cap, "speed": fast,
              "perplexity": ppl, "seconds": seconds}  # fmt: skip
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
