"""Offline throughput: aieng's `LLM.generate` against Hugging Face transformers' `generate`.

The same mixed-length workload runs through both engines on the same random-weight Llama
checkpoint (built on the spot in a temp folder): N requests (default 64) with prompt and output
lengths uniform in [16, 256] (seed 0), greedy, ignore_eos, fp32, torch.set_num_threads(2).

- aieng: every request is submitted at once (continuous batching over the paged KV cache).
- HF: static batches of 32 in request order, left padding with an attention mask; each batch
  runs with max_new_tokens = the largest requested output length in that batch (HF has no
  per-row stop here), and only each request's own requested output tokens count as useful
  output. Both engines' tokens/s are useful output tokens / wall time.

    .venv/bin/python benches/bench_offline.py [--models small,base] [--requests 64] [--quick]
        [--configs 512:64,1024:64,2048:64] [--label after] [--out benches/results]
        [--previous SITE]   # also an earlier design installed in SITE, in the same run
        [--quantization rtn]  # also each model quantized to INT4 by `aieng quantize`
        --models moe --label moe   # the tiny Qwen3-MoE, with the MoE layers' share of the run

`--quantization rtn` quantizes each checkpoint with `aieng quantize --method rtn` (INT4, group
128, asymmetric, the LM head too; random weights make AWQ's calibration meaningless) and runs it
in the same process on the same workload and settings, plus a single greedy stream (batch 1:
one request, 16-token prompt, 256 output tokens) for fp32 and INT4, and the resident bytes of
each model's weights (parameters and buffers after loading).

`--configs` lists aieng settings max_num_batched_tokens:max_num_seqs; every one is measured on
the first model and the best (highest tokens/s) is used on the others.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from aieng.benchmarks.offline import (
    HF_BATCH,
    identical_requests,
    machine,
    run_aieng,
    run_hf,
    workload,
)

THREADS = 2
MODELS = {
    # name: LlamaConfig overrides (vocab 32000 for both)
    "small": dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=256,
    ),
    "base": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        intermediate_size=2048,
    ),
    # A tiny Qwen3-MoE: 8 experts, top-2, every layer sparse (Qwen3MoeConfig, not Llama).
    "moe": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
        moe_intermediate_size=384,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
}
MOE_MODELS = ("moe",)
CORPUS = [
    "In the beginning was the word, and the word was with the engine.",
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in blocks of sixteen tokens.",
] * 10


def build_checkpoint(name: str, folder: Path) -> tuple[Path, int]:
    """Random-weight LlamaForCausalLM (Qwen3MoeForCausalLM for the MoE models) + a WordLevel
    tokenizer.json -> (folder, parameters)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    moe = name in MOE_MODELS
    config_class = transformers.Qwen3MoeConfig if moe else transformers.LlamaConfig
    config = config_class(
        vocab_size=32000,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
        **MODELS[name],
    )
    model_class = transformers.Qwen3MoeForCausalLM if moe else transformers.LlamaForCausalLM
    model = model_class(config)
    model.save_pretrained(folder, safe_serialization=True)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
    )
    return folder, sum(p.numel() for p in model.parameters())


def run_previous(
    site: str, folder: Path, requests: int, kv_bytes: int, setting: tuple[int, int], reps: int
) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = site + os.pathsep + env.get("PYTHONPATH", "")
    worker = Path(__file__).parent / "previous_design_worker.py"
    command = [sys.executable, str(worker), str(folder), str(requests), str(kv_bytes)]
    command += [str(setting[0]), str(setting[1]), str(reps)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def resident_weight_bytes(folder: Path) -> int:
    """Bytes of a loaded model's parameters and buffers (the rotary tables included)."""
    from aieng.models.loader import load_model

    model, _ = load_model(folder)
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def single_stream(folder: Path, reps: int) -> float:
    """Output tokens/s of one greedy request (16-token prompt, 256 tokens), best of reps."""
    prompts, _ = workload(1, 32000)
    run = run_aieng(
        folder, [prompts[0][:16]], [256], kv_cache_memory=64 << 20, max_num_seqs=1,
        reps=max(reps, 2),
    )  # fmt: skip
    return run.tokens_per_s


def run_quantized(
    folder: Path,
    out: Path,
    method: str,
    prompts: list[list[int]],
    output_lens: list[int],
    kv_bytes: int,
    setting: tuple[int, int],
    reps: int,
    fp32_run,
) -> dict:
    from aieng.config.model_config import ModelConfig
    from aieng.quantizer.compressed_tensors_writer import QuantScheme
    from aieng.quantizer.quantize import (
        QuantizeOptions,
        largest_group_size,
        quantize_checkpoint,
    )

    group = largest_group_size(ModelConfig.from_pretrained(folder))
    options = QuantizeOptions(
        method=method, scheme=QuantScheme(4, group, symmetric=False), quantize_lm_head=True
    )
    start = time.perf_counter()
    quantize_checkpoint(folder, out, options, progress=None)
    seconds = time.perf_counter() - start
    run = run_aieng(
        out, prompts, output_lens, kv_cache_memory=kv_bytes, max_num_batched_tokens=setting[0],
        max_num_seqs=setting[1], reps=reps,
    )  # fmt: skip
    result = {
        "method": method,
        "group_size": group,
        "quantize_s": seconds,
        "tokens": run.tokens,
        "wall_s": run.wall_s,
        "tokens_per_s": run.tokens_per_s,
        "greedy_identical_to_fp32": identical_requests(run, fp32_run),
        "stream_tokens_per_s": single_stream(out, reps),
        "fp32_stream_tokens_per_s": single_stream(folder, reps),
        "weight_bytes": resident_weight_bytes(out),
        "fp32_weight_bytes": resident_weight_bytes(folder),
    }
    print(f"  aieng INT4 {folder.name}: {json.dumps(result)}", flush=True)
    return result


def moe_share(folder: Path, prompts, output_lens, kv_bytes: int, setting: tuple[int, int]) -> dict:
    """One more (untimed-for-throughput) run with every SparseMoE forward timed: the MoE layers'
    seconds and their share of the run's wall time (the CPU is synchronous, so a layer's wall
    time is its compute)."""
    from aieng.layers.moe import SparseMoE

    spent = [0.0]
    original = SparseMoE.forward

    def timed(self, x):
        start = time.perf_counter()
        out = original(self, x)
        spent[0] += time.perf_counter() - start
        return out

    SparseMoE.forward = timed  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        run = run_aieng(
            folder, prompts, output_lens, kv_cache_memory=kv_bytes,
            max_num_batched_tokens=setting[0], max_num_seqs=setting[1],
        )  # fmt: skip
        total = time.perf_counter() - start
    finally:
        SparseMoE.forward = original  # type: ignore[method-assign]
    # run_aieng's warm-up generate is inside `total`; share = MoE seconds / wall of that run
    return {"moe_s": spent[0], "run_s": total, "share": spent[0] / total, "tokens": run.tokens}


def kv_budget(config: dict, num_requests: int) -> int:
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    kv_width = config["num_key_value_heads"] * head_dim
    per_token = 2 * config["num_hidden_layers"] * max(kv_width, config["hidden_size"]) * 4
    return int(num_requests * (256 + 256 + 32) * per_token * 1.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small,base")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="8 requests, a smoke run")
    ap.add_argument("--configs", default="2048:64", help="max_num_batched_tokens:max_num_seqs,...")
    ap.add_argument("--reps", type=int, default=1, help="timed repetitions per engine (best kept)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--previous",
        metavar="SITE",
        help="also run an earlier aieng design installed in this site folder (same workload, "
        "same checkpoint, same settings), in a subprocess",
    )
    ap.add_argument("--previous-name", default="previous design")
    ap.add_argument(
        "--quantization",
        choices=["rtn"],
        help="also run each model quantized to INT4 (group 128) with this method",
    )
    ap.add_argument("--label", default="", help="names this run in the results (e.g. before)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    num_requests = 8 if args.quick else args.requests
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]

    rows, tuning = [], []
    with tempfile.TemporaryDirectory() as tmp:
        chosen = None
        for name in args.models.split(","):
            folder, params = build_checkpoint(name, Path(tmp) / name)
            prompts, output_lens = workload(num_requests, 32000)
            kv_bytes = kv_budget(MODELS[name], num_requests)
            candidates = [chosen] if chosen else configs
            best = None
            for batched, seqs in candidates:
                run = run_aieng(
                    folder, prompts, output_lens, kv_cache_memory=kv_bytes,
                    max_num_batched_tokens=batched, max_num_seqs=seqs, reps=args.reps,
                )  # fmt: skip
                tokens, wall, walls, tps = run.tokens, run.wall_s, run.walls_s, run.tokens_per_s
                tuning.append(
                    {"model": name, "max_num_batched_tokens": batched, "max_num_seqs": seqs,
                     "tokens_per_s": tps, "walls_s": walls}
                )  # fmt: skip
                print(f"  aieng {name} {batched}:{seqs}: {tps:.1f} tok/s ({walls})", flush=True)
                if best is None or tps > best[0]:
                    best = (tps, wall, tokens, (batched, seqs), run)
            assert best is not None
            chosen = best[3]
            row = {
                "model": name,
                "params": params,
                "config": {**MODELS[name], "vocab_size": 32000},
                "requests": num_requests,
                "aieng": {
                    "tokens": best[2],
                    "wall_s": best[1],
                    "tokens_per_s": best[0],
                    "max_num_batched_tokens": chosen[0],
                    "max_num_seqs": chosen[1],
                },
            }
            if args.previous:
                prev = run_previous(
                    args.previous, folder, num_requests, kv_bytes, chosen, args.reps
                )
                row["previous"] = {
                    "name": args.previous_name,
                    "tokens": prev["tokens"],
                    "wall_s": prev["wall_s"],
                    "tokens_per_s": prev["tokens"] / prev["wall_s"],
                    "greedy_identical_requests": sum(
                        a == b for a, b in zip(prev["token_ids"], best[4].token_ids, strict=True)
                    ),
                }
                print(f"  {args.previous_name} {name}: {row['previous']['tokens_per_s']:.1f} tok/s")
            if name in MOE_MODELS:
                row["moe"] = moe_share(folder, prompts, output_lens, kv_bytes, chosen)
                print(f"  MoE layers' share of the aieng run: {row['moe']['share']:.1%}")
            if args.quantization:
                row["int4"] = run_quantized(
                    folder, Path(tmp) / f"{name}-int4", args.quantization, prompts, output_lens,
                    kv_bytes, chosen, args.reps, best[4],
                )  # fmt: skip
            if not args.skip_hf:
                hf = run_hf(folder, prompts, output_lens, args.reps)
                tokens, wall, walls = hf.tokens, hf.wall_s, hf.walls_s
                row["hf"] = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}
                row["ratio"] = best[0] / (tokens / wall)
                same = identical_requests(best[4], hf)
                row["greedy_identical_requests"] = same
                print(f"  hf {name}: {tokens / wall:.1f} tok/s ({walls}); {same} identical")
            rows.append(row)

    info = machine(THREADS)
    lines = [
        f"# bench_offline{f' ({args.label})' if args.label else ''}",
        "",
        f"Machine: {info['nproc']} CPUs ({info['cpu']}; {info['cpu_features']}), "
        f"torch {info['torch']}, "
        f"Python {info['python']}, torch.set_num_threads({THREADS}) for both engines.",
        "",
        f"Workload: {num_requests} requests, prompt and output lengths uniform in [16, 256] "
        "(seed 0), random token ids, greedy, ignore_eos, fp32. Random-weight LlamaConfig "
        "checkpoints, vocab 32000: small = hidden 64, 4 layers, 4 heads, intermediate 256; "
        "base = hidden 768, 12 layers, 12 heads, intermediate 2048; moe = a Qwen3-MoE "
        "(Qwen3MoeConfig): hidden 256, 4 layers, 4 heads (2 KV, head_dim 64), 8 experts of "
        "intermediate 384, top-2, renormalised, every layer sparse.",
        "",
        "aieng: all requests submitted at once to `LLM.generate` (prefix caching off). HF: "
        f"`generate` on static batches of {HF_BATCH}, left padded with an attention mask, each "
        "batch run to the largest output length in it; only each request's own requested "
        "output tokens are counted as useful output (tokens/s = useful tokens / wall time).",
        "",
        "| model | params | engine | setting | output tok/s | wall s | aieng/HF |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a = r["aieng"]
        setting = (
            f"max_num_batched_tokens={a['max_num_batched_tokens']}, "
            f"max_num_seqs={a['max_num_seqs']}"
        )
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:.1f}M | aieng | {setting} | "
            f"{a['tokens_per_s']:.1f} | {a['wall_s']:.2f} | {ratio} |"
        )
        if "previous" in r:
            p = r["previous"]
            lines.append(
                f"| {r['model']} | {r['params'] / 1e6:.1f}M | aieng, {p['name']} | same | "
                f"{p['tokens_per_s']:.1f} | {p['wall_s']:.2f} | "
                f"(greedy identical to this design: {p['greedy_identical_requests']}"
                f"/{r['requests']}) |"
            )
        if "int4" in r:
            q = r["int4"]
            lines.append(
                f"| {r['model']} | {r['params'] / 1e6:.1f}M | aieng INT4 ({q['method']} "
                f"g{q['group_size']}) | "
                f"same | {q['tokens_per_s']:.1f} | {q['wall_s']:.2f} | "
                f"({q['tokens_per_s'] / a['tokens_per_s']:.2f}x aieng fp32) |"
            )
        if "hf" in r:
            h = r["hf"]
            lines.append(
                f"| {r['model']} | {r['params'] / 1e6:.1f}M | HF transformers | batch {HF_BATCH} | "
                f"{h['tokens_per_s']:.1f} | {h['wall_s']:.2f} | |"
            )
    for r in rows:
        if "moe" in r:
            m = r["moe"]
            lines += [
                "",
                f"MoE ({r['model']}: {r['config']['num_experts']} experts, top-"
                f"{r['config']['num_experts_per_tok']}): the SparseMoE layers took "
                f"{m['moe_s']:.2f} s of a {m['run_s']:.2f} s aieng run ({m['share']:.1%}; "
                "a separate run with every MoE forward timed, warm-up included).",
            ]
    quantized = [r for r in rows if "int4" in r]
    if quantized:
        lines += [
            "",
            "INT4 against fp32 (the same aieng, the same run): a single greedy stream (batch 1, "
            "16-token prompt, 256 output tokens) and resident weight bytes after loading.",
            "",
            "| model | fp32 stream tok/s | INT4 stream tok/s | speed-up | fp32 weights MB | "
            "INT4 weights MB | ratio | greedy identical to fp32 (requests) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in quantized:
            q = r["int4"]
            lines.append(
                f"| {r['model']} | {q['fp32_stream_tokens_per_s']:.1f} | "
                f"{q['stream_tokens_per_s']:.1f} | "
                f"{q['stream_tokens_per_s'] / q['fp32_stream_tokens_per_s']:.2f}x | "
                f"{q['fp32_weight_bytes'] / 1e6:.1f} | {q['weight_bytes'] / 1e6:.1f} | "
                f"{q['weight_bytes'] / q['fp32_weight_bytes']:.3f} | "
                f"{q['greedy_identical_to_fp32']}/{r['requests']} |"
            )
    if len(tuning) > 1:
        lines += ["", "aieng settings tried (max_num_batched_tokens:max_num_seqs -> tok/s):", ""]
        lines += [
            f"- {t['model']} {t['max_num_batched_tokens']}:{t['max_num_seqs']}: "
            f"{t['tokens_per_s']:.1f}"
            for t in tuning
        ]
    lines += ["", "Command: `" + " ".join(["python", *sys.argv]) + "`", ""]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = f"_{args.label}" if args.label else ""
    (out / f"bench_offline{suffix}.md").write_text(text)
    (out / f"bench_offline{suffix}.json").write_text(
        json.dumps({"machine": info, "args": vars(args), "rows": rows, "tuning": tuning}, indent=2)
    )


if __name__ == "__main__":
    main()
