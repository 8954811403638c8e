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

`--configs` lists aieng settings max_num_batched_tokens:max_num_seqs; every one is measured on
the first model and the best (highest tokens/s) is used on the others.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

THREADS = 2
HF_BATCH = 32
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
}
CORPUS = [
    "In the beginning was the word, and the word was with the engine.",
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in blocks of sixteen tokens.",
] * 10


def build_checkpoint(name: str, folder: Path) -> tuple[Path, int]:
    """Random-weight LlamaForCausalLM + a WordLevel tokenizer.json -> (folder, parameters)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
        **MODELS[name],
    )
    model = transformers.LlamaForCausalLM(config)
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


def workload(num_requests: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(0)
    prompt_lens = rng.integers(16, 257, num_requests)
    output_lens = rng.integers(16, 257, num_requests)
    prompts = [rng.integers(3, vocab, n).tolist() for n in prompt_lens]
    return prompts, [int(n) for n in output_lens]


def kv_budget(config: dict, num_requests: int) -> int:
    per_token = 2 * config["num_hidden_layers"] * config["hidden_size"] * 4  # K+V, fp32
    return int(num_requests * (256 + 256 + 32) * per_token * 1.1)


def run_aieng(folder, prompts, output_lens, kv_bytes, batched_tokens, max_seqs, reps=1):
    from aieng import LLM, SamplingParams

    llm = LLM(
        str(folder),
        kv_cache_memory=kv_bytes,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=batched_tokens,
        enable_prefix_caching=False,
    )
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    walls = []
    for _ in range(reps):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - start)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(output_lens), (tokens, sum(output_lens))
    del llm
    return tokens, min(walls), walls, [list(o.outputs[0].token_ids) for o in outs]


@torch.inference_mode()
def run_hf(folder, prompts, output_lens, reps=1):
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # ignore_eos
    model.generation_config.pad_token_id = 0

    def batch_generate(batch_prompts, max_new):
        width = max(len(p) for p in batch_prompts)
        ids = torch.zeros(len(batch_prompts), width, dtype=torch.long)
        mask = torch.zeros(len(batch_prompts), width, dtype=torch.long)
        for row, p in enumerate(batch_prompts):  # left padding
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
        )
        return out[:, width:]

    batch_generate(prompts[:4], 4)  # warm-up
    walls, generated = [], []
    for _ in range(reps):
        generated = []
        start = time.perf_counter()
        for lo in range(0, len(prompts), HF_BATCH):
            batch, lens = prompts[lo : lo + HF_BATCH], output_lens[lo : lo + HF_BATCH]
            new = batch_generate(batch, max(lens))
            generated += [new[row, :n].tolist() for row, n in enumerate(lens)]
        walls.append(time.perf_counter() - start)
    return sum(output_lens), min(walls), walls, generated


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": THREADS,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small,base")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="8 requests, a smoke run")
    ap.add_argument("--configs", default="2048:64", help="max_num_batched_tokens:max_num_seqs,...")
    ap.add_argument("--reps", type=int, default=1, help="timed repetitions per engine (best kept)")
    ap.add_argument("--skip-hf", action="store_true")
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
                tokens, wall, walls, aieng_ids = run_aieng(
                    folder, prompts, output_lens, kv_bytes, batched, seqs, args.reps
                )
                tps = tokens / wall
                tuning.append(
                    {"model": name, "max_num_batched_tokens": batched, "max_num_seqs": seqs,
                     "tokens_per_s": tps, "walls_s": walls}
                )  # fmt: skip
                print(f"  aieng {name} {batched}:{seqs}: {tps:.1f} tok/s ({walls})", flush=True)
                if best is None or tps > best[0]:
                    best = (tps, wall, tokens, (batched, seqs), aieng_ids)
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
            if not args.skip_hf:
                tokens, wall, walls, hf_ids = run_hf(folder, prompts, output_lens, args.reps)
                row["hf"] = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}
                row["ratio"] = best[0] / (tokens / wall)
                same = sum(a == b for a, b in zip(best[4], hf_ids, strict=True))
                row["greedy_identical_requests"] = same
                print(f"  hf {name}: {tokens / wall:.1f} tok/s ({walls}); {same} identical")
            rows.append(row)

    info = machine()
    lines = [
        f"# bench_offline{f' ({args.label})' if args.label else ''}",
        "",
        f"Machine: {info['nproc']} CPUs ({info['cpu']}), torch {info['torch']}, "
        f"Python {info['python']}, torch.set_num_threads({THREADS}) for both engines.",
        "",
        f"Workload: {num_requests} requests, prompt and output lengths uniform in [16, 256] "
        "(seed 0), random token ids, greedy, ignore_eos, fp32. Random-weight LlamaConfig "
        "checkpoints, vocab 32000: small = hidden 64, 4 layers, 4 heads, intermediate 256; "
        "base = hidden 768, 12 layers, 12 heads, intermediate 2048.",
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
        if "hf" in r:
            h = r["hf"]
            lines.append(
                f"| {r['model']} | {r['params'] / 1e6:.1f}M | HF transformers | batch {HF_BATCH} | "
                f"{h['tokens_per_s']:.1f} | {h['wall_s']:.2f} | |"
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
