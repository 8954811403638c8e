"""Microseconds per engine step of the Rust core, driven by synthetic model outputs.

256 requests with prompt and output lengths uniform in [100, 1024] (seed 0,
ignore_eos), prefix caching on, block sizes 16 and 256. Each step calls
schedule(), reads the plan arrays a model runner reads (the core's new blocks for
its persistent block table; the peer's dense block table), and calls update() with
random sampled tokens. The workload runs --repeats times and the timings are pooled.
Peer in the same run: the same step in plain Python (benches/python_scheduler.py,
nano-vllm style).

    .venv/bin/python benches/bench_core.py [--requests 256] [--out benches/results]
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from aieng.core import EngineCore

try:
    from python_scheduler import PyScheduler
except ImportError:  # run as a module from the repo root
    from benches.python_scheduler import PyScheduler

RUNNER_FIELDS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "query_start_loc",
    "num_computed_tokens",
    "seq_lens",
    "logits_indices",
    "sample_request_rows",
    "slots",
)
CORE_FIELDS = (*RUNNER_FIELDS, "new_block_slots", "new_block_indices", "new_block_ids")
PEER_FIELDS = (*RUNNER_FIELDS, "block_tables")


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(100, 1025, size=n)
    outputs = rng.integers(100, 1025, size=n)
    return [
        (rng.integers(0, 32000, size=int(p)).tolist(), int(o))
        for p, o in zip(prompts, outputs, strict=True)
    ]


def drive(engine, sampled_pool: np.ndarray, max_num_seqs: int) -> tuple[list, list, int]:
    """Runs to completion; returns the step times (ns) at full load, of every step, and
    the number of tokens generated."""
    full_load, every = [], []
    generated, offset = 0, 0
    logits = RUNNER_FIELDS.index("logits_indices")
    while engine.has_unfinished():
        start = time.perf_counter_ns()
        plan = engine.schedule()
        if isinstance(plan, dict):
            arrays = [plan[f] for f in PEER_FIELDS]
        else:
            arrays = [getattr(plan, f) for f in CORE_FIELDS]
        n_samples = len(arrays[logits])
        tokens = sampled_pool[offset : offset + n_samples]
        engine.update(tokens)
        elapsed = time.perf_counter_ns() - start
        offset = (offset + n_samples) % (len(sampled_pool) - 4096)
        generated += n_samples
        every.append(elapsed)
        if engine.num_running == max_num_seqs or (
            len(arrays[0]) == max_num_seqs and n_samples == max_num_seqs
        ):
            full_load.append(elapsed)
    return full_load, every, generated


def summary(full_load: list, every: list, generated: int, runs: int) -> dict[str, float]:
    every_us = np.array(every) / 1e3
    full_us = np.array(full_load) / 1e3 if full_load else np.array([np.nan])
    return {
        "runs": runs,
        "steps": len(every) // runs,
        "full_load_steps": len(full_load),
        "us_per_step_full_load_mean": float(full_us.mean()),
        "us_per_step_full_load_p50": float(np.median(full_us)),
        "us_per_step_full_load_p99": float(np.percentile(full_us, 99)),
        "us_per_step_mean": float(every_us.mean()),
        "us_per_generated_token": float(every_us.sum() / max(generated, 1)),
        "generated_tokens": generated,
    }


def run(requests: int, block_size: int, engine_name: str, budget: int, repeats: int) -> dict:
    work = workload(requests)
    sampled_pool = np.random.default_rng(1).integers(3, 32000, size=1 << 20, dtype=np.int64)
    full_load, every, generated = [], [], 0
    for _ in range(repeats):
        engine = build(work, requests, block_size, engine_name, budget)
        full, all_steps, tokens = drive(engine, sampled_pool, requests)
        full_load += full
        every += all_steps
        generated += tokens
        if engine_name == "aieng (Rust core)":
            engine.check_invariants()
            stats = engine.stats()["pool"]
            assert stats["num_free_blocks"] == stats["num_blocks"]
    result = summary(full_load, every, generated, repeats)
    return {"engine": engine_name, "block_size": block_size, **result}


def build(work: list, requests: int, block_size: int, engine_name: str, budget: int):
    num_blocks = sum(-(-(len(p) + o) // block_size) for p, o in work) + 16
    if engine_name == "aieng (Rust core)":
        engine = EngineCore(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=requests,
            max_num_batched_tokens=budget,
            max_model_len=4096,
            enable_prefix_caching=True,
        )
        for i, (prompt, out) in enumerate(work):
            engine.add_request(f"r{i}", prompt, max_tokens=out, ignore_eos=True)
    else:
        engine = PyScheduler(num_blocks, block_size, requests, budget)
        for i, (prompt, out) in enumerate(work):
            engine.add(f"r{i}", prompt, out)
    return engine


def table(rows: list[dict]) -> str:
    head = (
        "| engine | block size | steps | full-load steps | µs/step full load (mean / p50 / p99)"
        " | µs/step all | µs/generated token |\n|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['engine']} | {r['block_size']} | {r['steps']} | {r['full_load_steps']} | "
        f"{r['us_per_step_full_load_mean']:.1f} / {r['us_per_step_full_load_p50']:.1f} / "
        f"{r['us_per_step_full_load_p99']:.1f} | {r['us_per_step_mean']:.1f} | "
        f"{r['us_per_generated_token']:.3f} |\n"
        for r in rows
    )
    return head + body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5, help="runs of the workload, pooled")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--no-peer", action="store_true", help="skip the plain-Python peer")
    args = ap.parse_args()
    rows = []
    for block_size in (16, 256):
        engines = ["aieng (Rust core)"] + ([] if args.no_peer else ["plain Python peer"])
        for name in engines:
            rows.append(
                run(args.requests, block_size, name, args.max_num_batched_tokens, args.repeats)
            )
            print(f"  done: {name}, block size {block_size}", flush=True)
    md = table(rows)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    machine = (
        f"{cpu_model()}, {platform.machine()} ({os.cpu_count()} cores), "
        f"python {platform.python_version()}"
    )
    note = (
        f"# bench_core\n\n{args.requests} requests, prompt/output lengths uniform in [100, 1024], "
        f"seed 0, ignore_eos, prefix caching on, max_num_batched_tokens "
        f"{args.max_num_batched_tokens}, max_num_seqs {args.requests}. A step = schedule() + "
        f"reading the arrays a model runner reads ({', '.join(RUNNER_FIELDS)}; the core's "
        f"new_block_slots/indices/ids, the peer's dense block_tables) + update(). Full load: "
        f"{args.requests} requests running. {args.repeats} runs of the workload, pooled; steps "
        f"are per run.\n\nMachine: {machine}.\n\n{md}"
    )
    (args.out / "bench_core.md").write_text(note)
    (args.out / "bench_core.json").write_text(json.dumps(rows, indent=2))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
