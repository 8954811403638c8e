"""The default model's held-out perplexity through aieng (`aieng eval`) and through HF
transformers on the same checkpoint and windows, and its single-stream generation speed.

    .venv/bin/python benches/bench_default_model.py HELDOUT.txt [--window 512] [--stride 256]

HELDOUT.txt is the KJV's held-out books as `aieng train --kjv` writes them (corpus/heldout.txt).
Results go to benches/results/default_model.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from aieng import LLM, SamplingParams
from aieng._core import Tokenizer
from aieng.benchmarks.evaluate import perplexity, sliding_windows
from aieng.benchmarks.offline import machine
from aieng.config.default_model import default_model_path

THREADS = 2


@torch.inference_mode()
def hf_perplexity(folder: Path, ids: list[int], window: int, stride: int) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for begin, end, first in sliding_windows(len(ids), window, stride):
        logits = model(torch.tensor([ids[begin:end]])).logits[0, :-1]
        logprobs = torch.log_softmax(logits.double(), -1)
        targets = torch.tensor(ids[begin + 1 : end])
        chosen = logprobs.gather(1, targets[:, None])[:, 0][first - begin - 1 :]
        total, count = total - float(chosen.sum()), count + len(chosen)
    return math.exp(total / count)


def generation_speed(prompt: str, max_tokens: int, reps: int = 3) -> tuple[float, int]:
    llm = LLM(max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    best = 0.0
    for _ in range(reps):
        start = time.perf_counter()
        [out] = llm.generate(prompt, params, use_tqdm=False)
        tokens = len(out.outputs[0].token_ids)
        best = max(best, tokens / (time.perf_counter() - start))
    return best, tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("heldout")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    folder = default_model_path()
    ours = perplexity(folder, args.heldout, window=args.window, stride=args.stride)
    ids = Tokenizer.from_dir(str(folder)).encode(
        Path(args.heldout).read_text(encoding="utf-8"), add_special_tokens=True
    )
    start = time.perf_counter()
    theirs = hf_perplexity(folder, ids, args.window, args.stride)
    hf_seconds = time.perf_counter() - start
    speed, tokens = generation_speed("And God said", 256)
    info = machine(THREADS)
    diff = abs(ours.perplexity - theirs) / theirs
    lines = [
        "# The default model: held-out perplexity and generation speed",
        "",
        f"Machine: {info['nproc']} CPUs ({info['cpu']}), torch {info['torch']}, "
        f"Python {info['python']}, {THREADS} threads, float32.",
        "",
        f"Held-out text: `{args.heldout}` ({ids.__len__():,} tokens), window {args.window}, "
        f"stride {args.stride}, {ours.tokens:,} tokens scored.",
        "",
        "| engine | perplexity | nats/token | seconds |",
        "|---|---|---|---|",
        f"| aieng (`aieng eval`) | {ours.perplexity:.4f} | {ours.nll:.4f} | {ours.seconds:.1f} |",
        f"| HF transformers | {theirs:.4f} | {math.log(theirs):.4f} | {hf_seconds:.1f} |",
        "",
        f"Relative difference: {diff:.2e}.",
        "",
        f"Single-stream greedy generation (`LLM(max_num_seqs=1)`, {tokens} tokens after "
        f"'And God said', best of 3): {speed:.1f} tokens/s.",
        "",
        "Command: `" + " ".join(["python", *sys.argv]) + "`",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "default_model.md").write_text(text)
    record = {
        "machine": info,
        "aieng": ours.as_dict(),
        "hf_perplexity": theirs,
        "relative_difference": diff,
        "single_stream_tokens_per_s": speed,
    }
    (out / "default_model.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
