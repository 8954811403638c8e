"""Tensor parallelism on CPU: the default model over 2 ranks (1 torch thread each, gloo) against
1 rank (2 threads), the same batch of greedy requests, in one run; with rank 0's time in
collectives per step (step broadcast, the layers' all-reduces, the logits all-gather).

    .venv/bin/python benches/bench_tensor_parallel.py [--requests 32] [--prompt-len 64]
        [--output-len 64] [--model PATH]

Rank 0's collective time includes waiting for rank 1 when it is slower (gloo returns when the
collective is done). Results go to benches/results/tensor_parallel.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from aieng import LLM, SamplingParams
from aieng.benchmarks.offline import machine
from aieng.distributed.comm_timer import timed_collectives
from aieng.models.default import default_model_path

RESULTS = Path(__file__).parent / "results"


def run(model: str, size: int, prompts: list[list[int]], output_len: int, reps: int) -> dict:
    if size == 1:
        torch.set_num_threads(os.cpu_count() or 1)
    llm = LLM(model, tensor_parallel_size=size, max_num_seqs=len(prompts))
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    best: dict = {}
    try:
        for _ in range(reps):
            steps_before = llm.engine.core.stats()["num_steps"]
            with timed_collectives() as comm:
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
            steps = llm.engine.core.stats()["num_steps"] - steps_before
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            if best and seconds >= best["seconds"]:
                continue
            best = {
                "tensor_parallel_size": size,
                "threads_per_rank": torch.get_num_threads(),
                "seconds": seconds,
                "output_tok_s": tokens / seconds,
                "steps": steps,
                "step_ms": 1e3 * seconds / steps,
                "comm_ms_per_step": 1e3 * comm.total_seconds / steps,
                "comm_share": comm.total_seconds / seconds,
                "comm_ms_per_step_by_op": {k: 1e3 * v / steps for k, v in comm.seconds.items()},
                "collective_calls_per_step": {k: v / steps for k, v in comm.calls.items()},
                "token_ids": [o.outputs[0].token_ids for o in outputs],
            }
    finally:
        if size > 1:
            llm.engine.runner.shutdown()
    return best


def table(runs: list[dict], identical: int, total: int) -> str:
    lines = [
        "| ranks | threads/rank | output tok/s | step ms | comm ms/step (rank 0) | comm share "
        "| broadcast / all-reduce / all-gather ms/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        ops = r["comm_ms_per_step_by_op"]
        split = " / ".join(
            f"{ops.get(k, 0.0):.3f}" for k in ("broadcast", "all_reduce", "all_gather")
        )
        lines.append(
            f"| {r['tensor_parallel_size']} | {r['threads_per_rank']} | {r['output_tok_s']:.1f} "
            f"| {r['step_ms']:.2f} | {r['comm_ms_per_step']:.3f} | {100 * r['comm_share']:.1f}% "
            f"| {split} |"
        )
    lines.append(f"\nGreedy outputs identical TP=2 vs TP=1: {identical}/{total} requests.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(5, 4000, (args.prompt_len,), generator=generator).tolist()
        for _ in range(args.requests)
    ]
    runs = [run(args.model, size, prompts, args.output_len, args.reps) for size in (1, 2)]
    identical = sum(a == b for a, b in zip(runs[0]["token_ids"], runs[1]["token_ids"], strict=True))
    report = table(runs, identical, len(prompts))
    print(report)
    setup = {k: getattr(args, k) for k in ("requests", "prompt_len", "output_len", "reps")}
    result = {
        "machine": machine(os.cpu_count() or 1),
        "setup": {**setup, "model": Path(args.model).name},
        "identical_requests": identical,
        "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tensor_parallel.json").write_text(json.dumps(result, indent=2) + "\n")
    header = (
        f"# Tensor parallelism on CPU\n\n{result['machine']['cpu']}, {os.cpu_count()} cores; "
        f"default model, {args.requests} requests x {args.prompt_len} prompt + "
        f"{args.output_len} output tokens, greedy; best of {args.reps}.\n\n"
    )
    (RESULTS / "tensor_parallel.md").write_text(header + report + "\n")


if __name__ == "__main__":
    main()
